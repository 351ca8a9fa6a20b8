//! [`GpuManager`]: MoE dispatch/combine on device memory over NCCL (or the local fabric), for
//! every layout (docs/design.md, section 3), with the same [`MoeConfig`] and the same row
//! orders as the CPU [`crate::moe::Manager`] (source rank, then source token, then k).
//!
//! The steps of dispatch and combine (counts and capacity mode) are the device-independent
//! [`Pipeline`]; this file is its CUDA [`Executor`]: a grow-only pool of device buffers, the
//! kernels loaded per id dtype, `cuMemsetD*`/`cuMemcpy*` on the caller's stream, the
//! [`Fabric`]'s exchanges, and the one host sync of counts mode (an event waited on while
//! polling the transport's asynchronous error, bounded by [`GpuManager::timeout`]; refused on
//! a capturing stream with [`crate::gpu::driver::CAPTURE_SYNC_MESSAGE`]).
//!
//! The pool ([`Pool`]) is sized at creation for `max_tokens_per_rank` tokens per rank, so
//! calls within it never allocate or free (and never move a buffer a captured graph uses). A
//! call that fails while its peers are in the collective marks the manager unusable and
//! aborts an owned NCCL communicator ([`GpuManager::failure`]).
//!
//! Status: compiled and clippy-clean, **never run on a GPU** (`scripts/gpu-check.sh` runs it).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::error::{Error, Result, Status};
use crate::gpu::calls::{Call, Calls};
use crate::gpu::driver::{
    memcpy_dtod_async, memcpy_dtoh_async, memcpy_htod_async, memset_d8_async, ContextGuard, Device,
    DeviceMemory, Event, PinnedHost, PrimaryContext, Stream,
};
use crate::gpu::kernels::{decode_error_word, FloatDtype, IdDtype};
use crate::gpu::launch::{memset_d32_async, KernelConfig, Kernels};
use crate::gpu::nccl::plan::{ExchangeOptions, ExchangePlan};
use crate::gpu::nccl::{NcclComm, NcclDataType};
use crate::gpu::transport::local::local_copies;
use crate::gpu::transport::pipeline::{DispatchInput, Executor, GpuDispatch, GpuMode, Pipeline};
use crate::gpu::transport::plan::{counts_row_len, DispatchShape};
use crate::gpu::transport::pool::{self, Block, Pool, PoolStats};
use crate::gpu::transport::Fabric;
use crate::moe::layout::Contract;
use crate::moe::MoeConfig;
use crate::num::FloatKind;
use crate::select::all2all::{Backend, Layout};

impl Block for DeviceMemory {
    fn ptr(&self) -> u64 {
        DeviceMemory::ptr(self)
    }

    fn bytes(&self) -> usize {
        DeviceMemory::bytes(self)
    }
}

/// The message of `check_device_error` on a capturing stream.
pub const CAPTURE_CHECK_MESSAGE: &str = "check_device_error synchronises the host with the stream, which is being captured into a CUDA graph; call it after the graph was launched, outside the capture";

/// Pinned host staging buffers, all sized at creation (the host syncs bound their reuse).
#[derive(Debug, Default)]
struct Staging(HashMap<&'static str, PinnedHost>);

impl Staging {
    /// Pinned host memory `name` of at least `bytes`.
    fn get(&mut self, name: &'static str, bytes: usize) -> Result<*mut u8> {
        let bytes = bytes.max(16);
        if let Some(m) = self.0.get(name) {
            if m.bytes() >= bytes {
                return Ok(m.ptr().cast());
            }
        }
        let m = PinnedHost::alloc(bytes)?;
        let p = m.ptr().cast();
        self.0.insert(name, m);
        Ok(p)
    }
}

/// The kernels of one manager, loaded per id dtype on first use.
#[derive(Debug)]
struct Loaded {
    device: Device,
    top_k: u32,
    expert: FloatDtype,
    out: FloatDtype,
    by_id: HashMap<IdDtype, Kernels>,
}

impl Loaded {
    fn get(&mut self, id: IdDtype) -> Result<&Kernels> {
        if !self.by_id.contains_key(&id) {
            let k = Kernels::load(
                &self.device,
                KernelConfig {
                    id_dtype: id,
                    top_k: self.top_k,
                    expert_dtype: self.expert,
                    out_dtype: self.out,
                },
            )?;
            self.by_id.insert(id, k);
        }
        self.by_id
            .get(&id)
            .ok_or_else(|| Error::Internal("kernels missing right after loading".into()))
    }
}

/// The CUDA executor of one call: the manager's pool, kernels and fabric on `s`.
struct Cuda<'a> {
    s: &'a Stream,
    ctx: &'a PrimaryContext,
    entered: Option<ContextGuard<'a>>,
    pool: &'a mut Pool<DeviceMemory>,
    staging: &'a mut Staging,
    kernels: &'a mut Loaded,
    comm: &'a dyn Fabric,
    timeout: Duration,
}

