//! Zero-copy views through the C ABI: tests/c/mem_test.c forks two ranks of a shared-memory
//! group that combine the same expert outputs from malloc'd memory, the manager's
//! expert-output buffer and epcomm_mem_alloc memory (byte-identical results, one in-place
//! combine counted per manager) for one backend per layout, then every misuse of the calls;
//! the parent checks that nothing is left in /dev/shm. Built as C11 and as C++17 against the
//! shared library, under ASan+UBSan.

mod common;

use std::time::Duration;

use common::*;

const MEM_TEST: &str = "tests/c/mem_test.c";
/// Prefix of its group names (`group_name`).
const GROUP_PREFIX: &str = "cmem";
/// The program's own deadline for its ranks is 45 s; this bounds the whole run above that.
const MEM_RUN_TIMEOUT: Duration = Duration::from_secs(90);

#[test]
fn mem_test_c11_shared_sanitized() {
    check_group_program(
        MEM_TEST,
        Lang::C11,
        GROUP_PREFIX,
        MEM_RUN_TIMEOUT,
        "mem_test (C11, libepcomm.so, ASan+UBSan)",
    );
}

#[test]
fn mem_test_cpp17_shared_sanitized() {
    check_group_program(
        MEM_TEST,
        Lang::Cxx17,
        GROUP_PREFIX,
        MEM_RUN_TIMEOUT,
        "mem_test (C++17, libepcomm.so, ASan+UBSan)",
    );
}
