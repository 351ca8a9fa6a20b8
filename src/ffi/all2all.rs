//! All2all managers: MoE dispatch and combine by vLLM backend name.

use std::ffi::c_char;
use std::sync::Mutex;

use super::group::epcomm_group;
use super::handle::{exclusive_handle, Dep, Exclusive, Handle};
// The output struct is moe_args' (one description for the host and GPU entry points); the
// C ABI's Rust users find it here.
pub use super::moe_args::epcomm_dispatch_output;
use super::moe_args::{
    combine_args, ids_arg, DispatchArgs, DispatchParts, DispatchTensors, OutputAddrs, OutputViews,
};
use super::tensor::{epcomm_tensor, Memory};
use super::{epcomm_dtype, guard};
use crate::bytes;
use crate::dtype::{Code, DType};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::moe::{self, fp8, Manager, MoeConfig};
use crate::num::FloatKind;
use crate::select::all2all;

/// What an all2all manager is built for; initialise with epcomm_moe_config_init.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_moe_config {
    /// sizeof(epcomm_moe_config); lets the struct grow. A config of the first layout (ending at
    /// apply_router_weight_on_input, from a header without dispatch_fp8) is still accepted.
    pub struct_size: u32,
    /// Logical experts of the layer.
    pub num_experts: i64,
    /// Redundant (replicated) experts added by EPLB; topk_ids are physical ids in
    /// [0, num_experts + num_redundant_experts), rank r owning a contiguous block of E/R.
    pub num_redundant_experts: i64,
    pub top_k: i64,
    /// Elements per hidden row.
    pub hidden_size: i64,
    /// Element type of the hidden rows (any; rows move as bytes). Default bfloat16.
    pub hidden_dtype: epcomm_dtype,
    /// Element type of the expert outputs passed to combine (float32/bfloat16/float16).
    pub expert_dtype: epcomm_dtype,
    /// Element type combine writes (float32/bfloat16/float16).
    pub out_dtype: epcomm_dtype,
    /// Tokens per rank the fixed-capacity layouts hold (M); required for deepep_low_latency,
    /// nixl_ep and the flashinfer backends; 0 = none.
    pub max_tokens_per_rank: i64,
    /// Bytes per token of each extra payload (e.g. fp8 scales) that travels with the rows.
    pub extra_row_bytes: *const i64,
    /// Entries in extra_row_bytes.
    pub num_extras: usize,
    /// Multiply each hidden row by its router weight before dispatch (top_k must be 1).
    pub apply_router_weight_on_input: bool,
    /// EPCOMM_DISPATCH_FP8_*: quantise the hidden rows to float8_e4m3fn on the sending side,
    /// one float32 scale per 128 elements (DeepEP low-latency's `use_fp8` format); the
    /// dispatch output's hidden is then float8_e4m3fn and epcomm_all2all_dispatch_scales gives
    /// the scales. Needs float hidden rows and hidden_size % 128 == 0. Default OFF.
    pub dispatch_fp8: i64,
    /// vLLM's `enable_fault_tolerance` (deepep_low_latency and nixl_ep only, else vLLM's
    /// ValueError at creation): a peer that dies or stalls fails the call in progress on every
    /// survivor (PEER_FAILURE/TIMEOUT naming it), then the next call forms the survivors' group
    /// and dispatch/combine run over it with that rank masked (epcomm_all2all_query_active_mask;
    /// the group needs a transport that can shrink). Default false.
    pub enable_fault_tolerance: bool,
}

/// Dispatch the hidden rows as they are (epcomm_moe_config.dispatch_fp8).
pub const EPCOMM_DISPATCH_FP8_OFF: i64 = 0;
/// float8_e4m3fn rows, scale = amax / 448 per 128 elements (DeepEP `round_scale=False`).
pub const EPCOMM_DISPATCH_FP8_E4M3: i64 = 1;
/// float8_e4m3fn rows, scales rounded up to powers of two (DeepEP `round_scale=True`, vLLM's
/// UE8M0 dispatch), still delivered as float32.
pub const EPCOMM_DISPATCH_FP8_E4M3_UE8M0: i64 = 2;

