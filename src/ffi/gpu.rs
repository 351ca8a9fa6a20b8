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

use super::all2all::{config_arg, epcomm_dispatch_output, epcomm_moe_config};
use super::guard;
use super::tensor::epcomm_tensor;
use crate::error::{Error, Result};

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
    inner: std::sync::Mutex<imp::Handle>,
}

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
    guard::call(|| {
        // SAFETY: caller contract for every pointer.
        let name = unsafe { guard::str_arg(backend, "backend") }?;
        let out = unsafe { guard::out_arg(out, "out") }?;
        let cfg = unsafe { config_arg(config) }?;
        if unique_id.is_null() {
            return Err(Error::NullPointer("unique_id"));
        }
        if world_size < 1 || rank < 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is not in a group of {world_size} ranks"
            )));
        }
        mode_arg(mode)?;
        device_arg(device)?;
        // SAFETY: 128 readable bytes (caller contract).
        let id = unsafe { std::slice::from_raw_parts(unique_id, 128) };
        let h = imp::create_from_id(name, cfg, id, rank, world_size, device, mode)?;
        *out = Box::into_raw(Box::new(epcomm_gpu_all2all {
            inner: std::sync::Mutex::new(h),
        }));
        Ok(())
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
    guard::call(|| {
        // SAFETY: caller contract for every pointer.
        let name = unsafe { guard::str_arg(backend, "backend") }?;
        let out = unsafe { guard::out_arg(out, "out") }?;
        let cfg = unsafe { config_arg(config) }?;
        if nccl_comm.is_null() {
            return Err(Error::NullPointer("nccl_comm"));
        }
        mode_arg(mode)?;
        device_arg(device)?;
        // SAFETY: caller contract: a live communicator that outlives the manager.
        let h = unsafe { imp::create_from_comm(name, cfg, nccl_comm, device, mode) }?;
        *out = Box::into_raw(Box::new(epcomm_gpu_all2all {
            inner: std::sync::Mutex::new(h),
        }));
        Ok(())
    })
}

/// Releases a GPU manager (NULL is a no-op): its buffers, and its communicator when it was
/// created from a unique id. Views it returned become invalid. Work already enqueued on the
/// host's stream must have finished (synchronize the stream first).
///
/// # Safety
/// `a2a` is NULL or a handle from epcomm_gpu_all2all_create*, not used after this call.
#[no_mangle]
pub unsafe extern "C" fn epcomm_gpu_all2all_destroy(a2a: *mut epcomm_gpu_all2all) {
    guard::call_or((), || {
        if !a2a.is_null() {
            // SAFETY: from Box::into_raw, destroyed once (caller contract).
            drop(unsafe { Box::from_raw(a2a) });
        }
    })
}

fn with_handle<T>(
    a2a: *const epcomm_gpu_all2all,
    f: impl FnOnce(&mut imp::Handle) -> Result<T>,
) -> Result<T> {
    // SAFETY: caller contract: NULL or a live handle.
    let h = unsafe { a2a.as_ref() }.ok_or(Error::NullPointer("a2a"))?;
    let mut g = h
        .inner
        .try_lock()
        .or_else(super::guard::recover_poisoned)
        .map_err(|_| {
            Error::InvalidState(
                "the GPU all2all handle is in use by another thread; use it from one thread at a time"
                    .into(),
            )
        })?;
    f(&mut g)
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
/// never synchronises and can be captured after one uncaptured call.
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
        with_handle(a2a, |h| {
            // SAFETY: caller contract for every pointer.
            let o = unsafe {
                imp::dispatch(
                    h,
                    stream,
                    hidden,
                    topk_ids,
                    topk_weights,
                    extras,
                    num_extras,
                )
            }?;
            // SAFETY: checked non-NULL; caller contract: writable.
            unsafe { *out = o };
            Ok(())
        })
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
    guard::call(|| {
        // SAFETY: caller contract.
        with_handle(a2a, |h| unsafe {
            imp::combine(h, stream, expert_output, output)
        })
    })
}

