//! The GPU path's C ABI: the capability probe, NCCL unique ids, and the GPU all2all handle
//! (MoE dispatch/combine on CUDA device tensors over NCCL, enqueued on the host's stream).
//!
//! Every symbol exists in every build (the header is the same); without the `nccl` feature, or
//! without a CUDA driver / NCCL library at run time, the entry points return
//! `EPCOMM_ERROR_UNAVAILABLE` with a message starting `CUDA is unavailable: ` or
//! `NCCL is unavailable: `. Argument checks (NULLs, ranges, sizes) come first in every build.
//!
//! CUDA tensors (`device_type` 2) given to the host-tensor functions (`epcomm_all2all_*`) are
//! rejected with an error naming the GPU functions below; they are never copied implicitly.
//!
//! Status: the device side has never run on a GPU; see docs/gpu.md.

use std::ffi::{c_char, c_void};
use std::sync::Mutex;

use super::all2all::{config_arg, epcomm_moe_config};
use super::guard;
use super::handle::{exclusive_handle, Exclusive, Handle};
use super::moe_args::epcomm_dispatch_output;
use super::moe_args::DispatchTensors;
use super::tensor::epcomm_tensor;
use crate::error::{Error, Result};
use crate::moe::MoeConfig;

/// Counts mode: exact sizes, one host sync per dispatch (the counts); not capturable.
pub const EPCOMM_GPU_MODE_COUNTS: i32 = 0;
/// Capacity mode: fixed max_tokens_per_rank slabs, no host sync, CUDA-graph capturable
/// (EXPERT_MAJOR backends only: deepep_low_latency, nixl_ep).
pub const EPCOMM_GPU_MODE_CAPACITY: i32 = 1;
/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const EPCOMM_NCCL_UNIQUE_ID_BYTES: i32 = 128;

const NO_NCCL_FEATURE: &str = "NCCL is unavailable: epcomm was built without the 'nccl' feature";

/// Writes the capability probe's JSON (driver, devices with compute capability, SM count,
/// VMM/POSIX-fd/fabric/IPC support and compute mode; NCCL and NVRTC versions and files; the
/// build's features) as a NUL-terminated string into `buf`. `*needed` always receives the
/// size including the NUL. `buf` may be NULL when `len` is 0 (a size query; returns EPCOMM_OK).
/// A `len` smaller than needed is EPCOMM_ERROR_INVALID_ARGUMENT (nothing written to `buf`).
/// Works in every build and without CUDA: each part reports `"available": false` and why.
///
/// # Safety
/// `buf` is NULL or writable for `len` bytes; `needed` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_cuda_caps(buf: *mut c_char, len: usize, needed: *mut usize) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let needed = unsafe { guard::out_arg(needed, "needed") }?;
        let json = crate::gpu::caps::probe().to_json_string();
        let n = json.len() + 1;
        *needed = n;
        if buf.is_null() {
            if len == 0 {
                return Ok(());
            }
            return Err(Error::NullPointer("buf"));
        }
        if len < n {
            return Err(Error::InvalidArgument(format!(
                "buffer of {len} bytes is too small for the caps JSON ({n} bytes with the terminating NUL)"
            )));
        }
        // SAFETY: `buf` holds at least n bytes (checked); the JSON has no interior NUL.
        unsafe {
            std::ptr::copy_nonoverlapping(json.as_ptr(), buf.cast::<u8>(), json.len());
            *buf.add(json.len()) = 0;
        }
        Ok(())
    })
}

/// Writes a new NCCL unique id (128 bytes, `ncclGetUniqueId`) to `out`: share it with every
/// rank (e.g. over the host group) and pass it to epcomm_gpu_all2all_create.
///
/// # Safety
/// `out` is NULL or writable for 128 bytes.
#[no_mangle]
pub unsafe extern "C" fn epcomm_nccl_unique_id(out: *mut u8) -> i32 {
    guard::call(|| {
        if out.is_null() {
            return Err(Error::NullPointer("out"));
        }
        if !cfg!(feature = "nccl") {
            return Err(Error::Unavailable(NO_NCCL_FEATURE.into()));
        }
        let id = crate::gpu::nccl::unique_id()?;
        // SAFETY: out is writable for 128 bytes (caller contract).
        unsafe { std::ptr::copy_nonoverlapping(id.as_bytes().as_ptr(), out, 128) };
        Ok(())
    })
}

