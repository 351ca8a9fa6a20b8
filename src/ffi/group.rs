//! Process groups: creation over shared memory or host callbacks, and the collectives.

use std::ffi::{c_char, c_void};
use std::sync::Mutex;
use std::time::Duration;

use super::guard;
use super::handle::{exclusive_handle, Dep, Exclusive, Handle};
use super::tensor::{check_writes_disjoint, epcomm_tensor, HostTensor};
use crate::error::{Error, Result};
use crate::group::host::{HostFailure, HostGroup, HostTransport};
use crate::group::shm::{ShmGroup, UniqueId, UNIQUE_ID_BYTES};
use crate::group::{AllToAllv, Group, GroupOptions, Op, P2p, ReduceScatterv, SharedBuf};
use crate::num::FloatKind;

/// A process group handle. Use it from one thread at a time (a second thread calling while a
/// call is in flight gets EPCOMM_ERROR_INVALID_STATE). Every collective must be called by all
/// ranks in the same order.
pub struct epcomm_group {
    inner: Mutex<Box<dyn Group>>,
    /// The group's name, for messages that cannot lock the group.
    name: String,
    /// Shared memory handed out by epcomm_mem_alloc, freed by epcomm_mem_free or with the
    /// handle.
    pub(crate) mem: Mutex<Vec<SharedBuf>>,
}

exclusive_handle!(
    epcomm_group,
    "group",
    Box<dyn Group>,
    "the group handle is in use by another thread; use a group from one thread at a time",
    label = |g: &epcomm_group| format!("group '{}'", g.name)
);

/// Options for group creation; initialise with epcomm_group_options_init.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_group_options {
    /// sizeof(epcomm_group_options); lets the struct grow.
    pub struct_size: u32,
    /// Bound on every wait, in seconds (<= 0: EPCOMM_TIMEOUT_S, else 60).
    pub timeout_s: f64,
    /// Initial bytes of each rank's shared region (shm; 0 = default 4 MiB). Grows on demand.
    pub initial_capacity_bytes: u64,
    /// Upper bound of a rank's shared region (0 = no bound but the memory available).
    pub max_capacity_bytes: u64,
    /// The group is an elastic (stateless) EP group.
    pub elastic: bool,
    /// shm: stage every transfer through the shared region instead of letting peers copy
    /// straight from this rank's buffers (the default, where the kernel allows it, is one copy
    /// per byte). EPCOMM_SHM_DIRECT=0 has the same effect.
    pub disable_direct_reads: bool,
}

/// Fills `options` with the defaults (and struct_size).
///
/// # Safety
/// `options` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_options_init(options: *mut epcomm_group_options) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(options, "options") }?;
        let d = GroupOptions::default();
        *out = epcomm_group_options {
            struct_size: std::mem::size_of::<epcomm_group_options>() as u32,
            timeout_s: d.timeout.as_secs_f64(),
            initial_capacity_bytes: d.initial_capacity as u64,
            max_capacity_bytes: d.max_capacity as u64,
            elastic: d.elastic,
            disable_direct_reads: !d.direct_reads,
        };
        Ok(())
    })
}

unsafe fn options_arg(options: *const epcomm_group_options) -> Result<GroupOptions> {
    let mut o = GroupOptions::default();
    // SAFETY: caller contract.
    let Some(c) = (unsafe { options.as_ref() }) else {
        return Ok(o);
    };
    guard::struct_size_arg::<epcomm_group_options>(
        c.struct_size,
        "options",
        "epcomm_group_options",
    )?;
    let max = crate::env::MAX_TIMEOUT_S;
    if c.timeout_s.is_nan() || c.timeout_s > max {
        return Err(Error::InvalidArgument(format!(
            "options->timeout_s is {:e}; expected seconds (> 0, at most {max}, one day), or <= 0 for the default",
            c.timeout_s
        )));
    }
    if c.timeout_s > 0.0 {
        o.timeout = Duration::from_secs_f64(c.timeout_s);
    }
    if c.initial_capacity_bytes != 0 {
        o.initial_capacity = c.initial_capacity_bytes as usize;
    }
    o.max_capacity = c.max_capacity_bytes as usize;
    o.elastic = c.elastic;
    o.direct_reads = !c.disable_direct_reads;
    Ok(o)
}

fn index_arg(v: i32, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| {
        Error::InvalidArgument(format!("{what} is {v}; expected a non-negative value"))
    })
}

fn finish_create(g: Box<dyn Group>, out: &mut *mut epcomm_group) {
    *out = epcomm_group {
        name: g.name().to_owned(),
        inner: Mutex::new(g),
        mem: Mutex::new(Vec::new()),
    }
    .into_raw();
}

/// The shared steps of the shm create calls: out, options, rank and world checked in the C
/// order, then `join`.
///
/// # Safety
/// `options` is NULL or valid; `out` is NULL or writable.
unsafe fn create_shm_with(
    rank: i32,
    world_size: i32,
    options: *const epcomm_group_options,
    out: *mut *mut epcomm_group,
    join: impl FnOnce(usize, usize, GroupOptions) -> Result<ShmGroup>,
) -> Result<()> {
    // SAFETY: caller contract.
    let out = unsafe { guard::out_arg(out, "out") }?;
    let opts = unsafe { options_arg(options) }?;
    let rank = index_arg(rank, "rank")?;
    let world = index_arg(world_size, "world_size")?;
    let g = join(rank, world, opts)?;
    finish_create(Box::new(g), out);
    Ok(())
}

