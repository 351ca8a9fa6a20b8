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