/// A GPU all2all manager: one backend, configuration, CUDA device and NCCL communicator. Used
/// by one thread at a time (like an NCCL communicator); every rank calls dispatch and combine
/// in the same order.
pub struct epcomm_gpu_all2all {
    inner: Mutex<imp::GpuState>,
}

exclusive_handle!(
    epcomm_gpu_all2all,
    "a2a",
    imp::GpuState,
    "the GPU all2all handle is in use by another thread; use it from one thread at a time"
);

fn mode_arg(mode: i32) -> Result<()> {
    if !(EPCOMM_GPU_MODE_COUNTS..=EPCOMM_GPU_MODE_CAPACITY).contains(&mode) {
        return Err(Error::InvalidArgument(format!(
            "mode is {mode}; expected EPCOMM_GPU_MODE_COUNTS (0) or EPCOMM_GPU_MODE_CAPACITY (1)"
        )));
    }
    Ok(())
}

fn device_arg(device: i32) -> Result<()> {
    if device < 0 {
        return Err(Error::InvalidArgument(format!(
            "device is {device}; expected a CUDA device ordinal >= 0"
        )));
    }
    Ok(())
}

/// The shared steps of the create calls, in the C checks' order: backend, out, config, the
/// call's own `checks`, mode, device; then `make` builds the manager.
///
/// # Safety
/// `backend` is NULL or a NUL-terminated string; `config` NULL or valid; `out` NULL or writable.
unsafe fn create_with(
    backend: *const c_char,
    config: *const epcomm_moe_config,
    out: *mut *mut epcomm_gpu_all2all,
    checks: impl FnOnce() -> Result<()>,
    mode: i32,
    device: i32,
    make: impl FnOnce(&str, MoeConfig) -> Result<imp::GpuState>,
) -> Result<()> {
    // SAFETY: caller contract for every pointer.
    let (name, out, cfg) = unsafe {
        (
            guard::str_arg(backend, "backend")?,
            guard::out_arg(out, "out")?,
            config_arg(config)?,
        )
    };
    checks()?;
    mode_arg(mode)?;
    device_arg(device)?;
    *out = epcomm_gpu_all2all {
        inner: Mutex::new(make(name, cfg)?),
    }
    .into_raw();
    Ok(())
}

/// Creates a GPU all2all manager and its own NCCL communicator (`ncclCommInitRank`, collective:
/// blocks until all `world_size` ranks joined) from `unique_id` (128 bytes from
/// epcomm_nccl_unique_id on one rank), on CUDA device `device` (its primary context, the one
/// PyTorch uses). `backend` is any all2all backend name vLLM accepts, `mode` an EPCOMM_GPU_MODE_*.
/// Kernels are compiled with NVRTC for the device at the first dispatch (cached in memory and
/// in $EPCOMM_CACHE_DIR). Logs `Using {ManagerClass} all2all manager.`.
///
/// # Safety
/// `backend` is NULL or a NUL-terminated string; `config` NULL or valid; `unique_id` NULL or
/// 128 readable bytes; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_gpu_all2all_create(
    backend: *const c_char,
    config: *const epcomm_moe_config,
    unique_id: *const u8,
    rank: i32,
    world_size: i32,
    device: i32,
    mode: i32,
    out: *mut *mut epcomm_gpu_all2all,
) -> i32 {
    let checks = || {
        if unique_id.is_null() {
            return Err(Error::NullPointer("unique_id"));
        }
        if world_size < 1 || rank < 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is not in a group of {world_size} ranks"
            )));
        }
        Ok(())
    };
    guard::call(|| {
        // SAFETY: caller contract for every pointer.
        unsafe {
            create_with(backend, config, out, checks, mode, device, |name, cfg| {
                // SAFETY: non-NULL (checked) with 128 readable bytes (caller contract).
                let id = std::slice::from_raw_parts(unique_id, 128);
                imp::create_from_id(name, cfg, id, rank, world_size, device, mode)
            })
        }
    })
}