/// The configuration's FP8 dispatch setting (OFF for a config of the first layout, whose
/// struct_size ends before `dispatch_fp8`).
///
/// # Safety
/// As config_arg.
pub(crate) unsafe fn fp8_arg(config: *const epcomm_moe_config) -> Result<Option<fp8::Scales>> {
    // SAFETY: caller contract.
    let c = unsafe { read_config(config) }?;
    fp8_mode(c.dispatch_fp8).map_err(|_| {
        Error::InvalidArgument(format!(
            "config->dispatch_fp8 is {}; expected EPCOMM_DISPATCH_FP8_OFF (0), EPCOMM_DISPATCH_FP8_E4M3 (1) or EPCOMM_DISPATCH_FP8_E4M3_UE8M0 (2)",
            c.dispatch_fp8
        ))
    })
}

/// sizeof(epcomm_moe_config) before `dispatch_fp8` was added: callers built against that
/// header keep working (their configs read as FP8 off).
const CONFIG_SIZE_V1: usize = std::mem::offset_of!(epcomm_moe_config, dispatch_fp8);

/// The configuration's fault-tolerance setting (false for a config of an earlier layout).
///
/// # Safety
/// As config_arg.
pub(crate) unsafe fn ft_arg(config: *const epcomm_moe_config) -> Result<bool> {
    // SAFETY: caller contract.
    Ok(unsafe { read_config(config) }?.enable_fault_tolerance)
}

/// A copy of the caller's config, reading only its `struct_size` bytes; fields it lacks keep
/// their epcomm_moe_config_init defaults.
///
/// # Safety
/// `config` is NULL or points to at least `struct_size` readable bytes, `struct_size` first.
unsafe fn read_config(config: *const epcomm_moe_config) -> Result<epcomm_moe_config> {
    if config.is_null() {
        return Err(Error::NullPointer("config"));
    }
    // SAFETY: the caller's struct starts with struct_size (caller contract).
    let size = unsafe { std::ptr::addr_of!((*config).struct_size).read_unaligned() } as usize;
    let full = std::mem::size_of::<epcomm_moe_config>();
    if size < CONFIG_SIZE_V1 {
        return Err(Error::InvalidArgument(format!(
            "config->struct_size is {size}: expected sizeof(epcomm_moe_config) = {full} (call epcomm_moe_config_init)"
        )));
    }
    let mut c = std::mem::MaybeUninit::<epcomm_moe_config>::zeroed();
    // SAFETY: c is writable; the init only writes it.
    unsafe { epcomm_moe_config_init(c.as_mut_ptr()) };
    // SAFETY: the caller's struct holds `size` bytes (its struct_size); at most `full` are copied
    // into c, which holds `full`; the two do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(
            config.cast::<u8>(),
            c.as_mut_ptr().cast::<u8>(),
            size.min(full),
        );
        Ok(c.assume_init())
    }
}

/// An EPCOMM_DISPATCH_FP8_* value.
fn fp8_mode(mode: i64) -> Result<Option<fp8::Scales>> {
    match mode {
        EPCOMM_DISPATCH_FP8_OFF => Ok(None),
        EPCOMM_DISPATCH_FP8_E4M3 => Ok(Some(fp8::Scales::Exact)),
        EPCOMM_DISPATCH_FP8_E4M3_UE8M0 => Ok(Some(fp8::Scales::Ue8m0)),
        v => Err(Error::InvalidArgument(format!(
            "dispatch_fp8 is {v}; expected EPCOMM_DISPATCH_FP8_OFF (0), EPCOMM_DISPATCH_FP8_E4M3 (1) or EPCOMM_DISPATCH_FP8_E4M3_UE8M0 (2)"
        ))),
    }
}

const BF16: epcomm_dtype = epcomm_dtype {
    code: Code::Bfloat as u8,
    bits: 16,
    lanes: 1,
};

/// Fills `config` with defaults: bfloat16 everywhere, everything else 0/false.
///
/// # Safety
/// `config` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_moe_config_init(config: *mut epcomm_moe_config) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(config, "config") }?;
        *out = epcomm_moe_config {
            struct_size: std::mem::size_of::<epcomm_moe_config>() as u32,
            num_experts: 0,
            num_redundant_experts: 0,
            top_k: 0,
            hidden_size: 0,
            hidden_dtype: BF16,
            expert_dtype: BF16,
            out_dtype: BF16,
            max_tokens_per_rank: 0,
            extra_row_bytes: std::ptr::null(),
            num_extras: 0,
            apply_router_weight_on_input: false,
            dispatch_fp8: EPCOMM_DISPATCH_FP8_OFF,
            enable_fault_tolerance: false,
        };
        Ok(())
    })
}

