//! `epcomm check` and `epcomm backends`.

use std::process::ExitCode;
use std::sync::Arc;

use serde_json::{Map, Value};

use epcomm::select::all2all::{self, ACCEPTED_NAMES};
use epcomm::select::config;
use epcomm::select::Hint;
use epcomm::{log, probe, Error};

use crate::cli::CheckArgs;

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

/// Builds the configuration JSON: `--config`, then `--eplb-config` and `--eplb-config.KEY`
/// merged into its `eplb_config`, then the other flags over it.
fn config_from_args(a: &CheckArgs) -> Result<Value, String> {
    let mut base = Map::new();
    if let Some(v) = &a.config {
        let text = if v.trim_start().starts_with('{') {
            v.clone()
        } else {
            std::fs::read_to_string(v)
                .map_err(|e| format!("argument --config: cannot read '{v}': {e}"))?
        };
        match serde_json::from_str::<Value>(&text) {
            Ok(Value::Object(m)) => base = m,
            Ok(_) => return Err("argument --config: expected a JSON object".into()),
            Err(e) => return Err(format!("argument --config: invalid JSON: {e}")),
        }
    }
    let mut eplb = Map::new();
    if let Some(v) = &a.eplb_config {
        match serde_json::from_str::<Value>(v) {
            Ok(Value::Object(m)) => eplb.extend(m),
            _ => return Err("argument --eplb-config: expected a JSON object".into()),
        }
    }
    for (k, v) in &a.eplb {
        eplb.insert(k.clone(), flag_value(v));
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
    for (k, v) in &a.flags {
        base.insert(k.clone(), flag_value(v));
    }
    Ok(Value::Object(base))
}

/// `epcomm check`: exit 0 and the resolved setup, or vLLM's exception line, a hint and exit 1.
pub fn cmd_check(args: &CheckArgs) -> ExitCode {
    let cfg = match config_from_args(args) {
        Ok(v) => v,
        Err(e) => return crate::usage_error(&e),
    };
    // Warnings are printed below, after the verdict line.
    log::set_sink(Some(Arc::new(|_, _| {})));
    let outcome = config::check_json(&cfg.to_string(), probe::nccl_usable(), probe::nixl_usable());
    if args.json {
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
            if !args.json {
                println!(
                    "all2all backend:   {} -> {} (layout {})",
                    r.effective_name,
                    r.manager_class,
                    r.layout.map_or("none: no exchange", all2all::Layout::name)
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

/// `epcomm backends`: every accepted name, its kind, what it resolves to.
pub fn cmd_backends(json_out: bool) -> ExitCode {
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
    println!(
        "{:<30} {:<10} {:<30} {:<14} {}",
        all2all::PASSTHROUGH,
        "canonical",
        "(no exchange)",
        "-",
        all2all::PASSTHROUGH_MANAGER_CLASS
    );
    println!();
    println!(
        "{}: the MoE backend dispatches and combines itself; epcomm creates no exchange for it.",
        all2all::PASSTHROUGH
    );
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
