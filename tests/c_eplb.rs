//! The EPLB policy through the C ABI (tests/c/eplb_test.c, vLLM's vectors), as C11 and C++17
//! under ASan+UBSan.

mod common;

use common::*;

fn run(compiler: &str, flags: &[&str], name: &str) {
    let dir = out_dir(name);
    let exe = dir.join("eplb_test");
    build_sanitized(
        compiler,
        flags,
        &manifest_dir().join("tests/c/eplb_test.c"),
        &exe,
    );
    assert_c_test_passed(name, &run_sanitized(&exe));
}

#[test]
fn eplb_policy_c11() {
    run(&c_compiler(), &["-std=c11"], "eplb-c11");
}

#[test]
fn eplb_policy_cxx17() {
    run(&cxx_compiler(), &["-x", "c++", "-std=c++17"], "eplb-cxx17");
}

// ---- EPLB at run time (tests/c/eplb_runtime_test.c): two forked ranks over a shm group ------

/// The program's own deadline for its ranks is 45 s; this bounds the whole run above that.
const RUNTIME_RUN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(90);

/// The program with its group-name argument and the environment tests/c_group.rs uses.
fn runtime_command(
    program: &std::path::Path,
    group: &str,
    asan_options: &str,
) -> std::process::Command {
    let mut cmd = std::process::Command::new(program);
    cmd.arg(group)
        .current_dir(manifest_dir())
        .env_remove("EPCOMM_LOG_LEVEL")
        .env_remove("EPCOMM_TIMEOUT_S")
        .env("RUST_BACKTRACE", "0")
        .env("ASAN_OPTIONS", asan_options)
        .env("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1");
    cmd
}

/// Runs the program with leak detection, and without it only where LeakSanitizer cannot run
/// (ptrace restrictions), under a fresh group name.
fn run_runtime_test(program: &std::path::Path, group: &str) -> RunOutput {
    let out = run_with_timeout(
        runtime_command(program, group, "detect_leaks=1:abort_on_error=0"),
        RUNTIME_RUN_TIMEOUT,
    );
    let lsan_unusable = out
        .stderr
        .contains("LeakSanitizer has encountered a fatal error")
        || out
            .stderr
            .contains("LeakSanitizer does not work under ptrace");
    if lsan_unusable {
        eprintln!(
            "note: LeakSanitizer is unusable here (ptrace restrictions); rerunning {} with detect_leaks=0",
            program.display()
        );
        return run_with_timeout(
            runtime_command(
                program,
                &format!("{group}r"),
                "detect_leaks=0:abort_on_error=0",
            ),
            RUNTIME_RUN_TIMEOUT,
        );
    }
    out
}

/// A group name unique to this process and variant; neither variant's name is a prefix of the
/// other's, so each run's /dev/shm check sees only its own group.
fn runtime_group_name(suffix: &str) -> String {
    format!("ceplbrt{}{suffix}", std::process::id())
}

fn run_runtime(compiler: &str, flags: &[&str], name: &str, suffix: &str) {
    let dir = out_dir(name);
    let exe = dir.join("eplb_runtime_test");
    build_sanitized(
        compiler,
        flags,
        &manifest_dir().join("tests/c/eplb_runtime_test.c"),
        &exe,
    );
    let out = run_runtime_test(&exe, &runtime_group_name(suffix));
    assert_c_test_passed(name, &out);
}

#[test]
fn eplb_runtime_c11() {
    run_runtime(&c_compiler(), &["-std=c11"], "eplb-runtime-c11", "c");
}

#[test]
fn eplb_runtime_cxx17() {
    run_runtime(
        &cxx_compiler(),
        &["-x", "c++", "-std=c++17"],
        "eplb-runtime-cxx17",
        "x",
    );
}