fn float_kind(d: epcomm_dtype, field: &str) -> Result<FloatKind> {
    FloatKind::from_dtype(d.into()).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "config->{field} is {}; expected torch.float32, torch.bfloat16 or torch.float16",
            DType::from(d).torch_name()
        ))
    })
}

fn nonneg(v: i64, field: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| {
        Error::InvalidArgument(format!("config->{field} is {v}; expected a value >= 0"))
    })
}

pub(crate) unsafe fn config_arg(config: *const epcomm_moe_config) -> Result<MoeConfig> {
    // SAFETY: caller contract.
    let c = unsafe { read_config(config) }?;
    // SAFETY: num_extras entries (caller contract).
    let extras =
        unsafe { guard::slice_arg(c.extra_row_bytes, c.num_extras, "config->extra_row_bytes") }?
            .iter()
            .map(|&b| nonneg(b, "extra_row_bytes[i]"))
            .collect::<Result<Vec<usize>>>()?;
    Ok(MoeConfig {
        num_experts: nonneg(c.num_experts, "num_experts")?
            + nonneg(c.num_redundant_experts, "num_redundant_experts")?,
        top_k: nonneg(c.top_k, "top_k")?,
        hidden: nonneg(c.hidden_size, "hidden_size")?,
        hidden_dtype: c.hidden_dtype.into(),
        expert_dtype: float_kind(c.expert_dtype, "expert_dtype")?,
        out_dtype: float_kind(c.out_dtype, "out_dtype")?,
        max_tokens_per_rank: nonneg(c.max_tokens_per_rank, "max_tokens_per_rank")?,
        extra_row_bytes: extras,
        apply_router_weight_on_input: c.apply_router_weight_on_input,
    })
}

/// Per-call statistics; arrays have world_size entries and stay valid until the next call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_all2all_stats {
    pub world_size: i32,
    pub tokens_sent: *const u64,
    pub tokens_received: *const u64,
    pub bytes_sent: *const u64,
    pub bytes_received: *const u64,
    pub combine_bytes_received: *const u64,
    pub dispatch_seconds: f64,
    pub combine_seconds: f64,
}

/// What a call on an all2all handle borrows: the manager and the arrays its last outputs
/// point into.
pub(crate) struct State {
    pub(crate) mgr: Manager,
    views: OutputViews,
    stats: [Vec<u64>; 5],
}

/// An all2all manager: MoE dispatch/combine for one backend name and configuration over a
/// group. Use from one thread at a time. It keeps its group alive: the group's destroy is
/// refused while a call of the manager is in flight, and otherwise frees the group with the
/// manager.
pub struct epcomm_all2all {
    group: Dep<epcomm_group>,
    inner: Mutex<State>,
}

exclusive_handle!(
    epcomm_all2all,
    "a2a",
    State,
    "the all2all handle is in use by another thread; use it from one thread at a time"
);

/// Creates a manager for `backend` (any name vLLM accepts; `naive`/`pplx` fall back to
/// allgather_reducescatter with vLLM's warning) over `group`. Logs
/// `Using {ManagerClass} all2all manager.`. `moonep` returns vLLM's "MoonEP not available"
/// RuntimeError (not implemented yet). apply_router_weight_on_input with top_k != 1 is vLLM's
/// AssertionError. Not collective; every rank must use the same backend and config (checked at
/// the first dispatch).
///
/// # Safety
/// `group` is NULL or a group handle (the manager keeps it alive); `backend` is NULL or a
/// NUL-terminated string; `config` is NULL or valid; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_create(
    group: *const epcomm_group,
    backend: *const c_char,
    config: *const epcomm_moe_config,
    out: *mut *mut epcomm_all2all,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let name = unsafe { guard::str_arg(backend, "backend") }?;
        let out = unsafe { guard::out_arg(out, "out") }?;
        let cfg = unsafe { config_arg(config) }?;
        let fp8 = unsafe { fp8_arg(config) }?;
        let ft = unsafe { ft_arg(config) }?;
        let group = unsafe { Dep::new(group) }?;
        let (rank, world) = group.with(|_, g| Ok((g.rank(), g.size())))?;
        let mut mgr = Manager::new(name, cfg, rank, world)?;
        mgr.set_dispatch_fp8(fp8)?;
        mgr.set_fault_tolerance(ft)?;
        let state = State {
            mgr,
            views: OutputViews::default(),
            stats: Default::default(),
        };
        *out = epcomm_all2all {
            group,
            inner: Mutex::new(state),
        }
        .into_raw();
        Ok(())
    })
}

