//! Our own NCCL loader and the two-sided transport's host side.
//!
//! cudarc cannot find NCCL's soname (`libnccl.so.2`) and panics on a missing library or symbol,
//! so the library is found by [`crate::probe::nccl`] (an already-loaded `libnccl.so.2` first, so
//! a host's communicator is used with the host's own copy) and every symbol is resolved here with
//! `dlsym`. A missing library or symbol is an [`Error::Unavailable`], never a panic. The C types
//! are declared here, so this module builds without the `cuda`/`nccl` features.
//!
//! The loader itself does not look at the `nccl` feature (it only needs `dlopen`); the C ABI
//! decides whether a build offers NCCL at all.
//!
//! Waiting: nothing here blocks on the GPU. A caller that waits for NCCL work (an event query
//! loop, a host sync for counts) should call [`NcclComm::async_error`] between polls and
//! [`NcclComm::abort`] an owned communicator when it reports an error; otherwise a peer that died
//! turns into a hang. A non-blocking communicator (a host's, created with `blocking = 0`)
//! answers `ncclInProgress` from collectives and group ends: that is work queued, not an
//! error; the call then polls `ncclCommGetAsyncError` until it leaves `ncclInProgress`,
//! bounded by [`NcclComm::set_timeout`].

pub mod plan;

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::probe::{self, Library};

pub use self::plan::{
    counts_plan, supports_zero_size_p2p, version_parts, CapacityLayout, ExchangeOptions,
    ExchangePlan, LocalCopy, PeerTransfer, ZERO_SIZE_P2P_MIN_VERSION,
};

/// `ncclResult_t`.
pub type NcclResult = c_int;
/// `ncclComm_t`: an opaque pointer.
pub type NcclCommRaw = *mut c_void;
/// `cudaStream_t` / `CUstream`: an opaque pointer.
pub type StreamRaw = *mut c_void;

/// `ncclSuccess`.
const NCCL_SUCCESS: NcclResult = 0;
/// `ncclInProgress` (non-blocking communicators).
const NCCL_IN_PROGRESS: NcclResult = 7;

/// `ncclUniqueId`: 128 opaque bytes, created on one rank and shared with the others.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId {
    /// The opaque bytes.
    pub internal: [u8; NcclUniqueId::BYTES],
}

impl NcclUniqueId {
    /// `NCCL_UNIQUE_ID_BYTES`.
    pub const BYTES: usize = 128;

    /// An id from its bytes (exactly 128).
    pub fn from_bytes(bytes: &[u8]) -> Result<NcclUniqueId> {
        let internal = bytes.try_into().map_err(|_| {
            Error::InvalidArgument(format!(
                "an NCCL unique id has {} bytes, got {}",
                Self::BYTES,
                bytes.len()
            ))
        })?;
        Ok(NcclUniqueId { internal })
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; NcclUniqueId::BYTES] {
        &self.internal
    }
}

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclUniqueId({:02x?}..)", &self.internal[..8])
    }
}

/// The `ncclDataType_t` values epcomm sends (fixed by nccl.h; its other types are not used
/// here: add one with nccl.h's value when a transfer needs it).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NcclDataType {
    /// `ncclUint8` (raw bytes).
    Uint8 = 1,
    /// `ncclInt32`.
    Int32 = 2,
}

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type GetUniqueIdFn = unsafe extern "C" fn(*mut NcclUniqueId) -> NcclResult;
type CommInitRankFn =
    unsafe extern "C" fn(*mut NcclCommRaw, c_int, NcclUniqueId, c_int) -> NcclResult;
type CommInitRankConfigFn = unsafe extern "C" fn(
    *mut NcclCommRaw,
    c_int,
    NcclUniqueId,
    c_int,
    *mut NcclConfig,
) -> NcclResult;

