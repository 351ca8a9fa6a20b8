//! The header-only C++17 wrapper include/epcomm.hpp, under ASan+UBSan against the shared
//! library: tests/cpp/wrapper_test.cpp (one process, as C++17 and C++20: exceptions with
//! vLLM's message and class, RAII handles, a one-rank MoE round trip, a host-transport group,
//! names, logging, the config builder, DLPack exports, the GPU manager without CUDA/NCCL),
//! tests/cpp/eplb_policy_test.cpp (vLLM's EPLB policy steps, migration batches, layer plans
//! and lost experts on vLLM's vectors), tests/cpp/ranks_test.cpp (two forked ranks of a
//! shared-memory group: send/recv, shared buffers and zero-copy combines, extras, FP8
//! dispatch, the EPLB communicator and every rearrangement, load statistics) and
//! tests/cpp/ft_test.cpp (three ranks, one killed: the fault-tolerant manager's error, mask,
//! recovery and dropped pairs, the group's lost ranks, the survivors' shrunk group and their
//! rearrangement with lost experts). The forking programs' parents check that nothing is left
//! in /dev/shm.

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

/// The same program as C++20, where tensors are also made from std::span.
#[test]
fn cpp_wrapper_cpp20_sanitized() {
    let exe = out_dir("cpp-wrapper-cpp20").join("wrapper_test");
    let source = manifest_dir().join("tests/cpp/wrapper_test.cpp");
    build_sanitized(&cxx_compiler(), &["-x", "c++", "-std=c++20"], &source, &exe);
    let out = run_group_program(&exe, &group_name("cppwrap", "y"), Duration::from_secs(60));
    assert_c_test_passed("wrapper_test (C++20, epcomm.hpp, ASan+UBSan)", &out);
}

#[test]
fn cpp_wrapper_eplb_policy_cpp17_sanitized() {
    let exe = out_dir("cpp-eplb-policy").join("eplb_policy_test");
    let source = manifest_dir().join("tests/cpp/eplb_policy_test.cpp");
    build_sanitized(&cxx_compiler(), Lang::Cxx17.flags(), &source, &exe);
    assert_c_test_passed(
        "eplb_policy_test (C++17, epcomm.hpp, ASan+UBSan)",
        &run_sanitized(&exe),
    );
}

#[test]
fn cpp_wrapper_ranks_cpp17_sanitized() {
    // The program's own deadline for its ranks is 45 s; this bounds the whole run above that.
    check_group_program(
        "tests/cpp/ranks_test.cpp",
        Lang::Cxx17,
        "cppranks",
        Duration::from_secs(90),
        "ranks_test (C++17, epcomm.hpp, two ranks, ASan+UBSan)",
    );
}

#[test]
fn cpp_wrapper_fault_tolerance_cpp17_sanitized() {
    check_group_program(
        "tests/cpp/ft_test.cpp",
        Lang::Cxx17,
        "cppft",
        Duration::from_secs(90),
        "ft_test (C++17, epcomm.hpp, three ranks, one killed, ASan+UBSan)",
    );
}