// Written out per handle, as every destroy pair: each is a C symbol of its own, which cbindgen
// reads as written (a macro would hide it from the header).
/// Releases a manager (NULL is a no-op), as epcomm_all2all_destroy_checked, whose status this
/// void form cannot return: a refused destroy frees nothing and records the error for
/// epcomm_last_error_message.
///
/// # Safety
/// `a2a` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_destroy(a2a: *mut epcomm_all2all) {
    if !a2a.is_null() {
        // SAFETY: caller contract.
        unsafe { epcomm_all2all_destroy_checked(a2a) };
    }
}

/// Releases a manager: EPCOMM_OK; views it returned become invalid, and a group destroyed before it
/// is freed now. NULL is EPCOMM_ERROR_NULL_POINTER. Refused with EPCOMM_ERROR_INVALID_STATE,
/// freeing nothing: while another thread's call on it is in flight (destroy again after it
/// returned); on a handle destroyed already; in a forked child of the process that made it.
///
/// # Safety
/// `a2a` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_destroy_checked(a2a: *mut epcomm_all2all) -> i32 {
    // SAFETY: only a registered handle is freed.
    guard::call(|| unsafe { epcomm_all2all::destroy(a2a) })
}

/// Runs `f` with the manager's state and its group.
///
/// # Safety
/// `a2a` is NULL or any pointer (only a live handle is used).
pub(crate) unsafe fn with_manager<T>(
    a2a: *const epcomm_all2all,
    f: impl FnOnce(&mut State, &mut dyn Group) -> Result<T>,
) -> Result<T> {
    // SAFETY: caller contract; the manager keeps its group alive.
    unsafe { epcomm_all2all::with(a2a, |h, st| h.group.with(|_, g| f(st, g.as_mut()))) }
}

/// Dispatches this rank's tokens (collective): `hidden` [T, hidden_size] of hidden_dtype,
/// `topk_ids` [T, top_k] int32/int64 (-1 = masked), `topk_weights` [T, top_k] float32,
/// `extras` (may be NULL when num_extras is 0) [T, extra_row_bytes[i]] bytes each. T may differ
/// between ranks and may be 0. Rows are ordered by source rank, then source token (REPLICATED,
/// TOKEN_MAJOR, RANK_MAJOR), or by local expert, then source rank, then source token
/// (EXPERT_MAJOR, EXPERT_PACKED). On bad input every rank returns an error (the others are told
/// which rank rejected its input); nobody hangs.
///
/// # Safety
/// Pointers are NULL or valid; tensors describe host memory valid for the call.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_dispatch(
    a2a: *mut epcomm_all2all,
    hidden: *const epcomm_tensor,
    topk_ids: *const epcomm_tensor,
    topk_weights: *const epcomm_tensor,
    extras: *const epcomm_tensor,
    num_extras: usize,
    out: *mut epcomm_dispatch_output,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract for every pointer below.
        unsafe {
            with_manager(a2a, |st, g| {
                let tensors =
                    DispatchTensors::new(hidden, topk_ids, topk_weights, extras, num_extras);
                let checked = host_dispatch(&st.mgr, tensors, out);
                let (out, d) = checked.map_err(|e| st.mgr.reject_dispatch(g, e))?;
                let ex: Vec<&[u8]> = d.args.extras.iter().map(|e| e.as_slice()).collect();
                st.mgr
                    .dispatch(g, d.args.hidden.as_slice(), &d.ids, &d.weights, &ex)?;
                *out = describe(&st.mgr, &mut st.views);
                Ok(())
            })
        }
    })
}

/// A host dispatch's checked tensors and its routing, read.
struct HostDispatch {
    args: DispatchArgs,
    ids: Vec<i64>,
    weights: Vec<f32>,
}

/// Every check of a host dispatch (before anything collective), then the routing read.
///
/// # Safety
/// As epcomm_all2all_dispatch.
unsafe fn host_dispatch<'a>(
    mgr: &Manager,
    tensors: DispatchTensors,
    out: *mut epcomm_dispatch_output,
) -> Result<(&'a mut epcomm_dispatch_output, HostDispatch)> {
    // SAFETY: caller contract for every pointer.
    let (out, args) = unsafe {
        (
            guard::out_arg(out, "out")?,
            DispatchArgs::parse(mgr.config(), Memory::Host, tensors)?,
        )
    };
    // The token count before topk_ids and topk_weights are read: rows beyond what the buffers
    // hold are never touched.
    mgr.check_tokens(args.tokens())?;
    // SAFETY: host tensors valid for reads during the call (caller contract).
    let (ids, weights) = unsafe {
        (
            ids_arg(&args.topk_ids)?,
            bytes::to_vec::<f32>(args.topk_weights.as_slice()),
        )
    };
    Ok((out, HostDispatch { args, ids, weights }))
}

