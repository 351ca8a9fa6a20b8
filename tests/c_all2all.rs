//! MoE dispatch/combine through the C ABI: tests/c/all2all_test.c forks two ranks that form a
//! shared-memory group and run the worked example of docs/design.md through one backend per layout
//! (dispatch output and combined result checked exactly, statistics, buffer sizing), plus the
//! error paths (MoonEP unavailable, apply_router_weight_on_input with top_k 2, the one-sided
//! manager's heterogeneous-layer assertion, a bad expert id or a wrong-shaped combine input on
//! one rank failing on both without a hang); the parent checks that nothing is left in
//! /dev/shm. Built as C11 and as C++17 against the shared library, under ASan+UBSan.

mod common;

use std::time::Duration;

use common::*;

const ALL2ALL_TEST: &str = "tests/c/all2all_test.c";
/// Prefix of its group names (`group_name`).
const GROUP_PREFIX: &str = "ca2a";
/// The program's own deadline for its ranks is 45 s; this bounds the whole run above that.
const ALL2ALL_RUN_TIMEOUT: Duration = Duration::from_secs(90);

#[test]
fn all2all_test_c11_shared_sanitized() {
    check_group_program(
        ALL2ALL_TEST,
        Lang::C11,
        GROUP_PREFIX,
        ALL2ALL_RUN_TIMEOUT,
        "all2all_test (C11, libepcomm.so, ASan+UBSan)",
    );
}

#[test]
fn all2all_test_cpp17_shared_sanitized() {
    check_group_program(
        ALL2ALL_TEST,
        Lang::Cxx17,
        GROUP_PREFIX,
        ALL2ALL_RUN_TIMEOUT,
        "all2all_test (C++17, libepcomm.so, ASan+UBSan)",
    );
}
