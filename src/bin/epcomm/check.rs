//! `epcomm check` and `epcomm backends`.

use std::process::ExitCode;
use std::sync::Arc;

use serde_json::{Map, Value};

use epcomm::select::all2all::{self, Layout, NameKind};
use epcomm::select::config;
use epcomm::select::suggest;
use epcomm::select::versions::{self, NameRule, Release};
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
    if let Some(v) = &a.vllm_version {
        base.insert("vllm_version".into(), Value::String(v.clone()));
    }
    if let Some(dir) = &a.vllm_src {
        let version = a.vllm_version.as_deref();
        base.insert("vllm_release".into(), describe_vllm_src(dir, version)?);
    }
    Ok(Value::Object(base))
}

/// The reader of a vLLM release's source (the one home of that reading, shared with
/// scripts/gen-vllm-versions.py and Python's `vllm_version="auto"`), run by python3.
const VLLM_RELEASE_PY: &str = include_str!("../../../python/epcomm/vllm_release.py");

/// What the vLLM in `dir` accepts, read from its own source by [`VLLM_RELEASE_PY`]
/// (`$EPCOMM_PYTHON`, else `python3`); `version` for a tree that does not say its own.
fn describe_vllm_src(dir: &str, version: Option<&str>) -> Result<Value, String> {
    let python = std::env::var("EPCOMM_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut cmd = std::process::Command::new(&python);
    cmd.arg("-c").arg(VLLM_RELEASE_PY).arg(dir);
    if let Some(v) = version {
        cmd.arg("--version").arg(v);
    }
    let out = cmd.output().map_err(|e| {
        format!("argument --vllm-src: cannot run '{python}' to read vLLM's source: {e} (set EPCOMM_PYTHON to a Python 3.9 or later)")
    })?;
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr);
        return Err(format!("argument --vllm-src: {}", why.trim()));
    }
    serde_json::from_slice::<Value>(&out.stdout).map_err(|e| {
        format!("argument --vllm-src: the reader of {dir} printed no description ({e})")
    })
}

/// The release `cfg` is checked against: its `vllm_release` description, else its
/// `vllm_version` (the default when none).
fn target_release(cfg: &Value) -> epcomm::Result<&'static Release> {
    match cfg.get("vllm_release") {
        Some(d) => versions::described(d),
        None => versions::release(target_version(cfg)),
    }
}

/// The release `cfg` targets (its `vllm_version`, else the default), as written.
fn target_version(cfg: &Value) -> &str {
    cfg.get("vllm_version")
        .and_then(Value::as_str)
        .unwrap_or(versions::DEFAULT_VERSION)
}

/// `epcomm check`: exit 0 and the resolved setup, or vLLM's exception line, a hint and exit 1.
pub fn cmd_check(args: &CheckArgs) -> ExitCode {
    let cfg = match config_from_args(args) {
        Ok(v) => v,
        Err(e) => return crate::usage_error(&e),
    };
    // A release neither in the table nor described: a usage error saying how to check it.
    if let Err(e) = target_release(&cfg) {
        let mut msg = e.to_string();
        if !msg.contains("--vllm-src") {
            msg.push_str("; to check against the deployed vLLM's own source, give --vllm-src DIR");
        }
        let what = if cfg.get("vllm_release").is_some() {
            "configuration key vllm_release"
        } else if args.vllm_version.is_some() {
            "argument --vllm-version"
        } else {
            "configuration key vllm_version"
        };
        return crate::usage_error(&format!("{what}: {msg}"));
    }
    // Warnings are printed below, after the verdict line.
    log::set_sink(Some(Arc::new(|_, _| {})));
    let outcome = config::check_json(&cfg.to_string(), probe::nccl_usable(), probe::nixl_usable());
    let hint = outcome
        .result
        .as_ref()
        .err()
        .and_then(|e| hint_for(&cfg, e));
    let release = target_release(&cfg).ok();
    if args.json {
        let mut v = outcome.to_json();
        if let Some(m) = v.as_object_mut() {
            if let Some(h) = &hint {
                m.insert("hint".into(), h.as_str().into());
            }
            if let (Some(r), true) = (release, outcome.result.is_ok()) {
                m.insert("vllm_version".into(), r.version.into());
            }
        }
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    }
    match &outcome.result {
        Err(e) => {
            eprintln!("{}: {}", e.exception(), e);
            if let Some(h) = hint {
                eprintln!("hint: {h}");
            }
            for w in &outcome.warnings {
                eprintln!("warning: {w}");
            }
            ExitCode::from(1)
        }
        Ok(r) => {
            if !args.json {
                print_resolution(
                    r,
                    &outcome,
                    release.map_or(versions::DEFAULT_VERSION, |r| r.version),
                );
            }
            ExitCode::SUCCESS
        }
    }
}