/// `ncclConfig_t` as NCCL 2.14 declared it (nccl.h). Later versions append fields; NCCL copies
/// `size` bytes over its defaults and ignores the fields a `version` predates, so this prefix
/// is valid for every NCCL >= 2.14.
#[repr(C)]
#[derive(Debug)]
struct NcclConfig {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

impl NcclConfig {
    /// `NCCL_CONFIG_INITIALIZER` of NCCL 2.14 with `blocking = 0`.
    fn nonblocking() -> NcclConfig {
        const UNDEF: c_int = c_int::MIN; // NCCL_CONFIG_UNDEF_INT
        NcclConfig {
            size: std::mem::size_of::<NcclConfig>(),
            magic: 0xcafe_beef,
            version: 21400, // NCCL_VERSION(2, 14, 0)
            blocking: 0,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
        }
    }
}
type CommFn = unsafe extern "C" fn(NcclCommRaw) -> NcclResult;
type CommIntFn = unsafe extern "C" fn(NcclCommRaw, *mut c_int) -> NcclResult;
type AllGatherFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    NcclCommRaw,
    StreamRaw,
) -> NcclResult;
type SendFn =
    unsafe extern "C" fn(*const c_void, usize, c_int, c_int, NcclCommRaw, StreamRaw) -> NcclResult;
type RecvFn =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclCommRaw, StreamRaw) -> NcclResult;
type GroupFn = unsafe extern "C" fn() -> NcclResult;
type ErrorStringFn = unsafe extern "C" fn(NcclResult) -> *const c_char;
type LastErrorFn = unsafe extern "C" fn(NcclCommRaw) -> *const c_char;

/// The resolved NCCL function table (one per process).
pub struct NcclApi {
    /// The library the symbols came from.
    pub lib: Library,
    /// The runtime version code (`ncclGetVersion`, e.g. 22809).
    pub version: i32,
    get_unique_id: GetUniqueIdFn,
    comm_init_rank: CommInitRankFn,
    /// `ncclCommInitRankConfig` exists from NCCL 2.14 on; optional.
    comm_init_rank_config: Option<CommInitRankConfigFn>,
    comm_destroy: CommFn,
    comm_abort: CommFn,
    comm_get_async_error: CommIntFn,
    comm_count: CommIntFn,
    comm_user_rank: CommIntFn,
    all_gather: AllGatherFn,
    send: SendFn,
    recv: RecvFn,
    group_start: GroupFn,
    group_end: GroupFn,
    get_error_string: ErrorStringFn,
    /// `ncclGetLastError` exists from NCCL 2.13 on; optional.
    get_last_error: Option<LastErrorFn>,
}

impl std::fmt::Debug for NcclApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclApi")
            .field("lib", &self.lib.name)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// Resolves `name` as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the `extern "C"` function-pointer type of the symbol's real signature.
unsafe fn sym<F: Copy>(lib: &Library, name: &str) -> std::result::Result<F, String> {
    let p = lib
        .symbol(name)
        .ok_or_else(|| format!("{} has no symbol {name}", lib.name))?;
    debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: the caller names the right signature; a data pointer and a function pointer have
    // the same size and representation on every platform NCCL supports.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

fn load() -> std::result::Result<NcclApi, String> {
    let lib = probe::nccl()?;
    // SAFETY: every type below is the signature from nccl.h (NCCL 2.x, stable across 2.x).
    unsafe {
        let get_version: GetVersionFn = sym(&lib, "ncclGetVersion")?;
        let mut version: c_int = 0;
        let rc = get_version(&mut version);
        if rc != NCCL_SUCCESS {
            return Err(format!("ncclGetVersion failed with ncclResult_t {rc}"));
        }
        if version / 10000 != 2 && version / 1000 != 2 {
            return Err(format!(
                "{} reports version code {version}; epcomm needs NCCL 2.x",
                lib.name
            ));
        }
        Ok(NcclApi {
            lib,
            version,
            get_unique_id: sym(&lib, "ncclGetUniqueId")?,
            comm_init_rank: sym(&lib, "ncclCommInitRank")?,
            comm_init_rank_config: sym(&lib, "ncclCommInitRankConfig").ok(),
            comm_destroy: sym(&lib, "ncclCommDestroy")?,
            comm_abort: sym(&lib, "ncclCommAbort")?,
            comm_get_async_error: sym(&lib, "ncclCommGetAsyncError")?,
            comm_count: sym(&lib, "ncclCommCount")?,
            comm_user_rank: sym(&lib, "ncclCommUserRank")?,
            all_gather: sym(&lib, "ncclAllGather")?,
            send: sym(&lib, "ncclSend")?,
            recv: sym(&lib, "ncclRecv")?,
            group_start: sym(&lib, "ncclGroupStart")?,
            group_end: sym(&lib, "ncclGroupEnd")?,
            get_error_string: sym(&lib, "ncclGetErrorString")?,
            get_last_error: sym(&lib, "ncclGetLastError").ok(),
        })
    }
}

/// The NCCL function table, loaded once per process. The error is
/// "NCCL is unavailable: {why}" (the wording of `epcomm_nccl_version`).
pub fn api() -> Result<&'static NcclApi> {
    static API: OnceLock<std::result::Result<NcclApi, String>> = OnceLock::new();
    API.get_or_init(load)
        .as_ref()
        .map_err(|e| Error::Unavailable(format!("NCCL is unavailable: {e}")))
}

