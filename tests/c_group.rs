//! Process groups through the C ABI: tests/c/group_test.c forks four ranks that form a
//! shared-memory group and run the collectives (uneven sizes, zeros, float32/bfloat16/int32),
//! argument errors that leave the group usable, and destroy; the parent checks that nothing is
//! left in /dev/shm. Built as C11 and as C++17 against the shared library, under ASan+UBSan.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

/// The program's own deadline for its ranks is 45 s; this bounds the whole run above that.
const GROUP_RUN_TIMEOUT: Duration = Duration::from_secs(90);

fn group_test_source() -> PathBuf {
    manifest_dir().join("tests/c/group_test.c")
}

/// The program with its group-name argument and the environment tests/common uses for
/// sanitized programs.
fn group_command(program: &Path, group: &str, asan_options: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.arg(group)
        .current_dir(manifest_dir())
        .env_remove("EPCOMM_LOG_LEVEL")
        .env_remove("EPCOMM_TIMEOUT_S")
        .env("RUST_BACKTRACE", "0")
        .env("ASAN_OPTIONS", asan_options)
        .env("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1");
    cmd
}

/// Like `run_sanitized`, with a group name: leak detection on, and off again only where
/// LeakSanitizer cannot run (ptrace restrictions).
fn run_group_test(program: &Path, group: &str) -> RunOutput {
    let out = run_with_timeout(
        group_command(program, group, "detect_leaks=1:abort_on_error=0"),
        GROUP_RUN_TIMEOUT,
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
            group_command(
                program,
                &format!("{group}r"),
                "detect_leaks=0:abort_on_error=0",
            ),
            GROUP_RUN_TIMEOUT,
        );
    }
    out
}

/// A group name unique to this process and variant; no variant's name is a prefix of another's,
/// so each run's /dev/shm check sees only its own group.
fn group_name(suffix: &str) -> String {
    format!("cgrp{}{suffix}", std::process::id())
}

#[test]
fn group_test_c11_shared_sanitized() {
    let dir = out_dir("group-c11");
    let exe = dir.join("group_test_c");
    build_sanitized(&c_compiler(), &["-std=c11"], &group_test_source(), &exe);
    let out = run_group_test(&exe, &group_name("c"));
    assert_c_test_passed("group_test (C11, libepcomm.so, ASan+UBSan)", &out);
}

#[test]
fn group_test_cpp17_shared_sanitized() {
    let dir = out_dir("group-cpp17");
    let exe = dir.join("group_test_cpp");
    build_sanitized(
        &cxx_compiler(),
        &["-x", "c++", "-std=c++17"],
        &group_test_source(),
        &exe,
    );
    let out = run_group_test(&exe, &group_name("x"));
    assert_c_test_passed("group_test (C++17, libepcomm.so, ASan+UBSan)", &out);
}