/// Waits for `ev`, polling the transport's async error, bounded by `timeout`; `what` names
/// the wait in the timeout's message.
fn wait_event(ev: &Event, comm: &dyn Fabric, timeout: Duration, what: &str) -> Result<()> {
    let start = Instant::now();
    loop {
        if ev.query()? {
            return Ok(());
        }
        comm.poll()?;
        if start.elapsed() > timeout {
            return Err(Error::Timeout(format!(
                "GPU all2all: {what} did not complete within {timeout:?} (a peer rank is not participating?)"
            )));
        }
        std::thread::sleep(Duration::from_micros(20));
    }
}

impl Executor for Cuda<'_> {
    fn enter(&mut self) -> Result<()> {
        self.entered = Some(self.ctx.enter()?);
        Ok(())
    }

    fn leave(&mut self) {
        self.entered = None;
    }

    fn reserve(&mut self, name: &str, bytes: usize) -> Result<()> {
        self.pool
            .reserve(name, bytes, DeviceMemory::alloc)
            .map(|_| ())
    }

    fn calls(&mut self, id: IdDtype) -> Result<Calls> {
        self.kernels.get(id).map(Kernels::calls)
    }

    fn buffer(&mut self, name: &str, bytes: usize) -> Result<u64> {
        let s = self.s;
        self.pool
            .get(name, bytes, || s.is_capturing(), DeviceMemory::alloc)
    }

    fn launch(&mut self, id: IdDtype, calls: &[Call]) -> Result<()> {
        let s = self.s;
        self.kernels.get(id)?.run(calls, s)
    }

    unsafe fn fill8(&mut self, dst: u64, value: u8, bytes: usize) -> Result<()> {
        // SAFETY: caller contract (Executor::fill8).
        unsafe { memset_d8_async(dst, value, bytes, self.s) }
    }

    unsafe fn fill32(&mut self, dst: u64, value: u32, count: usize) -> Result<()> {
        // SAFETY: caller contract (Executor::fill32).
        unsafe { memset_d32_async(dst, value, count, self.s) }
    }

    unsafe fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: caller contract (Executor::copy).
        unsafe { memcpy_dtod_async(dst, src, bytes, self.s) }
    }

    unsafe fn upload(&mut self, dst: u64, data: &[u8], staging: &'static str) -> Result<()> {
        let h = self.staging.get(staging, data.len())?;
        // SAFETY: `h` holds data.len() pinned bytes owned by the manager, whose previous copy
        // ended at the previous host sync (caller contract); `dst` per the caller.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), h, data.len());
            memcpy_htod_async(dst, h.cast(), data.len(), self.s)
        }
    }

    unsafe fn all_gather_i32(&mut self, send: u64, recv: u64, count: usize) -> Result<()> {
        // SAFETY: caller contract (Executor::all_gather_i32 = Fabric::all_gather_i32).
        unsafe { self.comm.all_gather_i32(send, recv, count, self.s) }
    }

    unsafe fn exchange(&mut self, items: &[(ExchangePlan, u64, u64)]) -> Result<()> {
        // SAFETY: caller contract (Executor::exchange = Fabric::exchange).
        unsafe { self.comm.exchange(items, self.s) }
    }

    fn read_i32(&mut self, src: u64, count: usize) -> Result<Vec<i32>> {
        let h = self.staging.get("h_counts", 4 * count)?;
        // SAFETY: `h` holds 4 * count pinned bytes; `src` is the caller's device buffer.
        unsafe { memcpy_dtoh_async(h.cast(), src, 4 * count, self.s) }?;
        let ev = Event::new(false)?;
        ev.record(self.s)?;
        wait_event(&ev, self.comm, self.timeout, "the counts all-gather")?;
        // SAFETY: the copy completed (event); the pinned buffer holds `count` int32.
        let raw = unsafe { std::slice::from_raw_parts(h.cast::<i32>(), count) };
        Ok(raw.to_vec())
    }

    fn ensure_not_capturing(&self) -> Result<()> {
        self.s.ensure_not_capturing()
    }

    fn abort(&mut self) {
        // Owned communicators only (a host's is the host's to abort); the peers' NCCL calls
        // then fail instead of waiting for this rank.
        let _ = self.comm.abort();
    }
}

