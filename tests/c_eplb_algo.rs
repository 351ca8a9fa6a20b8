//! vLLM v0.33.0's EPLB policy steps through the C ABI (tests/c/eplb_algo_test.c), as C11 and
//! C++17 under ASan+UBSan.

mod common;

use common::*;

fn run(lang: Lang, name: &str) {
    let dir = out_dir(name);
    let exe = dir.join("eplb_algo_test");
    build_sanitized(
        &lang.compiler(),
        lang.flags(),
        &manifest_dir().join("tests/c/eplb_algo_test.c"),
        &exe,
    );
    assert_c_test_passed(name, &run_sanitized(&exe));
}

#[test]
fn eplb_algo_c11() {
    run(Lang::C11, "eplb-algo-c11");
}

#[test]
fn eplb_algo_cxx17() {
    run(Lang::Cxx17, "eplb-algo-cxx17");
}