/// The last dispatch's buffers as C views, shaped by the layout's contract.
fn describe(mgr: &Manager, views: &mut OutputViews) -> epcomm_dispatch_output {
    let v = mgr.view();
    let at = |p: *const u8| p as usize;
    let parts = DispatchParts {
        layout: v.layout,
        received_rows: v.received_rows as i64,
        shapes: mgr.output_shapes(),
        hidden_dtype: mgr.dispatch_hidden_dtype(),
        offsets_dtype: DType::I64,
        at: OutputAddrs {
            hidden: at(v.hidden.as_ptr()),
            topk_ids: at(v.topk_ids.as_ptr().cast()),
            topk_weights: at(v.topk_weights.as_ptr().cast()),
            counts: at(v.counts.as_ptr().cast()),
            expert_offsets: at(v.expert_offsets.as_ptr().cast()),
            src_rank: at(v.src_rank.as_ptr().cast()),
            src_token: at(v.src_token.as_ptr().cast()),
            extras: v.extras.iter().map(|b| at(b.as_ptr())).collect(),
        },
    };
    views.describe(&parts, &mgr.config().extra_row_bytes, Memory::Host)
}

/// Changes the FP8 dispatch setting (EPCOMM_DISPATCH_FP8_*) for the next dispatches, as
/// config->dispatch_fp8 sets it at creation; the last dispatch's outputs become invalid. Every
/// rank must change it alike before its next dispatch (checked there). Not collective.
///
/// # Safety
/// `a2a` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_set_dispatch_fp8(
    a2a: *const epcomm_all2all,
    mode: i64,
) -> i32 {
    guard::call(|| {
        let scales = fp8_mode(mode)?;
        // SAFETY: caller contract.
        unsafe { with_manager(a2a, |st, _| st.mgr.set_dispatch_fp8(scales)) }
    })
}

/// The last dispatch's FP8 scales (config->dispatch_fp8 not OFF): float32 with the dispatch
/// output's hidden shape but hidden_size/128 in the last dimension, scale i of a row covering
/// its elements [128i, 128i+128) (value = float8 element x scale). An empty [0] view without
/// FP8 dispatch or before a dispatch. Valid until the handle's next call.
///
/// # Safety
/// `a2a` is NULL or a live handle; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_dispatch_scales(
    a2a: *const epcomm_all2all,
    out: *mut epcomm_tensor,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(out, "out") }?;
        // SAFETY: caller contract.
        *out = unsafe {
            with_manager(a2a, |st, _| {
                let m = &st.mgr;
                let s = m.dispatch_scales();
                let mut dims = m.output_shapes().hidden;
                match dims.last_mut() {
                    Some(last) if !s.is_empty() => *last = fp8::scale_row_bytes(*last) / 4,
                    _ => dims = vec![0],
                }
                Ok(st.views.host_view(s.as_ptr() as usize, DType::F32, &dims))
            })
        }?;
        Ok(())
    })
}

/// Brings the expert outputs home and reduces them (collective). `expert_output` has the shape
/// of the dispatch output's `hidden` and the config's expert_dtype: TOKEN_MAJOR and RANK_MAJOR
/// rows are already weighted and summed over this rank's experts, REPLICATED rows are this
/// rank's partial sums, EXPERT_MAJOR/EXPERT_PACKED rows are raw expert outputs (weighted on the
/// source). `output` is [T, hidden_size] of out_dtype; sums are accumulated in float32.
///
/// # Safety
/// Pointers are NULL or valid; tensors describe host memory valid for the call.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_combine(
    a2a: *mut epcomm_all2all,
    expert_output: *const epcomm_tensor,
    output: *const epcomm_tensor,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract for every pointer below.
        unsafe {
            with_manager(a2a, |st, g| {
                let mgr = &mut st.mgr;
                let dispatched = mgr.combine_rows().map(|rows| (rows, mgr.tokens()));
                let (y, o) = combine_args(
                    mgr.config(),
                    Memory::Host,
                    expert_output,
                    output,
                    dispatched,
                )
                .map_err(|e| mgr.reject_combine(g, e))?;
                mgr.combine(g, y.as_slice(), o.as_mut_slice())
            })
        }
    })
}

