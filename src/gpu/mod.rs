//! The GPU path (docs/gpu.md): CUDA kernels compiled at run time with NVRTC, the NCCL two-sided
//! transport and the one-node one-sided transport. Every native library is loaded with `dlopen`
//! at run time, so the crate builds and runs without CUDA; each failure is a status.
//!
//! - `kernels`: the header-free CUDA C sources and their variants (pure data, always built).
//! - `nvrtc`: our own NVRTC loader, compile to CUBIN/PTX, in-memory and on-disk cache.
//! - `nccl`: our own NCCL loader (function table) and the two-sided transport's host side.
//! - `onesided`: workspace layout, epochs/flags, device error word, fd passing (SCM_RIGHTS);
//!   not wired yet (its module doc names the caller to come and the tests).
//! - `launch` (`cuda`): compile/load a configuration's kernels, typed launches, error word.
//! - `transport`: host-side planning and the manager's pipeline (pure), the `GpuManager` (`nccl`).
//! - `calls`: every kernel launch as data (entry point, grid, arguments; pure, always built).
//! - `caps`: the capability probe (driver, compute capability, SMs, VMM/IPC, NCCL/NVRTC).

pub mod kernels;
pub mod nvrtc;

pub mod calls;
pub mod caps;
#[cfg(feature = "cuda")]
pub mod driver;
#[cfg(feature = "cuda")]
pub mod launch;
pub mod nccl;
pub mod onesided;
pub mod transport;
