//! The GPU transports' host side.
//!
//! - [`plan`]: pure planning (counts row, matrices, offsets, output shapes per layout); always
//!   built and unit-tested on the CPU.
//! - [`pipeline`]: every step of dispatch and combine, counts mode (one host sync per
//!   dispatch) and capacity mode (no host sync, CUDA-graph capturable), over the
//!   [`pipeline::Executor`] interface; always built, run on the host by the emulation tests.
//! - `GpuManager` (`nccl` feature): the pipeline with its CUDA executor over a `Fabric`.
//! - [`pool`]: the named device buffers (sized at creation, geometric growth, none while
//!   capturing), device-independent so the emulation runs the same policy.
//! - [`gate`]: the failing host barrier of the thread-rank fabrics.

pub mod gate;
pub mod pipeline;
pub mod plan;
pub mod pool;

#[cfg(feature = "cuda")]
pub mod local;
#[cfg(feature = "nccl")]
mod manager;
#[cfg(feature = "nccl")]
pub use manager::GpuManager;
pub use pipeline::{DispatchInput, GpuDispatch, GpuMode};

/// How a [`GpuManager`] moves bytes between ranks: NCCL (any topology), or the in-process
/// [`local::LocalFabric`] (ranks as threads sharing one GPU, for tests; NCCL refuses two ranks
/// on one device).
#[cfg(feature = "cuda")]
pub trait Fabric: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks.
    fn world(&self) -> usize;
    /// Whether zero-byte transfers may be issued (NCCL ≥ 2.12.10).
    fn zero_size_p2p(&self) -> bool;
    /// All-gather of `count` int32 per rank (`recv` holds `count * world`).
    ///
    /// # Safety
    /// `send`/`recv` are device memory of this device of the stated sizes; `s` is live.
    unsafe fn all_gather_i32(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        s: &crate::gpu::driver::Stream,
    ) -> crate::error::Result<()>;
    /// Every plan's transfers as one group, plus the self copies; enqueued on `s`.
    ///
    /// # Safety
    /// Each `(plan, send, recv)` has `send`/`recv` of at least `plan.send_bytes` /
    /// `plan.recv_bytes` on this device; every rank issues its plans for the same matrices.
    unsafe fn exchange(
        &self,
        items: &[(crate::gpu::nccl::plan::ExchangePlan, u64, u64)],
        s: &crate::gpu::driver::Stream,
    ) -> crate::error::Result<()>;
    /// An asynchronous transport error, polled while the host waits.
    fn poll(&self) -> crate::error::Result<()>;
    /// The bound on the transport's own host waits (a non-blocking NCCL communicator's
    /// queued calls).
    fn set_timeout(&mut self, _timeout: std::time::Duration) {}
    /// Ends this rank's part after a failure mid-call (an owned NCCL communicator:
    /// `ncclCommAbort`), so the peers fail instead of waiting for it; a transport it does
    /// not own is left alone. Every later call on it fails.
    fn abort(&self) -> crate::error::Result<()> {
        Ok(())
    }
}
