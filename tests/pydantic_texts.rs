//! The configuration check's field errors against pydantic itself: tests/py/test_pydantic_texts.py
//! defines pydantic dataclasses mirroring vLLM v0.34.0's `ParallelConfig` / `EPLBConfig` fields
//! (and epcomm's own keys) and, for 89 bad configurations, compares `str(ValidationError)` with
//! the message `epcomm_config_check_report` gives through ctypes; lax coercions pydantic accepts
//! must pass epcomm's field validation too.
//!
//! The mirror is checked with `ast` against vllm/config/parallel.py of v0.34.0's source tree
//! (`EPCOMM_VLLM_SRC`, else `scripts/fetch-vllm-sdist.sh 0.34.0 target/vllm-src`); without that
//! tree the comparison prints a SKIPPED line (`EPCOMM_REQUIRE_VLLM_SRC=1` makes it a failure).
//! The interpreter needs pydantic 2.13 (`common::python::pydantic_or_skip`: `pydantic==2.13.5`,
//! vLLM's pin, into the test venv; `EPCOMM_REQUIRE_PYTHON=1` makes its absence a failure).

mod common;

use std::process::Command;
use std::time::Duration;

use common::python::pydantic_or_skip;
use common::skip::{required, skipped};
use common::*;

const VLLM_VERSION: &str = "0.34.0";
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(120);

#[test]
fn config_field_errors_are_pydantics_texts() {
    const TEST: &str = "config_field_errors_are_pydantics_texts";
    let Some(python) = pydantic_or_skip(TEST) else {
        return;
    };
    let tree = match common::python::vllm_sdist(python, VLLM_VERSION) {
        Ok(tree) => Some(tree),
        Err(why) => {
            assert!(
                !required("EPCOMM_REQUIRE_VLLM_SRC"),
                "EPCOMM_REQUIRE_VLLM_SRC is set but {why}"
            );
            skipped(&format!("{TEST} (mirror vs vLLM's source)"), &why);
            None
        }
    };
    let lib = cdylib();
    let script = manifest_dir().join("tests/py/test_pydantic_texts.py");
    let mut cmd = Command::new(python);
    cmd.current_dir(manifest_dir())
        .arg(&script)
        .arg("-v")
        .env("EPCOMM_LIBRARY", &lib)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("PYTHONPATH")
        .env_remove("EPCOMM_LOG_LEVEL")
        .env_remove("EPCOMM_VLLM_SRC");
    if let Some(tree) = &tree {
        cmd.env("EPCOMM_VLLM_SRC", tree);
    }
    let out = run_with_timeout(cmd, SCRIPT_TIMEOUT);
    assert!(
        out.success(),
        "{}",
        out.describe(&format!(
            "EPCOMM_LIBRARY={} {} {} -v",
            lib.display(),
            python.display(),
            script.display()
        ))
    );
    // unittest reports on stderr: every case ran (none skipped but the source comparison).
    println!("{}", out.stderr);
    assert!(out
        .stderr
        .contains("89 bad configurations: epcomm's text == pydantic's"));
    assert_eq!(
        out.stderr.contains("mirror == "),
        tree.is_some(),
        "{}",
        out.stderr
    );
}
