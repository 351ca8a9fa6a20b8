//! valgrind memcheck over a multi-process run (docs/reliability.md):
//! tests/c/valgrind_test.c, built without sanitizers against the shared library, forks two
//! ranks that form a shared-memory group and run all_gatherv, reduce_scatterv and a
//! dispatch/combine, then 50 group + manager create/destroy cycles. It runs under
//!
//! ```text
//! valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite --trace-children=yes
//! ```
//!
//! with direct reads (the default) and with staging through the shared regions
//! (`EPCOMM_SHM_DIRECT=0`); every process (the parent and both ranks) must report
//! `ERROR SUMMARY: 0 errors` and no definite leak. Skipped, with a SKIPPED line, where valgrind is
//! not installed, unless `EPCOMM_REQUIRE_VALGRIND=1` (.ci/run installs valgrind and sets it).

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const SOURCE: &str = "tests/c/valgrind_test.c";
/// The program's own deadline for its ranks is 45 s; this bounds the whole run above that.
const RUN_TIMEOUT: Duration = Duration::from_secs(90);

const VALGRIND_ARGS: &[&str] = &[
    "--error-exitcode=1",
    "--leak-check=full",
    "--errors-for-leak-kinds=definite",
    "--trace-children=yes",
];

fn valgrind_available() -> bool {
    Command::new("valgrind")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Builds the program without sanitizers (valgrind and ASan do not mix), with debug info.
fn build() -> std::path::PathBuf {
    let exe = out_dir("valgrind_test").join("valgrind_test");
    let mut args: Vec<String> = vec!["-std=c11".into(), "-g".into(), "-O1".into()];
    args.extend(WARNING_FLAGS.iter().map(|s| s.to_string()));
    args.push(format!("-I{}", include_dir().display()));
    args.push(manifest_dir().join(SOURCE).display().to_string());
    args.push("-o".into());
    args.push(exe.display().to_string());
    args.extend(link_cdylib_args());
    compile(&c_compiler(), &args);
    exe
}

fn run_under_valgrind(exe: &std::path::Path, group: &str, direct: bool) {
    let mut cmd = Command::new("valgrind");
    cmd.args(VALGRIND_ARGS)
        .arg(exe)
        .arg(group)
        .current_dir(manifest_dir())
        .env_remove("EPCOMM_LOG_LEVEL")
        .env_remove("EPCOMM_TIMEOUT_S")
        .env_remove("EPCOMM_FAULT_POINT")
        .env("RUST_BACKTRACE", "0");
    if direct {
        cmd.env_remove("EPCOMM_SHM_DIRECT");
    } else {
        cmd.env("EPCOMM_SHM_DIRECT", "0");
    }
    let what = format!(
        "valgrind_test under valgrind ({})",
        if direct { "direct reads" } else { "staged" }
    );
    let start = Instant::now();
    let out = run_with_timeout(cmd, RUN_TIMEOUT);
    let elapsed = start.elapsed();
    assert!(out.success(), "{}", out.describe(&what));
    // One summary per process: the parent and the two forked ranks.
    let summaries: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("ERROR SUMMARY:"))
        .collect();
    assert_eq!(summaries.len(), 3, "{}", out.describe(&what));
    for s in &summaries {
        assert!(
            s.contains("ERROR SUMMARY: 0 errors from 0 contexts"),
            "{s}\n{}",
            out.describe(&what)
        );
    }
    for l in out
        .stderr
        .lines()
        .filter(|l| l.contains("definitely lost:"))
    {
        assert!(
            l.contains("definitely lost: 0 bytes in 0 blocks"),
            "{l}\n{}",
            out.describe(&what)
        );
    }
    assert_c_test_passed(&what, &out);
    println!(
        "{what}: {} processes, 0 errors, 0 bytes definitely lost, {:.1} s",
        summaries.len(),
        elapsed.as_secs_f64()
    );
}

#[test]
fn memcheck_multi_process_run_has_no_errors() {
    if !valgrind_available() {
        assert!(
            !common::skip::required("EPCOMM_REQUIRE_VALGRIND"),
            "valgrind is not installed but EPCOMM_REQUIRE_VALGRIND is set (.ci/run installs it)"
        );
        common::skip::skipped(
            "memcheck_multi_process_run_has_no_errors",
            "valgrind is not installed (Debian: apt install valgrind)",
        );
        return;
    }
    let exe = build();
    run_under_valgrind(&exe, &group_name("vg", "d"), true);
    run_under_valgrind(&exe, &group_name("vg", "s"), false);
}