/// Creates (rank 0) or joins (other ranks) the shared-memory group `name` of `world_size`
/// ranks on this host (processes or threads) and returns once all ranks joined. `options` may
/// be NULL for the defaults. Errors: bad arguments, a world size that differs between ranks,
/// a rank that never arrives (EPCOMM_ERROR_TIMEOUT naming it), a name in use by a live group.
/// A segment left by a crashed run is replaced.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string; `options` is NULL or valid; `out` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_create_shm(
    name: *const c_char,
    rank: i32,
    world_size: i32,
    options: *const epcomm_group_options,
    out: *mut *mut epcomm_group,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let name = unsafe { guard::str_arg(name, "name") }?;
        unsafe {
            create_shm_with(rank, world_size, options, out, |r, w, o| {
                ShmGroup::join(name, r, w, o)
            })
        }
    })
}

/// Bytes of an `epcomm_unique_id` (as NCCL's `NCCL_UNIQUE_ID_BYTES`).
pub const EPCOMM_UNIQUE_ID_BYTES: usize = 128;
const _: () = assert!(EPCOMM_UNIQUE_ID_BYTES == UNIQUE_ID_BYTES);

/// A group id made by one rank with `epcomm_group_unique_id` and passed to the others by the
/// host's own means (MPI_Bcast, a TCP store, torch.distributed), as `ncclUniqueId`: groups made
/// from distinct ids never meet, so they need no unique name. Plain bytes: copy it freely.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct epcomm_unique_id {
    pub internal: [u8; EPCOMM_UNIQUE_ID_BYTES],
}

/// Makes a fresh group id (128 random bits from the kernel) into `*out`, on one rank; the other
/// ranks get it from that rank and all call `epcomm_group_create_shm_unique` with it.
///
/// # Safety
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_unique_id(out: *mut epcomm_unique_id) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(out, "out") }?;
        *out = epcomm_unique_id {
            internal: UniqueId::new()?.0,
        };
        Ok(())
    })
}

/// As `epcomm_group_create_shm`, for the group of the id `*id` made by
/// `epcomm_group_unique_id` instead of a name. An id that was not made by it (altered, or
/// zeroed) is `EPCOMM_ERROR_INVALID_ARGUMENT`.
///
/// # Safety
/// `id` is NULL or points to a readable id; `options` is NULL or valid; `out` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_create_shm_unique(
    id: *const epcomm_unique_id,
    rank: i32,
    world_size: i32,
    options: *const epcomm_group_options,
    out: *mut *mut epcomm_group,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let id = UniqueId(
            unsafe { id.as_ref() }
                .ok_or(Error::NullPointer("id"))?
                .internal,
        );
        unsafe {
            create_shm_with(rank, world_size, options, out, |r, w, o| {
                ShmGroup::join_unique(&id, r, w, o)
            })
        }
    })
}

/// Host send: deliver `bytes` bytes at `data` to rank `peer`; return 0 on success.
pub type epcomm_host_send_fn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        peer: i32,
        data: *const c_void,
        bytes: usize,
    ) -> i32,
>;
/// Host receive: fill `bytes` bytes at `data` from rank `peer`; return 0 on success.
pub type epcomm_host_recv_fn = Option<
    unsafe extern "C" fn(user_data: *mut c_void, peer: i32, data: *mut c_void, bytes: usize) -> i32,
>;
/// Host all-gather: `bytes` from every rank into `output` (world_size * bytes, rank order).
pub type epcomm_host_all_gather_fn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        input: *const c_void,
        bytes: usize,
        output: *mut c_void,
    ) -> i32,
>;
/// Host barrier; return 0 on success. Not called (see `epcomm_host_callbacks`); kept so
/// existing hosts still compile.
pub type epcomm_host_barrier_fn = Option<unsafe extern "C" fn(user_data: *mut c_void) -> i32>;

/// Host lost ranks (fault tolerance, optional): set `out_mask[r]` (world_size entries, zeroed
/// by epcomm) to 1 for each rank the host's transport holds as lost (a peer it saw fail);
/// return 0 on success.
pub type epcomm_host_lost_ranks_fn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, out_mask: *mut u8, world_size: i32) -> i32>;
/// Host shrink (fault tolerance, optional): collective over the ranks not in `excluded`
/// (`num_excluded` ranks, increasing, not this rank); make a host communicator over those
/// survivors, renumbered in order, and store its user data in `*out_user_data`; return 0 on
/// success. epcomm builds the new group over it with the same callbacks; the host keeps it
/// valid until that group is destroyed.
pub type epcomm_host_shrink_fn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        excluded: *const i32,
        num_excluded: usize,
        out_user_data: *mut *mut c_void,
    ) -> i32,
>;