/// The GPU all2all manager: one NCCL communicator, one device, one configuration. Used by one
/// thread at a time, like the communicator. Every entry makes the device's primary context
/// current for its duration and restores the caller's afterwards.
pub struct GpuManager {
    pipe: Pipeline,
    // Dropped in this order, the context last (Drop releases the device resources with it
    // current first).
    pool: Pool<DeviceMemory>,
    staging: Staging,
    kernels: Loaded,
    comm: Box<dyn Fabric>,
    ctx: PrimaryContext,
    timeout: Duration,
}

impl Drop for GpuManager {
    fn drop(&mut self) {
        // Memory and modules are released in their context, before it (the dropping thread
        // may not be the one that used the manager; its own context is restored after).
        let _bound = self.ctx.enter();
        self.pool.clear();
        self.staging.0.clear();
        self.kernels.by_id.clear();
    }
}

impl std::fmt::Debug for GpuManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuManager")
            .field("backend", &self.pipe.backend())
            .field("rank", &self.comm.rank())
            .field("world", &self.comm.world())
            .field("mode", &self.pipe.mode())
            .finish()
    }
}

fn float(k: FloatKind) -> FloatDtype {
    match k {
        FloatKind::F32 => FloatDtype::F32,
        FloatKind::Bf16 => FloatDtype::Bf16,
        FloatKind::F16 => FloatDtype::F16,
    }
}

/// A failed creation-time allocation (out of device memory) with what creation asked for.
fn reserve_error(e: Error, name: &str, bytes: usize, total: usize, m: usize) -> Error {
    if e.status() != Status::Runtime {
        return e;
    }
    Error::Runtime(format!(
        "GPU all2all: every buffer is allocated at creation for max_tokens_per_rank = {m} ({total} bytes in all); buffer '{name}' of {bytes} bytes failed: {e}; lower max_tokens_per_rank"
    ))
}

