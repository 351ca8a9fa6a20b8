//! The Python scripts in tests/py, run against the built library through ctypes the way a
//! binding uses it: test_ctypes.py (selection, config checks, errors as Python exceptions),
//! test_group.py (groups with multiprocessing ranks and host callbacks), test_all2all.py
//! (dispatch/combine with numpy arrays as DLPack tensors), test_eplb.py (vLLM's EPLB vectors).
//! Each script bounds its own multi-process cases; the timeouts here bound whole runs.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

fn python() -> String {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let found = Command::new(&python)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "`{python} --version` failed: these tests need Python 3 (set $PYTHON to its path, or \
         install python3; .ci/run installs it)"
    );
    python
}

fn run_script(script: &str, timeout: Duration) {
    let python = python();
    let lib = cdylib();
    let mut cmd = Command::new(&python);
    cmd.current_dir(manifest_dir())
        .arg(manifest_dir().join("tests/py").join(script))
        .arg("-v")
        .env("EPCOMM_LIBRARY", &lib)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("RUST_BACKTRACE", "0")
        .env_remove("EPCOMM_LOG_LEVEL")
        .env_remove("EPCOMM_TIMEOUT_S");
    let out = run_with_timeout(cmd, timeout);
    assert!(
        out.success(),
        "{}",
        out.describe(&format!(
            "EPCOMM_LIBRARY={} {python} tests/py/{script} -v",
            lib.display()
        ))
    );
    // unittest reports on stderr.
    println!("{}", out.stderr);
}

#[test]
fn python_ctypes_binding() {
    run_script("test_ctypes.py", RUN_TIMEOUT);
}

#[test]
fn python_ctypes_groups() {
    run_script("test_group.py", Duration::from_secs(180));
}

#[test]
fn python_ctypes_eplb() {
    run_script("test_eplb.py", RUN_TIMEOUT);
}

#[test]
fn python_ctypes_all2all() {
    let numpy = Command::new(python())
        .args(["-c", "import numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        numpy,
        "`python3 -c 'import numpy'` failed: tests/py/test_all2all.py needs numpy; .ci/run \
         installs it (`python3 -m pip install numpy`)"
    );
    run_script("test_all2all.py", Duration::from_secs(300));
}