/// Host all-to-all with a size per peer (optional; MPI_Alltoallv, torch.distributed's
/// all_to_all_single with split sizes, grouped ncclSend/ncclRecv): send `send_bytes[p]` bytes
/// (consecutive chunks of `send`, rank order) to every rank p (this one included), and
/// receive `recv_bytes[p]` bytes from every rank p into consecutive chunks of `recv`; both
/// arrays hold world_size entries. epcomm has agreed on every size with every rank before it
/// calls this. Return 0 on success.
pub type epcomm_host_all_to_allv_fn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        send: *const c_void,
        send_bytes: *const usize,
        recv: *mut c_void,
        recv_bytes: *const usize,
    ) -> i32,
>;

/// The host's own transport (e.g. torch.distributed or MPI). `send` and `recv` are required and
/// blocking; `all_gather` is optional (NULL: built from send/recv). epcomm orders pairwise
/// exchanges so that blocking rendezvous sends cannot deadlock. Every collective starts with an
/// all_gather of a small header from every rank, so a rank's bad arguments, a disagreement on a
/// parameter or a rank calling another collective is the same error on every rank before any
/// data moves; that all_gather is also the barrier, so `barrier` is never called.
///
/// A callback's nonzero return fails the op with EPCOMM_ERROR_RUNTIME, or with the status it
/// returned when that is EPCOMM_ERROR_PEER_FAILURE or EPCOMM_ERROR_TIMEOUT (a peer the host
/// saw fail or time out). `lost_ranks` and `shrink` (fault tolerance) are optional and were
/// added last: a struct whose struct_size ends before them works as before (no rank is
/// reported lost; shrink is EPCOMM_ERROR_NOT_IMPLEMENTED). `all_to_allv` (optional, added
/// after them) moves the data of all_to_allv, dispatch, combine, EPLB's row exchanges,
/// all_gatherv and reduce_scatterv in one host call each (NULL, or a struct_size that ends
/// before it: send/recv pairs in a round-robin tournament, as before).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_host_callbacks {
    /// sizeof(epcomm_host_callbacks).
    pub struct_size: u32,
    /// Passed back to every callback.
    pub user_data: *mut c_void,
    pub send: epcomm_host_send_fn,
    pub recv: epcomm_host_recv_fn,
    pub all_gather: epcomm_host_all_gather_fn,
    pub barrier: epcomm_host_barrier_fn,
    /// Optional: the ranks the host holds as lost (`epcomm_group_lost_ranks`).
    pub lost_ranks: epcomm_host_lost_ranks_fn,
    /// Optional: the host communicator of the survivors (`epcomm_group_shrink`).
    pub shrink: epcomm_host_shrink_fn,
    /// Optional: the host's all-to-all with a size per peer.
    pub all_to_allv: epcomm_host_all_to_allv_fn,
}

/// sizeof(epcomm_host_callbacks) before `lost_ranks` and `shrink` were added: hosts built
/// against that header keep working.
const CALLBACKS_SIZE_V1: usize = std::mem::offset_of!(epcomm_host_callbacks, lost_ranks);

/// A copy of the host's callbacks, reading only its `struct_size` bytes (fields it lacks are
/// NULL).
///
/// # Safety
/// `callbacks` is NULL or points to at least `struct_size` readable bytes, `struct_size` first.
unsafe fn read_callbacks(callbacks: *const epcomm_host_callbacks) -> Result<epcomm_host_callbacks> {
    if callbacks.is_null() {
        return Err(Error::NullPointer("callbacks"));
    }
    // SAFETY: the host's struct starts with struct_size (caller contract).
    let size = unsafe { std::ptr::addr_of!((*callbacks).struct_size).read_unaligned() } as usize;
    let full = std::mem::size_of::<epcomm_host_callbacks>();
    if size < CALLBACKS_SIZE_V1 {
        return Err(Error::InvalidArgument(format!(
            "callbacks->struct_size is {size}: expected sizeof(epcomm_host_callbacks) = {full}"
        )));
    }
    let mut c = epcomm_host_callbacks {
        struct_size: size as u32,
        user_data: std::ptr::null_mut(),
        send: None,
        recv: None,
        all_gather: None,
        barrier: None,
        lost_ranks: None,
        shrink: None,
        all_to_allv: None,
    };
    // SAFETY: the host's struct holds `size` bytes; at most `full` are copied into c, which
    // holds `full`; NULL (all-zero) is a valid value of every callback field.
    unsafe {
        std::ptr::copy_nonoverlapping(
            callbacks.cast::<u8>(),
            std::ptr::addr_of_mut!(c).cast::<u8>(),
            size.min(full),
        )
    };
    Ok(c)
}

struct CallbackTransport {
    cb: epcomm_host_callbacks,
    /// The group's world size (the length of the lost-ranks mask).
    world: usize,
    /// The status of the last failed callback.
    failed_with: i32,
}
// SAFETY: the host promises its callbacks may be called from the thread using the group; the
// handle is used by one thread at a time.
unsafe impl Send for CallbackTransport {}

