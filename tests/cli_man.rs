//! `man/epcomm.1` is rendered from the command line's clap definition, so it cannot drift from
//! the options: this test renders it and fails when the file differs (regenerate it with
//! `BLESS=1 cargo test --test cli_man`), then checks that groff formats it without a warning.

#[allow(dead_code)]
#[path = "../src/bin/epcomm/cli.rs"]
mod cli;
mod common;

use std::io::Write;
use std::process::{Command, Stdio};

/// Escapes text for roff: backslashes, and a leading `.` or `'` that would read as a request.
fn esc(s: &str) -> String {
    let s = s.replace('\\', "\\e").replace('-', "\\-");
    if s.starts_with('.') || s.starts_with('\'') {
        format!("\\&{s}")
    } else {
        s
    }
}

/// One option as a roff tagged paragraph: `--name VALUE` (and `-s`), its help and default.
fn option(out: &mut String, arg: &clap::Arg) {
    let mut tag = Vec::new();
    if let Some(s) = arg.get_short() {
        tag.push(format!("\\fB\\-{s}\\fR"));
    }
    if let Some(l) = arg.get_long() {
        tag.push(format!("\\fB\\-\\-{}\\fR", esc(l)));
    }
    let mut tag = tag.join(", ");
    let takes_value = arg.get_num_args().is_some_and(|n| n.takes_values());
    if takes_value {
        let names: Vec<String> = arg
            .get_value_names()
            .map(|v| v.iter().map(|n| esc(n.as_str())).collect())
            .unwrap_or_default();
        let value = names.join(" ");
        if arg.get_num_args().is_some_and(|n| n.min_values() == 0) {
            tag.push_str(&format!("[=\\fI{value}\\fR]"));
        } else {
            tag.push_str(&format!(" \\fI{value}\\fR"));
        }
    }
    out.push_str(&format!(".TP\n{tag}\n"));
    let mut help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
    let values: Vec<String> = arg
        .get_possible_values()
        .iter()
        .filter(|v| !v.is_hide_set())
        .map(|v| v.get_name().to_owned())
        .collect();
    if takes_value && !values.is_empty() {
        help.push_str(&format!(" (one of: {})", values.join(", ")));
    }
    let defaults: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    if takes_value && !defaults.is_empty() {
        help.push_str(&format!(" [default: {}]", defaults.join(",")));
    }
    out.push_str(&esc(&help));
    out.push('\n');
}

/// A subcommand's section: its synopsis, what it does, and its options; then its own
/// subcommands.
fn command(out: &mut String, path: &str, cmd: &clap::Command) {
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        let name = format!("{path} {}", sub.get_name());
        if sub.has_subcommands() {
            command(out, &name, sub);
            continue;
        }
        out.push_str(&format!(".SS \"{}\"\n", esc(&name)));
        let usage = sub
            .clone()
            .bin_name(&name)
            .render_usage()
            .to_string()
            .replace("Usage: ", "");
        out.push_str(&format!(".B {}\n.PP\n", esc(usage.trim())));
        if let Some(about) = sub.get_about() {
            out.push_str(&format!("{}.\n", esc(&about.to_string())));
        }
        let args: Vec<&clap::Arg> = sub
            .get_arguments()
            .filter(|a| !a.is_hide_set() && a.get_id() != "help")
            .collect();
        if !args.is_empty() {
            out.push_str(".RS\n");
            for a in args {
                option(out, a);
            }
            out.push_str(".RE\n");
        }
    }
}

