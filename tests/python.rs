//! tests/py/test_ctypes.py: the library through Python's ctypes, the way a binding uses it.

mod common;

use std::process::Command;

use common::*;

#[test]
fn python_ctypes_binding() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let found = Command::new(&python)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "`{python} --version` failed: this test needs Python 3 (set $PYTHON to its path, or \
         install python3; CI installs it)"
    );
    let lib = cdylib();
    let mut cmd = Command::new(&python);
    cmd.current_dir(manifest_dir())
        .arg(manifest_dir().join("tests/py/test_ctypes.py"))
        .arg("-v")
        .env("EPCOMM_LIBRARY", &lib)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("RUST_BACKTRACE", "0")
        .env_remove("EPCOMM_LOG_LEVEL");
    let out = run_with_timeout(cmd, RUN_TIMEOUT);
    assert!(
        out.success(),
        "{}",
        out.describe(&format!(
            "EPCOMM_LIBRARY={} {python} tests/py/test_ctypes.py -v",
            lib.display()
        ))
    );
    // unittest reports on stderr.
    println!("{}", out.stderr);
}