impl CallbackTransport {
    /// A callback's return code, remembered for `failure_kind`.
    fn rc(&mut self, rc: i32) -> std::result::Result<(), String> {
        if rc == 0 {
            return Ok(());
        }
        self.failed_with = rc;
        let kind = match crate::Status::from_code(rc) {
            Some(crate::Status::PeerFailure) => " (EPCOMM_ERROR_PEER_FAILURE)",
            Some(crate::Status::Timeout) => " (EPCOMM_ERROR_TIMEOUT)",
            Some(_) | None => "",
        };
        Err(format!("callback returned {rc}{kind}"))
    }
}

impl HostTransport for CallbackTransport {
    fn send(&mut self, peer: usize, data: &[u8]) -> std::result::Result<(), String> {
        let (f, user) = (self.cb.send.ok_or("no send callback")?, self.cb.user_data);
        let (p, n) = (data.as_ptr().cast(), data.len());
        // SAFETY: the host's callback with its own user data; the buffer is valid for the call.
        let rc = unsafe { f(user, peer as i32, p, n) };
        self.rc(rc)
    }
    fn recv(&mut self, peer: usize, data: &mut [u8]) -> std::result::Result<(), String> {
        let (f, user) = (self.cb.recv.ok_or("no recv callback")?, self.cb.user_data);
        let (p, n) = (data.as_mut_ptr().cast(), data.len());
        // SAFETY: as above; the buffer is writable for `n` bytes.
        let rc = unsafe { f(user, peer as i32, p, n) };
        self.rc(rc)
    }
    fn all_gather(
        &mut self,
        mine: &[u8],
        out: &mut [u8],
    ) -> Option<std::result::Result<(), String>> {
        let (f, user) = (self.cb.all_gather?, self.cb.user_data);
        let (p, n, o) = (mine.as_ptr().cast(), mine.len(), out.as_mut_ptr().cast());
        // SAFETY: as above; `out` holds world * n bytes (checked by the caller).
        let rc = unsafe { f(user, p, n, o) };
        Some(self.rc(rc))
    }
    fn all_to_allv(&mut self, a: AllToAllv<'_>) -> Option<std::result::Result<(), String>> {
        let (f, user) = (self.cb.all_to_allv?, self.cb.user_data);
        let (s, r) = (a.send.as_ptr().cast(), a.recv.as_mut_ptr().cast());
        // SAFETY: as above; the size arrays hold world_size entries and the buffers their sums
        // (checked by the caller).
        let rc = unsafe { f(user, s, a.send_sizes.as_ptr(), r, a.recv_sizes.as_ptr()) };
        Some(self.rc(rc))
    }
    fn barrier(&mut self) -> Option<std::result::Result<(), String>> {
        let f = self.cb.barrier?;
        // SAFETY: as above.
        let rc = unsafe { f(self.cb.user_data) };
        Some(self.rc(rc))
    }
    fn failure_kind(&self) -> Option<HostFailure> {
        match crate::Status::from_code(self.failed_with) {
            Some(crate::Status::PeerFailure) => Some(HostFailure::PeerFailure),
            Some(crate::Status::Timeout) => Some(HostFailure::Timeout),
            Some(_) | None => None,
        }
    }
    fn lost_ranks(&self) -> Option<std::result::Result<Vec<usize>, String>> {
        let f = self.cb.lost_ranks?;
        let world = self.world;
        let mut mask = vec![0u8; world];
        // SAFETY: as above; `mask` holds world_size entries.
        let rc = unsafe { f(self.cb.user_data, mask.as_mut_ptr(), world as i32) };
        if rc != 0 {
            return Some(Err(format!("callback returned {rc}")));
        }
        Some(Ok((0..world).filter(|&r| mask[r] != 0).collect()))
    }
    fn shrink(
        &mut self,
        excluded: &[usize],
    ) -> Option<std::result::Result<Box<dyn HostTransport>, String>> {
        let f = self.cb.shrink?;
        let ranks: Vec<i32> = excluded.iter().map(|&r| r as i32).collect();
        let mut user: *mut c_void = std::ptr::null_mut();
        // SAFETY: as above; `ranks` holds `len` entries and `user` is writable.
        let rc = unsafe { f(self.cb.user_data, ranks.as_ptr(), ranks.len(), &mut user) };
        Some(self.rc(rc).map(|()| {
            let cb = epcomm_host_callbacks {
                user_data: user,
                ..self.cb
            };
            let world = self.world - excluded.len();
            let t = CallbackTransport {
                cb,
                world,
                failed_with: 0,
            };
            Box::new(t) as Box<dyn HostTransport>
        }))
    }
}

// The group constructors share (rank, world_size, options, out), spelled out for the header
// (see the module doc of `ffi`); create_shm_with and options_arg are the shared pieces.
/// Creates a group over the host's transport. `callbacks` is copied; `user_data` must stay
/// valid until the group is destroyed. `name` labels messages.
///
/// # Safety
/// Pointers are NULL or valid as documented.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_create_host(
    callbacks: *const epcomm_host_callbacks,
    name: *const c_char,
    rank: i32,
    world_size: i32,
    options: *const epcomm_group_options,
    out: *mut *mut epcomm_group,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let cb = unsafe { read_callbacks(callbacks) }?;
        let name = unsafe { guard::str_arg(name, "name") }?;
        let out = unsafe { guard::out_arg(out, "out") }?;
        let opts = unsafe { options_arg(options) }?;
        if cb.send.is_none() {
            return Err(Error::NullPointer("callbacks->send"));
        }
        if cb.recv.is_none() {
            return Err(Error::NullPointer("callbacks->recv"));
        }
        let rank = index_arg(rank, "rank")?;
        let world = index_arg(world_size, "world_size")?;
        let t = CallbackTransport {
            cb,
            world,
            failed_with: 0,
        };
        let g = HostGroup::new(Box::new(t), name, rank, world, opts.elastic)?;
        finish_create(Box::new(g), out);
        Ok(())
    })
}

