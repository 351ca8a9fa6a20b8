//! The Python scripts in tests/py, run against the built library through ctypes the way a
//! binding uses it: test_ctypes.py (selection, config checks, errors as Python exceptions),
//! test_group.py (groups with multiprocessing ranks and host callbacks), test_all2all.py
//! (dispatch/combine with numpy arrays as DLPack tensors), test_eplb.py (vLLM's EPLB vectors, lost experts, a scale-down after a failure on three
//! thread ranks);
//! and the epcomm package itself (python/ on PYTHONPATH): test_package.py (errors, groups,
//! dtypes, context managers) and, with torch, test_outputs.py (DLPack capsule lifetimes,
//! outputs as DLPack producers, out= tensors in place, the rest of the wrapped C ABI),
//! test_torch_group.py (`Group.from_torch` over gloo with 2 and 4 ranks in their
//! own IPC and mount namespaces, against the shm group's results),
//! test_ft.py (fault tolerance: a stalled rank masked and the survivors going on, through the
//! package and through epcomm.vllm's query_active_mask / query_fault / clean_buffers over gloo),
//! and test_vllm.py (`epcomm.vllm`'s all2all manager and EPLB communicator with 2 and 4 ranks
//! against a plain-torch reference of vLLM's AgRsAll2AllManager); test_mem.py (zero-copy
//! views: `Group.alloc` and `All2All.expert_output_buffer`, with torch); test_safety.py
//! (never silently wrong: any exception preparing a collective's arguments tells the peers,
//! views outlive close(), close() during a call on another thread is refused).
//! Each script bounds its own multi-process cases; the timeouts here bound whole runs.
//!
//! The interpreter is `common::python::env()`'s: `$PYTHON`/python3, or a venv under target/ with
//! numpy when python3 lacks it. Without python3 every test prints a SKIPPED line; without numpy
//! test_all2all.py does (EPCOMM_REQUIRE_PYTHON=1 / EPCOMM_REQUIRE_NUMPY=1 make those failures).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::python::{numpy_or_skip, python_or_skip, torch_or_skip};
use common::*;

fn run_script(python: &Path, script: &str, timeout: Duration) {
    run_script_with(python, script, timeout, None);
}

/// As `run_script`, with `python/` (the epcomm package) on PYTHONPATH for scripts that
/// import it.
fn run_package_script(python: &Path, script: &str, timeout: Duration) {
    run_script_with(
        python,
        script,
        timeout,
        Some(&manifest_dir().join("python")),
    );
}

fn run_script_with(python: &Path, script: &str, timeout: Duration, path: Option<&Path>) {
    let lib = cdylib();
    let mut cmd = Command::new(python);
    cmd.current_dir(manifest_dir())
        .arg(manifest_dir().join("tests/py").join(script))
        .arg("-v")
        .env("EPCOMM_LIBRARY", &lib)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("RUST_BACKTRACE", "0")
        .env_remove("PYTHONPATH")
        .env_remove("EPCOMM_LOG_LEVEL")
        .env_remove("EPCOMM_TIMEOUT_S");
    if let Some(path) = path {
        cmd.env("PYTHONPATH", path);
    }
    let out = run_with_timeout(cmd, timeout);
    assert!(
        out.success(),
        "{}",
        out.describe(&format!(
            "EPCOMM_LIBRARY={} {} tests/py/{script} -v",
            lib.display(),
            python.display()
        ))
    );
    // unittest reports on stderr.
    println!("{}", out.stderr);
}

#[test]
fn python_ctypes_binding() {
    if let Some(py) = python_or_skip("python_ctypes_binding") {
        run_script(&py.exe, "test_ctypes.py", RUN_TIMEOUT);
    }
}

#[test]
fn python_ctypes_groups() {
    if let Some(py) = python_or_skip("python_ctypes_groups") {
        run_script(&py.exe, "test_group.py", Duration::from_secs(180));
    }
}

#[test]
fn python_ctypes_eplb() {
    if let Some(py) = python_or_skip("python_ctypes_eplb") {
        run_script(&py.exe, "test_eplb.py", RUN_TIMEOUT);
    }
}

#[test]
fn python_ctypes_all2all() {
    if let Some(py) = numpy_or_skip("python_ctypes_all2all") {
        run_script(&py.exe, "test_all2all.py", Duration::from_secs(300));
    }
}

#[test]
fn python_package_api() {
    if let Some(py) = numpy_or_skip("python_package_api") {
        run_package_script(&py.exe, "test_package.py", Duration::from_secs(180));
    }
}

#[test]
fn python_package_outputs() {
    if let Some(py) = torch_or_skip("python_package_outputs") {
        run_package_script(py, "test_outputs.py", Duration::from_secs(180));
    }
}

#[test]
fn python_group_from_torch() {
    if let Some(py) = torch_or_skip("python_group_from_torch") {
        run_package_script(py, "test_torch_group.py", Duration::from_secs(400));
    }
}

#[test]
fn python_vllm_integration() {
    if let Some(py) = torch_or_skip("python_vllm_integration") {
        run_package_script(py, "test_vllm.py", Duration::from_secs(300));
    }
}

#[test]
fn python_fault_tolerance() {
    if let Some(py) = torch_or_skip("python_fault_tolerance") {
        run_package_script(py, "test_ft.py", Duration::from_secs(300));
    }
}

#[test]
fn python_zero_copy_mem() {
    if let Some(py) = torch_or_skip("python_zero_copy_mem") {
        run_package_script(py, "test_mem.py", Duration::from_secs(300));
    }
}

#[test]
fn python_never_silently_wrong() {
    if let Some(py) = torch_or_skip("python_never_silently_wrong") {
        run_package_script(py, "test_safety.py", Duration::from_secs(300));
    }
}
