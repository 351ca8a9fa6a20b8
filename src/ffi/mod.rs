//! The C ABI. Every `extern "C"` item of epcomm lives here; each is thin: it checks pointers,
//! converts arguments, calls the safe core and records the error. `include/epcomm.h` is
//! generated from this module by cbindgen.
//!
//! The shared pieces: `guard` (catch_unwind, last error, string/slice/output arguments),
//! `handle` (every opaque handle's create, NULL check, one-thread-at-a-time borrow and
//! destroy), `tensor` (DLPack descriptors checked in host or device memory), `moe_args`
//! (the dispatch/combine checks and output views of the host and GPU entry points) and
//! `eplb_args` (the EPLB entry points' dimensions and `rows × cols` arrays).
//!
//! Entry points that differ only in a name or an argument (each handle's `_destroy` /
//! `_destroy_checked`, `add_send` / `add_recv`, the `rearrange` variants) are written out one
//! by one on purpose: cbindgen does not expand macros, so a generated entry point would be
//! missing from the header. Their bodies are one call into the shared piece.
#![allow(non_camel_case_types)]

mod dtype_names;
mod eplb_args;
mod guard;
mod handle;
mod moe_args;

pub mod all2all;
pub mod config;
pub mod dlpack;
pub mod eplb;
pub mod eplb_algo;
pub mod eplb_runtime;
pub mod error;
pub mod ft;
pub mod gpu;
pub mod group;
pub mod log;
pub mod mem;
pub mod runtime;
pub mod select;
pub mod tensor;

/// ABI version of this header; bumped on any incompatible change.
pub const EPCOMM_ABI_VERSION: i32 = 1;

/// Major version of the library this header belongs to; epcomm_version() gives the version of
/// the library loaded at run time.
pub const EPCOMM_VERSION_MAJOR: i32 = 0;
/// Minor version of the library this header belongs to. While the major version is 0, a new
/// minor version may break the ABI (the SONAME is libepcomm.so.0.MINOR).
pub const EPCOMM_VERSION_MINOR: i32 = 1;
/// Patch version of the library this header belongs to.
pub const EPCOMM_VERSION_PATCH: i32 = 0;
/// The version as one number, MAJOR * 10000 + MINOR * 100 + PATCH, for `#if` comparisons
/// (`#if EPCOMM_VERSION_NUMBER >= 100` for 0.1.0 or later).
pub const EPCOMM_VERSION_NUMBER: i32 = 100;

/// Parses a decimal version component at compile time (the header's version macros must be
/// literals for cbindgen, so they are checked against Cargo's version instead of derived from it).
const fn parse_version_part(s: &str) -> i32 {
    let b = s.as_bytes();
    let mut i = 0;
    let mut v = 0;
    while i < b.len() {
        assert!(b[i].is_ascii_digit(), "version part is not a number");
        v = v * 10 + (b[i] - b'0') as i32;
        i += 1;
    }
    v
}

// A version bump in Cargo.toml without the matching constants above fails the build here
// (include/epcomm.h's EPCOMM_VERSION_STRING is generated from Cargo's version by tests/header.rs).
const _: () = {
    assert!(
        EPCOMM_VERSION_MAJOR == parse_version_part(env!("CARGO_PKG_VERSION_MAJOR")),
        "EPCOMM_VERSION_MAJOR differs from Cargo.toml's version"
    );
    assert!(
        EPCOMM_VERSION_MINOR == parse_version_part(env!("CARGO_PKG_VERSION_MINOR")),
        "EPCOMM_VERSION_MINOR differs from Cargo.toml's version"
    );
    assert!(
        EPCOMM_VERSION_PATCH == parse_version_part(env!("CARGO_PKG_VERSION_PATCH")),
        "EPCOMM_VERSION_PATCH differs from Cargo.toml's version"
    );
    assert!(
        EPCOMM_VERSION_NUMBER
            == EPCOMM_VERSION_MAJOR * 10000 + EPCOMM_VERSION_MINOR * 100 + EPCOMM_VERSION_PATCH,
        "EPCOMM_VERSION_NUMBER differs from MAJOR * 10000 + MINOR * 100 + PATCH"
    );
};

