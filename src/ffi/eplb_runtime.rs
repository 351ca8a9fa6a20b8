//! EPLB at run time: communicators (add_send / add_recv / execute), rearranging expert weights,
//! inspecting a layer's transfer plan, and the load statistics.

use std::ffi::c_char;
use std::sync::Mutex;

use super::all2all::epcomm_all2all;
use super::eplb_args::{dims, index};
use super::group::{epcomm_group, with_dep_group, with_group};
use super::guard;
use super::handle::{exclusive_handle, Dep, Exclusive, Handle};
use super::moe_args::ids_arg;
use super::select::{epcomm_eplb_select_request, SelectArgs};
use super::tensor::{check_writes_disjoint, epcomm_tensor, HostTensor, Memory};
use crate::eplb::communicator::{self, EplbCommunicator};
use crate::eplb::load::LoadState;
use crate::eplb::rearrange;
use crate::eplb::transfer::{self, LayerPlan};
use crate::error::{Error, Result};
use crate::group::P2p;
use crate::select::config;

struct Queued {
    send: bool,
    peer: usize,
    tensors: Vec<HostTensor>,
}

pub(crate) struct CommState {
    comm: Box<dyn EplbCommunicator>,
    queued: Vec<Queued>,
}

/// An EPLB communicator bound to a group, which it keeps alive (as an all2all manager does).
/// Use from one thread at a time.
pub struct epcomm_eplb_communicator {
    group: Dep<epcomm_group>,
    inner: Mutex<CommState>,
}

exclusive_handle!(
    epcomm_eplb_communicator,
    "comm",
    CommState,
    "the EPLB communicator is in use by another thread"
);

/// Builds the EPLB communicator vLLM's factory would choose for `request` (name or automatic,
/// elastic group, device of the expert weights, dtypes, NCCL/NIXL availability) over `group`,
/// with vLLM's rules and messages, and logs `Initialized EPLB communicator: {Class}.`. On this
/// build `torch_gloo` (and `torch_nccl` on host tensors) work over the group; the NCCL/NIXL
/// communicators report that epcomm's GPU transports are not implemented yet.
///
/// # Safety
/// `group` is NULL or a group handle (the communicator keeps it alive); `request` is NULL or valid;
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_communicator_create(
    group: *const epcomm_group,
    request: *const epcomm_eplb_select_request,
    out: *mut *mut epcomm_eplb_communicator,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(out, "out") }?;
        let args = unsafe { SelectArgs::from_ffi(request) }?;
        let group = unsafe { Dep::new(group) }?;
        group.with(|_, _| Ok(()))?;
        let comm = communicator::create(
            args.requested.as_deref(),
            args.elastic,
            args.device,
            &args.dtypes,
            args.nccl_available,
            args.nixl_available,
        )?;
        *out = epcomm_eplb_communicator {
            group,
            inner: Mutex::new(CommState {
                comm,
                queued: Vec::new(),
            }),
        }
        .into_raw();
        Ok(())
    })
}

// Written out per handle, as every destroy pair: each is a C symbol of its own, which cbindgen
// reads as written (a macro would hide it from the header).
/// Releases a communicator (NULL is a no-op), as epcomm_eplb_communicator_destroy_checked,
/// whose status this void form cannot return: a refused destroy frees nothing and records the
/// error for epcomm_last_error_message.
///
/// # Safety
/// `comm` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_communicator_destroy(comm: *mut epcomm_eplb_communicator) {
    if !comm.is_null() {
        // SAFETY: caller contract.
        unsafe { epcomm_eplb_communicator_destroy_checked(comm) };
    }
}

/// Releases a communicator: EPCOMM_OK; queued transfers are dropped, and a group destroyed before
/// it is freed now. NULL is EPCOMM_ERROR_NULL_POINTER. Refused with EPCOMM_ERROR_INVALID_STATE,
/// freeing nothing: while another thread's call on it is in flight; on a handle destroyed already;
/// in a forked child of the process that made it.
///
/// # Safety
/// `comm` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_communicator_destroy_checked(
    comm: *mut epcomm_eplb_communicator,
) -> i32 {
    // SAFETY: only a registered handle is freed.
    guard::call(|| unsafe { epcomm_eplb_communicator::destroy(comm) })
}

/// Runs `f` with the communicator's state and its group's handle (locked by `f` when it needs
/// it, so a queue is taken even when the group is busy).
///
/// # Safety
/// `comm` is NULL or a live handle.
unsafe fn with_comm<T>(
    comm: *const epcomm_eplb_communicator,
    f: impl FnOnce(&mut CommState, &Dep<epcomm_group>) -> Result<T>,
) -> Result<T> {
    // SAFETY: caller contract.
    unsafe { epcomm_eplb_communicator::with(comm, |h, c| f(c, &h.group)) }
}

unsafe fn queue(
    comm: *const epcomm_eplb_communicator,
    tensors: *const epcomm_tensor,
    num_tensors: usize,
    peer: i32,
    send: bool,
) -> Result<()> {
    let peer = index(peer.into(), "peer rank")?;
    // SAFETY: num_tensors descriptors (caller contract).
    let ts = unsafe {
        Memory::Host.tensors(tensors, num_tensors, "tensors", "tensors[i]", |_, _| Ok(()))
    }?;
    // SAFETY: caller contract.
    unsafe {
        epcomm_eplb_communicator::with(comm, |_, c| {
            c.queued.push(Queued {
                send,
                peer,
                tensors: ts,
            });
            Ok(())
        })
    }
}

/// Queues sending the rows of one expert (one tensor per weight tensor) to rank `dst`. The
/// memory must stay valid and unchanged until epcomm_eplb_communicator_execute returns.
/// `expert` labels the transfer (vLLM's interface); pairing is by order per peer pair.
///
/// # Safety
/// `tensors` holds `num_tensors` valid tensors (or is NULL when 0).
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_communicator_add_send(
    comm: *mut epcomm_eplb_communicator,
    tensors: *const epcomm_tensor,
    num_tensors: usize,
    dst: i32,
    expert: i64,
) -> i32 {
    let _ = expert;
    // SAFETY: caller contract.
    guard::call(|| unsafe { queue(comm, tensors, num_tensors, dst, true) })
}

// As add_send, spelled out for the header (see the module doc of `ffi`): one `queue`.
/// Queues receiving one expert's rows from rank `src` into `tensors` (valid until execute).
///
/// # Safety
/// `tensors` holds `num_tensors` valid tensors (or is NULL when 0).
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_communicator_add_recv(
    comm: *mut epcomm_eplb_communicator,
    tensors: *const epcomm_tensor,
    num_tensors: usize,
    src: i32,
    expert: i64,
) -> i32 {
    let _ = expert;
    // SAFETY: caller contract.
    guard::call(|| unsafe { queue(comm, tensors, num_tensors, src, false) })
}