/// Creates a GPU all2all manager on the host's NCCL communicator `nccl_comm` (an `ncclComm_t`,
/// borrowed: epcomm never destroys or aborts it; it must outlive the manager and come from the
/// same libnccl epcomm loads — an already-loaded libnccl.so.2 is reused for this reason). Rank
/// and world size are the communicator's. Otherwise as epcomm_gpu_all2all_create.
///
/// # Safety
/// `nccl_comm` is NULL or a live communicator; other pointers as epcomm_gpu_all2all_create.
#[no_mangle]
pub unsafe extern "C" fn epcomm_gpu_all2all_create_from_comm(
    backend: *const c_char,
    config: *const epcomm_moe_config,
    nccl_comm: *mut c_void,
    device: i32,
    mode: i32,
    out: *mut *mut epcomm_gpu_all2all,
) -> i32 {
    let checks = || {
        if nccl_comm.is_null() {
            return Err(Error::NullPointer("nccl_comm"));
        }
        Ok(())
    };
    guard::call(|| {
        // SAFETY: caller contract for every pointer; the communicator is live and outlives
        // the manager.
        unsafe {
            create_with(backend, config, out, checks, mode, device, |name, cfg| {
                imp::create_from_comm(name, cfg, nccl_comm, device, mode)
            })
        }
    })
}

// The destroy pair and dispatch's arguments are the host manager's (ffi/all2all.rs), spelled
// out for the header (see the module doc of `ffi`).
// Written out per handle, as every destroy pair: each is a C symbol of its own, which cbindgen
// reads as written (a macro would hide it from the header).
/// Releases a GPU manager (NULL is a no-op), as epcomm_gpu_all2all_destroy_checked, whose
/// status this void form cannot return: a refused destroy frees nothing and records the error
/// for epcomm_last_error_message.
///
/// # Safety
/// `a2a` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_gpu_all2all_destroy(a2a: *mut epcomm_gpu_all2all) {
    if !a2a.is_null() {
        // SAFETY: caller contract.
        unsafe { epcomm_gpu_all2all_destroy_checked(a2a) };
    }
}

/// Releases a GPU manager: EPCOMM_OK; its buffers, and its communicator when it was created from a
/// unique id. Views it returned become invalid. Work already enqueued on the host's stream must
/// have finished (synchronize the stream first). NULL is EPCOMM_ERROR_NULL_POINTER. Refused with
/// EPCOMM_ERROR_INVALID_STATE, freeing nothing: while another thread's call on it is in flight; on
/// a handle destroyed already; in a forked child of the process that made it.
///
/// # Safety
/// `a2a` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_gpu_all2all_destroy_checked(a2a: *mut epcomm_gpu_all2all) -> i32 {
    // SAFETY: only a registered handle is freed.
    guard::call(|| unsafe { epcomm_gpu_all2all::destroy(a2a) })
}

/// Runs `f` with the GPU manager behind `a2a`.
///
/// # Safety
/// `a2a` is NULL or a live handle.
unsafe fn with_handle<T>(
    a2a: *const epcomm_gpu_all2all,
    f: impl FnOnce(&mut imp::GpuState) -> Result<T>,
) -> Result<T> {
    // SAFETY: caller contract.
    unsafe { epcomm_gpu_all2all::with(a2a, |_, h| f(h)) }
}