/// `epcomm check`'s report of a valid configuration.
fn print_resolution(r: &config::Resolution, outcome: &config::CheckOutcome, version: &str) {
    println!(
        "vLLM release:      {version} (its names; other rules and messages follow v{})",
        versions::DEFAULT_VERSION
    );
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

/// The hint for `e`. For a name the targeted release rejects, the releases that accept it,
/// else that release's nearest names: [`Hint`] alone would suggest v0.33.0's names for the
/// rules without a `Literal` (envs.py's choices, the communicator's `Unknown all2all backend`),
/// and has no advice of its own for a name a `Literal` refuses.
fn hint_for(cfg: &Value, e: &Error) -> Option<String> {
    // A field error carries the configuration check's own advice (Hint has none for it).
    let (field, own) = if let Error::ConfigField { field, hint, .. } = e {
        (field.as_str(), hint.clone())
    } else {
        ("", e.hint())
    };
    let Ok(release) = target_release(cfg) else {
        return own;
    };
    if let Some(name) = cfg.get("all2all_backend").and_then(Value::as_str) {
        if !release.accepts_all2all(name) {
            let refused = match release.all2all_rule {
                NameRule::Literal => field == "all2all_backend",
                NameRule::EnvChoices | NameRule::Communicator => {
                    versions::name_error(release, name) == *e
                }
            };
            if refused {
                let from_release = versions::name_error_hint(release, name);
                return match release.all2all_rule {
                    NameRule::Literal => own.or(Some(from_release)),
                    NameRule::EnvChoices | NameRule::Communicator => Some(from_release),
                };
            }
        }
    }
    let communicator = cfg
        .pointer("/eplb_config/communicator")
        .and_then(Value::as_str);
    match communicator {
        Some(name) if field.ends_with("communicator") && !release.accepts_eplb(name) => {
            own.or_else(|| eplb_name_hint(release, name))
        }
        Some(_) | None => own,
    }
}

/// The releases that accept the EPLB communicator `name`, else `release`'s nearest names.
fn eplb_name_hint(release: &Release, name: &str) -> Option<String> {
    versions::eplb_hint(name, release).or_else(|| {
        (!release.eplb_communicators.is_empty()).then(|| {
            suggest::did_you_mean(
                name,
                release.eplb_communicators.iter().copied(),
                "valid EPLB communicators",
            )
        })
    })
}

/// One listed name: its status and what it becomes in the release, and what epcomm runs for
/// it (`None` where epcomm has no such backend).
struct Listed {
    name: &'static str,
    kind: NameKind,
    resolves: &'static str,
    layout: Option<Layout>,
    backend: Option<&'static str>,
    manager_class: Option<&'static str>,
}

/// The names `release` accepts, with epcomm's backend for what each becomes there.
fn listed(release: &'static Release) -> Vec<Listed> {
    let statuses = release.all2all_status.iter().zip(release.all2all_resolves);
    release
        .all2all_names
        .iter()
        .zip(statuses)
        .map(|(name, (kind, resolves))| {
            let epcomm = all2all::lookup(resolves).map(|a| a.backend);
            let passthrough = *resolves == all2all::PASSTHROUGH;
            Listed {
                name,
                kind: *kind,
                resolves,
                layout: epcomm.map(|b| b.layout()),
                backend: epcomm.map(|b| b.name()),
                manager_class: epcomm
                    .map(|b| b.manager_class())
                    .or(passthrough.then_some(all2all::PASSTHROUGH_MANAGER_CLASS)),
            }
        })
        .collect()
}

/// How `release` refuses an all2all name it does not accept.
fn rule_text(release: &Release) -> &'static str {
    match release.all2all_rule {
        NameRule::Literal => "ParallelConfig.all2all_backend's Literal refuses any other name",
        NameRule::EnvChoices => "envs.py refuses any other VLLM_ALL2ALL_BACKEND value",
        NameRule::Communicator => {
            "nothing checks VLLM_ALL2ALL_BACKEND: another name fails when the communicator is built"
        }
    }
}