/// Executes every queued send and receive (collective: every rank of the group calls it) and
/// clears the queue, also on failure. The j-th send from a to b fills the j-th receive on b
/// from a; sizes must agree.
///
/// # Safety
/// `comm` is NULL or a live handle; queued tensors are still valid.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_communicator_execute(
    comm: *mut epcomm_eplb_communicator,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        unsafe {
            with_comm(comm, |c, group| {
                let queued = std::mem::take(&mut c.queued);
                let each = || {
                    queued
                        .iter()
                        .flat_map(|q| q.tensors.iter().map(move |t| (q, t)))
                };
                let writes: Vec<_> = each().map(|(q, t)| (!q.send, t)).collect();
                check_writes_disjoint(&writes)?;
                // Queued tensors are valid until now; receives overlap no other (above).
                let mut ops: Vec<P2p<'_>> = each().map(|(q, t)| t.p2p(q.send, q.peer)).collect();
                with_dep_group(group, |g| c.comm.execute(g, &mut ops))
            })
        }
    })
}

/// What a rearrangement did.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct epcomm_eplb_summary {
    pub layers_changed: i64,
    pub rows_sent: i64,
    pub rows_received: i64,
    pub rows_copied_locally: i64,
}

unsafe fn maps(
    p: *const i64,
    layers: usize,
    slots: usize,
    what: &'static str,
) -> Result<Vec<Vec<i64>>> {
    let n = guard::entries::<i64>(layers, slots, what)?;
    // SAFETY: layers * slots (at least 1) entries (caller contract).
    let v = unsafe { guard::slice_arg(p, n, what) }?;
    if let Some((i, &bad)) = v.iter().enumerate().find(|(_, &x)| x < -1) {
        return Err(Error::InvalidArgument(format!(
            "{what}[{i}] is {bad}; expected a logical expert id or -1"
        )));
    }
    Ok(v.chunks(slots).map(<[i64]>::to_vec).collect())
}

/// Moves every layer's expert weights from the `old` to the `new` placement (physical →
/// logical maps, [num_layers, old_slots] and [num_layers, new_slots]; -1 = empty slot) through
/// `comm` (collective). `weights` holds num_layers * num_tensors host tensors, layer-major,
/// each with this rank's local experts along dimension 0. Receives are staged: a layer's
/// weights change only after all of its transfers succeeded, so a failure (a peer dies, a
/// timeout) leaves that layer and later ones exactly as they were; the error says which layers
/// were done. `rank_mapping` (old rank → new rank or -1; NULL = none) changes the EP size: with
/// one entry per rank of the group it is a scale-down (the old group moves), with fewer a
/// scale-up (the new group moves), with more a scale-down after a failure (the survivors'
/// group moves; see epcomm_eplb_rearrange_with_lost). A mapping with no surviving rank, two
/// old ranks on one new rank, an entry below -1 or beyond the new EP size, or (scale-down) a
/// new rank no surviving rank takes fails every rank with EPCOMM_ERROR_INVALID_ARGUMENT naming
/// the entry, before any layer moves. `summary_out` may be NULL. Each layer's transfers run in one
/// communicator execute; epcomm_eplb_rearrange_with can batch them instead.
///
/// # Safety
/// Pointers are NULL or valid for the sizes above; tensors describe host memory.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_rearrange(
    comm: *mut epcomm_eplb_communicator,
    old_phy2log: *const i64,
    new_phy2log: *const i64,
    num_layers: i64,
    old_slots: i64,
    new_slots: i64,
    weights: *const epcomm_tensor,
    num_tensors: usize,
    rank_mapping: *const i64,
    rank_mapping_len: usize,
    summary_out: *mut epcomm_eplb_summary,
) -> i32 {
    let call = RearrangeCall {
        old_phy2log,
        new_phy2log,
        num_layers,
        old_slots,
        new_slots,
        weights,
        num_tensors,
    };
    guard::call(|| {
        // SAFETY: NULL or rank_mapping_len entries (caller contract).
        let options = unsafe { mapping_arg(rank_mapping, rank_mapping_len) }.map(OptionsArg::plain);
        // SAFETY: caller contract.
        unsafe { call.run(comm, options, summary_out) }
    })
}

/// Options of epcomm_eplb_rearrange_with; initialise with epcomm_eplb_rearrange_options_init.
/// Every rank must pass the same: a disagreement fails every rank before any layer moves.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_eplb_rearrange_options {
    /// sizeof(epcomm_eplb_rearrange_options); lets the struct grow.
    pub struct_size: u32,
    /// Old rank → new rank or -1 (NULL = none), `rank_mapping_len` entries: a change of EP size,
    /// as in epcomm_eplb_rearrange.
    pub rank_mapping: *const i64,
    /// Entries of `rank_mapping`.
    pub rank_mapping_len: usize,
    /// vLLM v0.33.0's `EPLBConfig.migration_batching_enabled` (`use_async and
    /// enable_migration_batching`; epcomm_eplb_state_migration_batching reads it from a state's
    /// config): run each layer's transfers in the batches of vLLM's migration scheduler
    /// (epcomm_eplb_schedule_migration_batches), one communicator execute per batch, so each
    /// rank talks to at most one peer at a time. The same rows move from the same sources as
    /// without it; a layer that moves nothing runs no execute.
    pub migration_batching: bool,
}

/// What epcomm_eplb_rearrange_with_lost / epcomm_eplb_rearrange_into_with_lost do with logical
/// experts the new placement needs that no member rank holds (after a failure: every replica
/// was on a removed rank, so their weights are gone). Initialise with
/// epcomm_eplb_lost_experts_options_init. Every rank must pass the same allow_lost_experts.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_eplb_lost_experts_options {
    /// sizeof(epcomm_eplb_lost_experts_options); lets the struct grow.
    pub struct_size: u32,
    /// Rearrange anyway: the slots of lost experts are left unwritten, keeping the bytes they
    /// held on that rank before the call (double-buffered: copied from the same slot's live
    /// rows), never zeros, and the experts are reported through lost_experts_out. False (the
    /// default): such a rearrangement fails on every rank before any data moves
    /// (EPCOMM_ERROR_INVALID_ARGUMENT naming the layer and the experts).
    pub allow_lost_experts: bool,
    /// [lost_experts_capacity, 2]: receives the (layer, logical expert) pairs of the lost
    /// experts, layers ascending, experts ascending within a layer; written before any data
    /// moves when they fit, whatever the outcome. NULL = not wanted (then allow_lost_experts
    /// must not lose any).
    pub lost_experts_out: *mut i64,
    /// Pairs `lost_experts_out` has room for; num_layers * new_slots always suffices (a lost
    /// expert takes at least one slot of the new placement).
    pub lost_experts_capacity: usize,
    /// NULL or receives the number of lost (layer, expert) pairs (0 = none) before any data
    /// moves, also when the call then fails (e.g. lost_experts_capacity too small, or lost
    /// experts refused); left as it was when the maps or the rank mapping are rejected.
    pub num_lost_experts_out: *mut i64,
}