/// Synchronises `stream` and reports the device error word of the last dispatch/combine (bad
/// topk_ids, a full bucket): capacity mode's way to learn of bad input, since it never syncs
/// by itself. EPCOMM_OK when there was none.
///
/// # Safety
/// As epcomm_gpu_all2all_dispatch.
#[no_mangle]
pub unsafe extern "C" fn epcomm_gpu_all2all_check_error(
    a2a: *mut epcomm_gpu_all2all,
    stream: *mut c_void,
) -> i32 {
    guard::call(|| with_handle(a2a, |h| imp::check_error(h, stream)))
}

/// A device tensor the kernels read or write element by element (topk_ids, topk_weights,
/// combine's output) must start at a multiple of its element size: a misaligned load is a
/// sticky CUDA error that ends the context for the whole process, so it is refused here.
/// (Rows that only move as bytes — hidden, extras, expert outputs — may have any address.)
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
fn check_element_alignment(name: &str, addr: usize, elem_bytes: usize, bytes: usize) -> Result<()> {
    if bytes > 0 && elem_bytes > 1 && addr % elem_bytes != 0 {
        return Err(Error::InvalidArgument(format!(
            "tensor '{name}' starts at {addr:#x} (data + byte_offset), not a multiple of its {elem_bytes}-byte elements: the GPU kernels need aligned elements"
        )));
    }
    Ok(())
}

#[cfg(not(feature = "nccl"))]
mod imp {
    use super::*;

    /// Never constructed in a build without NCCL.
    pub struct Handle;

    pub fn create_from_id(
        _: &str,
        _: crate::moe::MoeConfig,
        _: &[u8],
        _: i32,
        _: i32,
        _: i32,
        _: i32,
    ) -> Result<Handle> {
        Err(Error::Unavailable(NO_NCCL_FEATURE.into()))
    }

    pub unsafe fn create_from_comm(
        _: &str,
        _: crate::moe::MoeConfig,
        _: *mut c_void,
        _: i32,
        _: i32,
    ) -> Result<Handle> {
        Err(Error::Unavailable(NO_NCCL_FEATURE.into()))
    }

    pub unsafe fn dispatch(
        _: &mut Handle,
        _: *mut c_void,
        _: *const epcomm_tensor,
        _: *const epcomm_tensor,
        _: *const epcomm_tensor,
        _: *const epcomm_tensor,
        _: usize,
    ) -> Result<epcomm_dispatch_output> {
        Err(Error::Unavailable(NO_NCCL_FEATURE.into()))
    }

    pub unsafe fn combine(
        _: &mut Handle,
        _: *mut c_void,
        _: *const epcomm_tensor,
        _: *const epcomm_tensor,
    ) -> Result<()> {
        Err(Error::Unavailable(NO_NCCL_FEATURE.into()))
    }

    pub fn check_error(_: &mut Handle, _: *mut c_void) -> Result<()> {
        Err(Error::Unavailable(NO_NCCL_FEATURE.into()))
    }
}

#[cfg(feature = "nccl")]
mod imp {
    use super::*;
    use crate::dtype::{Code, DType};
    use crate::ffi::epcomm_dtype;
    use crate::ffi::tensor::{epcomm_device, HostTensor};
    use crate::gpu::driver::{Device, PrimaryContext, Stream};
    use crate::gpu::kernels::IdDtype;
    use crate::gpu::nccl::{NcclComm, NcclUniqueId};
    use crate::gpu::transport::{DispatchInput, GpuManager, GpuMode};
    use crate::moe::MoeConfig;

    pub struct Handle {
        mgr: GpuManager,
        device: i32,
        shapes: Vec<Vec<i64>>,
        extras: Vec<epcomm_tensor>,
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

