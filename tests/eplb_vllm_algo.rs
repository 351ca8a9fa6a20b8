//! vLLM v0.34.0's own, unmodified `tests/distributed/test_eplb_algo.py`, run with pytest against
//! epcomm through the stand-in `vllm` package in tests/py/vllm_eplb_shim (its classmethods call
//! epcomm's Python package, `python/epcomm/eplb_algo.py`, over the C ABI).
//!
//! The file comes from v0.34.0's sdist (byte for byte v0.33.0's; the policy module is unchanged
//! too): `EPCOMM_VLLM_SRC` names an unpacked source tree, else
//! `scripts/fetch-vllm-sdist.sh 0.34.0 target/vllm-src` brings it (PyPI, once). Its SHA-256 is
//! checked, so the run is of the released file. Without the network the test prints a SKIPPED
//! line; `EPCOMM_REQUIRE_VLLM_SRC=1` makes that a failure. The interpreter needs torch, numpy and
//! pytest (`common::python::torch_or_skip`, `EPCOMM_REQUIRE_TORCH=1`).
//!
//! Of vLLM's 15 tests all pass; the CUDA and XPU cases of `test_device_compatibility` skip
//! themselves (pytest's count: 15 passed, 2 skipped). vLLM 0.34.0's
//! `test_push_recv_rows_match_receiver_rows` (tests/distributed/
//! test_eplb_migration_scheduler.py, also unmodified) runs too, its `move_to_buffer` the shim's
//! over epcomm's transfer plan: 16 passed.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::python::torch_or_skip;
use common::skip::{required, skipped};
use common::*;

/// The release the file is taken from, and the file's SHA-256 in that release's sdist.
const VLLM_VERSION: &str = "0.34.0";
const TEST_FILE: &str = "tests/distributed/test_eplb_algo.py";
const TEST_FILE_SHA256: &str = "9d8521e77d0c933674f04c8245dba7482fede1f6594bf4d04bdfb03d1cc42489";
/// vLLM 0.34.0's scheduler tests, of which `test_push_recv_rows_match_receiver_rows` runs.
const SCHEDULER_TEST_FILE: &str = "tests/distributed/test_eplb_migration_scheduler.py";
const SCHEDULER_TEST_FILE_SHA256: &str =
    "1abaa2666a2ebe59a52237108de6f6de837372011a01bdef85fb47591da36cd4";
/// What pytest reports for the file: vLLM's 15 tests pass, the CUDA and XPU cases skip.
const PASSED: usize = 15;
const SKIPPED: usize = 2;

/// How long fetching the sdist may take (a scratch venv, build tools, a ~50 MB download).
const PYTEST_TIMEOUT: Duration = Duration::from_secs(300);

fn sha256(python: &Path, file: &Path) -> String {
    let code = format!(
        "import hashlib; print(hashlib.sha256(open({:?}, 'rb').read()).hexdigest())",
        file.display().to_string()
    );
    common::python::run_code(python, &code)
        .unwrap_or_else(|e| panic!("sha256 of {}: {e}", file.display()))
        .trim()
        .to_owned()
}

/// The count pytest's summary line gives for `what` ("passed", "skipped", "failed").
fn count(summary: &str, what: &str) -> usize {
    summary
        .split([',', ' '])
        .collect::<Vec<_>>()
        .windows(2)
        .find(|w| w[1] == what)
        .and_then(|w| w[0].parse().ok())
        .unwrap_or(0)
}

/// Runs vLLM's test file `file` (its SHA-256 checked) with pytest against epcomm through the
/// shim, `filter` selecting tests (`-k`), and checks pytest's counts.
fn run_vllm_tests(test: &str, file: &str, sha: &str, filter: Option<&str>, want: (usize, usize)) {
    let Some(python) = torch_or_skip(test) else {
        return;
    };
    let tree = match common::python::vllm_sdist(python, VLLM_VERSION) {
        Ok(tree) => tree,
        Err(why) => {
            assert!(
                !required("EPCOMM_REQUIRE_VLLM_SRC"),
                "EPCOMM_REQUIRE_VLLM_SRC is set but {why}"
            );
            skipped(test, &why);
            return;
        }
    };
    let src = tree.join(file);
    assert_eq!(
        sha256(python, &src),
        sha,
        "{} is not v{VLLM_VERSION}'s file",
        src.display()
    );
    // A directory of its own: vLLM's conftest.py and pytest settings stay out of the run.
    let dir = out_dir(test);
    let name = Path::new(file).file_name().expect("a file name");
    let copy = dir.join(name);
    std::fs::copy(&src, &copy).expect("copy the test file");
    let shim = manifest_dir().join("tests/py/vllm_eplb_shim");
    let path = std::env::join_paths([shim, manifest_dir().join("python")]).expect("PYTHONPATH");
    let mut cmd = Command::new(python);
    cmd.current_dir(&dir)
        .args([
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--noconftest",
        ])
        .arg(&copy)
        .env("PYTHONPATH", path)
        .env("EPCOMM_LIBRARY", cdylib())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("EPCOMM_LOG_LEVEL");
    if let Some(k) = filter {
        cmd.args(["-k", k]);
    }
    let out = run_with_timeout(cmd, PYTEST_TIMEOUT);
    let what = format!("pytest {file} (vLLM {VLLM_VERSION}) against epcomm");
    assert!(out.success(), "{}", out.describe(&what));
    let summary = out
        .stdout
        .lines()
        .rev()
        .find(|l| l.contains(" passed"))
        .unwrap_or("")
        .to_owned();
    assert_eq!(
        (count(&summary, "passed"), count(&summary, "skipped")),
        want,
        "{summary}\n{}",
        out.describe(&what)
    );
    assert_eq!(count(&summary, "failed"), 0, "{summary}");
    println!("{what}: {summary}");
}

#[test]
fn vllm_test_eplb_algo_passes_against_epcomm() {
    run_vllm_tests(
        "vllm_test_eplb_algo_passes_against_epcomm",
        TEST_FILE,
        TEST_FILE_SHA256,
        None,
        (PASSED, SKIPPED),
    );
}

/// vLLM 0.34.0's `test_push_recv_rows_match_receiver_rows` (tests/distributed/
/// test_eplb_migration_scheduler.py, unmodified; no CUDA needed): for a push backend, every
/// rank's pushes land in exactly the buffer rows their receivers read, on 8 random placements,
/// batching off and on. Through the shim's `move_to_buffer`, the rows come from epcomm's
/// transfer plan (`epcomm.eplb.LayerPlan`), so the test checks that epcomm's senders and
/// receivers agree on every row. The file's other tests drive vLLM's own `move_to_buffer`
/// and `move_from_buffer` call by call; they are not run here.
#[test]
fn vllm_push_recv_rows_test_passes_against_epcomm() {
    run_vllm_tests(
        "vllm_push_recv_rows_test_passes_against_epcomm",
        SCHEDULER_TEST_FILE,
        SCHEDULER_TEST_FILE_SHA256,
        Some("test_push_recv_rows_match_receiver_rows"),
        (16, 0),
    );
}
