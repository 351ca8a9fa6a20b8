//! Process groups through the C ABI: tests/c/group_test.c forks four ranks that form a
//! shared-memory group and run the collectives (uneven sizes, zeros, float32/bfloat16/int32),
//! argument errors that leave the group usable, a shrink (epcomm_group_lost_ranks,
//! epcomm_group_shrink: three ranks form a smaller group), and destroy; the parent checks that
//! nothing is left in /dev/shm. Built as C11 and as C++17 against the shared library, under ASan+UBSan.

mod common;

use std::time::Duration;

use common::*;

const GROUP_TEST: &str = "tests/c/group_test.c";
/// Prefix of its group names (`group_name`).
const GROUP_PREFIX: &str = "cgrp";
/// The program's own deadline for its ranks is 45 s; this bounds the whole run above that.
const GROUP_RUN_TIMEOUT: Duration = Duration::from_secs(90);

#[test]
fn group_test_c11_shared_sanitized() {
    check_group_program(
        GROUP_TEST,
        Lang::C11,
        GROUP_PREFIX,
        GROUP_RUN_TIMEOUT,
        "group_test (C11, libepcomm.so, ASan+UBSan)",
    );
}

#[test]
fn group_test_cpp17_shared_sanitized() {
    check_group_program(
        GROUP_TEST,
        Lang::Cxx17,
        GROUP_PREFIX,
        GROUP_RUN_TIMEOUT,
        "group_test (C++17, libepcomm.so, ASan+UBSan)",
    );
}