/// Success.
pub const EPCOMM_OK: i32 = 0;
/// A required pointer argument was NULL (Python: ValueError).
pub const EPCOMM_ERROR_NULL_POINTER: i32 = 1;
/// Invalid argument or configuration; vLLM raises ValueError.
pub const EPCOMM_ERROR_INVALID_ARGUMENT: i32 = 2;
/// A precondition vLLM checks with `assert` failed (Python: AssertionError).
pub const EPCOMM_ERROR_ASSERTION: i32 = 3;
/// Not implemented (Python: NotImplementedError).
pub const EPCOMM_ERROR_NOT_IMPLEMENTED: i32 = 4;
/// Runtime failure (Python: RuntimeError).
pub const EPCOMM_ERROR_RUNTIME: i32 = 5;
/// A library or device the call needs is not available (NCCL, NIXL, CUDA) (RuntimeError).
pub const EPCOMM_ERROR_UNAVAILABLE: i32 = 6;
/// A wait ran past its timeout (Python: TimeoutError).
pub const EPCOMM_ERROR_TIMEOUT: i32 = 7;
/// A peer rank died or left (RuntimeError).
pub const EPCOMM_ERROR_PEER_FAILURE: i32 = 8;
/// The handle is not in a state that allows this call (RuntimeError).
pub const EPCOMM_ERROR_INVALID_STATE: i32 = 9;
/// An operating-system call failed (RuntimeError).
pub const EPCOMM_ERROR_SYSTEM: i32 = 10;
/// A bug in epcomm, e.g. a caught panic (RuntimeError).
pub const EPCOMM_ERROR_INTERNAL: i32 = 11;

/// Log level: errors only.
pub const EPCOMM_LOG_ERROR: i32 = 1;
/// Log level: warnings and errors (the default).
pub const EPCOMM_LOG_WARN: i32 = 2;
/// Log level: infos, warnings and errors.
pub const EPCOMM_LOG_INFO: i32 = 3;
/// Log level: everything.
pub const EPCOMM_LOG_DEBUG: i32 = 4;

/// all2all backend `allgather_reducescatter` (vLLM's default; also `naive`, `pplx`).
pub const EPCOMM_ALL2ALL_ALLGATHER_REDUCESCATTER: i32 = 0;
/// all2all backend `deepep_high_throughput`.
pub const EPCOMM_ALL2ALL_DEEPEP_HIGH_THROUGHPUT: i32 = 1;
/// all2all backend `deepep_low_latency`.
pub const EPCOMM_ALL2ALL_DEEPEP_LOW_LATENCY: i32 = 2;
/// all2all backend `deepep_v2`.
pub const EPCOMM_ALL2ALL_DEEPEP_V2: i32 = 3;
/// all2all backend `mori_high_throughput`.
pub const EPCOMM_ALL2ALL_MORI_HIGH_THROUGHPUT: i32 = 4;
/// all2all backend `mori_low_latency`.
pub const EPCOMM_ALL2ALL_MORI_LOW_LATENCY: i32 = 5;
/// all2all backend `nixl_ep`.
pub const EPCOMM_ALL2ALL_NIXL_EP: i32 = 6;
/// all2all backend `flashinfer_nvlink_two_sided` (also `flashinfer_all2allv`).
pub const EPCOMM_ALL2ALL_FLASHINFER_NVLINK_TWO_SIDED: i32 = 7;
/// all2all backend `flashinfer_nvlink_one_sided`.
pub const EPCOMM_ALL2ALL_FLASHINFER_NVLINK_ONE_SIDED: i32 = 8;
/// all2all backend `moonep`.
pub const EPCOMM_ALL2ALL_MOONEP: i32 = 9;
/// all2all backend `mori` (vLLM 0.34.0; MoRI EPv1, token-major; `mori_high_throughput` and
/// `mori_low_latency` are its deprecated aliases there, kept as their own codes).
pub const EPCOMM_ALL2ALL_MORI: i32 = 10;
/// all2all name `passthrough` (vLLM's PassThroughAll2AllManager): the MoE backend dispatches
/// and combines itself. No exchange and no EPCOMM_LAYOUT_*; creating a handle for it gives
/// vLLM's RuntimeError "passthrough has no all2all handle: ...".
pub const EPCOMM_ALL2ALL_PASSTHROUGH: i32 = 11;