/// The per-expert token counts of the manager's last dispatch.
///
/// # Safety
/// `a2a` is NULL or a live handle.
pub(crate) unsafe fn expert_counts(a2a: *const epcomm_all2all) -> Result<Vec<u32>> {
    // SAFETY: caller contract.
    unsafe {
        epcomm_all2all::with(a2a, |_, st| {
            if st.mgr.expert_counts().is_empty() {
                return Err(Error::InvalidState(
                    "the manager has not dispatched yet: record its load after a dispatch".into(),
                ));
            }
            Ok(st.mgr.expert_counts().to_vec())
        })
    }
}

/// Declares a MoE layer's top_k and num_experts (physical). The flashinfer_nvlink_one_sided
/// manager returns vLLM's AssertionError when they differ from what it was built with ("does
/// not support heterogeneous top_k across MoE layers"); the others an invalid-argument error.
///
/// # Safety
/// `a2a` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_check_layer(
    a2a: *const epcomm_all2all,
    top_k: i64,
    num_experts: i64,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        unsafe { epcomm_all2all::with(a2a, |_, st| st.mgr.check_layer(top_k, num_experts)) }
    })
}

/// Bytes a backend's dispatch buffers (rows, extras, metadata) and combine accumulator need for
/// `tokens_per_rank` tokens on each of `world_size` ranks, in the worst case, before anything
/// is allocated.
///
/// # Safety
/// `backend` is NULL or a NUL-terminated string; `config` is NULL or valid; `bytes_out` is NULL
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_buffer_bytes(
    backend: *const c_char,
    config: *const epcomm_moe_config,
    world_size: i32,
    tokens_per_rank: i64,
    bytes_out: *mut u64,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let name = unsafe { guard::str_arg(backend, "backend") }?;
        let out = unsafe { guard::out_arg(bytes_out, "bytes_out") }?;
        let cfg = unsafe { config_arg(config) }?;
        let b = all2all::resolve_quiet(name)?.backend;
        let world = usize::try_from(world_size)
            .ok()
            .filter(|&w| w > 0)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("world_size is {world_size}; expected >= 1"))
            })?;
        let tokens = usize::try_from(tokens_per_rank).map_err(|_| {
            Error::InvalidArgument(format!(
                "tokens_per_rank is {tokens_per_rank}; expected >= 0"
            ))
        })?;
        *out = moe::buffer_bytes(b.layout(), &cfg, world, tokens).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "the {} buffers for {tokens} tokens per rank on {world} ranks do not fit in 64 bits",
                b.name()
            ))
        })? as u64;
        Ok(())
    })
}

/// Statistics of the last dispatch and combine (tokens and bytes per peer, seconds).
///
/// # Safety
/// `a2a` is NULL or a live handle; `stats_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_all2all_get_stats(
    a2a: *const epcomm_all2all,
    stats_out: *mut epcomm_all2all_stats,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(stats_out, "stats_out") }?;
        *out = unsafe { epcomm_all2all::with(a2a, |_, st| Ok(stats_view(st))) }?;
        Ok(())
    })
}

/// The stats of the last calls, padded to the world size, as views of arrays kept in `st`.
fn stats_view(st: &mut State) -> epcomm_all2all_stats {
    let s = st.mgr.stats().clone();
    let world = s.tokens_sent.len().max(1);
    let pad = |v: &Vec<u64>| {
        let mut v = v.clone();
        v.resize(world, 0);
        v
    };
    st.stats = [
        pad(&s.tokens_sent),
        pad(&s.tokens_received),
        pad(&s.bytes_sent),
        pad(&s.bytes_received),
        pad(&s.combine_bytes_received),
    ];
    epcomm_all2all_stats {
        world_size: s.tokens_sent.len() as i32,
        tokens_sent: st.stats[0].as_ptr(),
        tokens_received: st.stats[1].as_ptr(),
        bytes_sent: st.stats[2].as_ptr(),
        bytes_received: st.stats[3].as_ptr(),
        combine_bytes_received: st.stats[4].as_ptr(),
        dispatch_seconds: s.dispatch_time.as_secs_f64(),
        combine_seconds: s.combine_time.as_secs_f64(),
    }
}