/// Leaves the group and releases the handle (NULL is a no-op), as
/// epcomm_group_destroy_checked, whose status this void form cannot return: a refused destroy
/// frees nothing and records the error for epcomm_last_error_message.
///
/// # Safety
/// `group` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_destroy(group: *mut epcomm_group) {
    if !group.is_null() {
        // SAFETY: caller contract.
        unsafe { epcomm_group_destroy_checked(group) };
    }
}

/// Leaves the group and releases the handle: EPCOMM_OK. A shared-memory group first lets peers
/// finish reading its last contribution (bounded wait), then unlinks its memory. With all2all
/// managers or EPLB communicators made over it still alive, the handle is gone at once (calls on it
/// are refused) and the group is left and freed with the last of them. NULL is
/// EPCOMM_ERROR_NULL_POINTER. Refused with EPCOMM_ERROR_INVALID_STATE, freeing nothing: while a
/// call using the group (its own, or one of a manager made over it) is in flight on another thread
/// (destroy again after it returned); on a handle destroyed already; in a forked child of the
/// process that made it (the parent's group is left untouched).
///
/// # Safety
/// `group` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_destroy_checked(group: *mut epcomm_group) -> i32 {
    // SAFETY: only a registered handle is freed.
    guard::call(|| unsafe { epcomm_group::destroy(group) })
}

/// Runs `f` on the group behind the handle.
///
/// # Safety
/// `group` is NULL or a live handle.
pub(crate) unsafe fn with_group<T>(
    group: *const epcomm_group,
    f: impl FnOnce(&mut dyn Group) -> Result<T>,
) -> Result<T> {
    // SAFETY: caller contract: NULL or a live handle.
    unsafe { epcomm_group::with(group, |_, g| f(g.as_mut())) }
}

/// Runs `f` on the group a manager or communicator was made over (alive while it lives).
pub(crate) fn with_dep_group<T>(
    group: &Dep<epcomm_group>,
    f: impl FnOnce(&mut dyn Group) -> Result<T>,
) -> Result<T> {
    group.with(|_, g| f(g.as_mut()))
}

/// The entry point of collective `op` on the group behind the handle: `f` checks the
/// arguments (its outer error) and then runs the collective (its inner result). A rejected
/// argument is reported to the peers too, which then fail at once naming this rank instead of
/// waiting for it.
///
/// # Safety
/// `group` is NULL or a live handle.
unsafe fn collective(
    group: *const epcomm_group,
    op: Op,
    f: impl FnOnce(&mut dyn Group) -> Result<Result<()>>,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        unsafe {
            with_group(group, |g| match f(g) {
                Ok(r) => r,
                Err(e) => Err(g.reject(op, e)),
            })
        }
    })
}

/// Runs a collective over an `input` and an `output` host tensor: both validated (in that
/// order), then `f` checks the rest (its outer error, reported to the peers) and runs it.
///
/// # Safety
/// `group` is NULL or a live handle; the tensors are NULL or valid descriptors.
unsafe fn rows_collective(
    group: *const epcomm_group,
    op: Op,
    input: *const epcomm_tensor,
    output: *const epcomm_tensor,
    f: impl FnOnce(&mut dyn Group, HostTensor, HostTensor) -> Result<Result<()>>,
) -> i32 {
    // SAFETY: caller contract.
    unsafe {
        collective(group, op, |g| {
            let inp = HostTensor::from_ffi(input, "input")?;
            let out = HostTensor::from_ffi(output, "output")?;
            f(g, inp, out)
        })
    }
}

/// Row counts as byte counts.
fn byte_counts(rows: &[usize], row_bytes: usize) -> Vec<usize> {
    rows.iter().map(|r| r * row_bytes).collect()
}

/// Writes this process's rank in the group.
///
/// # Safety
/// `group` is NULL or a live handle; `rank_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_rank(group: *const epcomm_group, rank_out: *mut i32) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(rank_out, "rank_out") }?;
        *out = unsafe { with_group(group, |g| Ok(g.rank() as i32)) }?;
        Ok(())
    })
}

/// Writes the number of ranks in the group.
///
/// # Safety
/// `group` is NULL or a live handle; `size_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_size(group: *const epcomm_group, size_out: *mut i32) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(size_out, "size_out") }?;
        *out = unsafe { with_group(group, |g| Ok(g.size() as i32)) }?;
        Ok(())
    })
}

