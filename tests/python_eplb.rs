//! tests/py/test_eplb.py: the EPLB policy through Python's ctypes with vLLM's test vectors.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// The script bounds each multi-process case at 60 s itself; this bounds the whole run.
const GROUP_SCRIPT_TIMEOUT: Duration = Duration::from_secs(180);

#[test]
fn python_ctypes_eplb() {
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
        .arg(manifest_dir().join("tests/py/test_eplb.py"))
        .arg("-v")
        .env("EPCOMM_LIBRARY", &lib)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("RUST_BACKTRACE", "0")
        .env_remove("EPCOMM_LOG_LEVEL")
        .env_remove("EPCOMM_TIMEOUT_S");
    let out = run_with_timeout(cmd, GROUP_SCRIPT_TIMEOUT);
    assert!(
        out.success(),
        "{}",
        out.describe(&format!(
            "EPCOMM_LIBRARY={} {python} tests/py/test_eplb.py -v",
            lib.display()
        ))
    );
    // unittest reports on stderr.
    println!("{}", out.stderr);
}