/// Dispatches this rank's tokens (collective) on the host's `stream` (a `cudaStream_t`; NULL =
/// the legacy default stream). Tensors are CUDA device tensors (device type 2) on the handle's
/// device: `hidden` [T, hidden_size] of hidden_dtype, `topk_ids` [T, top_k] int32/int64 (-1 =
/// masked), `topk_weights` [T, top_k] float32, `extras` [T, extra_row_bytes[i]] (may be NULL
/// when num_extras is 0). `out` receives CUDA views of buffers the handle owns (valid until
/// its next dispatch), shaped as for epcomm_all2all_dispatch, with two differences: ids are
/// int64, EXPERT_PACKED's expert_offsets are int32; in capacity mode `received_rows` is -1
/// (the counts are on the device). Counts mode synchronises the host once (after the counts
/// all-gather) and returns EPCOMM_ERROR_INVALID_STATE on a capturing stream; capacity mode
/// never synchronises and can be captured after one uncaptured call, at any T up to
/// max_tokens_per_rank (every buffer is allocated at creation, sized for it; no buffer a
/// captured graph uses ever moves). A call that fails while its peers are in the collective
/// (an allocation, launch or NCCL error, a host wait past the timeout) leaves the handle
/// unusable: every later call returns EPCOMM_ERROR_INVALID_STATE naming that first failure,
/// and a communicator epcomm created is aborted (ncclCommAbort). Every call makes the
/// handle's device context current for its duration only; the caller's stays current after.
///
/// # Safety
/// Pointers are NULL or valid; tensors describe device memory valid until the stream ran the
/// work; `stream` is NULL or a live stream of the handle's device.
#[no_mangle]
pub unsafe extern "C" fn epcomm_gpu_all2all_dispatch(
    a2a: *mut epcomm_gpu_all2all,
    stream: *mut c_void,
    hidden: *const epcomm_tensor,
    topk_ids: *const epcomm_tensor,
    topk_weights: *const epcomm_tensor,
    extras: *const epcomm_tensor,
    num_extras: usize,
    out: *mut epcomm_dispatch_output,
) -> i32 {
    guard::call(|| {
        if out.is_null() {
            return Err(Error::NullPointer("out"));
        }
        if num_extras > 0 && extras.is_null() {
            return Err(Error::NullPointer("extras"));
        }
        // SAFETY: caller contract for every pointer; `out` is non-NULL (checked) and writable.
        unsafe {
            with_handle(a2a, |h| {
                let tensors =
                    DispatchTensors::new(hidden, topk_ids, topk_weights, extras, num_extras);
                *out = imp::dispatch(h, stream, tensors)?;
                Ok(())
            })
        }
    })
}

/// Brings the expert outputs home and reduces them (collective) on `stream`: `expert_output`
/// (CUDA) has the shape of the dispatch output's `hidden` and the config's expert_dtype,
/// `output` (CUDA) is [T, hidden_size] of out_dtype. Same contract per layout as
/// epcomm_all2all_combine; float32 accumulation in a fixed order (bit-reproducible).
///
/// # Safety
/// As epcomm_gpu_all2all_dispatch.
#[no_mangle]
pub unsafe extern "C" fn epcomm_gpu_all2all_combine(
    a2a: *mut epcomm_gpu_all2all,
    stream: *mut c_void,
    expert_output: *const epcomm_tensor,
    output: *const epcomm_tensor,
) -> i32 {
    // SAFETY: caller contract.
    guard::call(|| unsafe { with_handle(a2a, |h| imp::combine(h, stream, expert_output, output)) })
}

/// Waits for `stream` (bounded by the handle's timeout, 300 s) and reports the device error word
/// of the last dispatch/combine (bad topk_ids, a full bucket): capacity mode's way to learn of
/// bad input, since it never syncs by itself. EPCOMM_OK when there was none;
/// EPCOMM_ERROR_INVALID_STATE on a stream being captured into a CUDA graph (call it after the
/// graph was launched).
///
/// # Safety
/// As epcomm_gpu_all2all_dispatch.
#[no_mangle]
pub unsafe extern "C" fn epcomm_gpu_all2all_check_error(
    a2a: *mut epcomm_gpu_all2all,
    stream: *mut c_void,
) -> i32 {
    // SAFETY: caller contract.
    guard::call(|| unsafe { with_handle(a2a, |h| imp::check_error(h, stream)) })
}

/// The GPU manager's device pool (`epcomm_gpu_all2all_get_stats`). Set `struct_size` to
/// `sizeof(epcomm_gpu_all2all_stats)` before the call: only that many bytes are written, so
/// callers built against an older, shorter struct keep working when it grows.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct epcomm_gpu_all2all_stats {
    /// `sizeof(epcomm_gpu_all2all_stats)` as the caller knows it.
    pub struct_size: u32,
    /// Device buffers held.
    pub pool_buffers: u64,
    /// Bytes of device memory held.
    pub pool_bytes: u64,
    /// Bytes allocated at creation (every buffer sized for max_tokens_per_rank tokens per rank).
    pub pool_reserved_bytes: u64,
    /// Device allocations made by calls after creation (a buffer first used or grown; each
    /// growth at least doubles it). 0 while every call stays within max_tokens_per_rank.
    pub pool_reallocations: u64,
}