/// Layout: every rank's tokens gathered on every rank; reduce_scatterv back.
pub const EPCOMM_LAYOUT_REPLICATED: i32 = 0;
/// Layout: each token once per rank holding one of its experts.
pub const EPCOMM_LAYOUT_TOKEN_MAJOR: i32 = 1;
/// Layout: fixed-capacity per-local-expert buckets.
pub const EPCOMM_LAYOUT_EXPERT_MAJOR: i32 = 2;
/// Layout: one row per (token, local expert), grouped by expert, exact size.
pub const EPCOMM_LAYOUT_EXPERT_PACKED: i32 = 3;
/// Layout: per-source-rank regions of fixed capacity.
pub const EPCOMM_LAYOUT_RANK_MAJOR: i32 = 4;
/// Layout: MoonEP's balanced expert slots (not implemented yet).
pub const EPCOMM_LAYOUT_MOONEP_SLOTS: i32 = 5;

/// Name kind: the backend's own name.
pub const EPCOMM_NAME_CANONICAL: i32 = 0;
/// Name kind: a deprecated alias (resolves with a warning).
pub const EPCOMM_NAME_ALIAS: i32 = 1;
/// Name kind: a removed backend (falls back to allgather_reducescatter with a warning).
pub const EPCOMM_NAME_REMOVED: i32 = 2;

/// EPLB communicator `torch_nccl`.
pub const EPCOMM_EPLB_TORCH_NCCL: i32 = 0;
/// EPLB communicator `torch_gloo`.
pub const EPCOMM_EPLB_TORCH_GLOO: i32 = 1;
/// EPLB communicator `pynccl`.
pub const EPCOMM_EPLB_PYNCCL: i32 = 2;
/// EPLB communicator `nixl`.
pub const EPCOMM_EPLB_NIXL: i32 = 3;
/// EPLB communicator `torch_xccl` (vLLM v0.33.0; host-staged in epcomm).
pub const EPCOMM_EPLB_TORCH_XCCL: i32 = 4;
/// EPLB communicator `symm_mem` (vLLM 0.34.0's push backend; host-staged in epcomm: rows are
/// stored into the receivers' next buffers when those are shared memory).
pub const EPCOMM_EPLB_SYMM_MEM: i32 = 5;

/// Availability field value: probe this process.
pub const EPCOMM_PROBE: i32 = -1;

/// DLPack device type: host memory.
pub const EPCOMM_DEVICE_CPU: i32 = 1;
/// DLPack device type: CUDA device memory.
pub const EPCOMM_DEVICE_CUDA: i32 = 2;
/// DLPack device type: ROCm device memory.
pub const EPCOMM_DEVICE_ROCM: i32 = 10;
/// DLPack device type: oneAPI (XPU) memory.
pub const EPCOMM_DEVICE_ONEAPI: i32 = 14;

/// An element type, laid out exactly like DLPack's `DLDataType`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct epcomm_dtype {
    /// DLPack type code (0 kDLInt, 1 kDLUInt, 2 kDLFloat, 4 kDLBfloat, 6 kDLBool, 10
    /// kDLFloat8_e4m3fn, ...). Messages name a type by its name, code and bits: "float32
    /// (kDLFloat, 32 bits)".
    pub code: u8,
    /// Bits per element.
    pub bits: u8,
    /// Vector lanes (1 for scalars).
    pub lanes: u16,
}

impl From<crate::dtype::DType> for epcomm_dtype {
    fn from(d: crate::dtype::DType) -> Self {
        epcomm_dtype {
            code: d.code,
            bits: d.bits,
            lanes: d.lanes,
        }
    }
}