const EXTRA: &str = r#".SH "EXIT STATUS"
.TP
.B 0
Success: the configuration is valid, the listing or benchmark completed, every demo backend
that ran passed.
.TP
.B 1
\fBcheck\fR: the configuration is rejected (the first line of stderr is vLLM's
\fIException\fR: \fImessage\fR, the next one a hint).
\fBdemo\fR: a backend that can run failed its reference check, or a rank failed, or no backend
ran.
\fBbench\fR: a rank failed, a received or combined value was wrong (#wrong is not 0), or every
case was refused for memory.
.TP
.B 2
Usage error: an unknown option or subcommand, a missing or invalid value; one line on stderr
names the option.
.TP
.B 141
Killed by SIGPIPE: the reader of stdout went away (e.g. \fBepcomm backends | head \-1\fR);
the shell reports 128 + 13. Nothing is printed.
.PP
A benchmark case that does not fit in memory is refused with one line on stderr naming the
backend, T, the bytes per rank and the option that shrinks it; the other cases still run and
the exit status is that of the cases that ran.
.SH ENVIRONMENT
.TP
.B EPCOMM_LOG_LEVEL
Log threshold of the library: \fBerror\fR, \fBwarn\fR (or \fBwarning\fR; the default),
\fBinfo\fR or \fBdebug\fR, any case. Log lines go to stderr.
.TP
.B EPCOMM_TIMEOUT_S
Seconds every wait of the shared-memory group may take before it fails with a timeout
(fractions allowed, at most 86400, one day; default 60).
.TP
.B EPCOMM_SHM_DIRECT
\fB1\fR (the default): peers read each other's buffers in place (process_vm_readv) where the
kernel allows it. \fB0\fR: the shared-memory group stages every contribution in its shared
regions (memory-backed, counted in the benchmarks' memory check).
.TP
.B EPCOMM_NVRTC_PATH
The NVRTC library file, or a directory holding libnvrtc.so.*, for the GPU path; when set it is
the only candidate.
.TP
.B EPCOMM_CACHE_DIR
Directory of the compiled-kernel cache of the GPU path (default
\fI$XDG_CACHE_HOME/epcomm\fR, else \fI~/.cache/epcomm\fR).
.TP
.B EPCOMM_NO_SIMD
\fB1\fR: the reductions use the portable kernels instead of AVX2 (default \fB0\fR).
.PP
An invalid value of any of these gives one warning naming the variable, the value and what is
used instead.
.SH EXAMPLES
Check a configuration given as vLLM flags:
.PP
.RS
.nf
epcomm check \-\-all2all\-backend deepep_low_latency \-\-enable\-expert\-parallel \-dp 4
.fi
.RE
.PP
Check a JSON configuration file, with one EPLB key overridden:
.PP
.RS
.nf
epcomm check \-\-config model.json \-\-eplb\-config.use_async=false
.fi
.RE
.PP
Run the demo on 2 ranks with small sizes:
.PP
.RS
.nf
epcomm demo \-\-ranks 2 \-\-tokens 64 \-\-hidden 256 \-\-experts 8 \-\-topk 2
.fi
.RE
.PP
Benchmark dispatch + combine of every backend at two token counts, as JSON:
.PP
.RS
.nf
epcomm bench moe \-\-backend all \-\-tokens 128,1024 \-\-json
.fi
.RE
.SH "SEE ALSO"
.BR head (1),
.BR pkg\-config (1);
the C header \fIepcomm.h\fR;
\fIREADME.md\fR and \fIdocs/\fR in the epcomm sources.
"#;

/// The whole page: clap_mangen's title, NAME, SYNOPSIS, DESCRIPTION and OPTIONS, one
/// subsection per subcommand under COMMANDS, then the sections clap knows nothing about.
fn render() -> String {
    let mut cmd = cli::command();
    // Building fills in what the derive leaves implicit (how many values an option takes).
    cmd.build();
    let man = clap_mangen::Man::new(cmd.clone())
        // The month this page's text last changed (roff's .TH needs a date in that field).
        .date("December 2026")
        .manual("User Commands");
    let mut buf: Vec<u8> = Vec::new();
    man.render_title(&mut buf).expect("render");
    man.render_name_section(&mut buf).expect("render");
    man.render_synopsis_section(&mut buf).expect("render");
    man.render_description_section(&mut buf).expect("render");
    man.render_options_section(&mut buf).expect("render");
    let mut page = String::from_utf8(buf).expect("utf-8");
    page.push_str(".SH COMMANDS\n");
    command(&mut page, "epcomm", &cmd);
    page.push_str(EXTRA);
    page
}

#[test]
fn man_page_matches_the_command_line() {
    let page = render();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/man/epcomm.1");
    if std::env::var_os("BLESS").is_some() {
        std::fs::create_dir_all(concat!(env!("CARGO_MANIFEST_DIR"), "/man")).expect("mkdir man");
        std::fs::write(path, &page).expect("write man/epcomm.1");
        return;
    }
    let current = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        current == page,
        "man/epcomm.1 is stale; regenerate it with: BLESS=1 cargo test --test cli_man"
    );
    for section in [
        ".SH NAME",
        ".SH SYNOPSIS",
        ".SH DESCRIPTION",
        ".SH COMMANDS",
        ".SH \"EXIT STATUS\"",
        ".SH ENVIRONMENT",
        ".SH EXAMPLES",
        ".SH \"SEE ALSO\"",
    ] {
        assert!(page.contains(section), "{section}");
    }
    for sub in [
        "epcomm check",
        "epcomm backends",
        "epcomm demo",
        "epcomm bench group",
        "epcomm bench moe",
        "epcomm bench eplb",
        "epcomm version",
    ] {
        assert!(page.contains(&format!(".SS \"{sub}\"")), "{sub}");
    }
    assert!(page.contains("\\fB\\-\\-eplb\\-config.use_async\\fR"));
}

#[test]
fn man_page_renders_without_warnings() {
    let Ok(mut child) = Command::new("groff")
        .args(["-man", "-Tutf8", "-ww", "-z"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
    else {
        common::skip::skipped(
            "man_page_renders_without_warnings",
            "groff is not installed (apt-get install groff-base)",
        );
        return;
    };
    let page =
        std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/man/epcomm.1")).expect("man/epcomm.1");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(&page)
        .expect("write to groff");
    let out = child.wait_with_output().expect("groff");
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
}