/// Bytes of today's `epcomm_gpu_all2all_stats`.
const GPU_STATS_BYTES: usize = std::mem::size_of::<epcomm_gpu_all2all_stats>();
/// The smallest `struct_size` accepted: `struct_size` and `pool_buffers`.
const GPU_STATS_MIN: usize = 16;

/// Writes the GPU manager's pool statistics into `stats_out` (its first `struct_size` bytes;
/// `struct_size` must be at least 16 and is left as given; fields past it are not written).
///
/// # Safety
/// `a2a` is NULL or a live handle; `stats_out` is NULL or writable for its `struct_size` bytes.
#[no_mangle]
pub unsafe extern "C" fn epcomm_gpu_all2all_get_stats(
    a2a: *const epcomm_gpu_all2all,
    stats_out: *mut epcomm_gpu_all2all_stats,
) -> i32 {
    guard::call(|| {
        if stats_out.is_null() {
            return Err(Error::NullPointer("stats_out"));
        }
        // SAFETY: the caller's struct starts with struct_size (caller contract).
        let size = unsafe { std::ptr::addr_of!((*stats_out).struct_size).read_unaligned() };
        let size = size as usize;
        if size < GPU_STATS_MIN {
            return Err(Error::InvalidArgument(format!(
                "stats_out->struct_size is {size}: set it to sizeof(epcomm_gpu_all2all_stats) = {GPU_STATS_BYTES}"
            )));
        }
        // SAFETY: caller contract.
        let mut st = unsafe { with_handle(a2a.cast_mut(), |h| Ok(imp::stats(h))) }?;
        st.struct_size = size as u32;
        let n = size.min(GPU_STATS_BYTES);
        // SAFETY: `stats_out` holds `size` >= n writable bytes (caller contract); `st` is a
        // plain repr(C) value of GPU_STATS_BYTES >= n bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&st as *const epcomm_gpu_all2all_stats).cast::<u8>(),
                stats_out.cast::<u8>(),
                n,
            )
        };
        Ok(())
    })
}

/// A device tensor the kernels read or write element by element (topk_ids, topk_weights,
/// combine's output) must start at a multiple of its element size: a misaligned load is a
/// sticky CUDA error that ends the context for the whole process, so it is refused here.
/// (Rows that only move as bytes — hidden, extras, expert outputs — may have any address.)
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
fn check_element_alignment(name: &str, addr: usize, elem_bytes: usize, bytes: usize) -> Result<()> {
    if bytes > 0 && elem_bytes > 1 && !addr.is_multiple_of(elem_bytes) {
        return Err(Error::InvalidArgument(format!(
            "tensor '{name}' starts at {addr:#x} (data + byte_offset), not a multiple of its {elem_bytes}-byte elements: the GPU kernels need aligned elements"
        )));
    }
    Ok(())
}

#[cfg(not(feature = "nccl"))]
mod imp {
    use super::*;

    /// Never constructed in a build without NCCL: the create calls fail.
    pub(crate) enum GpuState {}

    fn unavailable<T>() -> Result<T> {
        Err(Error::Unavailable(NO_NCCL_FEATURE.into()))
    }

    pub(super) fn create_from_id(
        _: &str,
        _: MoeConfig,
        _: &[u8],
        _: i32,
        _: i32,
        _: i32,
        _: i32,
    ) -> Result<GpuState> {
        unavailable()
    }

    pub(super) unsafe fn create_from_comm(
        _: &str,
        _: MoeConfig,
        _: *mut c_void,
        _: i32,
        _: i32,
    ) -> Result<GpuState> {
        unavailable()
    }

    pub(super) unsafe fn dispatch(
        h: &mut GpuState,
        _: *mut c_void,
        _: DispatchTensors,
    ) -> Result<epcomm_dispatch_output> {
        match *h {}
    }

    pub(super) unsafe fn combine(
        h: &mut GpuState,
        _: *mut c_void,
        _: *const epcomm_tensor,
        _: *const epcomm_tensor,
    ) -> Result<()> {
        match *h {}
    }

    pub(super) fn check_error(h: &mut GpuState, _: *mut c_void) -> Result<()> {
        match *h {}
    }

    pub(super) fn stats(h: &mut GpuState) -> epcomm_gpu_all2all_stats {
        match *h {}
    }
}