/// Fills `options` with the defaults (no rank mapping, no batching) and struct_size.
///
/// # Safety
/// `options` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_rearrange_options_init(
    options: *mut epcomm_eplb_rearrange_options,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(options, "options") }?;
        *out = epcomm_eplb_rearrange_options {
            struct_size: std::mem::size_of::<epcomm_eplb_rearrange_options>() as u32,
            rank_mapping: std::ptr::null(),
            rank_mapping_len: 0,
            migration_batching: false,
        };
        Ok(())
    })
}

/// Fills `options` with the defaults (lost experts refused, no outputs) and struct_size.
///
/// # Safety
/// `options` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_lost_experts_options_init(
    options: *mut epcomm_eplb_lost_experts_options,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(options, "lost_options") }?;
        *out = epcomm_eplb_lost_experts_options {
            struct_size: std::mem::size_of::<epcomm_eplb_lost_experts_options>() as u32,
            allow_lost_experts: false,
            lost_experts_out: std::ptr::null_mut(),
            lost_experts_capacity: 0,
            num_lost_experts_out: std::ptr::null_mut(),
        };
        Ok(())
    })
}

// The rearrange variants share their map and weight arguments, spelled out for the header
// (see the module doc of `ffi`); RearrangeCall carries them to the one implementation.
/// epcomm_eplb_rearrange with `options` (NULL = the defaults): the rank mapping and migration
/// batching. A bad `options` is reported to the peers as any other rejected argument.
///
/// # Safety
/// As epcomm_eplb_rearrange; `options` is NULL or valid, its rank_mapping NULL or valid for
/// rank_mapping_len entries.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_rearrange_with(
    comm: *mut epcomm_eplb_communicator,
    old_phy2log: *const i64,
    new_phy2log: *const i64,
    num_layers: i64,
    old_slots: i64,
    new_slots: i64,
    weights: *const epcomm_tensor,
    num_tensors: usize,
    options: *const epcomm_eplb_rearrange_options,
    summary_out: *mut epcomm_eplb_summary,
) -> i32 {
    // SAFETY: caller contract.
    unsafe {
        epcomm_eplb_rearrange_with_lost(
            comm,
            old_phy2log,
            new_phy2log,
            num_layers,
            old_slots,
            new_slots,
            weights,
            num_tensors,
            options,
            std::ptr::null(),
            summary_out,
        )
    }
}

/// epcomm_eplb_rearrange_with, choosing with `lost_options` (NULL = the defaults: refused)
/// what happens to logical experts the new placement needs that no member rank holds.
///
/// A rank mapping with more entries than the group has ranks is a scale-down after a
/// failure: the group is the survivors (`rank_mapping[old] >= 0`, at the new ranks it names,
/// e.g. the group epcomm_group_shrink made), the removed ranks are not members and send
/// nothing, and `old_phy2log` ([num_layers, old_slots], old_slots = rank_mapping_len x slots
/// per rank) is read as the survivors hold it; `new_phy2log` has group size x slots per rank
/// slots. Experts are sourced from surviving replicas only; one with none is lost: refused on
/// every rank before any data moves (EPCOMM_ERROR_INVALID_ARGUMENT, `rearrange: layer {l}
/// needs logical experts [..], which have no replica on a surviving rank (rank_mapping removes
/// ranks [..]); ...`) unless lost_options->allow_lost_experts. epcomm_eplb_lost_experts names
/// a layer's lost experts beforehand.
///
/// # Safety
/// As epcomm_eplb_rearrange_with; `lost_options` is NULL or valid, its outputs NULL or
/// writable for the sizes it gives.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn epcomm_eplb_rearrange_with_lost(
    comm: *mut epcomm_eplb_communicator,
    old_phy2log: *const i64,
    new_phy2log: *const i64,
    num_layers: i64,
    old_slots: i64,
    new_slots: i64,
    weights: *const epcomm_tensor,
    num_tensors: usize,
    options: *const epcomm_eplb_rearrange_options,
    lost_options: *const epcomm_eplb_lost_experts_options,
    summary_out: *mut epcomm_eplb_summary,
) -> i32 {
    let call = RearrangeCall {
        old_phy2log,
        new_phy2log,
        num_layers,
        old_slots,
        new_slots,
        weights,
        num_tensors,
    };
    guard::call(|| {
        // SAFETY: caller contract.
        let options = unsafe { rearrange_options_arg(options, lost_options) };
        // SAFETY: caller contract.
        unsafe { call.run(comm, options, summary_out) }
    })
}

/// epcomm_eplb_rearrange_with, double-buffered: `weights` (the live weights) are only read,
/// and every layer's new placement is written into `next_weights` (as many host tensors as
/// `weights`, the same layout, each of its live tensor's size, overlapping neither a live tensor
/// nor each other; need not be initialised), each byte once: a slot's row is its live row, a
/// local copy, a received row or a duplicate of one. The commit is the swap: `*next_valid_out`
/// (NULL = not wanted) is set, whatever the outcome, to the number of leading layers whose next
/// tensors hold the new placement (their transfer committed on every rank; the same on every
/// rank): num_layers on success; on a failure at layer l, l: layer l's next tensors are then
/// garbage, later ones untouched, and every live tensor unchanged. The error texts are those of
/// epcomm_eplb_rearrange_with. Bad next tensors (NULL, wrong size, aliasing) fail every rank
/// before any data moves, the failing rank with a message naming the tensor. Every rank must
/// call this function (not epcomm_eplb_rearrange_with) for the same rearrangement. Next
/// tensors that all lie in memory from epcomm_mem_alloc on the communicator's group (e.g. the
/// live and the next weights as the two halves of one allocation, swapped by turns) have
/// their received rows stored there by the senders (plain stores, one copy per byte, no
/// system call); other next tensors have them read from the senders through the kernel.
///
/// # Safety
/// As epcomm_eplb_rearrange_with; `next_weights` is NULL or holds num_layers * num_tensors
/// valid host tensor descriptors; `next_valid_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_rearrange_into(
    comm: *mut epcomm_eplb_communicator,
    old_phy2log: *const i64,
    new_phy2log: *const i64,
    num_layers: i64,
    old_slots: i64,
    new_slots: i64,
    weights: *const epcomm_tensor,
    next_weights: *const epcomm_tensor,
    num_tensors: usize,
    options: *const epcomm_eplb_rearrange_options,
    summary_out: *mut epcomm_eplb_summary,
    next_valid_out: *mut i64,
) -> i32 {
    // SAFETY: caller contract.
    unsafe {
        epcomm_eplb_rearrange_into_with_lost(
            comm,
            old_phy2log,
            new_phy2log,
            num_layers,
            old_slots,
            new_slots,
            weights,
            next_weights,
            num_tensors,
            options,
            std::ptr::null(),
            summary_out,
            next_valid_out,
        )
    }
}

