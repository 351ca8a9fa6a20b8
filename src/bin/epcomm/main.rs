//! `epcomm` command-line tool: check a configuration before launch, list backends, run the demo,
//! benchmark. The options are defined in `cli.rs` (clap); `man/epcomm.1` is rendered from them.

mod bench;
mod bench_eplb;
mod bench_moe;
mod check;
mod cli;
mod demo;
mod memory;
mod palette;
mod plot;
mod ranks;
mod stats;

use std::ffi::OsString;
use std::process::ExitCode;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use cli::{BenchCmd, Cmd};

/// A usage error: one line on stderr, exit 2.
pub fn usage_error(msg: &str) -> ExitCode {
    eprintln!("epcomm: error: {msg}");
    ExitCode::from(2)
}

/// clap's error as one line: its first line (which names the option), plus its suggestion.
fn one_line(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let first = text.lines().next().unwrap_or("invalid arguments");
    let first = first.strip_prefix("error: ").unwrap_or(first);
    // "unexpected argument '--x' found": the option is the news, not "found".
    let mut line = first.strip_suffix(" found").unwrap_or(first).to_owned();
    for kind in [
        ContextKind::SuggestedArg,
        ContextKind::SuggestedSubcommand,
        ContextKind::SuggestedValue,
    ] {
        let near = match e.get(kind) {
            Some(ContextValue::String(s)) => vec![s.clone()],
            Some(ContextValue::Strings(v)) => v.clone(),
            _ => continue,
        };
        if !near.is_empty() {
            let near: Vec<String> = near.iter().map(|s| format!("'{s}'")).collect();
            line.push_str(&format!(" (did you mean {}?)", near.join(" or ")));
            break;
        }
    }
    if let Some(ContextValue::Strings(valid)) = e
        .get(ContextKind::ValidValue)
        .filter(|v| !matches!(v, ContextValue::Strings(s) if s.is_empty()))
    {
        line.push_str(&format!(" (possible values: {})", valid.join(", ")));
    }
    line
}

/// Rewrites vLLM's multi-letter short flags of `check` (`-tp 2`, `-dp=4`) to their long form.
fn expand_short_aliases(args: Vec<OsString>) -> Vec<OsString> {
    if args.get(1).and_then(|a| a.to_str()) != Some("check") {
        return args;
    }
    args.into_iter()
        .map(|a| {
            let Some(s) = a.to_str() else { return a };
            let (flag, value) = match s.split_once('=') {
                Some((f, v)) => (f, Some(v)),
                None => (s, None),
            };
            match cli::SHORT_ALIASES.iter().find(|(short, _)| *short == flag) {
                Some((_, long)) => match value {
                    Some(v) => format!("{long}={v}").into(),
                    None => (*long).into(),
                },
                None => a,
            }
        })
        .collect()
}

fn main() -> ExitCode {
    // Writing to a closed pipe (`epcomm backends | head -1`) ends the process quietly by
    // SIGPIPE, as for C tools. Rust ignores SIGPIPE, which turns every print into a panic
    // on EPIPE; restoring the default here covers every writer (clap, println!, indicatif).
    // SAFETY: setting a signal's disposition to SIG_DFL before any thread starts is sound.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let args = expand_short_aliases(std::env::args_os().collect());
    let cli = match cli::parse(args) {
        Ok(c) => c,
        Err(e) => {
            return match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    let _ = e.print();
                    ExitCode::SUCCESS
                }
                // `epcomm bench` without its subcommand: the subcommand's usage on stderr.
                ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    let _ = e.print();
                    ExitCode::from(2)
                }
                _ => usage_error(&one_line(&e)),
            };
        }
    };
    match cli.command {
        None => {
            let _ = cli::command().print_help();
            ExitCode::SUCCESS
        }
        Some(Cmd::Check(a)) => check::cmd_check(&a),
        Some(Cmd::Backends { json, vllm_version }) => check::cmd_backends(json, &vllm_version),
        Some(Cmd::Demo(a)) => demo::cmd_demo(&a),
        Some(Cmd::Bench { which }) => match which {
            BenchCmd::Group(a) => bench::cmd_group(&a),
            BenchCmd::Moe(a) => bench_moe::cmd_moe(&a),
            BenchCmd::Eplb(a) => bench_eplb::cmd_eplb(&a),
        },
        Some(Cmd::Version) => {
            println!("epcomm {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
    }
}