/// The pinned staging buffers of a configuration (all fixed sizes).
fn staging_sizes(world: usize, num_experts: usize) -> [(&'static str, usize); 5] {
    let row = 4 * counts_row_len(world, num_experts);
    [
        ("h_counts", row * world),
        ("h_tokens", 4),
        ("h_offsets", 4 * (world + 1)),
        ("h_reject", row),
        ("h_err", 8),
    ]
}

impl GpuManager {
    /// A manager for `backend` over `comm` (whose rank/world are the EP group's) on CUDA
    /// device `device`. Validates like the CPU manager (same messages, same
    /// `Using … all2all manager.` info) and refuses what the GPU path does not do
    /// ([`Pipeline::new`]); then allocates every buffer for `max_tokens_per_rank` tokens per
    /// rank ([`Pipeline::reserve`]). The caller's current context is left as it was.
    pub fn new(
        backend: &str,
        cfg: MoeConfig,
        mut comm: Box<dyn Fabric>,
        device: usize,
        mode: GpuMode,
    ) -> Result<GpuManager> {
        let pipe = Pipeline::new(
            backend,
            cfg.clone(),
            comm.rank(),
            comm.world(),
            mode,
            comm.zero_size_p2p(),
        )?;
        let dev = Device::get(device)?;
        let ctx = PrimaryContext::retain(dev)?;
        let timeout = Duration::from_secs(300);
        comm.set_timeout(timeout);
        let mut m = GpuManager {
            pipe,
            pool: Pool::new(),
            staging: Staging::default(),
            kernels: Loaded {
                device: dev,
                top_k: cfg.top_k as u32,
                expert: float(cfg.expert_dtype),
                out: float(cfg.out_dtype),
                by_id: HashMap::new(),
            },
            comm,
            ctx,
            timeout,
        };
        m.reserve()?;
        Ok(m)
    }

    /// Creation-time sizing of the device pool and the pinned staging buffers.
    fn reserve(&mut self) -> Result<()> {
        let _bound = self.ctx.enter()?;
        let (r, e) = (self.world(), self.config().num_experts);
        for (name, bytes) in staging_sizes(r, e) {
            self.staging.get(name, bytes)?;
        }
        let sizes = self.pipe.buffer_sizes();
        let total: usize = sizes.iter().map(|(_, b)| pool::rounded(*b)).sum();
        let m = self.config().max_tokens_per_rank;
        for (name, bytes) in sizes {
            self.pool
                .reserve(&name, bytes, DeviceMemory::alloc)
                .map_err(|e| reserve_error(e, &name, bytes, total, m))?;
        }
        Ok(())
    }

    /// The bound on every host wait (the counts all-gather, `check_device_error`, a
    /// non-blocking NCCL communicator's queued calls); 300 s by default.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets [`GpuManager::timeout`].
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
        self.comm.set_timeout(timeout);
    }

    /// The device pool: buffers, bytes, what creation reserved and the allocations calls
    /// made since (0 while every call stays within `max_tokens_per_rank`).
    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// The first failure that left the group out of step, once there was one: every call
    /// since is refused with it ([`Pipeline::failure`]).
    pub fn failure(&self) -> Option<&str> {
        self.pipe.failure()
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.pipe.backend()
    }

    /// The layout.
    pub fn layout(&self) -> Layout {
        self.pipe.layout()
    }

    /// The layout's contract.
    pub fn contract(&self) -> &Contract {
        self.pipe.contract()
    }

    /// The configuration.
    pub fn config(&self) -> &MoeConfig {
        self.pipe.config()
    }

    /// The mode.
    pub fn mode(&self) -> GpuMode {
        self.pipe.mode()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.comm.world()
    }

    /// The transport.
    pub fn fabric(&self) -> &dyn Fabric {
        self.comm.as_ref()
    }

    /// Tokens (T) of the last dispatch: combine's output has this many rows.
    pub fn last_tokens(&self) -> Option<usize> {
        self.pipe.last_tokens()
    }

    /// The shape of the last dispatch.
    pub fn last_shape(&self) -> Option<&DispatchShape> {
        self.pipe.last_shape()
    }

    /// The pipeline and its CUDA executor on `s`.
    fn split<'a>(&'a mut self, s: &'a Stream) -> (&'a mut Pipeline, Cuda<'a>) {
        let x = Cuda {
            s,
            ctx: &self.ctx,
            entered: None,
            pool: &mut self.pool,
            staging: &mut self.staging,
            kernels: &mut self.kernels,
            comm: self.comm.as_ref(),
            timeout: self.timeout,
        };
        (&mut self.pipe, x)
    }

    /// Dispatch (collective). `stream` is the host's stream on this manager's device; every
    /// kernel and transfer is enqueued on it. Counts mode syncs the host once (see the module
    /// doc); capacity mode never does.
    pub fn dispatch(&mut self, stream: &Stream, input: &DispatchInput) -> Result<GpuDispatch> {
        let (pipe, mut x) = self.split(stream);
        pipe.dispatch(&mut x, input)
    }

    /// Returns `err` after telling the peers (counts mode) that this rank's dispatch input was
    /// rejected ([`Pipeline::reject_dispatch`]).
    pub fn reject_dispatch(&mut self, stream: &Stream, err: Error) -> Error {
        let (pipe, mut x) = self.split(stream);
        pipe.reject_dispatch(&mut x, err)
    }

    /// Reads the device error word of the last call (a host sync, bounded by the timeout,
    /// through pinned memory): capacity mode's way to learn about bad ids or full buckets,
    /// which it cannot check without syncing. InvalidState ([`CAPTURE_CHECK_MESSAGE`]) on a
    /// capturing stream. A wait that times out (or a transport error meanwhile) marks the
    /// manager unusable, as a failed call does ([`GpuManager::failure`]).
    pub fn check_device_error(&mut self, stream: &Stream) -> Result<()> {
        self.pipe.ensure_usable()?;
        let _bound = self.ctx.enter()?;
        if stream.is_capturing()? {
            return Err(Error::InvalidState(CAPTURE_CHECK_MESSAGE.into()));
        }
        let err = self.pool.get("err", 8, || Ok(false), DeviceMemory::alloc)?;
        let h = self.staging.get("h_err", 8)?;
        // SAFETY: `h` holds 8 pinned bytes; `err` is the 8-byte device error word.
        unsafe { memcpy_dtoh_async(h.cast(), err, 8, stream) }?;
        let ev = Event::new(false)?;
        ev.record(stream)?;
        if let Err(e) = wait_event(&ev, self.comm.as_ref(), self.timeout, "check_device_error") {
            // The stream never finished (or the transport failed): the group is out of step.
            self.pipe.mark_unusable(&e.to_string());
            let _ = self.comm.abort();
            return Err(e);
        }
        // SAFETY: the copy completed (event); 8 bytes, 8-aligned (cuMemHostAlloc).
        let word = unsafe { h.cast::<u64>().read() };
        match decode_error_word(word) {
            None => Ok(()),
            Some(e) => Err(e.to_error()),
        }
    }

    /// Combine (collective): `expert_output` has the dispatch buffer's rows
    /// (`shape.buffer_rows` × hidden, expert dtype), `out` gets `[T, hidden]` of the out dtype.
    pub fn combine(&mut self, stream: &Stream, expert_output: u64, out: u64) -> Result<()> {
        let (pipe, mut x) = self.split(stream);
        pipe.combine(&mut x, expert_output, out)
    }
}