#[cfg(feature = "nccl")]
mod imp {
    use super::*;
    use crate::dtype::DType;
    use crate::ffi::moe_args::{
        combine_args, DispatchArgs, DispatchParts, IdWidth, OutputAddrs, OutputViews,
    };
    use crate::ffi::tensor::{HostTensor, Memory};
    use crate::gpu::driver::{Device, PrimaryContext, Stream};
    use crate::gpu::kernels::IdDtype;
    use crate::gpu::nccl::{NcclComm, NcclUniqueId};
    use crate::gpu::transport::{DispatchInput, GpuDispatch, GpuManager, GpuMode};

    /// What a call on a GPU all2all handle borrows.
    pub(crate) struct GpuState {
        mgr: GpuManager,
        device: i32,
        views: OutputViews,
    }

    fn cuda_ready() -> Result<()> {
        crate::probe::cuda()
            .map_err(|e| Error::Unavailable(format!("CUDA is unavailable: {e}")))?;
        crate::gpu::nccl::api()?;
        Ok(())
    }

    fn gpu_mode(mode: i32) -> GpuMode {
        if mode == EPCOMM_GPU_MODE_CAPACITY {
            GpuMode::Capacity
        } else {
            GpuMode::Counts
        }
    }

    /// The device's primary context, retained for a create call (NCCL's init uses the
    /// current device: the caller pushes it with `enter` and gets its own back after).
    fn retain(device: i32) -> Result<PrimaryContext> {
        PrimaryContext::retain(Device::get(device as usize)?)
    }

    fn state(mgr: GpuManager, device: i32) -> GpuState {
        GpuState {
            mgr,
            device,
            views: OutputViews::default(),
        }
    }

    pub(super) fn create_from_id(
        name: &str,
        cfg: MoeConfig,
        id: &[u8],
        rank: i32,
        world: i32,
        device: i32,
        mode: i32,
    ) -> Result<GpuState> {
        // Validate the configuration before the (blocking, collective) communicator init.
        crate::moe::Manager::new(name, cfg.clone(), rank as usize, world as usize)?;
        cuda_ready()?;
        let ctx = retain(device)?;
        let _bound = ctx.enter()?;
        let id = NcclUniqueId::from_bytes(id)?;
        let comm = NcclComm::init_rank(&id, rank as usize, world as usize)?;
        let mgr = GpuManager::new(name, cfg, Box::new(comm), device as usize, gpu_mode(mode))?;
        Ok(state(mgr, device))
    }

    pub(super) unsafe fn create_from_comm(
        name: &str,
        cfg: MoeConfig,
        comm: *mut c_void,
        device: i32,
        mode: i32,
    ) -> Result<GpuState> {
        cuda_ready()?;
        let ctx = retain(device)?;
        let _bound = ctx.enter()?;
        // SAFETY: caller contract: a live communicator of the loaded NCCL.
        let comm = unsafe { NcclComm::adopt(comm) }?;
        let mgr = GpuManager::new(name, cfg, Box::new(comm), device as usize, gpu_mode(mode))?;
        Ok(state(mgr, device))
    }

    /// A device address for the manager (0 for an empty tensor).
    fn addr(t: &HostTensor) -> u64 {
        if t.bytes == 0 {
            0
        } else {
            t.ptr as u64
        }
    }

    pub(super) unsafe fn dispatch(
        h: &mut GpuState,
        stream: *mut c_void,
        tensors: DispatchTensors,
    ) -> Result<epcomm_dispatch_output> {
        // SAFETY: caller contract: NULL or a live stream of this device.
        let s = unsafe { Stream::borrowed(stream) };
        let mem = Memory::Cuda(h.device);
        let cfg = h.mgr.config();
        // SAFETY: the descriptors as this function's contract.
        let checked = unsafe { DispatchArgs::parse(cfg, mem, tensors) }.and_then(device_input);
        // The peers are told before they wait for this rank in the counts all-gather.
        let input = checked.map_err(|e| h.mgr.reject_dispatch(&s, e))?;
        let o = h.mgr.dispatch(&s, &input)?;
        Ok(describe(h, &o))
    }

