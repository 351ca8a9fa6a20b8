//! A visible record of a test that could not run because an optional tool is missing, and the
//! one place that says which tier of the suite is asked for.
//!
//! libtest captures what the `print!`/`eprint!` macros write, so a skip reported with them only
//! shows under `--nocapture`. Writing straight to the stderr handle bypasses that capture, so
//! the line appears in the normal `cargo test` output.
//!
//! Tiers: a plain `cargo test` runs the heavy tests (torch, vLLM's sdist and release table from
//! PyPI, NVRTC, MPI, valgrind, the install tools) only when what they need is already there,
//! and provisions nothing bigger than numpy. `EPCOMM_TEST_FULL=1` ([`FULL`]) asks for every
//! tier: the tests download what they need (torch, vLLM's sdist, ...) and every
//! `EPCOMM_REQUIRE_*` flag counts as set, so a missing tool is a failure, not a skip.

use std::io::Write;

/// The switch that asks for every tier (README: "Tests, in tiers"); `.ci/run` sets it.
pub const FULL: &str = "EPCOMM_TEST_FULL";

/// Reports that `test` did not run, and why (what is missing and how to get it), as one line
/// `SKIPPED <test>: <why>` on stderr that shows in normal `cargo test` output.
pub fn skipped(test: &str, why: &str) {
    let line = format!("SKIPPED {test}: {why}\n");
    // One write, so lines from tests running in parallel do not interleave; a failed write of a
    // diagnostic line is not worth failing the test for.
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

fn set(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Whether the full tier is asked for (`EPCOMM_TEST_FULL` set to anything but empty or `0`):
/// the heavy tests provision what they need (downloads of hundreds of MB to GB) instead of
/// skipping, and every `EPCOMM_REQUIRE_*` flag is implied.
pub fn full() -> bool {
    set(FULL)
}

/// Whether the environment variable `var` is set to a value asking that a skip fail instead
/// (anything but empty or `0`), as CI does for the tools it provides. [`full`] implies every
/// `EPCOMM_REQUIRE_*` variable.
pub fn required(var: &str) -> bool {
    set(var) || (var.starts_with("EPCOMM_REQUIRE_") && full())
}

/// The end of a SKIPPED line for a heavy test whose `what` is not already here: how much the
/// full tier downloads for it.
pub fn heavy(what: &str, download: &str) -> String {
    format!("not here: {what}; a plain `cargo test` downloads nothing that big, {FULL}=1 provisions it ({download})")
}

/// How many runs a fault campaign makes when its variable does not say: `ci_runs` (the size
/// CI runs, `.ci/run` sets [`FULL`]) in the full tier, half of it in a plain `cargo test`, which
/// the README promises in minutes. The campaign's variable overrides both.
pub fn campaign_runs(var: &str, ci_runs: u64) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if full() { ci_runs } else { ci_runs.div_ceil(2) })
}