/// `epcomm backends --json`: one object per all2all name.
fn print_backends_json(release: &'static Release) {
    let list: Vec<Value> = listed(release)
        .iter()
        .map(|n| {
            serde_json::json!({
                "name": n.name,
                "kind": n.kind.name(),
                "resolves_to": n.resolves,
                "backend": n.backend,
                "layout": n.layout.map(Layout::name),
                "manager_class": n.manager_class,
                "vllm_version": release.version,
            })
        })
        .collect();
    println!(
        "{}",
        serde_json::to_string_pretty(&Value::Array(list)).unwrap_or_default()
    );
}

/// `epcomm backends`: the names a release accepts, their status there, what epcomm runs.
pub fn cmd_backends(json_out: bool, version: &str) -> ExitCode {
    let release = match versions::release(version) {
        Ok(r) => r,
        Err(e) => return crate::usage_error(&format!("argument --vllm-version: {e}")),
    };
    if json_out {
        print_backends_json(release);
        return ExitCode::SUCCESS;
    }
    println!(
        "vLLM {} ({}): {}.",
        release.version,
        release.source.name(),
        rule_text(release)
    );
    println!(
        "{:<30} {:<10} {:<30} {:<14} manager class",
        "name", "kind", "resolves to", "layout"
    );
    for n in listed(release) {
        let layout = n.layout.map_or("-", Layout::name);
        let mut class = n
            .manager_class
            .unwrap_or("(epcomm has no such backend)")
            .to_owned();
        if let Some(b) = n.backend.filter(|b| *b != n.resolves) {
            class.push_str(&format!(" (epcomm runs {b})"));
        }
        let kind = n.kind.name();
        println!(
            "{:<30} {kind:<10} {:<30} {layout:<14} {class}",
            n.name, n.resolves
        );
    }
    print_backends_notes(release);
    ExitCode::SUCCESS
}

/// The lines after the table: EPLB communicators, the default, what a name means in epcomm.
fn print_backends_notes(release: &Release) {
    println!();
    if release.eplb_communicators.is_empty() {
        println!("EPLB communicators: not configurable in this release.");
    } else {
        println!(
            "EPLB communicators: {}.",
            release.eplb_communicators.join(", ")
        );
    }
    println!(
        "Default: {}. Names are exact and case-sensitive, as in vLLM. Rules and messages other \
         than the name sets follow v{}.",
        release.all2all_default,
        versions::DEFAULT_VERSION
    );
    if release.accepts_all2all(all2all::PASSTHROUGH) {
        println!(
            "{}: the MoE backend dispatches and combines itself; epcomm creates no exchange for it.",
            all2all::PASSTHROUGH
        );
    }
    println!(
        "Layout and manager class are epcomm's (vLLM v{}'s classes). A name selects a contract\n\
         (buffer layout, who applies the top-k weights, where the reduction happens); epcomm\n\
         implements every layout with its own kernels and transports and does not load DeepEP,\n\
         FlashInfer, MoRI, NIXL-EP or MoonEP.",
        versions::DEFAULT_VERSION
    );
}