/// epcomm_eplb_rearrange_into, choosing with `lost_options` (NULL = refused) what happens to
/// lost experts, as epcomm_eplb_rearrange_with_lost: allowed, a lost expert's next rows are
/// copied from the same slot's live rows.
///
/// # Safety
/// As epcomm_eplb_rearrange_into and epcomm_eplb_rearrange_with_lost.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn epcomm_eplb_rearrange_into_with_lost(
    comm: *mut epcomm_eplb_communicator,
    old_phy2log: *const i64,
    new_phy2log: *const i64,
    num_layers: i64,
    old_slots: i64,
    new_slots: i64,
    weights: *const epcomm_tensor,
    next_weights: *const epcomm_tensor,
    num_tensors: usize,
    options: *const epcomm_eplb_rearrange_options,
    lost_options: *const epcomm_eplb_lost_experts_options,
    summary_out: *mut epcomm_eplb_summary,
    next_valid_out: *mut i64,
) -> i32 {
    let call = RearrangeCall {
        old_phy2log,
        new_phy2log,
        num_layers,
        old_slots,
        new_slots,
        weights,
        num_tensors,
    };
    // SAFETY: NULL or writable (caller contract): 0 until a layer is valid, even on a panic.
    if let Some(v) = unsafe { next_valid_out.as_mut() } {
        *v = 0;
    }
    guard::call(|| {
        // SAFETY: caller contract.
        let options = unsafe { rearrange_options_arg(options, lost_options) };
        // SAFETY: caller contract.
        unsafe { call.run_into(comm, next_weights, options, summary_out, next_valid_out) }
    })
}

/// A rank mapping argument: NULL = none, else `len` entries, borrowed (not copied: the
/// rearrangement checks its length against the maps before it reads an entry).
///
/// # Safety
/// `p` is NULL or valid for `len` entries that outlive the call.
unsafe fn mapping_arg<'a>(p: *const i64, len: usize) -> Result<Option<&'a [i64]>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL with len entries (caller contract).
    unsafe { guard::slice_arg(p, len, "rank_mapping") }.map(Some)
}

/// The rearrangement options a C caller passed, read.
#[derive(Debug, Clone)]
struct OptionsArg<'a> {
    mapping: Option<&'a [i64]>,
    batching: bool,
    lost: rearrange::LostExperts,
    lost_out: *mut i64,
    capacity: usize,
    num_lost_out: *mut i64,
}

/// `options` (NULL = defaults) and `lost` (NULL = lost experts refused).
///
/// # Safety
/// `options` is NULL or valid, its rank_mapping NULL or valid for rank_mapping_len entries;
/// `lost` is NULL or valid.
unsafe fn rearrange_options_arg(
    options: *const epcomm_eplb_rearrange_options,
    lost: *const epcomm_eplb_lost_experts_options,
) -> Result<OptionsArg<'static>> {
    // SAFETY: caller contract.
    let mut arg = OptionsArg::plain(None);
    if let Some(o) = unsafe { options.as_ref() } {
        guard::struct_size_arg::<epcomm_eplb_rearrange_options>(
            o.struct_size,
            "options",
            "epcomm_eplb_rearrange_options",
        )?;
        // SAFETY: caller contract.
        arg.mapping = unsafe { mapping_arg(o.rank_mapping, o.rank_mapping_len) }?;
        arg.batching = o.migration_batching;
    }
    // SAFETY: caller contract.
    if let Some(l) = unsafe { lost.as_ref() } {
        guard::struct_size_arg::<epcomm_eplb_lost_experts_options>(
            l.struct_size,
            "lost_options",
            "epcomm_eplb_lost_experts_options",
        )?;
        if l.allow_lost_experts {
            arg.lost = rearrange::LostExperts::LeaveUnwritten;
        }
        (arg.lost_out, arg.capacity) = (l.lost_experts_out, l.lost_experts_capacity);
        arg.num_lost_out = l.num_lost_experts_out;
    }
    Ok(arg)
}

impl<'m> OptionsArg<'m> {
    /// The defaults: epcomm_eplb_rearrange's options.
    fn plain(mapping: Option<&'m [i64]>) -> OptionsArg<'m> {
        OptionsArg {
            mapping,
            batching: false,
            lost: rearrange::LostExperts::Refuse,
            lost_out: std::ptr::null_mut(),
            capacity: 0,
            num_lost_out: std::ptr::null_mut(),
        }
    }

    fn options<'a>(&'a self, dtypes: &'a [crate::dtype::DType]) -> rearrange::RearrangeOptions<'a> {
        rearrange::RearrangeOptions {
            rank_mapping: self.mapping,
            dtypes,
            migration_batching: self.batching,
            lost: self.lost,
            next_shared: false,
        }
    }

    /// Counts the lost experts before any data moves, writes the count and (when they fit) the
    /// pairs, and checks that allow_lost_experts has room to report them. Argument errors are
    /// left to the rearrangement, which reports them to every rank.
    ///
    /// # Safety
    /// The output pointers are NULL or valid as epcomm_eplb_rearrange_options says.
    unsafe fn report_lost(&self, world: usize, old: &[Vec<i64>], new: &[Vec<i64>]) -> Result<()> {
        let Ok(lost) = rearrange::lost_by_layer(world, old, new, &self.options(&[])) else {
            return Ok(());
        };
        let pairs: Vec<i64> = (lost.iter().enumerate())
            .flat_map(|(l, ids)| ids.iter().flat_map(move |&e| [l as i64, e]))
            .collect();
        let count = pairs.len() / 2;
        // SAFETY: NULL or writable (caller contract).
        if let Some(n) = unsafe { self.num_lost_out.as_mut() } {
            *n = count as i64;
        }
        if !self.lost_out.is_null() && count <= self.capacity {
            // SAFETY: room for `capacity` pairs (caller contract).
            unsafe { std::slice::from_raw_parts_mut(self.lost_out, 2 * count) }
                .copy_from_slice(&pairs);
        }
        let cap = if self.lost_out.is_null() {
            0
        } else {
            self.capacity
        };
        match self.lost {
            rearrange::LostExperts::LeaveUnwritten if count > cap => Err(Error::InvalidArgument(format!(
                "lost_options->allow_lost_experts leaves {count} (layer, logical expert) pairs unwritten but lost_options->lost_experts_out has room for {cap}; pass room for them (num_layers * new_slots pairs always suffice)"
            ))),
            rearrange::LostExperts::LeaveUnwritten | rearrange::LostExperts::Refuse => Ok(()),
        }
    }
}

/// The map and weight arguments of a rearrangement, as C passes them.
struct RearrangeCall {
    old_phy2log: *const i64,
    new_phy2log: *const i64,
    num_layers: i64,
    old_slots: i64,
    new_slots: i64,
    weights: *const epcomm_tensor,
    num_tensors: usize,
}

/// A rearrangement's checked arguments: old and new maps, weights, options.
type Prepared<'m> = (Vec<Vec<i64>>, Vec<Vec<i64>>, LayerWeights, OptionsArg<'m>);

