//! The GPU transports' host side.
//!
//! - [`plan`]: pure planning (counts row, matrices, offsets, scan levels, grid sizes, output
//!   shapes per layout); always built and unit-tested on the CPU.
//! - `GpuManager` (`nccl` feature): the NCCL two-sided pipeline of every layout, counts mode
//!   (one host sync per dispatch) and capacity mode (no host sync, CUDA-graph capturable).

pub mod plan;

#[cfg(feature = "nccl")]
mod manager;
#[cfg(feature = "nccl")]
pub use manager::{DispatchInput, GpuDispatch, GpuManager, GpuMode};