    fn bind(device: i32) -> Result<PrimaryContext> {
        let ctx = PrimaryContext::retain(Device::get(device as usize)?)?;
        ctx.set_current()?;
        Ok(ctx)
    }

    pub fn create_from_id(
        name: &str,
        cfg: MoeConfig,
        id: &[u8],
        rank: i32,
        world: i32,
        device: i32,
        mode: i32,
    ) -> Result<Handle> {
        // Validate the configuration before the (blocking, collective) communicator init.
        crate::moe::Manager::new(name, cfg.clone(), rank as usize, world as usize)?;
        cuda_ready()?;
        let _ctx = bind(device)?;
        let id = NcclUniqueId::from_bytes(id)?;
        let comm = NcclComm::init_rank(&id, rank as usize, world as usize)?;
        let mgr = GpuManager::new(name, cfg, Box::new(comm), device as usize, gpu_mode(mode))?;
        Ok(Handle {
            mgr,
            device,
            shapes: Vec::new(),
            extras: Vec::new(),
        })
    }

    pub unsafe fn create_from_comm(
        name: &str,
        cfg: MoeConfig,
        comm: *mut c_void,
        device: i32,
        mode: i32,
    ) -> Result<Handle> {
        cuda_ready()?;
        let _ctx = bind(device)?;
        // SAFETY: caller contract: a live communicator of the loaded NCCL.
        let comm = unsafe { NcclComm::adopt(comm) }?;
        let mgr = GpuManager::new(name, cfg, Box::new(comm), device as usize, gpu_mode(mode))?;
        Ok(Handle {
            mgr,
            device,
            shapes: Vec::new(),
            extras: Vec::new(),
        })
    }