impl From<epcomm_dtype> for crate::dtype::DType {
    fn from(d: epcomm_dtype) -> Self {
        crate::dtype::DType {
            code: d.code,
            bits: d.bits,
            lanes: d.lanes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Status;

    #[test]
    fn status_constants_match_core() {
        let c = [
            EPCOMM_OK,
            EPCOMM_ERROR_NULL_POINTER,
            EPCOMM_ERROR_INVALID_ARGUMENT,
            EPCOMM_ERROR_ASSERTION,
            EPCOMM_ERROR_NOT_IMPLEMENTED,
            EPCOMM_ERROR_RUNTIME,
            EPCOMM_ERROR_UNAVAILABLE,
            EPCOMM_ERROR_TIMEOUT,
            EPCOMM_ERROR_PEER_FAILURE,
            EPCOMM_ERROR_INVALID_STATE,
            EPCOMM_ERROR_SYSTEM,
            EPCOMM_ERROR_INTERNAL,
        ];
        assert_eq!(Status::ALL.map(|s| s as i32), c);
    }

    #[test]
    fn version_constants_match_cargo() {
        let parts: Vec<i32> = env!("CARGO_PKG_VERSION")
            .split('.')
            .map(|p| p.parse().unwrap())
            .collect();
        assert_eq!(
            parts,
            [
                EPCOMM_VERSION_MAJOR,
                EPCOMM_VERSION_MINOR,
                EPCOMM_VERSION_PATCH
            ]
        );
        assert_eq!(
            EPCOMM_VERSION_NUMBER,
            parts[0] * 10000 + parts[1] * 100 + parts[2]
        );
        // SAFETY: epcomm_version returns a static NUL-terminated string.
        let runtime = unsafe { std::ffi::CStr::from_ptr(error::epcomm_version()) };
        assert_eq!(runtime.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn enum_constants_match_core() {
        use crate::log::Level;
        use crate::select::all2all::{Backend, Layout, NameKind};
        use crate::select::eplb::Communicator;
        assert_eq!(
            Backend::ALL.map(|b| b as i32),
            [
                EPCOMM_ALL2ALL_ALLGATHER_REDUCESCATTER,
                EPCOMM_ALL2ALL_DEEPEP_HIGH_THROUGHPUT,
                EPCOMM_ALL2ALL_DEEPEP_LOW_LATENCY,
                EPCOMM_ALL2ALL_DEEPEP_V2,
                EPCOMM_ALL2ALL_MORI_HIGH_THROUGHPUT,
                EPCOMM_ALL2ALL_MORI_LOW_LATENCY,
                EPCOMM_ALL2ALL_NIXL_EP,
                EPCOMM_ALL2ALL_FLASHINFER_NVLINK_TWO_SIDED,
                EPCOMM_ALL2ALL_FLASHINFER_NVLINK_ONE_SIDED,
                EPCOMM_ALL2ALL_MOONEP,
                EPCOMM_ALL2ALL_MORI,
            ]
        );
        assert_eq!(Backend::from_code(EPCOMM_ALL2ALL_PASSTHROUGH), None);
        assert_eq!(
            Layout::ALL.map(|l| l as i32),
            [
                EPCOMM_LAYOUT_REPLICATED,
                EPCOMM_LAYOUT_TOKEN_MAJOR,
                EPCOMM_LAYOUT_EXPERT_MAJOR,
                EPCOMM_LAYOUT_EXPERT_PACKED,
                EPCOMM_LAYOUT_RANK_MAJOR,
                EPCOMM_LAYOUT_MOONEP_SLOTS,
            ]
        );
        assert_eq!(
            NameKind::ALL.map(|k| k as i32),
            [
                EPCOMM_NAME_CANONICAL,
                EPCOMM_NAME_ALIAS,
                EPCOMM_NAME_REMOVED
            ]
        );
        assert_eq!(
            Communicator::ALL.map(|c| c as i32),
            [
                EPCOMM_EPLB_TORCH_NCCL,
                EPCOMM_EPLB_TORCH_GLOO,
                EPCOMM_EPLB_PYNCCL,
                EPCOMM_EPLB_NIXL,
                EPCOMM_EPLB_TORCH_XCCL,
                EPCOMM_EPLB_SYMM_MEM,
            ]
        );
        assert_eq!(
            Level::ALL.map(|l| l as i32),
            [
                EPCOMM_LOG_ERROR,
                EPCOMM_LOG_WARN,
                EPCOMM_LOG_INFO,
                EPCOMM_LOG_DEBUG
            ]
        );
    }
}
