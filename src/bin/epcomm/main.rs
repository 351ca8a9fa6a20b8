//! `epcomm` command-line tool: check a configuration before launch, list backends, benchmark.

mod bench;
mod bench_eplb;
mod bench_moe;
mod demo;
mod opts;
mod plot;
mod ranks;
mod stats;

use std::process::ExitCode;
use std::sync::Arc;

use serde_json::{Map, Value};

use epcomm::select::all2all::{self, ACCEPTED_NAMES};
use epcomm::select::config::{self, CONFIG_KEYS, EPLB_CONFIG_KEYS};
use epcomm::select::suggest;
use epcomm::{log, probe, Error};

const USAGE: &str = "\
epcomm: vLLM's expert-parallel communication layer

usage:
  epcomm check [--config JSON|FILE] [vLLM-style flags] [--json]
  epcomm backends [--json]
  epcomm demo [--backend NAME|all] [--ranks N] [--tokens T] [--hidden H] [--experts E]
              [--topk K] [--dtype bf16|f16|f32] [--seed S] [--steps N] [--routing skewed|uniform]
  epcomm bench group [--ranks N] [--mib MiB] [--iters N] [--json]
  epcomm bench moe [--backend NAME,..|all] [--ranks N] [--tokens T,..] [--hidden H] [--experts E]
                   [--topk K] [--dtype bf16|f16|f32] [--routing uniform|skewed|top2] [--iters N] [--json]
                   [--svg FILE]
  epcomm bench eplb [--iters N] [--ranks N] [--layers L] [--experts-per-rank N] [--expert-mib MiB]
  epcomm version

check flags (override --config; `--flag value` or `--flag=value`):
  --all2all-backend NAME              --platform cuda|rocm|cpu|xpu
  --enable-expert-parallel            --enable-eplb
  --enable-elastic-ep                 --enable-dbo
  --enable-fault-tolerance            --enable-lora
  --tensor-parallel-size N (-tp)      --data-parallel-size N (-dp)
  --pipeline-parallel-size N (-pp)    --prefill-context-parallel-size N (-pcp)
  --data-parallel-external-lb         --data-parallel-hybrid-lb
  --num-experts N                     --nixl-available true|false
  --nccl-available true|false
  --eplb-config JSON                  --eplb-config.KEY VALUE (e.g. --eplb-config.use_async=false)

On error `check` prints `{Exception}: {message}` as the first line of stderr (vLLM's exact
message), then `hint: ...`, and exits 1.";

fn usage_error(msg: &str) -> ExitCode {
    eprintln!("epcomm: error: {msg}");
    eprintln!("run `epcomm --help` for usage");
    ExitCode::from(2)
}

/// Parses a flag value the way vLLM's CLI does: JSON scalars (true, 3, "x"), else a string.
fn flag_value(raw: &str) -> Value {
    match raw {
        "true" | "True" => Value::Bool(true),
        "false" | "False" => Value::Bool(false),
        _ => serde_json::from_str::<Value>(raw)
            .ok()
            .filter(|v| !v.is_object() && !v.is_array())
            .unwrap_or_else(|| Value::String(raw.to_owned())),
    }
}

const BOOL_FLAGS: [&str; 8] = [
    "enable_expert_parallel",
    "enable_eplb",
    "enable_elastic_ep",
    "enable_dbo",
    "enable_fault_tolerance",
    "enable_lora",
    "data_parallel_external_lb",
    "data_parallel_hybrid_lb",
];

fn short_alias(flag: &str) -> Option<&'static str> {
    match flag {
        "tp" => Some("tensor_parallel_size"),
        "dp" => Some("data_parallel_size"),
        "pp" => Some("pipeline_parallel_size"),
        "pcp" => Some("prefill_context_parallel_size"),
        _ => None,
    }
}

/// Builds the configuration JSON from `--config` and flags.
fn config_from_args(args: &[String]) -> Result<(Value, bool), String> {
    let mut base = Map::new();
    let mut flags = Map::new();
    let mut eplb = Map::new();
    let mut json_out = false;
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        let Some(stripped) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')) else {
            return Err(format!("unexpected argument '{arg}'"));
        };
        let (name, inline) = match stripped.split_once('=') {
            Some((n, v)) => (n, Some(v.to_owned())),
            None => (stripped, None),
        };
        if name == "json" {
            json_out = true;
            continue;
        }
        let key = short_alias(name)
            .map(str::to_owned)
            .unwrap_or_else(|| name.replace('-', "_"));
        let is_bool = BOOL_FLAGS.contains(&key.as_str());
        let mut value = || -> Result<String, String> {
            if let Some(v) = inline.clone() {
                return Ok(v);
            }
            let v = args
                .get(i)
                .ok_or_else(|| format!("argument --{name}: expected one argument"))?;
            i += 1;
            Ok(v.clone())
        };
        if key == "config" {
            let v = value()?;
            let text = if v.trim_start().starts_with('{') {
                v
            } else {
                std::fs::read_to_string(&v)
                    .map_err(|e| format!("argument --config: cannot read '{v}': {e}"))?
            };
            match serde_json::from_str::<Value>(&text) {
                Ok(Value::Object(m)) => base = m,
                Ok(_) => return Err("argument --config: expected a JSON object".into()),
                Err(e) => return Err(format!("argument --config: invalid JSON: {e}")),
            }
        } else if key == "eplb_config" {
            let v = value()?;
            match serde_json::from_str::<Value>(&v) {
                Ok(Value::Object(m)) => eplb.extend(m),
                _ => return Err("argument --eplb-config: expected a JSON object".into()),
            }
        } else if let Some(sub) = key.strip_prefix("eplb_config.") {
            if !EPLB_CONFIG_KEYS.contains(&sub) {
                let near = suggest::did_you_mean(sub, EPLB_CONFIG_KEYS, "valid keys");
                return Err(format!("unrecognized argument --{name} ({near})"));
            }
            let v = value()?;
            eplb.insert(sub.to_owned(), flag_value(&v));
        } else if CONFIG_KEYS.contains(&key.as_str()) {
            let v = if is_bool && inline.is_none() {
                Value::Bool(true)
            } else {
                flag_value(&value()?)
            };
            flags.insert(key, v);
        } else {
            let flag_names = CONFIG_KEYS.iter().map(|k| k.replace('_', "-"));
            let names: Vec<String> = flag_names.collect();
            let near = suggest::did_you_mean(
                &name.replace('_', "-"),
                names.iter().map(String::as_str),
                "valid flags",
            );
            return Err(format!("unrecognized argument --{name} ({near})"));
        }
    }
    if !eplb.is_empty() {
        let merged = match base.remove("eplb_config") {
            Some(Value::Object(mut m)) => {
                m.extend(eplb);
                m
            }
            _ => eplb,
        };
        base.insert("eplb_config".into(), Value::Object(merged));
    }
    base.extend(flags);
    Ok((Value::Object(base), json_out))
}

