//! The `epcomm` command line: `check` prints `{Exception}: {message}` first on stderr and exits 1
//! on error and the resolved setup on success; `--help` on every subcommand, one-line usage
//! errors (exit 2), quiet ends on a closed pipe; the demo's verdicts; the benchmarks' streaming
//! nccl-tests style tables, their memory refusals and their JSON.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Output, Stdio};

fn epcomm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_epcomm"))
        .args(args)
        .env_remove("EPCOMM_LOG_LEVEL")
        .output()
        .expect("run epcomm")
}

fn stderr_lines(o: &Output) -> Vec<String> {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// v0.34.0's `All2AllBackend` literal as pydantic lists it (the default release).
const V0_34_0_NAMES: &str = "'naive', 'pplx', 'deepep_high_throughput', 'deepep_low_latency', \
'deepep_v2', 'mori_high_throughput', 'mori_low_latency', 'moonep', 'mori', 'nixl_ep', \
'allgather_reducescatter', 'flashinfer_all2allv', 'flashinfer_nvlink_two_sided', \
'flashinfer_nvlink_one_sided' or 'passthrough'";

/// v0.33.0's, without `mori`.
const V0_33_0_NAMES: &str = "'naive', 'pplx', 'deepep_high_throughput', 'deepep_low_latency', \
'deepep_v2', 'mori_high_throughput', 'mori_low_latency', 'moonep', 'nixl_ep', \
'allgather_reducescatter', 'flashinfer_all2allv', 'flashinfer_nvlink_two_sided', \
'flashinfer_nvlink_one_sided' or 'passthrough'";

/// pydantic's message for a name the literal `names` refuses.
fn literal_error_of(names: &str, input: &str) -> String {
    format!(
        "1 validation error for ParallelConfig\nall2all_backend\n  Input should be \
         {names} [type=literal_error, input_value='{input}', input_type=str]\n    \
         For further information visit https://errors.pydantic.dev/2.13/v/literal_error"
    )
}

/// pydantic's message for a name v0.34.0's `ParallelConfig.all2all_backend` refuses.
fn literal_error(input: &str) -> String {
    literal_error_of(V0_34_0_NAMES, input)
}

#[test]
fn check_reports_unknown_backend_with_hint() {
    let o = epcomm(&["check", "--all2all-backend", "flashinfer-nvlink-2s"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&o.stderr),
        format!(
            "ValueError: {}\nhint: did you mean 'flashinfer_nvlink_two_sided'?\n",
            literal_error("flashinfer-nvlink-2s")
        )
    );
}

#[test]
fn check_prints_the_field_errors_hint() {
    let o = epcomm(&["check", "--config", r#"{"tensor_parallel_sise": 2}"#]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&o.stderr),
        "ValueError: 1 validation error for ParallelConfig\ntensor_parallel_sise\n  Unexpected \
         keyword argument [type=unexpected_keyword_argument, input_value=2, input_type=int]\n    \
         For further information visit \
         https://errors.pydantic.dev/2.13/v/unexpected_keyword_argument\n\
         hint: did you mean 'tensor_parallel_size'?\n"
    );
}

#[test]
fn check_reports_assertions_and_not_implemented() {
    let o = epcomm(&["check", "--all2all-backend=deepep_v2", "--enable-dbo"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr_lines(&o)[0].starts_with("AssertionError: Microbatching currently only supports")
    );

    let o = epcomm(&[
        "check",
        "--enable-eplb",
        "--enable-expert-parallel",
        "-dp",
        "2",
        "--enable-elastic-ep",
        "--data-parallel-hybrid-lb",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr_lines(&o)[0],
        "NotImplementedError: Elastic EP is not compatible with data_parallel_hybrid_lb. Elastic EP supports a single API server/core client path or data_parallel_external_lb, but not hybrid load balancing."
    );
}

#[test]
fn check_applies_dotted_eplb_flags_over_config() {
    let o = epcomm(&[
        "check",
        "--config",
        r#"{"enable_eplb": true, "enable_expert_parallel": true, "data_parallel_size": 4, "eplb_config": {"communicator": "pynccl"}}"#,
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr_lines(&o)[0]
        .starts_with("ValueError: pynccl communicator is incompatible with async EPLB"));

    let o = epcomm(&[
        "check",
        "--config",
        r#"{"enable_eplb": true, "enable_expert_parallel": true, "data_parallel_size": 4, "eplb_config": {"communicator": "pynccl"}}"#,
        "--eplb-config.use_async=false",
        "--nccl-available",
        "false",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr_lines(&o)[0],
        "RuntimeError: EPLB communicator 'pynccl' requested but unavailable."
    );
}

#[test]
fn check_success_prints_the_resolved_setup() {
    let o = epcomm(&[
        "check",
        "--all2all-backend",
        "naive",
        "--enable-expert-parallel",
        "--enable-eplb",
        "-dp",
        "4",
        "--nixl-available",
        "false",
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains(
            "all2all backend:   allgather_reducescatter -> AgRsAll2AllManager (layout REPLICATED)"
        ),
        "{out}"
    );
    assert!(
        out.contains(
            "EPLB communicator: torch_gloo -> TorchDistGlooStagedEplbCommunicator (auto-selected)"
        ),
        "{out}"
    );
    assert!(out.contains("WARNING The 'naive' all2all backend has been removed. Falling back to 'allgather_reducescatter'."), "{out}");
}

#[test]
fn check_json_output() {
    let o = epcomm(&["check", "--all2all-backend", "deepep_low_latency", "--json"]);
    assert_eq!(o.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(v["manager_class"], "DeepEPLLAll2AllManager");
    assert_eq!(v["layout"], "EXPERT_MAJOR");

    // v0.34.0 (the default): `mori` is MoRI EPv1 unless mori_ep_v2 selects EPv2.
    let o = epcomm(&[
        "check",
        "--all2all-backend",
        "mori",
        "--mori-ep-v2=false",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["all2all_backend"], "mori");
    assert_eq!(v["manager_class"], "MoriAll2AllManager");
    assert_eq!(v["layout"], "TOKEN_MAJOR");
    assert_eq!(v["warnings"], serde_json::json!([]));
    let o = epcomm(&[
        "check",
        "--all2all-backend",
        "mori",
        "--mori-ep-v2",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["exception"], "NotImplementedError");
    assert_eq!(
        v["message"],
        "all2all backend 'mori' with mori_ep_v2=True builds vLLM's MoriEPv2All2AllManager, \
         which epcomm does not implement; with mori_ep_v2=False (VLLM_MORI_EP_V2=0) 'mori' runs \
         MoriAll2AllManager (MoRI EPv1), whose token-major exchange epcomm has"
    );

    let o = epcomm(&[
        "check",
        "--vllm-version",
        "0.33.0",
        "--all2all-backend",
        "mori",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["exception"], "ValueError");
    assert_eq!(v["message"], literal_error_of(V0_33_0_NAMES, "mori"));
    assert_eq!(
        v["hint"],
        "'mori' is accepted from vLLM 0.34.0 on; you target 0.33.0"
    );
    assert_eq!(v["status"], 2);
}

#[test]
fn check_reads_a_config_file() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let o = epcomm(&[
        "check",
        "--config",
        &format!("{dir}/examples/configs/deepseek-v3-ep.json"),
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn usage_errors_exit_2_with_one_line_naming_the_option() {
    for (args, line) in [
        (
            &["check", "--enable-epl"][..],
            "epcomm: error: unexpected argument '--enable-epl' (did you mean '--enable-eplb'?)",
        ),
        (
            &["check", "--eplb-config.use_asyn=false"],
            "epcomm: error: unexpected argument '--eplb-config.use_asyn' (did you mean '--eplb-config.use_async'?)",
        ),
        (
            &["chek"],
            "epcomm: error: unrecognized subcommand 'chek' (did you mean 'check'?)",
        ),
        (
            &["--frobnicate"],
            "epcomm: error: unexpected argument '--frobnicate'",
        ),
        (
            &["backends", "--frobnicate"],
            "epcomm: error: unexpected argument '--frobnicate'",
        ),
        (
            &["demo", "--tokens"],
            "epcomm: error: a value is required for '--tokens <T>' but none was supplied",
        ),
        (
            &["bench", "moe", "--routing", "zipf"],
            "epcomm: error: invalid value 'zipf' for '--routing <ROUTING>' (possible values: uniform, skewed, top2)",
        ),
        (
            &["bench", "moe", "--dtype", "f8"],
            "epcomm: error: invalid value 'f8' for '--dtype <bf16|f16|f32>': expected bf16, f16 or f32, got 'f8'",
        ),
        (
            &["demo", "--experts", "7", "--ranks", "2"],
            "epcomm: error: --experts 7 must be a multiple of --ranks 2 (each rank owns E/R experts)",
        ),
        (
            &["demo", "--backend", "deepep_low_latncy"],
            "epcomm: error: --backend: Unknown all2all backend: deepep_low_latncy (did you mean 'deepep_low_latency'?)",
        ),
        (
            &["bench", "moe", "--backend", "allgather_reduce_scatter"],
            "epcomm: error: --backend: Unknown all2all backend: allgather_reduce_scatter (did you mean 'allgather_reducescatter'?)",
        ),
    ] {
        let o = epcomm(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert_eq!(stderr_lines(&o), [line], "{args:?}");
        assert!(o.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn help_on_every_subcommand_prints_its_usage_to_stdout() {
    for (args, usage) in [
        (&[][..], "Usage: epcomm [COMMAND]"),
        (&["check"], "Usage: epcomm check [OPTIONS]"),
        (&["backends"], "Usage: epcomm backends [OPTIONS]"),
        (&["demo"], "Usage: epcomm demo [OPTIONS]"),
        (&["bench"], "Usage: epcomm bench <COMMAND>"),
        (&["bench", "group"], "Usage: epcomm bench group [OPTIONS]"),
        (&["bench", "moe"], "Usage: epcomm bench moe [OPTIONS]"),
        (&["bench", "eplb"], "Usage: epcomm bench eplb [OPTIONS]"),
        (&["version"], "Usage: epcomm version"),
    ] {
        for flag in ["-h", "--help"] {
            let mut a = args.to_vec();
            a.push(flag);
            let o = epcomm(&a);
            let out = String::from_utf8_lossy(&o.stdout);
            assert_eq!(o.status.code(), Some(0), "{a:?}");
            assert!(out.starts_with(&format!("{usage}\n")), "{a:?}: {out}");
            assert!(out.contains("-h, --help"), "{a:?}: {out}");
            assert_eq!(String::from_utf8_lossy(&o.stderr), "", "{a:?}");
        }
    }
    // Each subcommand's own options, not the tool's.
    let o = epcomm(&["check", "--help"]);
    let out = String::from_utf8_lossy(&o.stdout);
    for flag in [
        "--config <JSON|FILE>",
        "--all2all-backend <NAME>",
        "--enable-eplb[=<true|false>]",
        "--eplb-config.use_async <VALUE>",
        "[short: -tp]",
    ] {
        assert!(out.contains(flag), "{flag}: {out}");
    }
    let o = epcomm(&["demo", "--help"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("--steps <N>"));
    // No subcommand at all prints the tool's help too.
    let o = epcomm(&[]);
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("Usage: epcomm [COMMAND]\n"));
}

#[test]
fn version_prints_the_version() {
    for args in [&["--version"][..], &["-V"], &["version"]] {
        let o = epcomm(args);
        assert_eq!(o.status.code(), Some(0), "{args:?}");
        assert_eq!(
            String::from_utf8_lossy(&o.stdout),
            "epcomm 0.1.0\n",
            "{args:?}"
        );
        assert!(o.stderr.is_empty(), "{args:?}");
    }
}

/// The process ended quietly after its reader went away: exit 0 (all was written before) or
/// SIGPIPE, and no panic text.
fn assert_quiet_end(child: std::process::Child, what: &str) {
    let o = child.wait_with_output().expect("wait");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.code() == Some(0) || o.status.signal() == Some(libc::SIGPIPE),
        "{what}: {:?} {err}",
        o.status
    );
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert!(!err.contains("Broken pipe"), "{what}: {err}");
}

#[test]
fn a_closed_pipe_ends_quietly() {
    let spawn = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_epcomm"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run epcomm")
    };
    // Closed before anything was written.
    for args in [&["backends"][..], &["--help"], &["check", "--help"]] {
        let mut c = spawn(args);
        drop(c.stdout.take());
        assert_quiet_end(c, &format!("{args:?}, pipe closed at once"));
    }
    // `| head -1`: one line read, then closed.
    for args in [&["backends"][..], &["--help"], &["backends", "--json"]] {
        let mut c = spawn(args);
        let mut first = String::new();
        BufReader::new(c.stdout.take().expect("stdout"))
            .read_line(&mut first)
            .expect("read a line");
        assert!(!first.is_empty(), "{args:?}");
        assert_quiet_end(c, &format!("{args:?} | head -1"));
    }
}

#[test]
fn backends_lists_every_name() {
    let o = epcomm(&["backends"]);
    assert_eq!(o.status.code(), Some(0));
    let out = String::from_utf8_lossy(&o.stdout);
    for n in epcomm::select::all2all::ACCEPTED_NAMES {
        assert!(out.contains(n.name), "{}", n.name);
    }
    assert!(out.contains("does not load DeepEP"));
    assert!(out.starts_with(
        "vLLM 0.34.0 (sdist): ParallelConfig.all2all_backend's Literal refuses any other name.\n"
    ));
    assert!(out.contains(
        "\npassthrough                    canonical  passthrough                    -              PassThroughAll2AllManager\n"
    ), "{out}");
    assert!(out.contains(
        "\nEPLB communicators: torch_nccl, torch_gloo, torch_xccl, nixl, pynccl, symm_mem.\n"
    ));
    let o = epcomm(&["backends", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // v0.34.0's literal: the 14 names with an exchange, then passthrough, which has none.
    assert_eq!(v.as_array().unwrap().len(), 15);
    assert_eq!(v[11]["name"], "flashinfer_all2allv");
    assert_eq!(v[11]["kind"], "alias");
    assert_eq!(v[11]["resolves_to"], "flashinfer_nvlink_two_sided");
    assert_eq!(v[5]["name"], "mori_high_throughput");
    assert_eq!(v[5]["kind"], "alias");
    assert_eq!(v[5]["resolves_to"], "mori");
    assert_eq!(v[8]["name"], "mori");
    assert_eq!(v[8]["layout"], "TOKEN_MAJOR");
    assert_eq!(v[8]["manager_class"], "MoriAll2AllManager");
    assert_eq!(
        v[14],
        serde_json::json!({
            "name": "passthrough",
            "kind": "canonical",
            "resolves_to": "passthrough",
            "backend": null,
            "layout": null,
            "manager_class": "PassThroughAll2AllManager",
            "vllm_version": "0.34.0",
        })
    );
}

const DEMO_SMALL: [&str; 14] = [
    "demo",
    "--ranks",
    "2",
    "--tokens",
    "16",
    "--hidden",
    "32",
    "--experts",
    "8",
    "--topk",
    "2",
    "--steps",
    "2",
    "--dtype",
];

#[test]
fn demo_runs_every_backend_and_checks_the_reference() {
    let mut args = DEMO_SMALL.to_vec();
    args.push("f32");
    let o = epcomm(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for b in epcomm::select::all2all::Backend::ALL {
        let line = out
            .lines()
            .find(|l| l.starts_with(&format!("{} ", b.name())))
            .unwrap_or_else(|| panic!("{out}"));
        if b.name() == "moonep" {
            assert_eq!(
                line,
                "moonep                       MOONEP_SLOTS   unavailable: MoonEP kernels are not part of epcomm"
            );
        } else {
            assert!(line.ends_with(" ok"), "{line}");
            assert!(line.contains(b.layout().name()), "{line}");
        }
    }
    assert!(!out.contains("AssertionError"), "{out}");
    let tail: Vec<&str> = out.lines().rev().take(2).collect();
    assert_eq!(
        tail,
        [
            "All checks passed.",
            "10 backends ran, 10 passed; 1 unavailable (moonep)"
        ],
        "{out}"
    );
}

#[test]
fn demo_fails_when_a_runnable_backend_fails() {
    // Every rank kills itself on entering combine: the backend cannot pass.
    let mut args = DEMO_SMALL.to_vec();
    args.extend(["f32", "--backend", "deepep_high_throughput,moonep"]);
    let o = Command::new(env!("CARGO_BIN_EXE_epcomm"))
        .args(&args)
        .env("EPCOMM_FAULT_POINT", "combine")
        .env_remove("EPCOMM_LOG_LEVEL")
        .output()
        .expect("run epcomm");
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{out}{err}");
    let row = out
        .lines()
        .find(|l| l.starts_with("deepep_high_throughput "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(row.contains("FAILED"), "{row}");
    assert!(
        out.contains("\n1 backend ran, 0 passed; 1 unavailable (moonep)\n"),
        "{out}"
    );
    assert!(!out.contains("All checks passed."), "{out}");
    assert!(err.ends_with("epcomm demo: FAILED\n"), "{err}");

    // Nothing that can run: not a pass either.
    let mut args = DEMO_SMALL.to_vec();
    args.extend(["f32", "--backend", "moonep"]);
    let o = epcomm(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("\n0 backends ran, 0 passed; 1 unavailable (moonep)\n"),
        "{out}"
    );
    assert!(!out.contains("All checks passed."), "{out}");
}

#[test]
fn bench_rejects_bad_iterations_without_panicking() {
    for (args, line) in [
        (
            &["bench", "eplb", "--iters", "0"][..],
            "epcomm: error: invalid value '0' for '--iters <N>': expected a positive integer, got 0",
        ),
        (
            &["bench", "eplb", "--iters", "x"],
            "epcomm: error: invalid value 'x' for '--iters <N>': expected a positive integer, got 'x'",
        ),
        (
            &["bench", "moe", "--iters", "0"],
            "epcomm: error: invalid value '0' for '--iters <N>': expected a positive integer, got 0",
        ),
        (
            &["bench", "group", "--iters", "0"],
            "epcomm: error: invalid value '0' for '--iters <N>': expected a positive integer, got 0",
        ),
        (
            &["bench", "eplb", "--ranks", "1"],
            "epcomm: error: need --ranks >= 2 and --experts-per-rank >= 2",
        ),
    ] {
        let o = epcomm(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert_eq!(stderr_lines(&o), [line], "{args:?}");
    }
    let o = epcomm(&["bench"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).starts_with("Usage: epcomm bench <COMMAND>"));
}

/// The table rows of nccl-tests style output: the lines not starting with `#`.
fn rows(out: &str) -> Vec<Vec<&str>> {
    out.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split_whitespace().collect())
        .collect()
}

/// nccl-tests conventions: `#` header with the parameters, the formula and the columns, data
/// rows with `#wrong` last and 0, and the closing summary lines.
fn assert_nccl_table(out: &str, columns: &[&str], data_rows: usize) {
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("# epcomm bench "), "{out}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("# algbw = size / time; busbw = algbw * ")),
        "{out}"
    );
    let header: Vec<&str> = lines
        .iter()
        .find(|l| l.contains("size(B)"))
        .unwrap_or_else(|| panic!("{out}"))
        .split_whitespace()
        .collect();
    assert_eq!(header[0], "#");
    assert_eq!(&header[1..], columns, "{out}");
    let rows = rows(out);
    assert_eq!(rows.len(), data_rows, "{out}");
    for r in &rows {
        assert_eq!(r.len(), columns.len(), "{r:?}");
        assert_eq!(*r.last().unwrap(), "0", "#wrong: {r:?}");
        for (c, v) in columns.iter().zip(r) {
            if c.ends_with("(us)") || c.ends_with("(GB/s)") || *c == "size(B)" {
                assert!(v.parse::<f64>().is_ok_and(|x| x >= 0.0), "{c}: {v}");
            }
        }
    }
    assert!(lines.contains(&"# Out of bounds values : 0 OK"), "{out}");
    if let Some(avg) = lines
        .iter()
        .find_map(|l| l.strip_prefix("# Avg bus bandwidth    : "))
    {
        assert!(avg.parse::<f64>().is_ok_and(|x| x >= 0.0), "{avg}");
        return;
    }
    // bench moe: one average per backend and R (backends move different bytes), each a
    // backend of the table.
    let at = lines
        .iter()
        .position(|l| *l == "# Avg bus bandwidth per backend (GB/s, the mean busbw over its T; none across backends, which move different bytes):")
        .unwrap_or_else(|| panic!("{out}"));
    let avgs: Vec<Vec<&str>> = lines[at + 1..]
        .iter()
        .take_while(|l| l.starts_with("#   "))
        .map(|l| l[4..].split_whitespace().collect())
        .collect();
    assert!(!avgs.is_empty(), "{out}");
    for a in &avgs {
        assert_eq!(a.len(), 3, "{a:?}");
        assert!(rows.iter().any(|r| r[0] == a[0]), "{a:?}: {out}");
        assert!(
            a[1].starts_with("R=") && a[1][2..].parse::<usize>().is_ok(),
            "{a:?}"
        );
        assert!(a[2].parse::<f64>().is_ok_and(|x| x >= 0.0), "{a:?}");
    }
    let mut averaged: Vec<&str> = avgs.iter().map(|a| a[0]).collect();
    let mut tabled: Vec<&str> = rows.iter().map(|r| r[0]).collect();
    for v in [&mut averaged, &mut tabled] {
        v.sort_unstable();
        v.dedup();
    }
    assert_eq!(averaged, tabled, "one average per backend: {out}");
}

const MOE_COLUMNS: [&str; 12] = [
    "backend",
    "T",
    "size(B)",
    "dispatch(us)",
    "combine(us)",
    "time(us)",
    "p99(us)",
    "algbw(GB/s)",
    "busbw(GB/s)",
    "memcpy(us)",
    "time/T(us)",
    "#wrong",
];

const MOE_SMALL: [&str; 12] = [
    "bench",
    "moe",
    "--hidden",
    "64",
    "--experts",
    "8",
    "--topk",
    "2",
    "--iters",
    "2",
    "--warmup",
    "1",
];

#[test]
fn bench_moe_prints_an_nccl_tests_table_with_a_real_check() {
    let mut args = MOE_SMALL.to_vec();
    args.extend([
        "--backend",
        "deepep_high_throughput,deepep_low_latency,allgather_reducescatter,deepep_v2,flashinfer_nvlink_two_sided",
        "--tokens",
        "1,8",
        "--routing",
        "top2",
    ]);
    let o = epcomm(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    assert_eq!(err, "");
    assert_nccl_table(&out, &MOE_COLUMNS, 10);
    assert!(out.contains(
        "# algbw = size / time; busbw = algbw * (n-1)/n with n = 2 ranks (nccl-tests' alltoall)"
    ));
    let rows = rows(&out);
    assert_eq!(rows[0][..2], ["deepep_high_throughput", "1"]);
    assert_eq!(rows[1][..2], ["deepep_high_throughput", "8"]);
    assert_eq!(rows[9][..2], ["flashinfer_nvlink_two_sided", "8"]);
    // top2 routing: each token goes to the one other rank, 64 bf16 out and back.
    assert_eq!(rows[1][2], "2048");
}

#[test]
fn bench_moe_fp8_rows_next_to_the_plain_ones() {
    // FP8 dispatch needs hidden % 128 == 0.
    let mut args = MOE_SMALL.to_vec();
    args[3] = "256";
    args.extend([
        "--backend",
        "deepep_high_throughput",
        "--tokens",
        "4",
        "--fp8",
    ]);
    let o = epcomm(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    assert_nccl_table(&out, &MOE_COLUMNS, 2);
    let rows = rows(&out);
    assert_eq!(rows[0][..2], ["deepep_high_throughput", "4"]);
    assert_eq!(rows[1][..2], ["deepep_high_throughput+fp8", "4"]);
    // The dequantised rows are checked against the float32 reference like the plain ones.
    assert_eq!(rows[0].last().copied(), Some("0"), "{out}");
    assert_eq!(rows[1].last().copied(), Some("0"), "{out}");
    assert!(out.contains("(+fp8 rows: 0.125, the e4m3 bound)"), "{out}");
}

#[test]
fn bench_moe_refuses_a_case_that_does_not_fit_and_runs_the_others() {
    // T = 2^30 tokens of hidden 256: terabytes of receive buffers per rank.
    let mut args = MOE_SMALL.to_vec();
    args[3] = "256";
    let svg = std::env::temp_dir().join(format!("epcomm-refused-{}.svg", std::process::id()));
    args.extend([
        "--backend",
        "deepep_high_throughput",
        "--tokens",
        "1073741824,2",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    let o = epcomm(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    let err = stderr_lines(&o);
    assert_eq!(o.status.code(), Some(0), "{out}{err:?}");
    assert_eq!(err.len(), 1, "{err:?}");
    let line = &err[0];
    let prefix = "epcomm bench moe: refused deepep_high_throughput T=1073741824: needs ";
    let rest = line
        .strip_prefix(prefix)
        .unwrap_or_else(|| panic!("{line}"));
    let (bytes, rest) = rest
        .split_once(" bytes per rank (")
        .expect("bytes per rank");
    let bytes: u64 = bytes.parse().expect("a byte count");
    let avail: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .map(|kb: u64| kb * 1024)
        .expect("MemAvailable");
    assert!(bytes * 2 > avail, "{line}");
    assert!(
        rest.contains(" the TOKEN_MAJOR layout's buffers + "),
        "{line}"
    );
    // The parts add up to the bytes per rank (to the rounding of their one-decimal GB), which
    // times the ranks is the total named.
    let (parts, total) = rest
        .split_once(" reference) x 2 ranks = ")
        .unwrap_or_else(|| panic!("{line}"));
    let gb = |s: &str| -> f64 { s.trim().strip_suffix(" GB").unwrap().parse().unwrap() };
    let (head, parts) = parts.split_once(": ").unwrap();
    let sum: f64 = parts
        .split(" + ")
        .map(|p| gb(&p[..p.find(" GB").unwrap() + 3]))
        .sum();
    assert!((sum - gb(head)).abs() <= 0.15, "{sum} vs {head}: {line}");
    assert!((bytes as f64 / 1e9 - gb(head)).abs() <= 0.05, "{line}");
    let total = &total[..total
        .find(" in all, more than the ")
        .unwrap_or_else(|| panic!("{line}"))];
    assert!(
        (gb(total) - 2.0 * bytes as f64 / 1e9).abs() <= 0.05,
        "{line}"
    );
    assert!(rest.contains(" in all, more than the "), "{line}");
    assert!(
        line.ends_with(" available (MemAvailable); lower --tokens or --hidden"),
        "{line}"
    );
    let rows = rows(&out);
    assert_eq!(rows.len(), 1, "{out}");
    assert_eq!(rows[0][..2], ["deepep_high_throughput", "2"]);
    assert!(
        out.contains("\n# 1 of 2 cases refused for memory (see stderr)\n"),
        "{out}"
    );
    // The chart marks the refused case (a cross in the backend's colour at its T, and the
    // legend says what a cross means); the line has only the measured point.
    let (chart, lines) = svg_lines(&svg);
    assert_eq!(lines, [1, 1], "{chart}");
    assert!(
        chart.contains(">refused (did not fit in memory)</text>"),
        "{chart}"
    );
    assert!(
        chart.contains(r##"stroke="#d62728" stroke-width="2"/>"##),
        "{chart}"
    );
    assert!(
        chart.contains(r#"text-anchor="middle">1073741824</text>"#),
        "{chart}"
    );
    std::fs::remove_file(&svg).ok();
    std::fs::remove_file(svg.with_file_name(format!(
        "epcomm-refused-{}-us-per-token.svg",
        std::process::id()
    )))
    .ok();
}

#[test]
fn bench_moe_prints_each_row_as_soon_as_it_is_measured() {
    // The second case takes seconds in a debug build; the first row must come before it ends.
    let mut child = Command::new(env!("CARGO_BIN_EXE_epcomm"))
        .args([
            "bench",
            "moe",
            "--backend",
            "deepep_high_throughput",
            "--tokens",
            "1,512",
            "--hidden",
            "1024",
            "--experts",
            "8",
            "--topk",
            "2",
            "--iters",
            "4",
            "--warmup",
            "0",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("run epcomm");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    loop {
        line.clear();
        assert!(stdout.read_line(&mut line).expect("read") > 0, "no row");
        if !line.starts_with('#') {
            break;
        }
    }
    assert!(
        line.trim_start().starts_with("deepep_high_throughput "),
        "{line}"
    );
    assert!(
        child.try_wait().expect("try_wait").is_none(),
        "the first row came only when the process ended"
    );
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).expect("read");
    assert!(child.wait().expect("wait").success(), "{rest}");
    assert_eq!(rows(&rest).len(), 1, "{rest}");
}

/// An SVG chart's polylines, each as its points' count; the document must be one `<svg>`.
fn svg_lines(path: &std::path::Path) -> (String, Vec<usize>) {
    let chart = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    assert!(chart.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert!(chart.trim_end().ends_with("</svg>"));
    assert_eq!(chart.matches("<svg").count(), 1);
    assert_eq!(chart.matches('<').count(), chart.matches('>').count());
    let lines = chart
        .split("<polyline ")
        .skip(1)
        .map(|l| {
            let pts = l.split("points=\"").nth(1).expect("points");
            let pts = &pts[..pts.find('"').expect("closing quote")];
            for xy in pts.split(' ') {
                let (x, y) = xy.split_once(',').expect("x,y");
                assert!(x.parse::<f64>().is_ok() && y.parse::<f64>().is_ok(), "{xy}");
            }
            pts.split(' ').count()
        })
        .collect();
    (chart, lines)
}

/// How cost grows: one table per R (its header naming R), one row per (R, T) in order, a GB/s
/// chart per R and one microseconds-per-token chart, every line with one point per T.
#[test]
fn bench_moe_sweeps_ranks_and_tokens() {
    let dir = std::env::temp_dir().join(format!("epcomm-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("cost.svg");
    let mut args = MOE_SMALL.to_vec();
    args.extend(["--ranks", "2,4", "--tokens", "1,2,4", "--svg"]);
    args.push(svg.to_str().unwrap());
    let o = epcomm(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    assert_eq!(err, "");
    assert_nccl_table(&out, &MOE_COLUMNS, 6);
    let titles: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("# epcomm bench moe: "))
        .collect();
    let title = |n: usize| {
        let over = if n > num_cpus() {
            ", oversubscribed"
        } else {
            ""
        };
        format!("# epcomm bench moe: dispatch + combine over shared memory, {n} ranks (processes, one per core{over})")
    };
    assert_eq!(titles, [title(2), title(4)], "{out}");
    let heads = out.lines().filter(|l| l.contains("size(B)")).count();
    assert_eq!(heads, 2, "{out}");
    // The table of R = 4 follows R = 2's: its rows come after its header.
    let (r2, r4) = out.split_at(out.find(titles[1]).expect("R = 4 table"));
    for (text, want) in [(r2, ["1", "2", "4"]), (r4, ["1", "2", "4"])] {
        let rows = rows(text);
        let ts: Vec<&str> = rows.iter().map(|r| r[1]).collect();
        assert_eq!(ts, want, "{text}");
        assert!(rows.iter().all(|r| r[0] == "deepep_high_throughput"));
        for r in &rows {
            // time/T = time / T, as printed (2 decimals of the 1-decimal time).
            let (time, t, per): (f64, f64, f64) = (
                r[5].parse().unwrap(),
                r[1].parse().unwrap(),
                r[10].parse().unwrap(),
            );
            assert!((per - time / t).abs() <= 0.05 / t + 0.006, "{r:?}");
            // time = dispatch + combine (of the median iteration), to the printed rounding.
            let (d, c): (f64, f64) = (r[3].parse().unwrap(), r[4].parse().unwrap());
            assert!((d + c - time).abs() <= 0.15, "{r:?}");
        }
    }
    assert!(
        r4.contains("with n = 4 ranks (nccl-tests' alltoall)"),
        "{r4}"
    );
    for n in [2, 4] {
        let (chart, lines) = svg_lines(&dir.join(format!("cost-r{n}.svg")));
        assert!(chart.contains(&format!("dispatch+combine, {n} ranks, H=64 bfloat16")));
        assert!(chart.contains(">deepep_high_throughput</text>"));
        assert!(chart.contains(">memcpy (same bytes)</text>"));
        assert_eq!(lines, [3, 3], "{chart}");
        // deepep_high_throughput's colour in every chart; memcpy black; ticks at measured T
        // only; a log y axis.
        assert!(chart.contains(r##"stroke="#d62728""##), "{chart}");
        assert!(chart.contains(r##"stroke="#000000""##), "{chart}");
        for t in ["1", "2", "4"] {
            assert_eq!(
                chart
                    .matches(&format!(r#"text-anchor="middle">{t}</text>"#))
                    .count(),
                1,
                "{chart}"
            );
        }
        assert!(!chart.contains(r#"text-anchor="middle">3</text>"#));
        assert!(chart.contains("log scale"), "{chart}");
    }
    let (chart, lines) = svg_lines(&dir.join("cost-us-per-token.svg"));
    for label in [
        "deepep_high_throughput, R=2",
        "2 x memcpy, R=2",
        "deepep_high_throughput, R=4",
        "2 x memcpy, R=4",
    ] {
        assert!(
            chart.contains(&format!(">{label}</text>")),
            "{label}: {chart}"
        );
    }
    assert_eq!(lines, [3, 3, 3, 3], "{chart}");
    assert!(chart.contains("microseconds per token (time / T, log scale)"));
    assert!(
        !svg.exists(),
        "several R: one GB/s file per R, none at FILE itself"
    );
    std::fs::remove_dir_all(&dir).ok();
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `--sweep` alone: T = 1, 2, ..., 8192 and R = 2, 4, 8 (read from the JSON of a sweep cut
/// to its first T by --tokens, which wins over the sweep's default).
#[test]
fn bench_moe_sweep_defaults_to_ranks_2_4_8() {
    let mut args = MOE_SMALL.to_vec();
    args.extend(["--sweep", "--tokens", "1", "--json"]);
    let o = epcomm(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let rows: serde_json::Value = serde_json::from_str(&out).expect("one JSON document");
    let got: Vec<(u64, u64)> = rows
        .as_array()
        .expect("array")
        .iter()
        .map(|r| (r["ranks"].as_u64().unwrap(), r["tokens"].as_u64().unwrap()))
        .collect();
    assert_eq!(got, [(2, 1), (4, 1), (8, 1)]);
    for r in rows.as_array().unwrap() {
        // T = 1: the time per token is the pair's time.
        let (per, time) = (r["us_per_token"].as_f64(), r["time_us"].as_f64());
        assert!(per.is_some_and(|v| v > 0.0) && per == time, "{r}");
    }
}

/// CI runs every benchmark once on a tiny case (no timing is asserted): the JSON and SVG
/// outputs are well formed.
#[test]
fn bench_moe_json_and_svg() {
    let dir = std::env::temp_dir().join(format!("epcomm-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("bench.svg");
    let mut args = MOE_SMALL.to_vec();
    args.extend([
        "--backend",
        "deepep_high_throughput,allgather_reducescatter",
        "--tokens",
        "1,4",
        "--json",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    let o = epcomm(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let rows: serde_json::Value = serde_json::from_str(&out).expect("one JSON document");
    let rows = rows.as_array().expect("array");
    assert_eq!(rows.len(), 4);
    assert_eq!(rows[1]["backend"], "deepep_high_throughput");
    assert_eq!(rows[1]["tokens"], 4);
    for r in rows {
        assert_eq!(r["wrong"], 0, "{r}");
        assert_eq!(r["ranks"], 2, "{r}");
        for key in [
            "size_bytes",
            "time_us",
            "algbw_gbps",
            "busbw_gbps",
            "dispatch_ms",
            "combine_ms",
            "pair_ms",
            "pair_p99_ms",
            "gbps_dedup",
            "gbps_per_expert",
            "memcpy_ms",
        ] {
            assert!(r[key].as_f64().is_some_and(|v| v >= 0.0), "{key}: {r}");
        }
    }
    let chart = std::fs::read_to_string(&svg).expect("svg written");
    assert!(chart.starts_with("<svg") && chart.trim_end().ends_with("</svg>"));
    assert!(chart.contains("deepep_high_throughput") && chart.contains("memcpy"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bench_eplb_and_group_tables() {
    let args = [
        "bench",
        "eplb",
        "--iters",
        "2",
        "--layers",
        "2",
        "--experts-per-rank",
        "4",
        "--expert-mib",
        "1",
    ];
    let o = epcomm(&args);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.lines().nth(1).is_some_and(
            |l| l.starts_with("# policy (L=58, E=256, P=288, G=8, N=4, R=32): median ")
        ),
        "{out}"
    );
    assert!(out.contains(
        "# transfer: 2 ranks, 2 layers x 4 experts of 1 MiB per rank, half received from a peer, half moved locally"
    ));
    assert_nccl_table(
        &out,
        &[
            "op",
            "size(B)",
            "received(B)",
            "time(us)",
            "p99(us)",
            "algbw(GB/s)",
            "busbw(GB/s)",
            "memcpy(us)",
            "#wrong",
        ],
        2,
    );
    // Half of each rank's 2 x 4 slots come from the peer, half move locally: 8 MiB placed,
    // staged and double-buffered.
    assert_eq!(rows(&out)[0][..3], ["rearrange", "8388608", "4194304"]);
    assert_eq!(rows(&out)[1][..3], ["double_buf", "8388608", "4194304"]);
    assert!(
        out.contains("\n# double-buffered transfer/memcpy bandwidth: "),
        "{out}"
    );
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let o = epcomm(&json_args);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON document");
    assert_eq!(v["wrong"], 0);
    assert_eq!(v["size_bytes"], 8388608);
    assert_eq!(v["received_bytes"], 4194304);
    assert!(
        v["double_buffered_time_us"]
            .as_f64()
            .is_some_and(|t| t > 0.0),
        "{v}"
    );

    let o = epcomm(&[
        "bench", "group", "--ranks", "2", "--mib", "1", "--iters", "2",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_nccl_table(
        &out,
        &[
            "op",
            "size(B)",
            "time(us)",
            "p99(us)",
            "algbw(GB/s)",
            "busbw(GB/s)",
            "memcpy(us)",
            "p99(us)",
            "#wrong",
        ],
        1,
    );
    assert_eq!(rows(&out)[0][..2], ["all_to_allv", "1048576"]);
    assert!(
        out.contains("\n# time ratio all_to_allv / memcpy: "),
        "{out}"
    );
    let o = epcomm(&[
        "bench", "group", "--ranks", "2", "--mib", "1", "--iters", "2", "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON document");
    assert_eq!(v["wrong"], 0);
    assert_eq!(v["size_bytes"], 1048576.0);
}

#[test]
fn bench_group_and_eplb_refuse_what_does_not_fit() {
    for (args, prefix, suffix) in [
        (
            &["bench", "group", "--mib", "1000000000"][..],
            "epcomm bench group: refused all_to_allv of 1000000000 MiB per rank: needs 2097152000000000 bytes per rank (2097152.0 GB) x 2 ranks = 4194304.0 GB in all, more than the ",
            " available (MemAvailable); lower --mib",
        ),
        (
            &["bench", "eplb", "--expert-mib", "100000000", "--iters", "1"],
            "epcomm bench eplb: refused eplb transfer of 4 layers x 16 experts of 100000000 MiB: needs ",
            " available (MemAvailable); lower --layers, --experts-per-rank or --expert-mib",
        ),
    ] {
        let o = epcomm(args);
        let err = stderr_lines(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err:?}");
        assert_eq!(err.len(), 1, "{args:?}: {err:?}");
        assert!(err[0].starts_with(prefix), "{}", err[0]);
        assert!(err[0].ends_with(suffix), "{}", err[0]);
    }
}

/// The portable (non-SIMD) reduction kernels pass the demo's reference check too.
#[test]
fn demo_passes_with_simd_disabled() {
    for dtype in ["bf16", "f16"] {
        let o = Command::new(env!("CARGO_BIN_EXE_epcomm"))
            .args([
                "demo",
                "--backend",
                "deepep_high_throughput",
                "--ranks",
                "2",
                "--tokens",
                "24",
                "--hidden",
                "40",
                "--experts",
                "8",
                "--topk",
                "2",
                "--steps",
                "1",
                "--dtype",
                dtype,
            ])
            .env("EPCOMM_NO_SIMD", "1")
            .env_remove("EPCOMM_LOG_LEVEL")
            .output()
            .expect("run epcomm");
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{out}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(out.contains("All checks passed."), "{out}");
    }
}
