//! A visible record of a test that could not run because an optional tool is missing.
//!
//! libtest captures what the `print!`/`eprint!` macros write, so a skip reported with them only
//! shows under `--nocapture`. Writing straight to the stderr handle bypasses that capture, so
//! the line appears in the normal `cargo test` output.

use std::io::Write;

/// Reports that `test` did not run, and why (what is missing and how to get it), as one line
/// `SKIPPED <test>: <why>` on stderr that shows in normal `cargo test` output.
pub fn skipped(test: &str, why: &str) {
    let line = format!("SKIPPED {test}: {why}\n");
    // One write, so lines from tests running in parallel do not interleave; a failed write of a
    // diagnostic line is not worth failing the test for.
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// Whether the environment variable `var` is set to a value asking that a skip fail instead
/// (anything but empty or `0`), as CI does for the tools it provides.
pub fn required(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| !v.is_empty() && v != "0")
}