impl RearrangeCall {
    /// Checks the arguments (before the group is used).
    ///
    /// # Safety
    /// The pointers are NULL or valid for the sizes they are given with.
    unsafe fn prepare<'m>(&self, options: Result<OptionsArg<'m>>) -> Result<Prepared<'m>> {
        let &RearrangeCall {
            num_layers,
            old_slots,
            new_slots,
            ..
        } = self;
        let [l, os, ns] = dims!(num_layers, old_slots, new_slots);
        // SAFETY: caller contract for every pointer below.
        let (old, new, layers) = unsafe {
            (
                maps(self.old_phy2log, l, os, "old_phy2log")?,
                maps(self.new_phy2log, l, ns, "new_phy2log")?,
                LayerWeights::parse(self.weights, l, self.num_tensors)?,
            )
        };
        Ok((old, new, layers, options?))
    }

    /// Runs the rearrangement; a rejected argument is reported to the peers too.
    ///
    /// # Safety
    /// As epcomm_eplb_rearrange_with.
    unsafe fn run<'m>(
        &self,
        comm: *mut epcomm_eplb_communicator,
        options: Result<OptionsArg<'m>>,
        summary_out: *mut epcomm_eplb_summary,
    ) -> Result<()> {
        // SAFETY: caller contract.
        let prepared = unsafe { self.prepare(options) };
        // SAFETY: caller contract: a live handle whose group is live.
        let summary = unsafe {
            with_comm(comm, |c, group| {
                with_dep_group(group, |g| {
                    // The outputs are NULL or valid (caller contract).
                    let report =
                        |p: Prepared<'m>| p.3.report_lost(g.size(), &p.0, &p.1).map(|()| p);
                    let (old, new, w, o) = prepared
                        .and_then(report)
                        .map_err(|e| rearrange::reject_rearrange(g, e))?;
                    rearrange::rearrange_with(
                        g,
                        c.comm.as_mut(),
                        &old,
                        &new,
                        &mut w.views(),
                        &w.row_bytes,
                        &o.options(&w.dtypes),
                    )
                })
            })
        }?;
        // SAFETY: NULL or writable (caller contract).
        unsafe { write_summary(summary_out, &summary) };
        Ok(())
    }

    /// Runs the double-buffered rearrangement; a rejected argument (the next weights
    /// included) is reported to the peers too. Writes the valid layers to `next_valid_out`
    /// whatever the outcome.
    ///
    /// # Safety
    /// As epcomm_eplb_rearrange_into.
    unsafe fn run_into(
        &self,
        comm: *mut epcomm_eplb_communicator,
        next_weights: *const epcomm_tensor,
        options: Result<OptionsArg<'_>>,
        summary_out: *mut epcomm_eplb_summary,
        next_valid_out: *mut i64,
    ) -> Result<()> {
        // SAFETY: caller contract.
        let prepared = unsafe { self.prepare(options) }.and_then(|p| {
            // SAFETY: caller contract.
            let next = unsafe { next_arg(next_weights, &p.2) }?;
            Ok((p, next))
        });
        let prepared = |world| {
            // SAFETY: the outputs are NULL or valid (caller contract).
            prepared
                .and_then(|p| unsafe { p.0 .3.report_lost(world, &p.0 .0, &p.0 .1) }.map(|()| p))
        };
        let mut valid = 0;
        // SAFETY: caller contract: a live handle whose group is live.
        let summary = unsafe {
            with_comm(comm, |c, group| {
                group.with(|h, g| {
                    let g = g.as_mut();
                    let ((old, new, w, o), next) =
                        prepared(g.size()).map_err(|e| rearrange::reject_rearrange(g, e))?;
                    let options = rearrange::RearrangeOptions {
                        next_shared: in_group_memory(h, &*g, &next.tensors),
                        ..o.options(&w.dtypes)
                    };
                    // SAFETY: checked: the next tensors overlap neither each other nor the
                    // live ones, which are only read.
                    let (live, mut next) = (w.read_views(), next.views());
                    let out = rearrange::rearrange_into(
                        g,
                        c.comm.as_mut(),
                        &old,
                        &new,
                        &live,
                        &mut next,
                        &w.row_bytes,
                        &options,
                    );
                    valid = out.next_valid;
                    out.result
                })
            })
        };
        // SAFETY: NULL or writable (caller contract).
        if let Some(v) = unsafe { next_valid_out.as_mut() } {
            *v = valid as i64;
        }
        // SAFETY: NULL or writable (caller contract).
        unsafe { write_summary(summary_out, &summary?) };
        Ok(())
    }
}

/// Whether every tensor lies in memory of this rank's group from epcomm_mem_alloc: then the
/// senders of a double-buffered rearrangement store the rows straight into it.
fn in_group_memory(h: &epcomm_group, g: &dyn crate::group::Group, tensors: &[HostTensor]) -> bool {
    let mem = h.mem.lock().unwrap_or_else(|e| e.into_inner());
    let inside = |t: &HostTensor| {
        let (a, n) = (t.ptr as usize, t.bytes);
        mem.iter().any(|b| {
            let start = b.as_ptr() as usize;
            g.owns_shared(b) && a >= start && a - start <= b.len() && n <= b.len() - (a - start)
        })
    };
    !tensors.is_empty() && tensors.iter().all(inside)
}

/// Writes `summary` to `out` unless it is NULL.
///
/// # Safety
/// `out` is NULL or writable.
unsafe fn write_summary(out: *mut epcomm_eplb_summary, summary: &rearrange::Summary) {
    // SAFETY: caller contract.
    if let Some(out) = unsafe { out.as_mut() } {
        *out = epcomm_eplb_summary {
            layers_changed: summary.layers_changed as i64,
            rows_sent: summary.rows_sent as i64,
            rows_received: summary.rows_received as i64,
            rows_copied_locally: summary.rows_copied_locally as i64,
        };
    }
}