impl NcclApi {
    /// NCCL's text for a result code.
    pub fn error_string(&self, rc: NcclResult) -> String {
        // SAFETY: ncclGetErrorString returns a static string for every code.
        let p = unsafe { (self.get_error_string)(rc) };
        if p.is_null() {
            return format!("unknown NCCL error {rc}");
        }
        // SAFETY: non-NULL, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// NCCL's last error detail (`ncclGetLastError`, NCCL ≥ 2.13), if any.
    fn last_error(&self, comm: NcclCommRaw) -> Option<String> {
        let f = self.get_last_error?;
        // SAFETY: ncclGetLastError accepts NULL or a communicator and returns a C string.
        let p = unsafe { f(comm) };
        if p.is_null() {
            return None;
        }
        // SAFETY: non-NULL, NUL-terminated, owned by NCCL.
        let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
        (!s.is_empty()).then_some(s)
    }

    /// `Ok` for `ncclSuccess`, else the error for `rc` from the call `what`.
    pub fn check(&self, rc: NcclResult, what: &str) -> Result<()> {
        self.check_comm(rc, what, std::ptr::null_mut())
    }

    fn check_comm(&self, rc: NcclResult, what: &str, comm: NcclCommRaw) -> Result<()> {
        if rc == NCCL_SUCCESS {
            return Ok(());
        }
        let mut msg = format!(
            "NCCL error in {what}: {} (ncclResult_t {rc})",
            self.error_string(rc)
        );
        if let Some(detail) = self.last_error(comm) {
            msg.push_str(": ");
            msg.push_str(&detail);
        }
        Err(nccl_error(rc, msg))
    }

    /// A new unique id (`ncclGetUniqueId`), to be shared with every rank.
    pub fn unique_id(&self) -> Result<NcclUniqueId> {
        let mut id = NcclUniqueId {
            internal: [0; NcclUniqueId::BYTES],
        };
        // SAFETY: `id` is a writable ncclUniqueId.
        let rc = unsafe { (self.get_unique_id)(&mut id) };
        self.check(rc, "ncclGetUniqueId")?;
        Ok(id)
    }

    /// `ncclGroupStart`.
    pub fn group_start(&self) -> Result<()> {
        // SAFETY: no arguments; NCCL tracks groups per thread.
        self.check(unsafe { (self.group_start)() }, "ncclGroupStart")
    }

    /// `ncclGroupEnd`.
    pub fn group_end(&self) -> Result<()> {
        // SAFETY: as above.
        self.check(unsafe { (self.group_end)() }, "ncclGroupEnd")
    }
}

/// The status for an NCCL result code: invalid argument/usage → InvalidArgument, remote error →
/// PeerFailure, in progress → InvalidState, the rest → Runtime.
fn nccl_error(rc: NcclResult, msg: String) -> Error {
    match rc {
        4 | 5 => Error::InvalidArgument(msg),
        6 => Error::PeerFailure(msg),
        7 => Error::InvalidState(msg),
        _ => Error::Runtime(msg),
    }
}

/// An NCCL communicator: owned (created from a unique id, destroyed on drop) or borrowed (a
/// host's `ncclComm_t`, never destroyed or aborted by epcomm). Like NCCL itself, one thread at
/// a time may use it.
#[derive(Debug)]
pub struct NcclComm {
    api: &'static NcclApi,
    raw: NcclCommRaw,
    owned: bool,
    /// Aborted (owned only): never destroyed or used again.
    aborted: Cell<bool>,
    rank: usize,
    world: usize,
    timeout: Duration,
}

/// How long a non-blocking communicator's queued call may stay `ncclInProgress` by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

// SAFETY: an ncclComm_t may be used from any thread as long as one thread uses it at a time,
// which `&mut`/ownership rules and the handle's documented contract give.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Joins the communicator of `world` ranks identified by `id` as `rank` (collective over
    /// all ranks), bounded by [`DEFAULT_TIMEOUT`] ([`NcclComm::init_rank_within`]).
    pub fn init_rank(id: &NcclUniqueId, rank: usize, world: usize) -> Result<NcclComm> {
        NcclComm::init_rank_within(id, rank, world, DEFAULT_TIMEOUT)
    }