/// Fault tolerance: writes, for each rank r of the group, `out_mask[r]` = 1 if this rank holds
/// r as lost, else 0 (vLLM's active-mask encoding: 0 live, 1 masked). After an op failed,
/// the lost ranks are the rank the failure was blamed on (dead, stalled, failed or gone) and
/// every peer whose process is gone; never this rank; none while nothing failed. Over host
/// callbacks: what the host's `lost_ranks` callback reports (none without it). `len` must be
/// the group's size. Works on a group broken by a failure.
///
/// # Safety
/// `group` is NULL or a live handle; `out_mask` is NULL or holds `len` writable entries.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_lost_ranks(
    group: *const epcomm_group,
    out_mask: *mut i32,
    len: usize,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let (world, lost) = unsafe { with_group(group, |g| Ok((g.size(), g.lost_ranks()))) }?;
        if out_mask.is_null() {
            return Err(Error::NullPointer("out_mask"));
        }
        if len != world {
            return Err(Error::InvalidArgument(format!(
                "lost_ranks: out_mask has {len} entries; expected one per rank of the group ({world})"
            )));
        }
        // SAFETY: `out_mask` holds `len` writable entries (caller contract).
        let mask = unsafe { std::slice::from_raw_parts_mut(out_mask, len) };
        mask.fill(0);
        for r in lost {
            mask[r] = 1;
        }
        Ok(())
    })
}

/// Fault tolerance (as ncclCommShrink, MPI ULFM's MPI_Comm_shrink): the ranks of the group not
/// in `excluded` (`num_excluded` ranks, increasing, not this rank) form a new group, renumbered
/// in the old order, returned in `*out` (a normal group handle, with the same options).
/// Collective over the survivors; every survivor must pass the same list: survivors whose lists
/// differ fail (EPCOMM_ERROR_TIMEOUT, or EPCOMM_ERROR_INVALID_STATE naming both lists) and no
/// group forms. A rank its peers hold as lost (it stalled past the timeout, or failed) is
/// refused (EPCOMM_ERROR_PEER_FAILURE) and never joins. `group` stays valid (usually broken by
/// the failure): destroy it separately. Over host callbacks this calls the host's `shrink`
/// callback (EPCOMM_ERROR_NOT_IMPLEMENTED without it).
///
/// # Safety
/// `group` is NULL or a live handle; `excluded` holds `num_excluded` entries (or is NULL when
/// it is 0); `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_shrink(
    group: *mut epcomm_group,
    excluded: *const i32,
    num_excluded: usize,
    out: *mut *mut epcomm_group,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(out, "out") }?;
        let raw = unsafe { guard::slice_arg(excluded, num_excluded, "excluded") }?;
        let ranks = raw
            .iter()
            .enumerate()
            .map(|(i, &r)| index_arg(r, &format!("excluded[{i}]")))
            .collect::<Result<Vec<usize>>>()?;
        // SAFETY: caller contract.
        let g = unsafe { with_group(group, |g| g.shrink(&ranks)) }?;
        finish_create(g, out);
        Ok(())
    })
}

/// Returns once every rank entered the barrier.
///
/// # Safety
/// `group` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_barrier(group: *mut epcomm_group) -> i32 {
    // SAFETY: caller contract.
    guard::call(|| unsafe { with_group(group, |g| g.barrier()) })
}

/// The sum of row counts, or an error naming them when it does not fit.
fn total(counts: &[usize], what: &str) -> Result<usize> {
    counts
        .iter()
        .try_fold(0usize, |a, &c| a.checked_add(c))
        .filter(|&t| t <= 1 << 62)
        .ok_or_else(|| Error::InvalidArgument(format!("sum({what}) is too large: {counts:?}")))
}

/// Reads `world` row counts.
unsafe fn counts_arg(p: *const i64, world: usize, what: &'static str) -> Result<Vec<usize>> {
    // SAFETY: `world` (at least 1) entries (caller contract).
    let raw = unsafe { guard::slice_arg(p, world, what) }?;
    raw.iter()
        .enumerate()
        .map(|(i, &c)| {
            usize::try_from(c).map_err(|_| {
                Error::InvalidArgument(format!("{what}[{i}] is {c}; expected a row count >= 0"))
            })
        })
        .collect()
}

// The collectives below are written out for the header (see the module doc of `ffi`): each
// signature is its C API, each body one call of `collective` or `rows_collective`.
/// Gathers every rank's `input` rows along dimension 0 into `output`, in rank order.
/// `sizes` holds world_size row counts (sizes[r] = rows of rank r, may be 0); `input` has
/// sizes[rank] rows, `output` sum(sizes) rows of the same row shape and dtype (any dtype).
///
/// # Safety
/// Pointers are NULL or valid; tensors describe host memory valid for the call.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_all_gatherv(
    group: *mut epcomm_group,
    input: *const epcomm_tensor,
    sizes: *const i64,
    output: *const epcomm_tensor,
) -> i32 {
    // SAFETY: caller contract for every pointer.
    unsafe {
        rows_collective(group, Op::AllGatherv, input, output, |g, inp, out| {
            let sizes = counts_arg(sizes, g.size(), "sizes")?;
            inp.check_rows_like(&out)?;
            inp.check_rows(sizes[g.rank()], &format!("sizes[{}]", g.rank()))?;
            out.check_rows(total(&sizes, "sizes")?, "sum(sizes)")?;
            inp.check_disjoint(&out)?;
            let byte_sizes = byte_counts(&sizes, inp.row_bytes());
            Ok(g.all_gatherv(inp.as_slice(), &byte_sizes, out.as_mut_slice()))
        })
    }
}