fn cmd_check(args: &[String]) -> ExitCode {
    let (cfg, json_out) = match config_from_args(args) {
        Ok(v) => v,
        Err(e) => return usage_error(&e),
    };
    // Warnings are printed below, after the verdict line.
    log::set_sink(Some(Arc::new(|_, _| {})));
    let outcome = config::check_json(&cfg.to_string(), probe::nccl_usable(), probe::nixl_usable());
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(&outcome.to_json()).unwrap_or_default()
        );
    }
    match &outcome.result {
        Err(e) => {
            print_error(e);
            for w in &outcome.warnings {
                eprintln!("warning: {w}");
            }
            ExitCode::from(1)
        }
        Ok(r) => {
            if !json_out {
                println!(
                    "all2all backend:   {} -> {} (layout {})",
                    r.effective_name,
                    r.manager_class,
                    r.layout.name()
                );
                match r.eplb_communicator {
                    Some(c) => println!(
                        "EPLB communicator: {} -> {}{}",
                        c.name(),
                        c.class_name(),
                        if r.eplb_communicator_auto {
                            " (auto-selected)"
                        } else {
                            ""
                        }
                    ),
                    None => println!("EPLB communicator: none (EPLB disabled)"),
                }
                if outcome.warnings.is_empty() {
                    println!("warnings:          none");
                } else {
                    println!("warnings:");
                    for w in &outcome.warnings {
                        println!("  WARNING {w}");
                    }
                }
                for i in &outcome.infos {
                    println!("  INFO {i}");
                }
                println!("OK: configuration is valid");
            }
            ExitCode::SUCCESS
        }
    }
}

fn print_error(e: &Error) {
    eprintln!("{}: {}", e.exception(), e);
    if let Some(h) = e.hint() {
        eprintln!("hint: {h}");
    }
}

fn cmd_backends(args: &[String]) -> ExitCode {
    let json_out = match args {
        [] => false,
        [a] if a == "--json" => true,
        _ => return usage_error("`backends` takes only --json"),
    };
    if json_out {
        let list: Vec<Value> = ACCEPTED_NAMES
            .iter()
            .map(|n| {
                serde_json::json!({
                    "name": n.name,
                    "kind": n.kind.name(),
                    "backend": n.backend.name(),
                    "layout": n.backend.layout().name(),
                    "manager_class": n.backend.manager_class(),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&Value::Array(list)).unwrap_or_default()
        );
        return ExitCode::SUCCESS;
    }
    println!(
        "{:<30} {:<10} {:<30} {:<14} manager class",
        "name", "kind", "resolves to", "layout"
    );
    for n in ACCEPTED_NAMES.iter() {
        println!(
            "{:<30} {:<10} {:<30} {:<14} {}",
            n.name,
            n.kind.name(),
            n.backend.name(),
            n.backend.layout().name(),
            n.backend.manager_class()
        );
    }
    println!();
    println!(
        "Default: {}. Names are exact and case-sensitive, as in vLLM.",
        all2all::DEFAULT_BACKEND.name()
    );
    println!(
        "A name selects a contract (buffer layout, who applies the top-k weights, where the\n\
         reduction happens); epcomm implements every layout with its own kernels and transports\n\
         and does not load DeepEP, FlashInfer, MoRI, NIXL-EP or MoonEP."
    );
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("check") => cmd_check(&args[1..]),
        Some("backends") => cmd_backends(&args[1..]),
        Some("bench") => bench::cmd_bench(&args[1..]),
        Some("demo") => demo::cmd_demo(&args[1..]),
        Some("version" | "--version" | "-V") => {
            println!("epcomm {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Some("help" | "--help" | "-h") | None => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some(other) => {
            let near = suggest::did_you_mean(
                other,
                ["check", "backends", "demo", "bench", "version"],
                "commands",
            );
            usage_error(&format!("unknown command '{other}' ({near})"))
        }
    }
}