/// The next weights of a double-buffered rearrangement: one host tensor per live one, of its
/// size, overlapping neither a live tensor nor another next one.
///
/// # Safety
/// `p` is NULL or holds as many valid host tensor descriptors as `live` has tensors.
unsafe fn next_arg(p: *const epcomm_tensor, live: &LayerWeights) -> Result<LayerWeights> {
    let n = live.tensors.len();
    // SAFETY: caller contract.
    let tensors =
        unsafe { Memory::Host.tensors(p, n, "next_weights", "next_weights[i]", |_, _| Ok(())) }?;
    let ranges = |ts: &[HostTensor]| -> Vec<Vec<(usize, usize)>> {
        let layer = |l: &[HostTensor]| l.iter().map(|t| (t.ptr as usize, t.bytes)).collect();
        ts.chunks(live.per_layer).map(layer).collect()
    };
    rearrange::check_next_buffers(&ranges(&live.tensors), &ranges(&tensors))?;
    Ok(LayerWeights {
        tensors,
        per_layer: live.per_layer,
        row_bytes: live.row_bytes.clone(),
        dtypes: live.dtypes.clone(),
    })
}

/// The weight tensors of a rearrangement: `per_layer` tensors per layer, layer-major, every
/// layer with the first layer's row sizes; no two overlap.
struct LayerWeights {
    tensors: Vec<HostTensor>,
    per_layer: usize,
    row_bytes: Vec<usize>,
    dtypes: Vec<crate::dtype::DType>,
}

impl LayerWeights {
    /// # Safety
    /// `weights` is NULL or holds `layers * per_layer` valid host tensor descriptors.
    unsafe fn parse(
        weights: *const epcomm_tensor,
        layers: usize,
        per_layer: usize,
    ) -> Result<LayerWeights> {
        if per_layer == 0 {
            return Err(Error::InvalidArgument(
                "num_tensors is 0; expected the number of weight tensors per layer".into(),
            ));
        }
        // SAFETY: caller contract.
        let tensors = unsafe {
            Memory::Host.tensors(
                weights,
                layers * per_layer,
                "weights",
                "weights[i]",
                |_, _| Ok(()),
            )
        }?;
        let writes: Vec<_> = tensors.iter().map(|t| (true, t)).collect();
        check_writes_disjoint(&writes)?;
        let first = &tensors[..per_layer];
        let row_bytes: Vec<usize> = first.iter().map(HostTensor::row_bytes).collect();
        for (i, t) in tensors.iter().enumerate() {
            let want = row_bytes[i % per_layer];
            if t.row_bytes() != want {
                return Err(Error::InvalidArgument(format!(
                    "weights[{i}] has rows of {} bytes but tensor {} of layer 0 has {want}; every layer must have the same tensors",
                    t.row_bytes(),
                    i % per_layer,
                )));
            }
        }
        let dtypes = first.iter().map(|t| t.dtype).collect();
        Ok(LayerWeights {
            tensors,
            per_layer,
            row_bytes,
            dtypes,
        })
    }

    /// Every layer's tensors as mutable bytes.
    ///
    /// # Safety
    /// The tensors' memory is valid for writes and used by nobody else during the borrow
    /// (the tensors were checked not to overlap).
    unsafe fn views<'a>(&self) -> Vec<Vec<&'a mut [u8]>> {
        self.tensors
            .chunks(self.per_layer)
            // SAFETY: caller contract.
            .map(|layer| layer.iter().map(|t| unsafe { t.as_mut_slice() }).collect())
            .collect()
    }

    /// Every layer's tensors as bytes, read only.
    ///
    /// # Safety
    /// The tensors' memory is valid for reads and not written during the borrow.
    unsafe fn read_views<'a>(&self) -> Vec<Vec<&'a [u8]>> {
        self.tensors
            .chunks(self.per_layer)
            // SAFETY: caller contract.
            .map(|layer| layer.iter().map(|t| unsafe { t.as_slice() }).collect())
            .collect()
    }
}

/// One rank's transfer plan for one layer (see epcomm_eplb_plan_layer).
pub struct epcomm_eplb_layer_plan {
    plan: LayerPlan,
    unchanged: Vec<u8>,
    local_copies: Vec<i64>,
    sends: Vec<i64>,
    recvs: Vec<i64>,
    duplicates: Vec<i64>,
}

/// Immutable once made: borrowed without a lock.
impl Handle for epcomm_eplb_layer_plan {
    const ARG: &'static str = "plan";
}

/// Views of a layer plan; valid until the plan is destroyed.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_eplb_plan_view {
    /// Local slots.
    pub num_slots: i64,
    /// num_slots flags: 1 = the slot keeps its expert.
    pub unchanged: *const u8,
    /// [num_local_copies, 2]: (destination slot, source slot).
    pub local_copies: *const i64,
    pub num_local_copies: i64,
    /// [num_sends, 3]: (expert, source slot, destination rank), vLLM's order.
    pub sends: *const i64,
    pub num_sends: i64,
    /// [num_recvs, 3]: (expert, primary slot, source rank).
    pub recvs: *const i64,
    pub num_recvs: i64,
    /// [num_duplicates, 2]: (destination slot, primary slot).
    pub duplicates: *const i64,
    pub num_duplicates: i64,
}

/// Computes rank `rank`'s transfer plan for one layer from the old and new maps (`num_slots`
/// physical slots each, `slots_per_rank` per rank), with vLLM's sender/receiver pairing.
///
/// # Safety
/// `old_phy2log` and `new_phy2log` hold num_slots entries; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_plan_layer(
    old_phy2log: *const i64,
    new_phy2log: *const i64,
    num_slots: i64,
    slots_per_rank: i64,
    rank: i32,
    out: *mut *mut epcomm_eplb_layer_plan,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(out, "out") }?;
        let [p, n] = dims!(num_slots, slots_per_rank);
        let old = unsafe { maps(old_phy2log, 1, p, "old_phy2log") }?;
        let new = unsafe { maps(new_phy2log, 1, p, "new_phy2log") }?;
        let rank = index(rank.into(), "rank")?;
        let plan = transfer::plan_layer(&old[0], &new[0], n, rank)?;
        let flat2 =
            |v: &[(usize, usize)]| v.iter().flat_map(|&(a, b)| [a as i64, b as i64]).collect();
        let flat3 = |v: &[(i64, usize, usize)]| {
            v.iter()
                .flat_map(|&(a, b, c)| [a, b as i64, c as i64])
                .collect()
        };
        *out = epcomm_eplb_layer_plan {
            unchanged: plan.unchanged.iter().map(|&u| u8::from(u)).collect(),
            local_copies: flat2(&plan.local_copies),
            sends: flat3(&plan.sends),
            recvs: flat3(&plan.recvs),
            duplicates: flat2(&plan.duplicates),
            plan,
        }
        .into_raw();
        Ok(())
    })
}