// all_gatherv and reduce_scatterv take the same C arguments (a group, two tensors, the sizes);
// what they share beyond that is rows_collective.
/// Sums every rank's `input` (sum(sizes) rows) and writes this rank's slice (sizes[rank]
/// rows, after the rows of lower ranks) to `output`. dtype float32, bfloat16 or float16 (same
/// for both tensors); accumulates in float32, in rank order (deterministic).
///
/// # Safety
/// Pointers are NULL or valid; tensors describe host memory valid for the call.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_reduce_scatterv(
    group: *mut epcomm_group,
    input: *const epcomm_tensor,
    sizes: *const i64,
    output: *const epcomm_tensor,
) -> i32 {
    // SAFETY: caller contract for every pointer.
    unsafe {
        rows_collective(group, Op::ReduceScatterv, input, output, |g, inp, out| {
            let kind = FloatKind::from_dtype(inp.dtype).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "tensor 'input' has dtype {}; reduce_scatterv expects torch.float32, torch.bfloat16 or torch.float16",
                    inp.dtype.torch_name()
                ))
            })?;
            let sizes = counts_arg(sizes, g.size(), "sizes")?;
            inp.check_rows_like(&out)?;
            inp.check_rows(total(&sizes, "sizes")?, "sum(sizes)")?;
            out.check_rows(sizes[g.rank()], &format!("sizes[{}]", g.rank()))?;
            inp.check_disjoint(&out)?;
            Ok(g.reduce_scatterv(ReduceScatterv {
                input: inp.as_slice(),
                rows: &sizes,
                row_elems: inp.row_elems(),
                kind,
                output: out.as_mut_slice(),
            }))
        })
    }
}

/// Sends send_counts[p] consecutive rows of `input` to each rank p (in rank order) and receives
/// recv_counts[p] rows from each rank p into consecutive rows of `output`. Both tensors have the
/// same row shape and dtype (any dtype).
///
/// # Safety
/// Pointers are NULL or valid; tensors describe host memory valid for the call.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_all_to_allv(
    group: *mut epcomm_group,
    input: *const epcomm_tensor,
    send_counts: *const i64,
    output: *const epcomm_tensor,
    recv_counts: *const i64,
) -> i32 {
    // SAFETY: caller contract for every pointer.
    unsafe {
        rows_collective(group, Op::AllToAllv, input, output, |g, inp, out| {
            let sc = counts_arg(send_counts, g.size(), "send_counts")?;
            let rc = counts_arg(recv_counts, g.size(), "recv_counts")?;
            inp.check_rows_like(&out)?;
            inp.check_rows(total(&sc, "send_counts")?, "sum(send_counts)")?;
            out.check_rows(total(&rc, "recv_counts")?, "sum(recv_counts)")?;
            let me = g.rank();
            if sc[me] != rc[me] {
                return Err(Error::InvalidArgument(format!(
                    "all_to_allv: rank {me} sends {} rows to itself but expects {} (send_counts[{me}] != recv_counts[{me}])",
                    sc[me], rc[me]
                )));
            }
            inp.check_disjoint(&out)?;
            let (sb, rb) = (
                byte_counts(&sc, inp.row_bytes()),
                byte_counts(&rc, inp.row_bytes()),
            );
            Ok(g.all_to_allv(AllToAllv {
                send: inp.as_slice(),
                send_sizes: &sb,
                recv: out.as_mut_slice(),
                recv_sizes: &rb,
            }))
        })
    }
}

/// Point-to-point operation kind: send.
pub const EPCOMM_P2P_SEND: i32 = 0;
/// Point-to-point operation kind: receive.
pub const EPCOMM_P2P_RECV: i32 = 1;

/// One operation of a send/recv batch.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_p2p_op {
    /// EPCOMM_P2P_SEND or EPCOMM_P2P_RECV.
    pub kind: i32,
    /// The other rank (may be this rank).
    pub peer: i32,
    /// The whole tensor is sent, or received into (same byte size on both sides).
    pub tensor: *const epcomm_tensor,
}

