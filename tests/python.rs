//! The Python scripts in tests/py, run against the built library through ctypes the way a
//! binding uses it: test_ctypes.py (selection, config checks, errors as Python exceptions),
//! test_group.py (groups with multiprocessing ranks and host callbacks), test_all2all.py
//! (dispatch/combine with numpy arrays as DLPack tensors), test_eplb.py (vLLM's EPLB vectors).
//! Each script bounds its own multi-process cases; the timeouts here bound whole runs.
//!
//! The interpreter is `common::python::env()`'s: `$PYTHON`/python3, or a venv under target/ with
//! numpy when python3 lacks it. Without python3 every test prints a SKIPPED line; without numpy
//! test_all2all.py does (EPCOMM_REQUIRE_PYTHON=1 / EPCOMM_REQUIRE_NUMPY=1 make those failures).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::python::{numpy_or_skip, python_or_skip};
use common::*;

fn run_script(python: &Path, script: &str, timeout: Duration) {
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