/// Describes a layer plan.
///
/// # Safety
/// `plan` is NULL or a live plan; `view_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_layer_plan_view(
    plan: *const epcomm_eplb_layer_plan,
    view_out: *mut epcomm_eplb_plan_view,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(view_out, "view_out") }?;
        let p = unsafe { epcomm_eplb_layer_plan::borrow(plan) }?;
        *out = epcomm_eplb_plan_view {
            num_slots: p.unchanged.len() as i64,
            unchanged: p.unchanged.as_ptr(),
            local_copies: p.local_copies.as_ptr(),
            num_local_copies: p.plan.local_copies.len() as i64,
            sends: p.sends.as_ptr(),
            num_sends: p.plan.sends.len() as i64,
            recvs: p.recvs.as_ptr(),
            num_recvs: p.plan.recvs.len() as i64,
            duplicates: p.duplicates.as_ptr(),
            num_duplicates: p.plan.duplicates.len() as i64,
        };
        Ok(())
    })
}

/// Releases a layer plan (NULL is a no-op), as epcomm_eplb_layer_plan_destroy_checked, whose
/// status this void form cannot return: a refused destroy frees nothing and records the error
/// for epcomm_last_error_message.
///
/// # Safety
/// `plan` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_layer_plan_destroy(plan: *mut epcomm_eplb_layer_plan) {
    if !plan.is_null() {
        // SAFETY: caller contract.
        unsafe { epcomm_eplb_layer_plan_destroy_checked(plan) };
    }
}

/// Releases a layer plan: EPCOMM_OK; its views become invalid. NULL is EPCOMM_ERROR_NULL_POINTER.
/// Refused with EPCOMM_ERROR_INVALID_STATE, freeing nothing: while another thread's call on it is
/// in flight; on a plan destroyed already; in a forked child of the process that made it.
///
/// # Safety
/// `plan` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_layer_plan_destroy_checked(
    plan: *mut epcomm_eplb_layer_plan,
) -> i32 {
    // SAFETY: only a registered handle is freed.
    guard::call(|| unsafe { epcomm_eplb_layer_plan::destroy(plan) })
}

/// The logical experts of one layer's old placement (`old_phy2log`, `num_slots` = old ranks x
/// `slots_per_rank` entries, -1 = empty) with no replica on a surviving rank
/// (`rank_mapping[r] >= 0`; `rank_mapping_len` = the old ranks, -1 = removed; the survivors
/// take the new ranks 0 to survivors - 1, one each, as the rearrangement after the failure
/// requires, else EPCOMM_ERROR_INVALID_ARGUMENT naming the entry): after a failure their
/// weights are gone. One layer per call: a layer's
/// lost experts depend only on its own map. `*num_lost_out` receives their count; `lost_out`
/// (room for `lost_capacity` ids; NULL = count only) receives them ascending. A capacity
/// below the count is EPCOMM_ERROR_INVALID_ARGUMENT (the count is still written);
/// `num_slots` ids always fit.
///
/// # Safety
/// `old_phy2log` holds num_slots entries, `rank_mapping` rank_mapping_len; `lost_out` is NULL
/// or writable for lost_capacity entries; `num_lost_out` is writable (NULL is
/// EPCOMM_ERROR_NULL_POINTER).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn epcomm_eplb_lost_experts(
    old_phy2log: *const i64,
    num_slots: i64,
    slots_per_rank: i64,
    rank_mapping: *const i64,
    rank_mapping_len: usize,
    lost_out: *mut i64,
    lost_capacity: usize,
    num_lost_out: *mut i64,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract (NULL or writable).
        let count_out = unsafe { guard::out_arg(num_lost_out, "num_lost_out") }?;
        let [p, n] = dims!(num_slots, slots_per_rank);
        // SAFETY: caller contract.
        let old = unsafe { maps(old_phy2log, 1, p, "old_phy2log") }?;
        let mapping = unsafe { guard::slice_arg(rank_mapping, rank_mapping_len, "rank_mapping") }?;
        let lost = crate::eplb::lost_experts(&old[0], n, mapping)?;
        *count_out = lost.len() as i64;
        if lost_out.is_null() {
            return Ok(());
        }
        if lost.len() > lost_capacity {
            return Err(Error::InvalidArgument(format!(
                "lost_capacity is {lost_capacity} but {} experts are lost; pass room for *num_lost_out ids (num_slots always suffice)",
                lost.len()
            )));
        }
        // SAFETY: writable for lost_capacity entries (caller contract).
        unsafe { std::slice::from_raw_parts_mut(lost_out, lost.len()) }.copy_from_slice(&lost);
        Ok(())
    })
}

/// Expert-load statistics of one model on one rank (window, schedule, balancedness log).
pub struct epcomm_eplb_state {
    inner: Mutex<LoadState>,
    /// The config's `migration_batching_enabled` (fixed at creation).
    migration_batching: bool,
}

exclusive_handle!(
    epcomm_eplb_state,
    "state",
    LoadState,
    "the EPLB state is in use by another thread"
);

/// Creates load statistics for a model with `num_layers` MoE layers of `num_physical` experts:
/// epcomm_eplb_state_new with its arguments in an older order, kept for existing callers (new
/// code calls epcomm_eplb_state_new, whose order the C++ and Python constructors share).
/// `eplb_config_json` is vLLM's EPLBConfig as JSON (NULL = defaults: window_size 1000,
/// step_interval 3000, ...), validated as epcomm_config_check does. The first rearrangement is
/// due after step_interval / 4 steps, as in vLLM. `model_name` (required; NULL is
/// EPCOMM_ERROR_NULL_POINTER) names the model in vLLM's balancedness line.
///
/// # Safety
/// Strings are NULL or NUL-terminated; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_state_create(
    eplb_config_json: *const c_char,
    model_name: *const c_char,
    num_layers: i64,
    num_physical: i64,
    out: *mut *mut epcomm_eplb_state,
) -> i32 {
    // SAFETY: the same contract.
    unsafe { epcomm_eplb_state_new(num_layers, num_physical, model_name, eplb_config_json, out) }
}