    /// Joins the communicator of `world` ranks identified by `id` as `rank`; the current CUDA
    /// device is the one NCCL uses. With NCCL >= 2.14 the communicator is non-blocking
    /// (`ncclCommInitRankConfig`, `blocking = 0`): the init, and later every group end and
    /// collective, returns at once and is waited out polling `ncclCommGetAsyncError`, bounded
    /// by `timeout` (the init) and [`NcclComm::set_timeout`] (the rest); an init that does not
    /// complete in time (a rank that never joined) is aborted and a Timeout. Older NCCL:
    /// `ncclCommInitRank`, which blocks until every rank joined, with no bound.
    pub fn init_rank_within(
        id: &NcclUniqueId,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<NcclComm> {
        let api = api()?;
        if world == 0 || rank >= world || world > c_int::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "NCCL communicator: rank {rank} is out of range for world size {world}"
            )));
        }
        let mut raw: NcclCommRaw = std::ptr::null_mut();
        let (rc, what) = match api.comm_init_rank_config {
            Some(f) => {
                let mut cfg = NcclConfig::nonblocking();
                // SAFETY: `raw` is writable; the id by value and the config as nccl.h declares.
                let rc = unsafe { f(&mut raw, world as c_int, *id, rank as c_int, &mut cfg) };
                (rc, "ncclCommInitRankConfig")
            }
            // SAFETY: `raw` is writable; the id is passed by value as nccl.h declares.
            None => (
                unsafe { (api.comm_init_rank)(&mut raw, world as c_int, *id, rank as c_int) },
                "ncclCommInitRank",
            ),
        };
        if raw.is_null() {
            api.check(rc, what)?;
            return Err(Error::Runtime(format!(
                "NCCL error in {what}: returned success but no communicator"
            )));
        }
        let mut comm = NcclComm {
            api,
            raw,
            owned: true,
            aborted: Cell::new(false),
            rank,
            world,
            timeout,
        };
        if let Err(e) = comm.settle(rc, what) {
            // A half-made communicator: abort it (never destroyed) and report why.
            let _ = comm.abort();
            return Err(e);
        }
        comm.timeout = DEFAULT_TIMEOUT;
        Ok(comm)
    }

    /// Adopts a host's communicator (borrowed: never destroyed or aborted here).
    ///
    /// # Safety
    /// `raw` must be a live `ncclComm_t` created by the same NCCL library [`api`] loaded (the
    /// host's already-loaded `libnccl.so.2` is preferred for exactly this reason), and must
    /// outlive the returned value.
    pub unsafe fn adopt(raw: NcclCommRaw) -> Result<NcclComm> {
        if raw.is_null() {
            return Err(Error::NullPointer("nccl_comm"));
        }
        let api = api()?;
        let mut comm = NcclComm {
            api,
            raw,
            owned: false,
            aborted: Cell::new(false),
            rank: 0,
            world: 0,
            timeout: DEFAULT_TIMEOUT,
        };
        let (mut r, mut n): (c_int, c_int) = (0, 0);
        // SAFETY: caller contract: a live communicator; outputs writable.
        comm.check(
            unsafe { (api.comm_user_rank)(raw, &mut r) },
            "ncclCommUserRank",
        )?;
        // SAFETY: as above.
        comm.check(unsafe { (api.comm_count)(raw, &mut n) }, "ncclCommCount")?;
        comm.rank = usize::try_from(r).unwrap_or(0);
        comm.world = usize::try_from(n).unwrap_or(0);
        Ok(comm)
    }

    fn check(&self, rc: NcclResult, what: &str) -> Result<()> {
        self.api.check_comm(rc, what, self.raw)
    }

    /// The bound on waiting for a non-blocking communicator's queued call.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// `rc` of a call outside a group or of the outermost group end: `ncclInProgress` (a
    /// non-blocking communicator queued it) waits until the communicator leaves that state.
    fn settle(&self, rc: NcclResult, what: &str) -> Result<()> {
        if rc != NCCL_IN_PROGRESS {
            return self.check(rc, what);
        }
        let start = Instant::now();
        loop {
            let mut state: c_int = NCCL_SUCCESS;
            // SAFETY: live communicator, writable output.
            let call = unsafe { (self.api.comm_get_async_error)(self.raw, &mut state) };
            self.check(call, "ncclCommGetAsyncError")?;
            if state != NCCL_IN_PROGRESS {
                return self.check(state, what);
            }
            if start.elapsed() > self.timeout {
                return Err(Error::Timeout(format!(
                    "NCCL: {what} was still in progress after {:?} (a non-blocking communicator; a peer rank is not participating?)",
                    self.timeout
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// A call inside a group: `ncclInProgress` is queued work (the group end settles it).
    fn check_queued(&self, rc: NcclResult, what: &str) -> Result<()> {
        if rc == NCCL_IN_PROGRESS {
            return Ok(());
        }
        self.check(rc, what)
    }

    /// `ncclGroupStart` for this communicator's calls.
    pub fn group_start(&self) -> Result<()> {
        self.api.group_start()
    }

    /// `ncclGroupEnd`, settled: a non-blocking communicator's `ncclInProgress` is waited out
    /// (bounded).
    pub fn group_end(&self) -> Result<()> {
        // SAFETY: no arguments; NCCL tracks groups per thread.
        let rc = unsafe { (self.api.group_end)() };
        self.settle(rc, "ncclGroupEnd")
    }

    /// The function table.
    pub fn api(&self) -> &'static NcclApi {
        self.api
    }

    /// The raw `ncclComm_t`.
    pub fn raw(&self) -> NcclCommRaw {
        self.raw
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Whether epcomm created (and will destroy) this communicator.
    pub fn is_owned(&self) -> bool {
        self.owned
    }

    /// The communicator's asynchronous error (`ncclCommGetAsyncError`): `Ok` while healthy or
    /// still initialising. Poll it while waiting on NCCL work.
    pub fn async_error(&self) -> Result<()> {
        self.live()?;
        let mut rc: c_int = NCCL_SUCCESS;
        // SAFETY: live communicator, writable output.
        let call = unsafe { (self.api.comm_get_async_error)(self.raw, &mut rc) };
        self.check(call, "ncclCommGetAsyncError")?;
        if rc == NCCL_IN_PROGRESS {
            return Ok(());
        }
        self.check(rc, "an asynchronous NCCL operation")
    }

    /// Aborts an owned communicator (`ncclCommAbort`: pending work is dropped, peers see an
    /// error); it is not destroyed afterwards and every later call on it fails. A second abort
    /// is a no-op. A borrowed one is the host's to abort: InvalidState.
    pub fn abort(&self) -> Result<()> {
        if !self.owned {
            return Err(Error::InvalidState(
                "the NCCL communicator is borrowed from the host; epcomm never aborts it".into(),
            ));
        }
        if self.aborted.replace(true) {
            return Ok(());
        }
        // SAFETY: owned, live communicator; Drop will not destroy it (aborted).
        let rc = unsafe { (self.api.comm_abort)(self.raw) };
        self.api.check(rc, "ncclCommAbort")
    }

    /// Whether [`NcclComm::abort`] ran.
    pub fn is_aborted(&self) -> bool {
        self.aborted.get()
    }

    /// InvalidState once aborted (the handle is gone).
    fn live(&self) -> Result<()> {
        if self.aborted.get() {
            return Err(Error::InvalidState(
                "the NCCL communicator was aborted after an earlier failure".into(),
            ));
        }
        Ok(())
    }

    /// `ncclAllGather` of `count` elements of `dtype` per rank.
    ///
    /// # Safety
    /// `send` holds `count` elements and `recv` `count * world` elements, both device memory
    /// of this communicator's device; `stream` is a valid stream of that device (or NULL for
    /// the legacy default stream).
    pub unsafe fn all_gather(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: NcclDataType,
        stream: StreamRaw,
    ) -> Result<()> {
        self.live()?;
        // SAFETY: caller contract.
        let rc =
            unsafe { (self.api.all_gather)(send, recv, count, dtype as c_int, self.raw, stream) };
        self.settle(rc, "ncclAllGather")
    }

    /// Issues one grouped exchange (`ncclGroupStart`; per planned peer an `ncclSend` and an
    /// `ncclRecv` of bytes; `ncclGroupEnd`). The plan's local copy is not issued here (a copy
    /// kernel or `cuMemcpyDtoDAsync` does it). Returns once the work is enqueued on `stream`;
    /// waiting, and polling [`NcclComm::async_error`] meanwhile, is the caller's business.
    ///
    /// # Safety
    /// `send_base` / `recv_base` are device addresses of at least `plan.send_bytes` /
    /// `plan.recv_bytes` bytes on this communicator's device, and `stream` is a valid stream of
    /// that device. Every rank must issue its own plan for the same matrix.
    pub unsafe fn exchange(
        &self,
        plan: &ExchangePlan,
        send_base: u64,
        recv_base: u64,
        stream: StreamRaw,
    ) -> Result<()> {
        if plan.world != self.world || plan.rank != self.rank {
            return Err(Error::InvalidArgument(format!(
                "exchange plan is for rank {} of {}, but the communicator is rank {} of {}",
                plan.rank, plan.world, self.rank, self.world
            )));
        }
        self.live()?;
        self.api.group_start()?;
        let mut first_err: Option<Error> = None;
        let sends = plan.sends.iter().map(|t| (true, send_base, t));
        for (send, base, t) in sends.chain(plan.recvs.iter().map(|t| (false, recv_base, t))) {
            // SAFETY: caller contract.
            if let Err(e) = unsafe { self.queue_p2p(send, base, t, stream) } {
                first_err.get_or_insert(e);
            }
        }
        // The group must be closed even after a failed call, or NCCL's per-thread group state
        // stays open for the next caller.
        let end = self.group_end();
        match first_err {
            Some(e) => Err(e),
            None => end,
        }
    }

    /// Queues one `ncclSend` (`send`) or `ncclRecv` of `t` at `base` in the open group.
    ///
    /// # Safety
    /// As [`NcclComm::exchange`]: `base` holds the plan's bytes on this device.
    unsafe fn queue_p2p(
        &self,
        send: bool,
        base: u64,
        t: &PeerTransfer,
        stream: StreamRaw,
    ) -> Result<()> {
        let p = (base as usize).wrapping_add(t.offset) as *mut c_void;
        let (dtype, peer) = (NcclDataType::Uint8 as c_int, t.peer as c_int);
        // SAFETY: caller contract; peer < world (plans are built for this world).
        let rc = unsafe {
            if send {
                (self.api.send)(p, t.bytes, dtype, peer, self.raw, stream)
            } else {
                (self.api.recv)(p, t.bytes, dtype, peer, self.raw, stream)
            }
        };
        let what = if send { "ncclSend to" } else { "ncclRecv from" };
        self.check_queued(rc, &format!("{what} rank {}", t.peer))
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.owned && !self.aborted.get() {
            // SAFETY: owned, live communicator; never used again. Errors cannot be reported
            // from drop; ncclCommDestroy frees the resources either way.
            let _ = unsafe { (self.api.comm_destroy)(self.raw) };
        }
    }
}

/// A new unique id from the loaded NCCL.
pub fn unique_id() -> Result<NcclUniqueId> {
    api()?.unique_id()
}