/// A batch of sends and receives (like torch.distributed.batch_isend_irecv): the j-th send
/// from a to b fills the j-th receive on b from a, with equal byte sizes. Collective: every rank
/// calls it, possibly with num_ops = 0.
///
/// # Safety
/// `ops` holds `num_ops` valid entries (or is NULL when num_ops is 0); tensors are valid.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_send_recv(
    group: *mut epcomm_group,
    ops: *const epcomm_p2p_op,
    num_ops: usize,
) -> i32 {
    // SAFETY: caller contract for every pointer; each tensor is valid for the call and
    // receive buffers do not overlap others (checked below).
    unsafe {
        collective(group, Op::SendRecv, |g| {
            let raw = guard::slice_arg(ops, num_ops, "ops")?;
            let mut tensors = Vec::with_capacity(raw.len());
            for (i, o) in raw.iter().enumerate() {
                let t = HostTensor::from_ffi(o.tensor, "ops[i].tensor").map_err(|e| match e {
                    Error::NullPointer(_) => Error::InvalidArgument(format!(
                        "ops[{i}].tensor (or its shape/data) is NULL; expected a tensor"
                    )),
                    other => other,
                })?;
                if o.kind != EPCOMM_P2P_SEND && o.kind != EPCOMM_P2P_RECV {
                    return Err(Error::InvalidArgument(format!(
                        "ops[{i}].kind is {}; expected EPCOMM_P2P_SEND (0) or EPCOMM_P2P_RECV (1)",
                        o.kind
                    )));
                }
                let peer = index_arg(o.peer, "peer")?;
                tensors.push((o.kind, peer, t));
            }
            let writes: Vec<_> = tensors
                .iter()
                .map(|(k, _, t)| (*k == EPCOMM_P2P_RECV, t))
                .collect();
            check_writes_disjoint(&writes)?;
            // Each tensor is valid for the call; receive buffers overlap no other (above).
            let mut p2p: Vec<P2p<'_>> = tensors
                .iter()
                .map(|(k, peer, t)| t.p2p(*k == EPCOMM_P2P_SEND, *peer))
                .collect();
            Ok(g.send_recv(&mut p2p))
        })
    }
}

/// Copies `tensor` of rank `root` into `tensor` on every other rank (same byte size).
///
/// # Safety
/// Pointers are NULL or valid; the tensor describes host memory valid for the call.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_broadcast(
    group: *mut epcomm_group,
    tensor: *const epcomm_tensor,
    root: i32,
) -> i32 {
    // SAFETY: caller contract.
    unsafe {
        collective(group, Op::Broadcast, |g| {
            let t = HostTensor::from_ffi(tensor, "tensor")?;
            let root = index_arg(root, "root")?;
            Ok(g.broadcast(root, t.as_mut_slice()))
        })
    }
}

/// Gathers `bytes` bytes from every rank into `output` (world_size * bytes, rank order): for
/// small metadata such as counts.
///
/// # Safety
/// `input` holds `bytes` bytes; `output` holds world_size * `bytes` bytes.
#[no_mangle]
pub unsafe extern "C" fn epcomm_group_all_gather(
    group: *mut epcomm_group,
    input: *const c_void,
    bytes: usize,
    output: *mut c_void,
) -> i32 {
    // SAFETY: caller contract.
    unsafe {
        collective(group, Op::AllGatherv, |g| {
            if bytes > 0 && input.is_null() {
                return Err(Error::NullPointer("input"));
            }
            if output.is_null() {
                return Err(Error::NullPointer("output"));
            }
            let world = g.size();
            let Some(total) = bytes
                .checked_mul(world)
                .filter(|&t| t <= isize::MAX as usize)
            else {
                return Err(Error::InvalidArgument(format!(
                    "all_gather: bytes is {bytes}; expected at most {} (world_size {world} times bytes must fit in the largest buffer, {} bytes)",
                    isize::MAX as usize / world,
                    isize::MAX
                )));
            };
            let inp: &[u8] = if bytes == 0 {
                &[]
            } else {
                std::slice::from_raw_parts(input.cast(), bytes)
            };
            let out = std::slice::from_raw_parts_mut(output.cast::<u8>(), total);
            let (a0, a1) = (input as usize, input as usize + bytes);
            let (b0, b1) = (output as usize, output as usize + out.len());
            if bytes > 0 && a0 < b1 && b0 < a1 {
                return Err(Error::InvalidArgument(
                    "buffers 'input' and 'output' overlap; in-place operation is not supported"
                        .into(),
                ));
            }
            Ok(g.all_gather(inp, out))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// epcomm_tensor must be DLPack's DLTensor, field for field.
    #[test]
    fn tensor_has_dltensor_layout() {
        use std::mem::{offset_of, size_of};
        // DLTensor on LP64: data 0, device 8 (type 8, id 12), ndim 16, dtype 20 (code 20,
        // bits 21, lanes 22), shape 24, strides 32, byte_offset 40; size 48.
        assert_eq!(size_of::<epcomm_tensor>(), 48);
        assert_eq!(offset_of!(epcomm_tensor, data), 0);
        assert_eq!(offset_of!(epcomm_tensor, device), 8);
        assert_eq!(offset_of!(epcomm_tensor, ndim), 16);
        assert_eq!(offset_of!(epcomm_tensor, dtype), 20);
        assert_eq!(offset_of!(epcomm_tensor, shape), 24);
        assert_eq!(offset_of!(epcomm_tensor, strides), 32);
        assert_eq!(offset_of!(epcomm_tensor, byte_offset), 40);
        assert_eq!(size_of::<super::super::tensor::epcomm_device>(), 8);
        assert_eq!(size_of::<super::super::epcomm_dtype>(), 4);
    }

    #[test]
    fn default_timeout_is_sane() {
        assert!(crate::group::DEFAULT_TIMEOUT >= Duration::from_secs(10));
    }
}