/// Creates load statistics for a model with `num_layers` MoE layers of `num_physical` experts,
/// in the order every binding shares: C++ `epcomm::EplbState(num_layers, num_physical,
/// model_name, config_json)`, Python `epcomm.EplbState(num_layers, num_physical, *,
/// model_name, eplb_config)`. `model_name` (required; NULL is EPCOMM_ERROR_NULL_POINTER) names
/// the model in vLLM's balancedness line; `eplb_config_json` is vLLM's EPLBConfig as JSON
/// (NULL = defaults: window_size 1000, step_interval 3000, ...), validated as
/// epcomm_config_check does. The first rearrangement is due after step_interval / 4 steps, as
/// in vLLM.
///
/// # Safety
/// Strings are NULL or NUL-terminated; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_state_new(
    num_layers: i64,
    num_physical: i64,
    model_name: *const c_char,
    eplb_config_json: *const c_char,
    out: *mut *mut epcomm_eplb_state,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(out, "out") }?;
        let model = unsafe { guard::str_arg(model_name, "model_name") }?;
        let cfg = if eplb_config_json.is_null() {
            config::EplbConfig::default()
        } else {
            config::parse_eplb_config_json(unsafe {
                guard::str_arg(eplb_config_json, "eplb_config_json")
            }?)?
        };
        let [num_layers, num_physical] = dims!(num_layers, num_physical);
        let state = LoadState::new(&cfg, model, num_layers, num_physical)?;
        *out = epcomm_eplb_state {
            inner: Mutex::new(state),
            migration_batching: cfg.migration_batching_enabled(),
        }
        .into_raw();
        Ok(())
    })
}

// As the communicator's destroy pair: each handle's, spelled out for the header.
/// Releases load statistics (NULL is a no-op), as epcomm_eplb_state_destroy_checked, whose
/// status this void form cannot return: a refused destroy frees nothing and records the error
/// for epcomm_last_error_message.
///
/// # Safety
/// `state` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_state_destroy(state: *mut epcomm_eplb_state) {
    if !state.is_null() {
        // SAFETY: caller contract.
        unsafe { epcomm_eplb_state_destroy_checked(state) };
    }
}

/// Releases load statistics: EPCOMM_OK. NULL is EPCOMM_ERROR_NULL_POINTER. Refused with
/// EPCOMM_ERROR_INVALID_STATE, freeing nothing: while another thread's call on it is in flight; on
/// a state destroyed already; in a forked child of the process that made it.
///
/// # Safety
/// `state` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_state_destroy_checked(state: *mut epcomm_eplb_state) -> i32 {
    // SAFETY: only a registered handle is freed.
    guard::call(|| unsafe { epcomm_eplb_state::destroy(state) })
}

/// Sets `*enabled_out` to vLLM's `EPLBConfig.migration_batching_enabled` for the config the
/// state was made with: `use_async and enable_migration_batching` (both from
/// `eplb_config_json`; vLLM's defaults are use_async true, enable_migration_batching false).
/// Pass it as epcomm_eplb_rearrange_options.migration_batching to rearrange as vLLM's async
/// worker does.
///
/// # Safety
/// `state` is NULL or live; `enabled_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_state_migration_batching(
    state: *const epcomm_eplb_state,
    enabled_out: *mut bool,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(enabled_out, "enabled_out") }?;
        // SAFETY: caller contract; the flag is immutable, so no lock is needed.
        *out = unsafe { epcomm_eplb_state::borrow(state) }?.migration_batching;
        Ok(())
    })
}

/// Runs `f` with the load statistics behind `state`.
///
/// # Safety
/// `state` is NULL or a live handle.
unsafe fn with_state<T>(
    state: *const epcomm_eplb_state,
    f: impl FnOnce(&mut LoadState) -> Result<T>,
) -> Result<T> {
    // SAFETY: caller contract.
    unsafe { epcomm_eplb_state::with(state, |_, s| f(s)) }
}

/// Adds the expert load of the manager's last dispatch to layer `layer` of this step (the
/// counts were taken while dispatch validated the ids: no second pass over topk_ids).
///
/// # Safety
/// Handles are NULL or live.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_state_record_dispatch(
    state: *mut epcomm_eplb_state,
    layer: i64,
    a2a: *const epcomm_all2all,
) -> i32 {
    guard::call(|| {
        let layer = index(layer, "layer")?;
        // SAFETY: caller contract.
        let counts = unsafe { super::all2all::expert_counts(a2a) }?;
        unsafe { with_state(state, |s| s.record_counts(layer, &counts)) }
    })
}

/// Adds one token per valid id of `topk_ids` (int32/int64, -1 ignored) to layer `layer`.
///
/// # Safety
/// `state` is NULL or live; `topk_ids` is NULL or a valid host tensor.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_state_record(
    state: *mut epcomm_eplb_state,
    layer: i64,
    topk_ids: *const epcomm_tensor,
) -> i32 {
    guard::call(|| {
        let layer = index(layer, "layer")?;
        // SAFETY: caller contract.
        let t = unsafe { HostTensor::from_ffi(topk_ids, "topk_ids") }?;
        // SAFETY: a host tensor valid for reads (caller contract).
        let ids = unsafe { ids_arg(&t) }?;
        unsafe { with_state(state, |s| s.record_ids(layer, &ids)) }
    })
}

/// Ends a forward step (collective on `group` when logging balancedness): logs vLLM's
/// `EPLB step: ...` line on rank 0 every log_balancedness_interval steps when `log_stats` and
/// the config's log_balancedness are set, keeps the window, and sets `*rearrange_out` when a
/// rearrangement is due.
///
/// # Safety
/// Handles are NULL or live; `rearrange_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_state_step(
    state: *mut epcomm_eplb_state,
    group: *mut epcomm_group,
    is_dummy: bool,
    log_stats: bool,
    rearrange_out: *mut bool,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(rearrange_out, "rearrange_out") }?;
        *out = unsafe {
            with_state(state, |s| {
                with_group(group, |g| s.step(g, is_dummy, log_stats))
            })
        }?;
        Ok(())
    })
}

/// The window's load per logical expert, summed over the window and all ranks (collective):
/// `phy2log` [num_layers, num_physical] (the current placement), `load_out`
/// [num_layers, num_logical] floats, ready for epcomm_eplb_rebalance.
///
/// # Safety
/// Buffers hold the sizes above; handles are NULL or live.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_state_logical_load(
    state: *const epcomm_eplb_state,
    group: *mut epcomm_group,
    phy2log: *const i64,
    num_layers: i64,
    num_physical: i64,
    num_logical: i64,
    load_out: *mut f32,
) -> i32 {
    guard::call(|| {
        let [l, p, e] = dims!(num_layers, num_physical, num_logical);
        if load_out.is_null() {
            return Err(Error::NullPointer("load_out"));
        }
        let n = guard::entries::<f32>(l, e, "load_out")?;
        // SAFETY: caller contract.
        let m = unsafe { maps(phy2log, l, p, "phy2log") }?;
        let load =
            unsafe { with_state(state, |s| with_group(group, |g| s.logical_load(g, &m, e))) }?;
        // SAFETY: caller contract (l * e entries).
        let out = unsafe { guard::slice_mut_arg(load_out, n, "load_out") }?;
        for (d, v) in out.iter_mut().zip(load.iter().flatten()) {
            *d = *v;
        }
        Ok(())
    })
}