    fn view(
        shapes: &mut Vec<Vec<i64>>,
        ptr: u64,
        dtype: DType,
        dims: &[usize],
        device: i32,
    ) -> epcomm_tensor {
        shapes.push(dims.iter().map(|&d| d as i64).collect());
        let shape = shapes.last_mut().expect("just pushed");
        epcomm_tensor {
            data: ptr as *mut c_void,
            device: epcomm_device {
                device_type: crate::ffi::EPCOMM_DEVICE_CUDA,
                device_id: device,
            },
            ndim: shape.len() as i32,
            dtype: epcomm_dtype {
                code: dtype.code,
                bits: dtype.bits,
                lanes: dtype.lanes,
            },
            shape: shape.as_mut_ptr(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        }
    }

    fn check_2d(t: &HostTensor, rows: usize, cols: usize, what: &str) -> Result<()> {
        if t.shape.len() != 2 || t.shape[0] != rows || t.shape[1] != cols {
            return Err(Error::InvalidArgument(format!(
                "tensor '{}' has shape {:?}; expected {what}",
                t.name, t.shape
            )));
        }
        Ok(())
    }

    fn addr(t: &HostTensor) -> u64 {
        if t.bytes == 0 {
            0
        } else {
            t.ptr as u64
        }
    }

    pub unsafe fn dispatch(
        h: &mut Handle,
        stream: *mut c_void,
        hidden: *const epcomm_tensor,
        topk_ids: *const epcomm_tensor,
        topk_weights: *const epcomm_tensor,
        extras: *const epcomm_tensor,
        num_extras: usize,
    ) -> Result<epcomm_dispatch_output> {
        // SAFETY: caller contract: NULL or a live stream of this device.
        let s = unsafe { Stream::borrowed(stream) };
        // SAFETY: the descriptors as this function's contract.
        let checked =
            unsafe { dispatch_input(h, hidden, topk_ids, topk_weights, extras, num_extras) };
        let input = match checked {
            Ok(i) => i,
            // The peers are told before they wait for this rank in the counts all-gather.
            Err(e) => return Err(h.mgr.reject_dispatch(&s, e)),
        };
        let dev = h.device;
        let cfg = h.mgr.config().clone();
        let o = h.mgr.dispatch(&s, &input)?;
        let sh = &o.shape;
        let mut shapes = Vec::new();
        let empty = |shapes: &mut Vec<Vec<i64>>, dt| view(shapes, 0, dt, &[0], dev);
        let hidden_v = view(&mut shapes, o.hidden, cfg.hidden_dtype, &sh.hidden, dev);
        let ids_v = if sh.topk_ids.is_empty() {
            empty(&mut shapes, DType::I64)
        } else {
            view(&mut shapes, o.topk_ids, DType::I64, &sh.topk_ids, dev)
        };
        let w_v = if sh.topk_weights.is_empty() {
            empty(&mut shapes, DType::F32)
        } else {
            view(
                &mut shapes,
                o.topk_weights,
                DType::F32,
                &sh.topk_weights,
                dev,
            )
        };
        let counts_v = view(&mut shapes, o.counts, DType::I32, &[sh.counts], dev);
        let offs_v = view(
            &mut shapes,
            o.expert_offsets,
            DType::I32,
            &[sh.expert_offsets],
            dev,
        );
        let sr_v = view(&mut shapes, o.src_rank, DType::I32, &[sh.src], dev);
        let st_v = view(&mut shapes, o.src_token, DType::I32, &[sh.src], dev);
        let u8t = DType::new(Code::UInt, 8);
        let mut extras_v = Vec::new();
        for (i, &p) in o.extras.iter().enumerate() {
            let mut dims = sh.hidden.clone();
            *dims.last_mut().expect("hidden has a last dimension") = cfg.extra_row_bytes[i];
            extras_v.push(view(&mut shapes, p, u8t, &dims, dev));
        }
        h.shapes = shapes;
        h.extras = extras_v;
        Ok(epcomm_dispatch_output {
            layout: sh.layout as i32,
            received_rows: if sh.received_rows == usize::MAX {
                -1
            } else {
                sh.received_rows as i64
            },
            hidden: hidden_v,
            topk_ids: ids_v,
            topk_weights: w_v,
            counts: counts_v,
            expert_offsets: offs_v,
            src_rank: sr_v,
            src_token: st_v,
            extras: h.extras.as_ptr(),
            num_extras: h.extras.len(),
        })
    }

    /// The checks of a dispatch's tensors, before anything collective.
    unsafe fn dispatch_input(
        h: &Handle,
        hidden: *const epcomm_tensor,
        topk_ids: *const epcomm_tensor,
        topk_weights: *const epcomm_tensor,
        extras: *const epcomm_tensor,
        num_extras: usize,
    ) -> Result<DispatchInput> {
        let dev = h.device;
        let cfg = h.mgr.config().clone();
        let k = cfg.top_k;
        // SAFETY (tensor descriptors): caller contract.
        let x = unsafe { HostTensor::from_ffi_cuda(hidden, "hidden", dev) }?;
        let ids = unsafe { HostTensor::from_ffi_cuda(topk_ids, "topk_ids", dev) }?;
        let w = unsafe { HostTensor::from_ffi_cuda(topk_weights, "topk_weights", dev) }?;
        let t = x.rows();
        if x.dtype != cfg.hidden_dtype || x.row_elems() != cfg.hidden {
            return Err(Error::InvalidArgument(format!(
                "tensor 'hidden' has shape {:?} and dtype {}; expected [T, {}] of {}",
                x.shape,
                x.dtype.torch_name(),
                cfg.hidden,
                cfg.hidden_dtype.torch_name()
            )));
        }
        check_2d(&ids, t, k, &format!("[{t}, {k}] (T x top_k)"))?;
        check_2d(&w, t, k, &format!("[{t}, {k}] (T x top_k)"))?;
        let id_dtype = match (ids.dtype.code(), ids.dtype.bits) {
            (Some(Code::Int), 32) => IdDtype::I32,
            (Some(Code::Int), 64) => IdDtype::I64,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "tensor 'topk_ids' has dtype {}; expected torch.int32 or torch.int64",
                    ids.dtype.torch_name()
                )))
            }
        };
        if w.dtype != DType::F32 {
            return Err(Error::InvalidArgument(format!(
                "tensor 'topk_weights' has dtype {}; expected torch.float32",
                w.dtype.torch_name()
            )));
        }
        check_element_alignment(
            "topk_ids",
            ids.ptr as usize,
            ids.dtype.bits as usize / 8,
            ids.bytes,
        )?;
        check_element_alignment("topk_weights", w.ptr as usize, 4, w.bytes)?;
        if num_extras != cfg.extra_row_bytes.len() {
            return Err(Error::InvalidArgument(format!(
                "{num_extras} extra payloads given, the manager was created for {}",
                cfg.extra_row_bytes.len()
            )));
        }
        let mut xs = Vec::new();
        for i in 0..num_extras {
            // SAFETY: num_extras descriptors (caller contract).
            let e = unsafe { HostTensor::from_ffi_cuda(extras.add(i), "extras[i]", dev) }?;
            if e.rows() != t || e.row_bytes() != cfg.extra_row_bytes[i] {
                return Err(Error::InvalidArgument(format!(
                    "tensor 'extras[{i}]' has shape {:?}; expected {t} rows of {} bytes",
                    e.shape, cfg.extra_row_bytes[i]
                )));
            }
            xs.push(addr(&e));
        }
        Ok(DispatchInput {
            hidden: addr(&x),
            topk_ids: addr(&ids),
            id_dtype,
            topk_weights: addr(&w),
            tokens: t,
            extras: xs,
        })
    }

    pub unsafe fn combine(
        h: &mut Handle,
        stream: *mut c_void,
        expert_output: *const epcomm_tensor,
        output: *const epcomm_tensor,
    ) -> Result<()> {
        let dev = h.device;
        let cfg = h.mgr.config().clone();
        // SAFETY (tensor descriptors): caller contract.
        let y = unsafe { HostTensor::from_ffi_cuda(expert_output, "expert_output", dev) }?;
        let o = unsafe { HostTensor::from_ffi_cuda(output, "output", dev) }?;
        let shape = h.mgr.last_shape().cloned().ok_or_else(|| {
            Error::InvalidState("combine called without a dispatch before it".into())
        })?;
        if y.dtype != cfg.expert_dtype.dtype() {
            return Err(Error::InvalidArgument(format!(
                "tensor 'expert_output' has dtype {}; the manager was created for {}",
                y.dtype.torch_name(),
                cfg.expert_dtype.dtype().torch_name()
            )));
        }
        if y.bytes != shape.buffer_rows * cfg.hidden * cfg.expert_dtype.size() {
            return Err(Error::InvalidArgument(format!(
                "tensor 'expert_output' has shape {:?}; expected the dispatch output's shape {:?}",
                y.shape, shape.hidden
            )));
        }
        let t = h.mgr.last_tokens().unwrap_or(0);
        if o.dtype != cfg.out_dtype.dtype() || o.row_elems() != cfg.hidden || o.rows() != t {
            return Err(Error::InvalidArgument(format!(
                "tensor 'output' has shape {:?} and dtype {}; expected [{t}, {}] (the dispatch's T) of {}",
                o.shape,
                o.dtype.torch_name(),
                cfg.hidden,
                cfg.out_dtype.dtype().torch_name()
            )));
        }
        check_element_alignment("output", o.ptr as usize, cfg.out_dtype.size(), o.bytes)?;
        // SAFETY: caller contract: NULL or a live stream of this device.
        let s = unsafe { Stream::borrowed(stream) };
        h.mgr.combine(&s, addr(&y), addr(&o))
    }

    pub fn check_error(h: &mut Handle, stream: *mut c_void) -> Result<()> {
        // SAFETY: caller contract: NULL or a live stream of this device.
        let s = unsafe { Stream::borrowed(stream) };
        h.mgr.check_device_error(&s)
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
