//! The `epcomm` command line: `check` prints `{Exception}: {message}` first on stderr and exits 1
//! on error; prints the resolved setup and exits 0 on success.

use std::process::{Command, Output};

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

#[test]
fn check_reports_unknown_backend_with_hint() {
    let o = epcomm(&["check", "--all2all-backend", "flashinfer-nvlink-2s"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr_lines(&o);
    assert_eq!(
        err[0],
        "ValueError: Unknown all2all backend: flashinfer-nvlink-2s"
    );
    assert_eq!(err[1], "hint: did you mean 'flashinfer_nvlink_two_sided'?");
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
        "NotImplementedError: Elastic EP is not compatible with data_parallel_external_lb or data_parallel_hybrid_lb. Elastic EP relies on a single API server and core client to coordinate scale up/down."
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

    let o = epcomm(&["check", "--all2all-backend", "mori", "--json"]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["exception"], "ValueError");
    assert_eq!(v["message"], "Unknown all2all backend: mori");
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
fn usage_errors_exit_2() {
    let o = epcomm(&["check", "--enable-epl"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr_lines(&o)[0]
        .contains("unrecognized argument --enable-epl (did you mean 'enable-eplb'?)"));
    let o = epcomm(&["chek"]);
    assert_eq!(o.status.code(), Some(2));
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
    let o = epcomm(&["backends", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 13);
    assert_eq!(v[10]["name"], "flashinfer_all2allv");
    assert_eq!(v[10]["kind"], "alias");
}

#[test]
fn demo_runs_every_backend_and_checks_the_reference() {
    let o = epcomm(&[
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
        "f32",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for b in epcomm::select::all2all::Backend::ALL {
        if b.name() == "moonep" {
            assert!(
                out.contains("moonep AssertionError: MoonEP not available."),
                "{out}"
            );
        } else {
            let line = out
                .lines()
                .find(|l| l.starts_with(&format!("{} ", b.name())))
                .unwrap_or_else(|| panic!("{out}"));
            assert!(line.ends_with(" ok"), "{line}");
            assert!(line.contains(b.layout().name()), "{line}");
        }
    }
    assert!(out.contains("All checks passed."));
    let o = epcomm(&["demo", "--experts", "7", "--ranks", "2"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr_lines(&o)[0].contains("--experts 7 must be a multiple of --ranks 2"));
}

#[test]
fn bench_rejects_bad_iterations_without_panicking() {
    for args in [
        &["bench", "eplb", "--iters", "0"][..],
        &["bench", "eplb", "--iters", "x"],
        &["bench", "moe", "--iters", "0"],
        &["bench", "group", "--iters", "0"],
    ] {
        let o = epcomm(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.starts_with("epcomm: error: "), "{args:?}: {err}");
        assert!(
            err.lines().next().unwrap().contains("--iters"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// CI runs every benchmark once on a tiny case (no timing is asserted): the table/JSON/SVG
/// outputs are well formed and `--help` prints the usage.
#[test]
fn bench_runs_a_tiny_case() {
    let dir = std::env::temp_dir().join(format!("epcomm-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("bench.svg");
    let o = epcomm(&[
        "bench",
        "moe",
        "--backend",
        "deepep_high_throughput,allgather_reducescatter",
        "--tokens",
        "1,4",
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
        "--json",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let rows: serde_json::Value = serde_json::from_str(&out).expect("JSON table");
    let rows = rows.as_array().expect("array");
    assert_eq!(rows.len(), 4);
    for r in rows {
        for key in [
            "dispatch_ms",
            "combine_ms",
            "pair_ms",
            "gbps_dedup",
            "memcpy_ms",
        ] {
            assert!(r[key].as_f64().is_some_and(|v| v >= 0.0), "{key}: {r}");
        }
    }
    let chart = std::fs::read_to_string(&svg).expect("svg written");
    assert!(chart.starts_with("<svg") && chart.trim_end().ends_with("</svg>"));
    assert!(chart.contains("deepep_high_throughput") && chart.contains("memcpy"));
    std::fs::remove_dir_all(&dir).ok();

    let o = epcomm(&[
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
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.starts_with("EPLB policy (L=58, E=256, P=288"), "{out}");
    // Half of each rank's 2 x 4 slots come from the peer, half move locally: 8 MiB placed.
    assert!(
        out.contains("EPLB weight transfer (2 ranks, 2 layers x 4 experts of 1 MiB per rank")
            && out.contains(": 8.0 MiB placed per rank in "),
        "{out}"
    );
    let o = epcomm(&[
        "bench", "group", "--ranks", "2", "--mib", "1", "--iters", "2",
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("time ratio all_to_allv / memcpy"));
    for (args, usage) in [
        (&["bench", "moe", "--help"][..], "usage: epcomm bench moe"),
        (&["bench", "eplb", "--help"], "usage: epcomm bench eplb"),
        (&["bench", "group", "--help"], "usage: epcomm bench group"),
        (&["bench", "--help"], "usage: epcomm bench group"),
    ] {
        let o = epcomm(args);
        assert_eq!(o.status.code(), Some(0), "{args:?}");
        assert!(
            String::from_utf8_lossy(&o.stdout).starts_with(usage),
            "{args:?}"
        );
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
