//! epcomm: vLLM's expert-parallel communication layer (all2all backend selection, MoE
//! dispatch/combine, EPLB) as a Rust library with a stable C ABI.
//!
//! Module map (docs/design.md, section 1): the core (`select`, `dtype`, `error`, `log`) is safe
//! Rust with no FFI types; `ffi` holds every `extern "C"` item; `probe` finds optional native
//! libraries.

pub mod bytes;
pub mod call;
pub mod copy;
pub mod dtype;
pub mod env;
pub mod eplb;
pub mod error;
pub mod fault;
pub mod ffi;
pub(crate) mod fsize;
pub mod gpu;
pub mod group;
pub mod log;
pub mod moe;
pub mod num;
pub mod probe;
pub mod select;
mod var;

pub use error::{Error, Result, Status};