impl Fabric for NcclComm {
    fn rank(&self) -> usize {
        NcclComm::rank(self)
    }

    fn world(&self) -> usize {
        NcclComm::world(self)
    }

    fn zero_size_p2p(&self) -> bool {
        ExchangeOptions::for_version(self.api().version).zero_size_p2p
    }

    unsafe fn all_gather_i32(&self, send: u64, recv: u64, count: usize, s: &Stream) -> Result<()> {
        // SAFETY: caller contract (Fabric::all_gather_i32).
        unsafe {
            self.all_gather(
                send as *const std::ffi::c_void,
                recv as *mut std::ffi::c_void,
                count,
                NcclDataType::Int32,
                s.raw(),
            )
        }
    }

    unsafe fn exchange(&self, items: &[(ExchangePlan, u64, u64)], s: &Stream) -> Result<()> {
        self.group_start()?;
        let mut first: Option<Error> = None;
        for (plan, send, recv) in items {
            // SAFETY: caller contract (Fabric::exchange).
            if let Err(e) = unsafe { NcclComm::exchange(self, plan, *send, *recv, s.raw()) } {
                first.get_or_insert(e);
            }
        }
        // Close the group even after a failed call (NCCL's group state is per thread); a
        // non-blocking communicator's ncclInProgress is waited out, bounded.
        let end = self.group_end();
        if let Some(e) = first {
            return Err(e);
        }
        end?;
        // SAFETY: caller contract.
        unsafe { local_copies(items, s) }
    }

    fn poll(&self) -> Result<()> {
        self.async_error()
    }

    fn set_timeout(&mut self, timeout: Duration) {
        NcclComm::set_timeout(self, timeout);
    }

    fn abort(&self) -> Result<()> {
        if self.is_owned() {
            NcclComm::abort(self)
        } else {
            Ok(())
        }
    }
}
