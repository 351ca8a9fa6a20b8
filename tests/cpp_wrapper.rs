//! The header-only C++17 wrapper include/epcomm.hpp (tests/cpp/wrapper_test.cpp): exceptions
//! with vLLM's message and class, RAII handles, tensors, a one-rank MoE round trip and the EPLB
//! policy, under ASan+UBSan.

mod common;

use std::time::Duration;

use common::*;

#[test]
fn cpp_wrapper_cpp17_sanitized() {
    check_group_program(
        "tests/cpp/wrapper_test.cpp",
        Lang::Cxx17,
        "cppwrap",
        Duration::from_secs(60),
        "wrapper_test (C++17, epcomm.hpp, ASan+UBSan)",
    );
}
