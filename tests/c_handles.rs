//! Handle lifetimes through the C ABI: tests/c/handles_test.c forks two ranks of a
//! shared-memory group; on rank 0 a second thread's barrier (then dispatch) waits for rank 1
//! while the first thread destroys the group and the manager: every destroy is refused with
//! EPCOMM_ERROR_INVALID_STATE and its full message, nothing is freed (ASan), and the call
//! completes OK, 40 times each. A forked child of rank 0 is refused every call (destroy
//! included) with the fork message, and the parent's and peer's next barrier and dispatch are
//! OK. Calls on a destroyed manager and a second destroy are refused; a manager keeps a
//! destroyed group alive until its own destroy, and nothing is left in /dev/shm. Built as C11
//! and as C++17 against the shared library, under ASan+UBSan.

mod common;

use std::time::Duration;

use common::*;

const HANDLES_TEST: &str = "tests/c/handles_test.c";
/// Prefix of its group names (`group_name`).
const GROUP_PREFIX: &str = "chdl";
/// The program's own deadline for its ranks is 45 s; this bounds the whole run above that.
const HANDLES_RUN_TIMEOUT: Duration = Duration::from_secs(90);

#[test]
fn handles_test_c11_shared_sanitized() {
    check_group_program(
        HANDLES_TEST,
        Lang::C11,
        GROUP_PREFIX,
        HANDLES_RUN_TIMEOUT,
        "handles_test (C11, libepcomm.so, ASan+UBSan)",
    );
}

#[test]
fn handles_test_cpp17_shared_sanitized() {
    check_group_program(
        HANDLES_TEST,
        Lang::Cxx17,
        GROUP_PREFIX,
        HANDLES_RUN_TIMEOUT,
        "handles_test (C++17, libepcomm.so, ASan+UBSan)",
    );
}