    /// The GPU's own requirement on checked dispatch tensors (aligned elements), then their
    /// device addresses.
    fn device_input(a: DispatchArgs) -> Result<DispatchInput> {
        let (ids, w) = (&a.topk_ids, &a.topk_weights);
        let id_bytes = ids.dtype.bits as usize / 8;
        check_element_alignment("topk_ids", ids.ptr as usize, id_bytes, ids.bytes)?;
        check_element_alignment("topk_weights", w.ptr as usize, 4, w.bytes)?;
        Ok(DispatchInput {
            hidden: addr(&a.hidden),
            topk_ids: addr(ids),
            id_dtype: match a.id_width {
                IdWidth::I32 => IdDtype::I32,
                IdWidth::I64 => IdDtype::I64,
            },
            topk_weights: addr(w),
            tokens: a.tokens(),
            extras: a.extras.iter().map(addr).collect(),
        })
    }

    /// A dispatch's device buffers as CUDA views (a buffer the layout does not produce is
    /// at address 0).
    fn describe(h: &mut GpuState, o: &GpuDispatch) -> epcomm_dispatch_output {
        let sh = &o.shape;
        let at = |a: u64| a as usize;
        let parts = DispatchParts {
            layout: sh.layout,
            received_rows: i64::try_from(sh.received_rows).unwrap_or(-1),
            shapes: sh.shapes.clone(),
            hidden_dtype: h.mgr.config().hidden_dtype,
            offsets_dtype: DType::I32,
            at: OutputAddrs {
                hidden: at(o.hidden),
                topk_ids: at(o.topk_ids),
                topk_weights: at(o.topk_weights),
                counts: at(o.counts),
                expert_offsets: at(o.expert_offsets),
                src_rank: at(o.src_rank),
                src_token: at(o.src_token),
                extras: o.extras.iter().map(|&a| at(a)).collect(),
            },
        };
        let mem = Memory::Cuda(h.device);
        h.views
            .describe(&parts, &h.mgr.config().extra_row_bytes, mem)
    }

    pub(super) unsafe fn combine(
        h: &mut GpuState,
        stream: *mut c_void,
        expert_output: *const epcomm_tensor,
        output: *const epcomm_tensor,
    ) -> Result<()> {
        let (mgr, mem) = (&mut h.mgr, Memory::Cuda(h.device));
        let dispatched = mgr
            .last_shape()
            .map(|s| (s.buffer_rows, mgr.last_tokens().unwrap_or(0)));
        // SAFETY: the descriptors as this function's contract.
        let (y, o) = unsafe { combine_args(mgr.config(), mem, expert_output, output, dispatched) }?;
        let out_elem = mgr.config().out_dtype.size();
        check_element_alignment("output", o.ptr as usize, out_elem, o.bytes)?;
        // SAFETY: caller contract: NULL or a live stream of this device.
        let s = unsafe { Stream::borrowed(stream) };
        // Without a dispatch before it, the manager's combine is the invalid-state error.
        mgr.combine(&s, addr(&y), addr(&o))
    }

    pub(super) fn check_error(h: &mut GpuState, stream: *mut c_void) -> Result<()> {
        // SAFETY: caller contract: NULL or a live stream of this device.
        let s = unsafe { Stream::borrowed(stream) };
        h.mgr.check_device_error(&s)
    }

    pub(super) fn stats(h: &mut GpuState) -> epcomm_gpu_all2all_stats {
        let p = h.mgr.stats();
        epcomm_gpu_all2all_stats {
            struct_size: 0,
            pool_buffers: p.buffers as u64,
            pool_bytes: p.bytes as u64,
            pool_reserved_bytes: p.reserved_bytes as u64,
            pool_reallocations: p.reallocations,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::check_element_alignment;

    #[test]
    fn misaligned_device_tensors_are_refused() {
        check_element_alignment("topk_ids", 0x1000, 8, 64).unwrap();
        check_element_alignment("topk_ids", 0x1004, 4, 64).unwrap();
        let e = check_element_alignment("topk_ids", 0x1004, 8, 64).unwrap_err();
        assert!(
            e.to_string().contains("tensor 'topk_ids' starts at 0x1004"),
            "{e}"
        );
        assert!(check_element_alignment("output", 0x1001, 2, 2).is_err());
        // Empty tensors and byte rows have no alignment requirement.
        check_element_alignment("output", 0x1001, 2, 0).unwrap();
        check_element_alignment("extras[0]", 0x1001, 1, 7).unwrap();
    }
}
