//! The EPLB policy through the C ABI (tests/c/eplb_test.c, vLLM's vectors), as C11 and C++17
//! under ASan+UBSan.

mod common;

use std::time::Duration;

use common::*;

fn run(lang: Lang, name: &str) {
    let dir = out_dir(name);
    let exe = dir.join("eplb_test");
    build_sanitized(
        &lang.compiler(),
        lang.flags(),
        &manifest_dir().join("tests/c/eplb_test.c"),
        &exe,
    );
    assert_c_test_passed(name, &run_sanitized(&exe));
}

#[test]
fn eplb_policy_c11() {
    run(Lang::C11, "eplb-c11");
}

#[test]
fn eplb_policy_cxx17() {
    run(Lang::Cxx17, "eplb-cxx17");
}

// ---- EPLB at run time (tests/c/eplb_runtime_test.c): two forked ranks over a shm group ------

const RUNTIME_TEST: &str = "tests/c/eplb_runtime_test.c";
/// Prefix of its group names (`group_name`).
const RUNTIME_GROUP_PREFIX: &str = "ceplbrt";
/// The program's own deadline for its ranks is 45 s; this bounds the whole run above that.
const RUNTIME_RUN_TIMEOUT: Duration = Duration::from_secs(90);

#[test]
fn eplb_runtime_c11() {
    check_group_program(
        RUNTIME_TEST,
        Lang::C11,
        RUNTIME_GROUP_PREFIX,
        RUNTIME_RUN_TIMEOUT,
        "eplb-runtime-c11",
    );
}

#[test]
fn eplb_runtime_cxx17() {
    check_group_program(
        RUNTIME_TEST,
        Lang::Cxx17,
        RUNTIME_GROUP_PREFIX,
        RUNTIME_RUN_TIMEOUT,
        "eplb-runtime-cxx17",
    );
}
