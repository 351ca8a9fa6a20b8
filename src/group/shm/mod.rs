//! The shared-memory transport: ranks on one host (processes or threads).
//!
//! Layout: a control segment (a header, one slot of counters per rank and one data descriptor per
//! rank) and one data segment per rank, which that rank writes and every peer maps. Segments are
//! sealed memfds without a name in /dev/shm (see segment.rs): peers open them through
//! `/proc/{pid}/fd/{fd}` while their creator still holds the descriptor, and the creator closes
//! it once every peer has mapped them, so nothing of a formed group can be reached by name or
//! left behind by a crash. A primitive is a numbered *op*: each rank writes what it shares
//! once into its own region and sets `published = n`; peers wait for that, read straight from
//! the region into their outputs (reductions sum there too), and set `consumed = n`. A rank
//! reuses its region only after every peer consumed its previous op, so there are no full
//! barriers between ops. Regions grow on demand (a new generation; peers remap lazily).
//!
//! Direct mode (the default where the kernel allows it): instead of copying its contribution
//! into its region, a rank publishes the addresses of its own buffers, and peers copy straight
//! from them (`process_vm_readv`, or a plain copy between threads): one copy per byte, as MPI's
//! CMA path. The rank then waits until every peer consumed the op before returning, since the
//! buffers are the caller's. Ranks agree on the mode when they join (`EPCOMM_SHM_DIRECT=0`
//! forces the region mode).
//!
//! Joining: rank 0 creates the control segment and a rendezvous record `/dev/shm/epcomm.{name}`
//! naming it (replacing a stale record of a crashed run), every rank claims its slot and maps
//! every peer's data segment, and once all did, rank 0 removes the record and every rank closes
//! its descriptors. A process of another job that meets the record or a taken slot marks the
//! group conflicted, so neither job forms a group with the other's ranks. Every wait is
//! bounded by the timeout and checks peers' liveness (pid gone or zombie, or the peer marked
//! itself failed/left) about every 50 ms.

mod agree;
mod segment;

pub use self::segment::pin_current_thread;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use self::segment::{
    copy_from_process, copy_scattered_from_process, pid_alive, Segment, SharedAtomics,
};
use super::{
    check_len, check_p2p, check_rank, check_reduce_scatterv, check_sizes, Group, GroupOptions, Op,
    P2p,
};
use crate::error::{Error, Result};
use crate::group::rows;
use crate::num::{self, FloatKind};

const MAGIC: u64 = 0x6570_636f_6d6d_0004; // "epcomm" + layout version 4
const LAYOUT_VERSION: u32 = 4;
const HEADER_BYTES: usize = 4096;
/// `Header::conflict_pid` once the group formed without a conflict.
const FORMED: u64 = u64::MAX;
/// Bounds of the settle time: after every rank joined, a group keeps its rendezvous record
/// for three times the spread of its ranks' arrivals, within these bounds, so that the ranks of
/// another job started at about the same time under the same name meet it and both jobs fail
/// instead of forming mixed groups.
const SETTLE_MIN: Duration = Duration::from_millis(20);
const SETTLE_MAX: Duration = Duration::from_secs(1);
/// Largest world size the shm transport accepts.
pub const MAX_WORLD: usize = 1024;
const OP_HEADER_BYTES: usize = 64;
const LIVENESS_PERIOD: Duration = Duration::from_millis(50);

#[repr(C, align(64))]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    world: AtomicU32,
    creator_pid: AtomicU32,
    _pad: AtomicU32,
    session: AtomicU64,
    /// A rank that tried to join with another world size: rank + 1 (0 = none).
    mismatch_rank: AtomicU64,
    mismatch_world: AtomicU64,
    /// When rank 0 created the segment (ns since the Unix epoch).
    created_ns: AtomicU64,
    /// pid of a process of another job that tried to join this group under the same name
    /// (0 = none): the group must not form. Rank 0 sets [`FORMED`] once the group has waited
    /// out its settle time; the first to set the word decides, so every rank agrees.
    conflict_pid: AtomicU64,
    /// The identity (st_dev, st_ino) of the rendezvous record rank 0 created, so it is removed
    /// even when another process overwrote or truncated its contents.
    record_dev: AtomicU64,
    record_ino: AtomicU64,
}
// SAFETY: atomics only; all-zero is the valid "uninitialised" state.
unsafe impl SharedAtomics for Header {}

const SLOT_EMPTY: u32 = 0;
const SLOT_ACTIVE: u32 = 1;
const SLOT_LEFT: u32 = 2;
const SLOT_FAILED: u32 = 3;
/// Gave up waiting for the others to join (timed out); not a failure the others report.
const SLOT_GAVE_UP: u32 = 4;

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[repr(C, align(128))]
struct Slot {
    token: AtomicU64,
    pid: AtomicU32,
    state: AtomicU32,
    data_gen: AtomicU64,
    data_bytes: AtomicU64,
    published: AtomicU64,
    consumed: AtomicU64,
    op_kind: AtomicU32,
    /// Direct reads of this rank's memory work for peers: 0 unknown, 1 yes, 2 no.
    direct_ok: AtomicU32,
    /// Address of a private probe word (holding `token`) for the direct-read check.
    probe_addr: AtomicU64,
    /// Rank 0's slot only: the group's decision word, the latest op decided and how
    /// (see [`Decision`]). Every rank obeys it, so all reach the same outcome for every op.
    decision: AtomicU64,
    /// `n << 8 | verdict` of the op `n` this rank published: [`VERDICT_OK`] or
    /// [`VERDICT_REJECTED`] (its arguments failed its own checks; it sends nothing).
    verdict: AtomicU64,
    /// The op's parameters every rank must agree on (root, dtype, sizes digest, ...).
    params: [AtomicU64; PARAMS],
}
// SAFETY: atomics only; all-zero means an empty slot.
unsafe impl SharedAtomics for Slot {}

/// Parameter words per op that every rank compares before any data moves.
const PARAMS: usize = 5;
const VERDICT_OK: u64 = 1;
const VERDICT_REJECTED: u64 = 2;

// The decision word: outcome (2 bits) | cause (6 bits) | blamed rank + 1 (12 bits) | op (44).
// 0 is "op 0 (the join) committed". A rank takes part in op n only after it saw op n - 1
// committed, so a word for a later op implies that every earlier op was committed.
const OUTCOME_COMMIT: u64 = 1;
const OUTCOME_ABORT: u64 = 2;
const OP_BITS: u64 = 44;
const OP_MASK: u64 = (1 << OP_BITS) - 1;

/// Why an op was aborted: the first failure, which every rank reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    /// The blamed rank's process is gone.
    Died = 1,
    /// The blamed rank did not arrive within the timeout.
    Stalled = 2,
    /// An error on the blamed rank aborted the op.
    Failed = 3,
    /// The blamed rank destroyed its handle.
    Left = 4,
}

impl Cause {
    fn from_code(c: u64) -> Cause {
        [Cause::Died, Cause::Stalled, Cause::Left]
            .into_iter()
            .find(|x| *x as u64 == c)
            .unwrap_or(Cause::Failed)
    }
}

/// The outcome of one op, as the decision word says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    Pending,
    Commit,
    Abort { rank: usize, cause: Cause },
}

fn abort_word(n: u64, rank: usize, cause: Cause) -> u64 {
    OUTCOME_ABORT << 62 | (cause as u64) << 56 | ((rank as u64 + 1) & 0xfff) << OP_BITS | n
}

/// What decision word `d` says about op `n`.
fn decoded(d: u64, n: u64) -> Decision {
    let op = d & OP_MASK;
    let aborted = d >> 62 == OUTCOME_ABORT;
    if op > n || (op == n && !aborted) {
        return Decision::Commit;
    }
    if !aborted {
        return Decision::Pending;
    }
    Decision::Abort {
        rank: (((d >> OP_BITS) & 0xfff) as usize).saturating_sub(1),
        cause: Cause::from_code((d >> 56) & 0x3f),
    }
}

/// Where a rank's data segment is: the creator's descriptor number and the file's identity,
/// which peers check when they open it. `gen` is stored last (release).
#[repr(C, align(64))]
struct DataDesc {
    fd: AtomicU32,
    _pad: AtomicU32,
    dev: AtomicU64,
    ino: AtomicU64,
    bytes: AtomicU64,
    gen: AtomicU64,
    /// When this rank called join (ns since the Unix epoch): the spread of the ranks' arrivals
    /// sets how long the group waits for a conflicting job to show up.
    started_ns: AtomicU64,
}
// SAFETY: atomics only; all-zero means "not created yet".
unsafe impl SharedAtomics for DataDesc {}

fn control_bytes(world: usize) -> usize {
    HEADER_BYTES + world * (std::mem::size_of::<Slot>() + std::mem::size_of::<DataDesc>())
}

fn desc_offset(world: usize, r: usize) -> usize {
    HEADER_BYTES + world * std::mem::size_of::<Slot>() + r * std::mem::size_of::<DataDesc>()
}

/// Tells peers where segment `seg` (generation `gen`) is.
fn publish_desc(d: &DataDesc, seg: &Segment, gen: u64) {
    d.fd.store(seg.fd().unwrap_or(0), Ordering::Relaxed);
    d.dev.store(seg.key().0, Ordering::Relaxed);
    d.ino.store(seg.key().1, Ordering::Relaxed);
    d.bytes.store(seg.len() as u64, Ordering::Relaxed);
    d.gen.store(gen, Ordering::Release);
}

/// A rank maps the control segment and every rank's data segment (at most `world + 1` new
/// mappings; thread ranks of one process share them). Refuses a group that would exceed
/// `vm.max_map_count` with the mappings this process already has, so the limit is an error
/// here instead of a failed mmap (or an abort) later.
fn check_map_budget(name: &str, rank: usize, world: usize) -> Result<()> {
    let Some(limit) = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
    else {
        return Ok(());
    };
    // One count of this process's mappings serves the thread ranks joining at about the same
    // time (each adds its share), so 1024 of them do not each read /proc/self/maps.
    static COUNTED: Mutex<Option<(Instant, usize)>> = Mutex::new(None);
    let mut counted = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    let used = match *counted {
        Some((at, n)) if at.elapsed() < Duration::from_millis(200) => n,
        _ => {
            let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
                return Ok(());
            };
            maps.lines().count()
        }
    };
    *counted = Some((Instant::now(), used + 2));
    map_budget(name, rank, world, used, limit)
}

/// Whether `world + 2` more mappings fit under `limit` with `used` taken (and a margin of 256
/// for growth, which remaps one region at a time, and the process's own allocations).
fn map_budget(name: &str, rank: usize, world: usize, used: usize, limit: usize) -> Result<()> {
    if used + world + 2 + 256 > limit {
        return Err(Error::System(format!(
            "group '{name}' needs up to {} memory mappings on rank {rank}, but this process already has {used} of the vm.max_map_count limit of {limit} (raise it with sysctl vm.max_map_count, or run fewer ranks per process)",
            world + 2
        )));
    }
    Ok(())
}

/// The rendezvous record `/dev/shm/epcomm.{name}`: where rank 0's control segment is. Written
/// once with one pwrite and read with pread (never mapped); a checksum tells a complete record
/// from one being written.
#[derive(Clone, Copy, Debug)]
struct Record {
    version: u32,
    world: u32,
    creator: u32,
    fd: u32,
    key: segment::FileKey,
    session: u64,
    created_ns: u64,
}

const RECORD_BYTES: usize = 64;

fn record_checksum(b: &[u8]) -> u64 {
    b[..56].chunks_exact(8).fold(0xcbf2_9ce4_8422_2325, |h, c| {
        (h ^ u64::from_ne_bytes(c.try_into().unwrap())).wrapping_mul(0x100_0000_01b3)
    })
}

impl Record {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(RECORD_BYTES);
        b.extend(MAGIC.to_ne_bytes());
        b.extend(self.version.to_ne_bytes());
        b.extend(self.world.to_ne_bytes());
        b.extend(self.creator.to_ne_bytes());
        b.extend(self.fd.to_ne_bytes());
        b.extend(self.key.0.to_ne_bytes());
        b.extend(self.key.1.to_ne_bytes());
        b.extend(self.session.to_ne_bytes());
        b.extend(self.created_ns.to_ne_bytes());
        let sum = record_checksum(&b);
        b.extend(sum.to_ne_bytes());
        b
    }

    /// A complete record of any epcomm layout (the first fields have kept their places since
    /// layout 3, whose control segment sat under this name), or None for a partial or foreign
    /// one.
    fn decode(b: &[u8]) -> Option<Record> {
        let u32_at = |i: usize| {
            b.get(i..i + 4)
                .map(|w| u32::from_ne_bytes(w.try_into().unwrap()))
        };
        let u64_at = |i: usize| {
            b.get(i..i + 8)
                .map(|w| u64::from_ne_bytes(w.try_into().unwrap()))
        };
        if u64_at(0)? >> 16 != MAGIC >> 16 {
            return None;
        }
        let version = u32_at(8)?;
        let mut r = Record {
            version,
            world: u32_at(12)?,
            creator: u32_at(16)?,
            fd: 0,
            key: (0, 0),
            session: 0,
            created_ns: 0,
        };
        if version != LAYOUT_VERSION {
            return Some(r);
        }
        if b.len() < RECORD_BYTES || u64_at(56)? != record_checksum(b) {
            return None;
        }
        r.fd = u32_at(20)?;
        r.key = (u64_at(24)?, u64_at(32)?);
        r.session = u64_at(40)?;
        r.created_ns = u64_at(48)?;
        Some(r)
    }
}

fn align64(x: usize) -> usize {
    (x + 63) & !63
}

/// Group names: 1..=64 of [A-Za-z0-9_.-], so they are valid shm names on every system.
fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "group name '{name}' is not valid: expected 1 to 64 characters from A-Z, a-z, 0-9, '_', '.', '-'"
        )))
    }
}

fn random_u64() -> u64 {
    use std::collections::hash_map::RandomState;
    use std::hash::{BuildHasher, Hasher};
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish() | 1
}

fn sys_err(what: String, e: std::io::Error) -> Error {
    Error::System(format!("{what}: {e}"))
}

/// Bytes of a unique group id, as `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;
const UNIQUE_ID_TAG: &[u8] = b"epcomm-uid1:";

/// A group id made by one rank ([`UniqueId::new`]) and passed to the others by the host's own
/// means (as `ncclGetUniqueId`): groups made from distinct ids never meet, whatever names other
/// jobs use, so names need not be unique.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UniqueId(pub [u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    /// A fresh id: 128 random bits from the kernel (getrandom).
    pub fn new() -> Result<UniqueId> {
        let mut random = [0u8; 16];
        let mut got = 0;
        while got < random.len() {
            // SAFETY: writes at most the remaining bytes of `random`.
            let n = unsafe {
                libc::getrandom(random[got..].as_mut_ptr().cast(), random.len() - got, 0)
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(sys_err(
                    "cannot make a unique group id (getrandom)".into(),
                    e,
                ));
            }
            got += n as usize;
        }
        let mut id = [0u8; UNIQUE_ID_BYTES];
        id[..UNIQUE_ID_TAG.len()].copy_from_slice(UNIQUE_ID_TAG);
        let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
        id[UNIQUE_ID_TAG.len()..UNIQUE_ID_TAG.len() + 32].copy_from_slice(hex.as_bytes());
        Ok(UniqueId(id))
    }

    /// The group name the id stands for (`uid-` and its 32 hex digits).
    pub fn group_name(&self) -> Result<String> {
        let b = &self.0;
        let t = UNIQUE_ID_TAG.len();
        let hex = &b[t..t + 32];
        let valid = b.starts_with(UNIQUE_ID_TAG)
            && hex
                .iter()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
            && b[t + 32..].iter().all(|&c| c == 0);
        if !valid {
            return Err(Error::InvalidArgument(format!(
                "unique group id is not one made by UniqueId::new / epcomm_group_unique_id: it starts with {:?}; expected \"epcomm-uid1:\", 32 lowercase hex digits and zero bytes",
                String::from_utf8_lossy(&b[..t.min(b.len())])
            )));
        }
        Ok(format!("uid-{}", String::from_utf8_lossy(hex)))
    }
}

/// A rank's membership in a shared-memory group.
pub struct ShmGroup {
    name: String,
    rank: usize,
    world: usize,
    opts: GroupOptions,
    control: Segment,
    control_name: String,
    control_unlinked: bool,
    session: u64,
    data: Segment,
    gen: u64,
    peers: Vec<Option<(u64, Segment)>>,
    seq: u64,
    broken: Option<String>,
    pid: u32,
    /// Peers read this rank's buffers directly (agreed by all ranks at join).
    direct: bool,
    /// A private word peers read at join to test direct reads (kept alive for that).
    _probe: Box<u64>,
    /// The op whose buffers peers may still be reading (direct mode), until it finishes.
    exposed: Option<u64>,
    /// The op that first published a grown region: its descriptor stays open for peers to map
    /// it until that op is committed.
    grown_at: u64,
    /// Buffer tables of this process's thread ranks of this group (direct mode).
    tables: Arc<LocalTables>,
}

impl std::fmt::Debug for ShmGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmGroup")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("seq", &self.seq)
            .finish()
    }
}

struct Deadline {
    start: Instant,
    timeout: Duration,
}

impl Deadline {
    fn new(timeout: Duration) -> Self {
        Deadline {
            start: Instant::now(),
            timeout,
        }
    }
    fn expired(&self) -> bool {
        self.start.elapsed() >= self.timeout
    }
}

/// Spin, then yield, then sleep in short steps: fast when peers are close, cheap when not.
struct Backoff {
    iter: u32,
    start: Instant,
}

/// Threads of this process waiting in a Backoff now: long waits sleep in proportion, so 1024
/// thread ranks polling 1024 slots each do not starve the ones that have work.
static WAITING: AtomicU64 = AtomicU64::new(0);

impl Drop for Backoff {
    fn drop(&mut self) {
        WAITING.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Backoff {
    fn new() -> Self {
        WAITING.fetch_add(1, Ordering::Relaxed);
        Backoff {
            iter: 0,
            start: Instant::now(),
        }
    }
    fn snooze(&mut self) {
        self.iter += 1;
        if self.iter < 64 {
            std::hint::spin_loop();
        } else if self.start.elapsed() < Duration::from_millis(2) {
            std::thread::yield_now();
        } else if self.start.elapsed() < Duration::from_millis(50) {
            std::thread::sleep(Duration::from_micros(50));
        } else {
            // A long wait (ranks still starting, a slow peer): wake less often, the more so the
            // more threads of this process wait, so they leave the CPU to the ones with work.
            let waiting = WAITING.load(Ordering::Relaxed).max(1);
            let us = (waiting * 32).clamp(1000, 50_000);
            std::thread::sleep(Duration::from_micros(us));
        }
    }
}

impl ShmGroup {
    /// Creates (rank 0) or joins (other ranks) the group `name` of `world` ranks; returns once
    /// every rank has joined.
    pub fn join(name: &str, rank: usize, world: usize, opts: GroupOptions) -> Result<ShmGroup> {
        check_name(name)?;
        if world == 0 || world > MAX_WORLD {
            return Err(Error::InvalidArgument(format!(
                "world_size is {world}; expected 1..={MAX_WORLD}"
            )));
        }
        if rank >= world {
            return Err(Error::InvalidArgument(format!(
                "rank is {rank}; expected 0 <= rank < world_size ({world})"
            )));
        }
        // From here on this thread works as `rank`: its log lines say so.
        crate::log::set_thread_rank(Some(rank));
        if opts.max_capacity != 0 && opts.initial_capacity > opts.max_capacity {
            return Err(Error::InvalidArgument(format!(
                "initial capacity {} bytes exceeds the maximum capacity {} bytes",
                opts.initial_capacity, opts.max_capacity
            )));
        }
        check_map_budget(name, rank, world)?;
        let control_name = format!("/epcomm.{name}");
        let deadline = Deadline::new(opts.timeout);
        let started_ns = now_ns();
        let pid = std::process::id();
        let token = random_u64();
        let abandon = |e: Error| {
            if rank == 0 {
                Segment::unlink(&control_name);
            }
            e
        };
        // Open (or create) the control segment and claim the slot. A slot held by a dead or
        // failed process belongs to an earlier attempt that is being torn down: wait for the
        // next segment instead of failing.
        let control = loop {
            let control = if rank == 0 {
                Self::create_control(name, &control_name, world, &deadline)?
            } else {
                Self::open_control(name, &control_name, rank, world, &deadline)?
            };
            let slot: &Slot = control.at(HEADER_BYTES + rank * std::mem::size_of::<Slot>());
            if slot
                .token
                .compare_exchange(0, token, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                break control;
            }
            let other = slot.pid.load(Ordering::Acquire);
            let failed_attempt = (0..world).any(|r| {
                let s: &Slot = control.at(HEADER_BYTES + r * std::mem::size_of::<Slot>());
                let p = s.pid.load(Ordering::Acquire);
                s.state.load(Ordering::Acquire) == SLOT_FAILED || (p != 0 && !pid_alive(p))
            });
            if rank != 0 && failed_attempt && !deadline.expired() {
                drop(control);
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            // Another live process holds this rank: another job uses the name (or this job
            // started the rank twice). Neither may form a group with the other's ranks.
            let header: &Header = control.at(0);
            let _ = header.conflict_pid.compare_exchange(
                0,
                u64::from(pid),
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            return Err(abandon(Error::InvalidState(format!(
                "group name '{name}' is in use by another job: rank {rank} is already taken (by pid {other}); each rank joins once, and jobs that run at the same time need distinct group names"
            ))));
        };
        let header: &Header = control.at(0);
        let session = header.session.load(Ordering::Acquire);
        let slot: &Slot = control.at(HEADER_BYTES + rank * std::mem::size_of::<Slot>());
        slot.pid.store(pid, Ordering::Release);
        let capacity = opts.initial_capacity.max(4096);
        let data_name = Self::data_name(name, session, rank, 1, pid);
        let data = match Segment::create(&data_name, capacity) {
            Ok(d) => d,
            Err(e) => {
                // Tell the others this rank failed, so they stop waiting for it.
                slot.state.store(SLOT_FAILED, Ordering::Release);
                return Err(abandon(sys_err(
                    format!(
                        "cannot create the shared-memory region of rank {rank} ({capacity} bytes)"
                    ),
                    e,
                )));
            }
        };
        let probe = Box::new(token);
        slot.probe_addr
            .store(&*probe as *const u64 as u64, Ordering::Relaxed);
        slot.data_bytes.store(capacity as u64, Ordering::Relaxed);
        slot.data_gen.store(1, Ordering::Relaxed);
        let desc: &DataDesc = control.at(desc_offset(world, rank));
        desc.started_ns.store(started_ns, Ordering::Relaxed);
        publish_desc(desc, &data, 1);
        slot.pid.store(pid, Ordering::Relaxed);
        slot.state.store(SLOT_ACTIVE, Ordering::Release);

        let mut g = ShmGroup {
            name: name.to_owned(),
            rank,
            world,
            opts,
            control,
            control_name,
            control_unlinked: false,
            session,
            data,
            gen: 1,
            peers: (0..world).map(|_| None).collect(),
            seq: 0,
            broken: None,
            pid,
            direct: false,
            _probe: probe,
            exposed: None,
            grown_at: 0,
            tables: local_tables(session, world),
        };
        crate::fault::point("join");
        if let Err(e) = g.wait_joined(&deadline) {
            let e = g.conflict_or(e);
            if matches!(e, Error::Timeout(_)) {
                // The others wait for the same missing ranks and time out on their own, naming
                // them; marking this rank failed (or letting it look dead once it exits) would
                // only blur their message.
                g.broken = Some(e.to_string());
                g.mark(SLOT_GAVE_UP);
                return Err(e);
            }
            g.linger_on_conflict();
            return Err(g.fail(e));
        }
        if let Err(e) = g.agree_direct().and_then(|()| g.settle()) {
            let e = g.conflict_or(e);
            g.linger_on_conflict();
            return Err(g.fail(e));
        }
        // Every rank mapped every segment (agree_direct maps them before it reports): from here
        // on nothing of the group is reachable by name or descriptor.
        g.data.close_fd();
        g.control.close_fd();
        if rank == 0 {
            g.unlink_own_control();
            g.control_unlinked = true;
        }
        Ok(g)
    }

    /// Joins the group of unique id `id` (made by one rank with [`UniqueId::new`] and passed to
    /// the others): as [`ShmGroup::join`] with the name the id stands for.
    pub fn join_unique(
        id: &UniqueId,
        rank: usize,
        world: usize,
        opts: GroupOptions,
    ) -> Result<ShmGroup> {
        Self::join(&id.group_name()?, rank, world, opts)
    }

    fn data_name(name: &str, session: u64, rank: usize, gen: u64, pid: u32) -> String {
        format!("/epcomm.{name}.{session:016x}.{rank}.{gen}.{pid}")
    }

    /// Removes data segments of dead processes left by crashed runs of this group name (named
    /// segments of epcomm releases before layout 4; later ones leave none).
    fn remove_stale_data(name: &str) {
        let prefix = format!("epcomm.{name}.");
        let Ok(dir) = std::fs::read_dir("/dev/shm") else {
            return;
        };
        for entry in dir.flatten() {
            let file = entry.file_name();
            let Some(file) = file.to_str() else { continue };
            let Some(rest) = file.strip_prefix(&prefix) else {
                continue;
            };
            // {session}.{rank}.{gen}.{pid}
            let parts: Vec<&str> = rest.split('.').collect();
            if parts.len() != 4 {
                continue;
            }
            if let Ok(pid) = parts[3].parse::<u32>() {
                if !pid_alive(pid) {
                    Segment::unlink(&format!("/{file}"));
                }
            }
        }
    }

    /// The rendezvous record of `name`: Ok(None) if there is none (or only a partial one).
    fn read_record(name: &str, control_name: &str) -> Result<Option<Record>> {
        match Segment::read_record(control_name, RECORD_BYTES) {
            Ok(None) => Ok(None),
            Ok(Some(b)) => Ok(Record::decode(&b).or_else(|| {
                // Being written this very moment, or garbage: look again after a beat.
                std::thread::sleep(Duration::from_millis(20));
                Segment::read_record(control_name, RECORD_BYTES)
                    .ok()
                    .flatten()
                    .and_then(|b| Record::decode(&b))
            })),
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Err(Error::InvalidState(
                format!("group name '{name}' is in use by another job or user, refused: {e}"),
            )),
            Err(e) => Err(sys_err(format!("cannot read /dev/shm{control_name}"), e)),
        }
    }

    fn create_control(
        name: &str,
        control_name: &str,
        world: usize,
        deadline: &Deadline,
    ) -> Result<Segment> {
        let bytes = control_bytes(world);
        let seg = Segment::create(&format!("{control_name}.control"), bytes).map_err(|e| {
            sys_err(
                format!("cannot create shared memory {control_name} ({bytes} bytes)"),
                e,
            )
        })?;
        let session = random_u64();
        let created_ns = now_ns();
        let h: &Header = seg.at(0);
        h.version.store(LAYOUT_VERSION, Ordering::Relaxed);
        h.world.store(world as u32, Ordering::Relaxed);
        h.creator_pid.store(std::process::id(), Ordering::Relaxed);
        h.session.store(session, Ordering::Relaxed);
        h.created_ns.store(created_ns, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        let record = Record {
            version: LAYOUT_VERSION,
            world: world as u32,
            creator: std::process::id(),
            fd: seg.fd().unwrap_or(0),
            key: seg.key(),
            session,
            created_ns,
        }
        .encode();
        loop {
            match Segment::create_record(control_name, &record) {
                Ok(key) => {
                    h.record_dev.store(key.0, Ordering::Relaxed);
                    h.record_ino.store(key.1, Ordering::Release);
                    Self::remove_stale_data(name);
                    return Ok(seg);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    // Someone else's record: stale (its creator is gone, or it is garbage) or
                    // live (another job with the same name is joining).
                    if let Some(r) = Self::read_record(name, control_name)? {
                        if pid_alive(r.creator) {
                            Self::mark_conflict(&r, world);
                            return Err(Error::InvalidState(format!(
                                "group name '{name}' is in use by another job: its rank 0 (pid {}) is still waiting for its ranks to join; jobs that run at the same time need distinct group names",
                                r.creator
                            )));
                        }
                    }
                    crate::log::info(&format!(
                        "replacing stale shared-memory segment {control_name} left by a crashed run"
                    ));
                    Segment::unlink(control_name);
                }
                Err(e) => {
                    return Err(sys_err(
                        format!("cannot create shared memory {control_name}"),
                        e,
                    ))
                }
            }
            if deadline.expired() {
                return Err(Error::Timeout(format!(
                    "timed out after {:.1} s creating group '{name}'",
                    deadline.timeout.as_secs_f64()
                )));
            }
        }
    }

    /// Maps the control segment a record names (None if it is gone or not the one named).
    fn map_control(r: &Record, min_len: usize) -> Option<Segment> {
        Self::try_map_control(r, min_len).ok()
    }

    /// Maps the control segment a record names, or says why not.
    fn try_map_control(r: &Record, min_len: usize) -> std::result::Result<Segment, String> {
        let seg = Segment::open_peer("control", r.creator, r.fd, r.key, min_len).map_err(|e| {
            format!(
                "cannot open /proc/{}/fd/{} (the control segment of rank 0): {e}",
                r.creator, r.fd
            )
        })?;
        let h: &Header = seg.at(0);
        if h.magic.load(Ordering::Acquire) == MAGIC
            && h.session.load(Ordering::Acquire) == r.session
        {
            Ok(seg)
        } else {
            Err(format!(
                "/proc/{}/fd/{} is not the control segment its record names",
                r.creator, r.fd
            ))
        }
    }

    /// Tells the live group behind record `r` that another job met it, so it does not form.
    fn mark_conflict(r: &Record, _world: usize) {
        if r.version != LAYOUT_VERSION {
            return;
        }
        if let Some(seg) = Self::map_control(r, HEADER_BYTES) {
            let h: &Header = seg.at(0);
            let _ = h.conflict_pid.compare_exchange(
                0,
                u64::from(std::process::id()),
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
    }

    fn open_control(
        name: &str,
        control_name: &str,
        rank: usize,
        world: usize,
        deadline: &Deadline,
    ) -> Result<Segment> {
        let mut backoff = Backoff::new();
        // A record created after this rank started waiting is this group's.
        let started_ns = now_ns();
        // Why rank 0's live segment could not be mapped, for the timeout's message.
        let mut unmapped: Option<String> = None;
        loop {
            if let Some(r) = Self::read_record(name, control_name)? {
                let alive = pid_alive(r.creator);
                if r.version != LAYOUT_VERSION && alive {
                    return Err(Error::InvalidArgument(format!(
                        "group '{name}' was created by an epcomm with shared-memory layout {}; this epcomm uses layout {LAYOUT_VERSION}",
                        r.version
                    )));
                }
                if r.version == LAYOUT_VERSION && !alive && r.created_ns >= started_ns {
                    // Created for this join, then rank 0 died: not a stale segment to wait
                    // out. Remove what the dead creator left.
                    Segment::unlink(control_name);
                    Self::remove_stale_data(name);
                    return Err(Error::PeerFailure(format!(
                        "rank 0 of group '{name}' died (pid {} is gone) while the group was joining",
                        r.creator
                    )));
                }
                if r.version == LAYOUT_VERSION && alive {
                    // A failure to map it means rank 0 just finished (or died): look again.
                    let mapped = Self::try_map_control(&r, HEADER_BYTES);
                    if let Err(why) = &mapped {
                        unmapped = Some(why.clone());
                    }
                    if let Ok(seg) = mapped {
                        let h: &Header = seg.at(0);
                        let their_world = h.world.load(Ordering::Relaxed) as usize;
                        if their_world != world {
                            h.mismatch_world.store(world as u64, Ordering::Relaxed);
                            h.mismatch_rank.store(rank as u64 + 1, Ordering::Release);
                            return Err(Error::InvalidArgument(format!(
                                "rank {rank} joined group '{name}' with world_size {world}, but rank 0 created it with world_size {their_world}"
                            )));
                        }
                        if seg.len() >= control_bytes(world) {
                            return Ok(seg);
                        }
                    }
                }
                // Stale (creator gone): wait for this job's rank 0.
            }
            if deadline.expired() {
                // A record whose creator is gone serves nobody: remove it on the way out.
                if let Ok(Some(r)) = Self::read_record(name, control_name) {
                    if !pid_alive(r.creator) {
                        Segment::unlink(control_name);
                        Self::remove_stale_data(name);
                    }
                }
                let why = unmapped.map(|w| format!("; last: {w}")).unwrap_or_default();
                return Err(Error::Timeout(format!(
                    "timed out after {:.1} s waiting for rank 0 to create group '{name}' (rank {rank} of {world}){why}",
                    deadline.timeout.as_secs_f64()
                )));
            }
            backoff.snooze();
            if backoff.iter > 64 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn header(&self) -> &Header {
        self.control.at(0)
    }

    fn slot(&self, r: usize) -> &Slot {
        self.control
            .at(HEADER_BYTES + r * std::mem::size_of::<Slot>())
    }

    /// Unlinks the rendezvous record if it still belongs to this group's session (a new group
    /// of the same name may have replaced it).
    fn unlink_own_control(&self) {
        let h = self.header();
        let created = (
            h.record_dev.load(Ordering::Relaxed),
            h.record_ino.load(Ordering::Acquire),
        );
        let ours = match Self::read_record(&self.name, &self.control_name) {
            Ok(Some(r)) => r.session == self.session,
            // Unreadable as a record (overwritten, truncated): still ours if it is the file
            // rank 0 created.
            Ok(None) | Err(_) => {
                created != (0, 0) && Segment::record_key(&self.control_name) == Some(created)
            }
        };
        if ours {
            Segment::unlink(&self.control_name);
        }
    }

    /// The data descriptor of rank `r`.
    fn desc(&self, r: usize) -> &DataDesc {
        self.control.at(desc_offset(self.world, r))
    }

    /// Fails if a process of another job met this group (its record or a taken slot).
    fn check_conflict(&self) -> Result<()> {
        match self.header().conflict_pid.load(Ordering::Acquire) {
            0 | FORMED => Ok(()),
            pid => Err(Error::InvalidState(format!(
                "group name '{}' is in use by another job: pid {pid} tried to join this group under the same name, so rank {} refuses to form it; jobs that run at the same time need distinct group names",
                self.name, self.rank
            ))),
        }
    }

    /// Records the buffers of op `n` (direct mode) where thread ranks of this process read them.
    fn note_table(&self, n: u64, payload: &[&[u8]]) {
        let mut t = self.tables[self.rank]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        t.0 = n;
        t.1.clear();
        t.1.extend(payload.iter().map(|b| (b.as_ptr() as u64, b.len())));
    }

    /// The buffers thread rank `p` of this process recorded for op `n`.
    fn local_table(&self, p: usize, n: u64) -> Option<Vec<(u64, usize)>> {
        let t = self.tables[p].lock().unwrap_or_else(|e| e.into_inner());
        (t.0 == n).then(|| t.1.clone())
    }

    /// What explains a failed join best: a conflict with another job, else a rank that died
    /// (a rank that failed because of that death would otherwise be blamed), else `e`.
    fn conflict_or(&self, e: Error) -> Error {
        if let Err(c) = self.check_conflict() {
            return c;
        }
        // Only a rank still marked active can have died unannounced: one that failed or left
        // marked its slot first (and may have exited since).
        let dead = (0..self.world).find(|&d| {
            let s = self.slot(d);
            let pid = s.pid.load(Ordering::Acquire);
            d != self.rank
                && s.state.load(Ordering::Acquire) == SLOT_ACTIVE
                && pid != 0
                && !pid_alive(pid)
        });
        match (dead, &e) {
            (Some(d), Error::PeerFailure(_)) => Error::PeerFailure(format!(
                "rank {d} of group '{}' died (pid {} is gone) while the group was joining",
                self.name,
                self.slot(d).pid.load(Ordering::Acquire)
            )),
            _ => e,
        }
    }

    /// Three times the spread of the ranks' arrivals so far, within the settle bounds.
    fn settle_time(&self) -> Duration {
        let first = (0..self.world)
            .map(|r| self.desc(r).started_ns.load(Ordering::Relaxed))
            .filter(|&t| t != 0)
            .min()
            .unwrap_or(0);
        let spread = Duration::from_nanos(now_ns().saturating_sub(first));
        (spread * 3).clamp(SETTLE_MIN, SETTLE_MAX)
    }

    /// Rank 0 of a group another job met keeps its record a settle time longer before it fails,
    /// so the rest of that job meets it too and fails saying so (instead of forming a group
    /// with this job's leftover ranks or waiting for them).
    fn linger_on_conflict(&self) {
        let c = self.header().conflict_pid.load(Ordering::Acquire);
        if self.rank == 0 && c != 0 && c != FORMED {
            std::thread::sleep(self.settle_time());
        }
    }

    /// Waits out the settle time (rank 0) or for rank 0's verdict (the others), with the record
    /// and descriptors still open, so a job that started at about the same time under the same
    /// name meets this group; then the group forms unless such a job marked it.
    fn settle(&self) -> Result<()> {
        let h = self.header();
        if self.rank == 0 {
            let until = Instant::now() + self.settle_time();
            while Instant::now() < until && h.conflict_pid.load(Ordering::Acquire) == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            let _ = h
                .conflict_pid
                .compare_exchange(0, FORMED, Ordering::AcqRel, Ordering::Acquire);
            return self.check_conflict();
        }
        let deadline = Deadline::new(SETTLE_MAX + self.opts.timeout);
        let mut last_check = Instant::now();
        while h.conflict_pid.load(Ordering::Acquire) == 0 {
            if last_check.elapsed() >= LIVENESS_PERIOD {
                last_check = Instant::now();
                let s = self.slot(0);
                let pid = s.pid.load(Ordering::Acquire);
                if s.state.load(Ordering::Acquire) != SLOT_ACTIVE || !pid_alive(pid) {
                    return Err(Error::PeerFailure(format!(
                        "rank 0 of group '{}' (pid {pid}) failed or died while the group was forming (seen from rank {})",
                        self.name, self.rank
                    )));
                }
                if deadline.expired() {
                    return Err(Error::Timeout(format!(
                        "timed out after {:.1} s waiting for rank 0 of group '{}' to complete its creation (rank {})",
                        deadline.timeout.as_secs_f64(),
                        self.name,
                        self.rank
                    )));
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.check_conflict()
    }

    /// Maps rank `p`'s current data segment unless it is mapped already; a failure says what
    /// became of that rank.
    fn map_peer(&mut self, p: usize) -> Result<()> {
        let d = self.desc(p);
        let gen = d.gen.load(Ordering::Acquire);
        if self.peers[p].as_ref().map(|(g, _)| *g) == Some(gen) {
            return Ok(());
        }
        let (fd, key) = (
            d.fd.load(Ordering::Relaxed),
            (d.dev.load(Ordering::Relaxed), d.ino.load(Ordering::Relaxed)),
        );
        let bytes = d.bytes.load(Ordering::Relaxed);
        let s = self.slot(p);
        let pid = s.pid.load(Ordering::Acquire);
        let label = Self::data_name(&self.name, self.session, p, gen, pid);
        let min_len = usize::try_from(bytes)
            .unwrap_or(usize::MAX)
            .max(OP_HEADER_BYTES);
        match Segment::open_peer(&label, pid, fd, key, min_len) {
            Ok(seg) => {
                self.peers[p] = Some((gen, seg));
                Ok(())
            }
            Err(e) => {
                let (name, me) = (&self.name, self.rank);
                // A dying process loses its descriptors before it stops looking alive: give
                // its death a moment to show, so the error names what happened.
                let deadline = Instant::now() + Duration::from_millis(500);
                while s.state.load(Ordering::Acquire) == SLOT_ACTIVE
                    && pid_alive(pid)
                    && Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(match s.state.load(Ordering::Acquire) {
                    SLOT_LEFT => Error::PeerFailure(format!(
                        "rank {p} of group '{name}' left the group (destroyed its handle) before rank {me} could map its shared-memory region"
                    )),
                    SLOT_FAILED => Error::PeerFailure(format!(
                        "rank {p} of group '{name}' failed (an error on that rank aborted its group) before rank {me} could map its shared-memory region"
                    )),
                    _ if !pid_alive(pid) => Error::PeerFailure(format!(
                        "rank {p} of group '{name}' died (pid {pid} is gone) before rank {me} could map its shared-memory region"
                    )),
                    _ => Error::PeerFailure(format!(
                        "cannot map the shared-memory region of rank {p} of group '{name}' (generation {gen}, pid {pid}, descriptor {fd}) on rank {me}: {e}"
                    )),
                })
            }
        }
    }

    fn mark(&self, state: u32) {
        self.slot(self.rank).state.store(state, Ordering::Release);
    }

    /// The error naming a rank that claimed its slot and whose process is gone, if any.
    fn dead_while_joining(&self) -> Option<Error> {
        let r = (0..self.world).find(|&r| {
            let s = self.slot(r);
            s.state.load(Ordering::Acquire) == SLOT_ACTIVE
                && !pid_alive(s.pid.load(Ordering::Acquire))
        })?;
        Some(Error::PeerFailure(format!(
            "rank {r} of group '{}' died (pid {} is gone) while the group was joining",
            self.name,
            self.slot(r).pid.load(Ordering::Acquire)
        )))
    }

    fn wait_joined(&self, deadline: &Deadline) -> Result<()> {
        let mut backoff = Backoff::new();
        let mut last_check = Instant::now();
        loop {
            self.check_conflict()?;
            let h = self.header();
            let m = h.mismatch_rank.load(Ordering::Acquire);
            if m != 0 {
                return Err(Error::InvalidArgument(format!(
                    "rank {} tried to join group '{}' with world_size {}, but this group has world_size {}",
                    m - 1,
                    self.name,
                    h.mismatch_world.load(Ordering::Relaxed),
                    self.world
                )));
            }
            if let Some(r) =
                (0..self.world).find(|&r| self.slot(r).state.load(Ordering::Acquire) == SLOT_FAILED)
            {
                // A rank that failed because another died: name the dead one, as that rank does.
                if let Some(e) = self.dead_while_joining() {
                    return Err(e);
                }
                return Err(Error::PeerFailure(format!(
                    "rank {r} of group '{}' failed while joining (see that rank's error)",
                    self.name
                )));
            }
            let missing: Vec<usize> = (0..self.world)
                .filter(|&r| self.slot(r).state.load(Ordering::Acquire) == SLOT_EMPTY)
                .collect();
            let gave_up = (0..self.world)
                .find(|&r| self.slot(r).state.load(Ordering::Acquire) == SLOT_GAVE_UP);
            match (gave_up, missing.is_empty()) {
                // Another rank timed out waiting for the same missing ranks: so does this one.
                (Some(_), false) => {
                    return Err(Error::Timeout(format!(
                        "timed out after {:.1} s waiting for rank(s) {} to join group '{}'",
                        deadline.timeout.as_secs_f64(),
                        list(&missing),
                        self.name
                    )))
                }
                (Some(r), true) => {
                    return Err(Error::PeerFailure(format!(
                    "rank {r} of group '{}' gave up waiting for the group to form (it timed out)",
                    self.name
                )))
                }
                (None, true) => return Ok(()),
                (None, false) => {}
            }
            if last_check.elapsed() >= LIVENESS_PERIOD {
                last_check = Instant::now();
                if let Some(e) = self.dead_while_joining() {
                    return Err(e);
                }
                if deadline.expired() {
                    return Err(Error::Timeout(format!(
                        "timed out after {:.1} s waiting for rank(s) {} to join group '{}'",
                        deadline.timeout.as_secs_f64(),
                        list(&missing),
                        self.name
                    )));
                }
            }
            backoff.snooze();
        }
    }

    /// Tests direct reads of every peer's probe word and agrees on the mode with all ranks.
    fn agree_direct(&mut self) -> Result<()> {
        // Map every peer's region before reporting: once all reported, every rank mapped every
        // region and the descriptors can close.
        let me = self.rank;
        for p in (0..self.world).filter(|&p| p != me) {
            self.map_peer(p)?;
        }
        let wanted = self.opts.direct_reads && crate::env::shm_direct();
        let ok = wanted
            && (0..self.world).all(|p| {
                let s = self.slot(p);
                let pid = s.pid.load(Ordering::Acquire);
                let mut word = [0u8; 8];
                copy_from_process(
                    pid,
                    pid == self.pid,
                    s.probe_addr.load(Ordering::Acquire),
                    &mut word,
                )
                .is_ok()
                    && u64::from_ne_bytes(word) == s.token.load(Ordering::Acquire)
            });
        self.slot(self.rank)
            .direct_ok
            .store(if ok { 1 } else { 2 }, Ordering::Release);
        self.wait_peers(Op::Join, 0, |s| s.direct_ok.load(Ordering::Acquire) != 0)?;
        self.direct = (0..self.world).all(|p| self.slot(p).direct_ok.load(Ordering::Acquire) == 1);
        Ok(())
    }

    /// Whether peers read this group's contributions directly (one copy per byte).
    pub fn direct(&self) -> bool {
        self.direct
    }

    fn check_usable(&self, op: Op) -> Result<()> {
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(Error::InvalidState(format!(
                "{}: group '{}' is unusable after an earlier failure ({why}); destroy it and create a new one",
                op.name(),
                self.name
            ))),
        }
    }

    /// Records a failure: this handle is unusable and peers see this rank as failed. If peers
    /// that are threads of this process may still be copying from the caller's buffers (direct
    /// mode), waits (bounded) until each has consumed the op or stopped, so the buffers can be
    /// released safely. (Other processes read through the kernel, which fails cleanly, and they
    /// then see this rank as failed before their op completes.)
    fn fail(&mut self, e: Error) -> Error {
        if self.broken.is_none() && self.seq > 0 {
            // Abort the op in progress unless it was decided already, so no peer commits it.
            let _ = self.decide(self.seq, abort_word(self.seq, self.rank, Cause::Failed));
        }
        if self.broken.is_none() {
            self.broken = Some(e.to_string());
            self.mark(SLOT_FAILED);
        }
        if let Some(n) = self.exposed.take() {
            let deadline = Deadline::new(self.opts.timeout);
            let mut backoff = Backoff::new();
            loop {
                let reading = (0..self.world).any(|p| {
                    let s = self.slot(p);
                    p != self.rank
                        && s.pid.load(Ordering::Acquire) == self.pid
                        && s.consumed.load(Ordering::Acquire) < n
                        && s.state.load(Ordering::Acquire) == SLOT_ACTIVE
                });
                if !reading || deadline.expired() {
                    break;
                }
                backoff.snooze();
            }
        }
        e
    }

    /// The peers for which `ready(peer slot)` does not hold yet.
    fn pending_peers(&self, ready: &impl Fn(&Slot) -> bool) -> Vec<usize> {
        (0..self.world)
            .filter(|&p| p != self.rank && !ready(self.slot(p)))
            .collect()
    }

    /// Waits until `ready(peer slot)` holds for every peer.
    fn wait_peers(&mut self, op: Op, n: u64, ready: impl Fn(&Slot) -> bool) -> Result<()> {
        let deadline = Deadline::new(self.opts.timeout);
        let mut backoff = Backoff::new();
        let mut last_check = Instant::now();
        loop {
            let pending = self.pending_peers(&ready);
            if pending.is_empty() {
                return Ok(());
            }
            if last_check.elapsed() >= LIVENESS_PERIOD {
                last_check = Instant::now();
                self.check_peers(op, n, &pending)?;
                if deadline.expired() {
                    return Err(Error::Timeout(format!(
                        "timed out after {:.1} s in {} of group '{}' (op #{n}) waiting for rank(s) {}",
                        deadline.timeout.as_secs_f64(),
                        op.name(),
                        self.name,
                        list(&pending)
                    )));
                }
            }
            backoff.snooze();
        }
    }

    fn check_peers(&self, op: Op, n: u64, pending: &[usize]) -> Result<()> {
        match self.failed_peer(pending) {
            Some((p, cause)) => Err(self.failure_error(op, n, p, cause)),
            None => Ok(()),
        }
    }

    /// The first failure among `pending`: a rank that died (its region is then removed, so
    /// the crash leaves nothing in /dev/shm), else one that left or failed. A pending rank that
    /// failed may have failed because another rank died: then the dead one is named.
    fn failed_peer(&self, pending: &[usize]) -> Option<(usize, Cause)> {
        let dead = |p: usize| {
            let s = self.slot(p);
            let pid = s.pid.load(Ordering::Acquire);
            // A rank that failed or left and then exited did not die: it said so first.
            let gone =
                s.state.load(Ordering::Acquire) == SLOT_ACTIVE && pid != 0 && !pid_alive(pid);
            if gone {
                let gen = s.data_gen.load(Ordering::Acquire);
                Segment::unlink(&Self::data_name(&self.name, self.session, p, gen, pid));
            }
            gone
        };
        if let Some(&p) = pending.iter().find(|&&p| dead(p)) {
            return Some((p, Cause::Died));
        }
        let (p, cause) =
            pending
                .iter()
                .find_map(|&p| match self.slot(p).state.load(Ordering::Acquire) {
                    SLOT_LEFT => Some((p, Cause::Left)),
                    SLOT_FAILED => Some((p, Cause::Failed)),
                    _ => None,
                })?;
        let me = self.rank;
        match (0..self.world).find(|&d| d != me && d != p && dead(d)) {
            Some(d) if cause == Cause::Failed => Some((d, Cause::Died)),
            Some(_) | None => Some((p, cause)),
        }
    }

    /// The error every rank reports for a failure of rank `p` (the first failure of op `n`).
    fn failure_error(&self, op: Op, n: u64, p: usize, cause: Cause) -> Error {
        let (name, me, what) = (&self.name, self.rank, op.name());
        let timeout = self.opts.timeout.as_secs_f64();
        if p >= self.world {
            // Only a process that wrote into the control segment can name a rank out of range.
            return Error::PeerFailure(format!(
                "{what} (op #{n}) of group '{name}' was aborted by a decision word naming rank {p}, outside the group of {} ranks (the control segment was altered; seen from rank {me})",
                self.world
            ));
        }
        match cause {
            Cause::Stalled if p == me => Error::PeerFailure(format!(
                "rank {me} of group '{name}' (this rank) was late for {what} (op #{n}): the other ranks timed out after {timeout:.1} s waiting for it and aborted the op"
            )),
            Cause::Stalled => Error::Timeout(format!(
                "timed out after {timeout:.1} s in {what} of group '{name}' (op #{n}) waiting for rank(s) {p}"
            )),
            Cause::Died => Error::PeerFailure(format!(
                "rank {p} of group '{name}' died (pid {} is gone) during {what} (op #{n}, seen from rank {me})",
                self.slot(p).pid.load(Ordering::Acquire)
            )),
            Cause::Failed => Error::PeerFailure(format!(
                "rank {p} of group '{name}' failed (an error on that rank aborted its group) during {what} (op #{n}, seen from rank {me})"
            )),
            Cause::Left => Error::PeerFailure(format!(
                "rank {p} of group '{name}' left (destroyed its group handle) during {what} (op #{n}, seen from rank {me})"
            )),
        }
    }

    /// The group's decision word (in rank 0's slot).
    fn decision_word(&self) -> &AtomicU64 {
        &self.slot(0).decision
    }

    /// Decides op `n` as `want` unless it is decided already; returns the decision.
    fn decide(&self, n: u64, want: u64) -> Decision {
        let word = self.decision_word();
        loop {
            let d = word.load(Ordering::Acquire);
            match decoded(d, n) {
                Decision::Pending => {
                    if word
                        .compare_exchange(d, want, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        return decoded(want, n);
                    }
                }
                decided => return decided,
            }
        }
    }

    /// Waits until `ready(peer slot)` holds for every peer or op `n` is committed. A failed,
    /// dead or stalled peer aborts op `n` (unless it was decided first); the error then names
    /// the first failure, the same on every rank.
    fn wait_op(&mut self, op: Op, n: u64, ready: impl Fn(&Slot) -> bool) -> Result<()> {
        let deadline = Deadline::new(self.opts.timeout);
        let mut backoff = Backoff::new();
        let mut last_check = Instant::now();
        loop {
            let decided = match decoded(self.decision_word().load(Ordering::Acquire), n) {
                Decision::Pending => {
                    // The spin path allocates nothing: the pending list is made only for the
                    // liveness check.
                    if (0..self.world).all(|p| p == self.rank || ready(self.slot(p))) {
                        return Ok(());
                    }
                    if last_check.elapsed() >= LIVENESS_PERIOD {
                        last_check = Instant::now();
                        let pending = self.pending_peers(&ready);
                        if pending.is_empty() {
                            return Ok(());
                        }
                        if let Some((p, cause)) = self.failed_peer(&pending) {
                            self.decide(n, abort_word(n, p, cause))
                        } else if deadline.expired() {
                            self.decide(n, abort_word(n, pending[0], Cause::Stalled))
                        } else {
                            Decision::Pending
                        }
                    } else {
                        Decision::Pending
                    }
                }
                d @ (Decision::Commit | Decision::Abort { .. }) => d,
            };
            match decided {
                Decision::Pending => backoff.snooze(),
                Decision::Commit => return Ok(()),
                Decision::Abort { rank, cause } => {
                    return Err(self.failure_error(op, n, rank, cause))
                }
            }
        }
    }

    /// Makes this rank's region at least `bytes` long (a new generation if needed).
    fn reserve(&mut self, bytes: usize) -> Result<()> {
        // The op that published the last growth was committed, so every peer mapped it.
        if self.grown_at != 0 && self.seq > self.grown_at {
            self.data.close_fd();
            self.grown_at = 0;
        }
        if bytes <= self.data.len() {
            return Ok(());
        }
        let max = self.opts.max_capacity;
        if max != 0 && bytes > max {
            return Err(Error::InvalidArgument(format!(
                "group '{}' needs {bytes} bytes of shared memory on rank {} for this call, more than the maximum capacity of {max} bytes (set a larger max_capacity_bytes)",
                self.name, self.rank
            )));
        }
        let mut new_len = (self.data.len() * 2).max(bytes);
        new_len = (new_len + (2 << 20) - 1) & !((2 << 20) - 1);
        if max != 0 {
            new_len = new_len.min(max);
        }
        let gen = self.gen + 1;
        let name = Self::data_name(&self.name, self.session, self.rank, gen, self.pid);
        let seg = Segment::create(&name, new_len).map_err(|e| {
            sys_err(
                format!(
                    "cannot grow the shared-memory region of rank {} of group '{}' to {new_len} bytes",
                    self.rank, self.name
                ),
                e,
            )
        })?;
        // Every peer consumed the previous op, so none reads the old region any more; peers
        // map the new one when they gather this op, through its descriptor, which closes once
        // this op is committed.
        self.data = seg;
        self.gen = gen;
        self.grown_at = self.seq;
        publish_desc(self.desc(self.rank), &self.data, gen);
        let slot = self.slot(self.rank);
        slot.data_bytes.store(new_len as u64, Ordering::Relaxed);
        slot.data_gen.store(gen, Ordering::Release);
        Ok(())
    }

    /// Starts op `n`. Op n-1 was committed, so every peer consumed it and this rank's region
    /// is free; a peer may have aborted op n already.
    fn begin(&mut self, op: Op) -> Result<u64> {
        self.check_usable(op)?;
        let n = self.seq + 1;
        self.seq = n;
        match decoded(self.decision_word().load(Ordering::Acquire), n) {
            Decision::Abort { rank, cause } => Err(self.failure_error(op, n, rank, cause)),
            Decision::Pending | Decision::Commit => Ok(n),
        }
    }

    /// Publishes op `n`: metadata words, then the payload (copied into this rank's region) or,
    /// in direct mode, a table of (address, length) of the caller's buffers.
    fn publish(&mut self, op: Op, n: u64, meta: &[u64], payload: &[&[u8]]) -> Result<()> {
        self.publish_as(op, n, VERDICT_OK, &[], meta, payload)
    }

    /// Publishes op `n` with this rank's verdict on its own arguments and the parameters every
    /// rank must agree on (zero-padded to [`PARAMS`] words).
    fn publish_as(
        &mut self,
        op: Op,
        n: u64,
        verdict: u64,
        params: &[u64],
        meta: &[u64],
        payload: &[&[u8]],
    ) -> Result<()> {
        {
            let slot = self.slot(self.rank);
            for (i, w) in slot.params.iter().enumerate() {
                w.store(params.get(i).copied().unwrap_or(0), Ordering::Relaxed);
            }
            slot.verdict.store(n << 8 | verdict, Ordering::Relaxed);
        }
        let payload_len: usize = payload.iter().map(|p| p.len()).sum();
        let meta_off = OP_HEADER_BYTES;
        let payload_off = align64(meta_off + meta.len() * 8);
        let region_bytes = if self.direct {
            payload.len() * 16
        } else {
            payload_len
        };
        self.reserve(payload_off + region_bytes)?;
        let mut head = [0u8; 40];
        head[0..4].copy_from_slice(&(op as u32).to_ne_bytes());
        head[4..8].copy_from_slice(&u32::from(self.direct).to_ne_bytes());
        head[8..16].copy_from_slice(&n.to_ne_bytes());
        head[16..24].copy_from_slice(&(payload_len as u64).to_ne_bytes());
        head[24..32].copy_from_slice(&(meta.len() as u64).to_ne_bytes());
        head[32..40].copy_from_slice(&(payload.len() as u64).to_ne_bytes());
        self.data.write(0, &head);
        let meta_bytes: Vec<u8> = meta.iter().flat_map(|m| m.to_ne_bytes()).collect();
        self.data.write(meta_off, &meta_bytes);
        if self.direct {
            let table: Vec<u8> = payload
                .iter()
                .flat_map(|p| [p.as_ptr() as u64, p.len() as u64])
                .flat_map(|w| w.to_ne_bytes())
                .collect();
            self.note_table(n, payload);
            self.data.write(payload_off, &table);
        } else {
            let mut off = payload_off;
            for part in payload {
                self.data.write(off, part);
                off += part.len();
            }
        }
        if self.direct {
            self.exposed = Some(n);
        }
        let slot = self.slot(self.rank);
        slot.op_kind.store(op as u32, Ordering::Relaxed);
        slot.published.store(n, Ordering::Release);
        Ok(())
    }

    /// Waits for every peer's op `n`, checks they are in the same primitive, and maps regions.
    fn gather_published(&mut self, op: Op, n: u64) -> Result<()> {
        self.wait_op(op, n, |s| s.published.load(Ordering::Acquire) >= n)?;
        for p in 0..self.world {
            if p == self.rank {
                continue;
            }
            let s = self.slot(p);
            let kind = s.op_kind.load(Ordering::Acquire);
            if kind != op as u32 {
                let theirs = Op::from_code(kind).map_or("an unknown operation", |o| o.name());
                return Err(Error::InvalidState(format!(
                    "rank {p} of group '{}' called {theirs} while rank {} called {} (op #{n}); every rank must call the same collectives in the same order",
                    self.name,
                    self.rank,
                    op.name()
                )));
            }
            self.map_peer(p)?;
        }
        Ok(())
    }

    /// Rank p's published metadata words and payload for the current op (p may be this rank).
    /// Every word read from the segment is checked against the segment's size and against what
    /// a rank may publish for this op, so a segment another process altered is an error naming
    /// the rank, never an allocation of its choosing, a panic or a fault.
    fn parts(&self, p: usize) -> Result<(Vec<u64>, Payload<'_>)> {
        let seg = if p == self.rank {
            &self.data
        } else {
            match self.peers[p].as_ref() {
                Some((_, seg)) => seg,
                None => {
                    return Err(Error::Internal(format!(
                        "the region of rank {p} of group '{}' is not mapped on rank {}",
                        self.name, self.rank
                    )))
                }
            }
        };
        let bad = |what: String| {
            Error::PeerFailure(format!(
                "the shared-memory region of rank {p} of group '{}' (memfd {}) holds an invalid op header: {what}; another process may have written to it (seen from rank {})",
                self.name,
                seg.name().trim_start_matches('/'),
                self.rank
            ))
        };
        let mut head = [0u8; 40];
        seg.read(0, &mut head);
        let word = |i: usize| u64::from_ne_bytes(head[i..i + 8].try_into().unwrap());
        let kind = u32::from_ne_bytes(head[0..4].try_into().unwrap());
        let direct = u32::from_ne_bytes(head[4..8].try_into().unwrap());
        let (n, payload_len, meta_len, pieces) = (word(8), word(16), word(24), word(32));
        let expected = self.slot(p).op_kind.load(Ordering::Acquire);
        if kind != expected {
            return Err(bad(format!(
                "operation code {kind}, but the rank's slot says {expected}"
            )));
        }
        // The op this rank published last is the one being read.
        let current = self.slot(self.rank).published.load(Ordering::Acquire);
        if n != current {
            return Err(bad(format!("op #{n}, expected op #{current}")));
        }
        if direct != u32::from(self.direct) {
            return Err(bad(format!(
                "mode word {direct}, expected {}",
                u32::from(self.direct)
            )));
        }
        let room = seg.len() - OP_HEADER_BYTES;
        if meta_len > (room / 8) as u64 {
            return Err(bad(format!(
                "{meta_len} metadata words, more than the {} bytes of the region hold",
                seg.len()
            )));
        }
        let meta_len = meta_len as usize;
        let mut meta_bytes = vec![0u8; meta_len * 8];
        seg.read(OP_HEADER_BYTES, &mut meta_bytes);
        let meta: Vec<u64> = meta_bytes
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        let payload_off = align64(OP_HEADER_BYTES + meta_len * 8);
        let left = seg.len().saturating_sub(payload_off);
        let payload_len = usize::try_from(payload_len).unwrap_or(usize::MAX);
        let payload = if self.direct {
            if pieces > (left / 16) as u64 {
                return Err(bad(format!(
                    "{pieces} buffer addresses, more than the {} bytes of the region hold",
                    seg.len()
                )));
            }
            let pid = self.slot(p).pid.load(Ordering::Acquire);
            let local = pid == self.pid;
            let table: Vec<(u64, usize)> = if local {
                // A thread rank's buffers are followed only as its owner recorded them in this
                // process's memory: a forged address must not fault this process.
                match self.local_table(p, n) {
                    Some(t) => t,
                    None => {
                        return Err(bad(format!(
                            "no buffers of op #{n} were published by rank {p} in this process"
                        )))
                    }
                }
            } else {
                let mut raw = vec![0u8; pieces as usize * 16];
                seg.read(payload_off, &mut raw);
                raw.chunks_exact(16)
                    .map(|c| {
                        let w = |i: usize| u64::from_ne_bytes(c[i..i + 8].try_into().unwrap());
                        (w(0), usize::try_from(w(8)).unwrap_or(usize::MAX))
                    })
                    .collect()
            };
            let total = table.iter().try_fold(0usize, |acc, &(addr, len)| {
                addr.checked_add(len as u64)?;
                acc.checked_add(len)
            });
            if total != Some(payload_len) {
                return Err(bad(format!(
                    "buffers of {total:?} bytes in all, but a payload of {payload_len} bytes"
                )));
            }
            Payload::Direct {
                rank: p,
                pid,
                local,
                pieces: table,
                len: payload_len,
            }
        } else {
            if payload_len > left {
                return Err(bad(format!(
                    "a payload of {payload_len} bytes at offset {payload_off}, past the end of the region ({} bytes)",
                    seg.len()
                )));
            }
            Payload::Region(seg.view(payload_off, payload_len))
        };
        check_meta(Op::from_code(kind), &meta, payload_len, self.world).map_err(bad)?;
        Ok((meta, payload))
    }

    /// Ends op `n`: this rank is prepared (it read all it needs; `consumed = n`); the op commits
    /// once every rank is prepared, or aborts on a failure or timeout, whichever rank decides
    /// first, and every rank obeys that decision. So a late rank never commits what the others
    /// aborted, and a rank that dies right after the commit does not undo it for the others
    /// (they see the death at the next op). On commit no peer reads the caller's buffers any
    /// more (direct mode).
    fn finish(&mut self, op: Op, n: u64) -> Result<()> {
        self.slot(self.rank).consumed.store(n, Ordering::Release);
        self.wait_op(op, n, |s| s.consumed.load(Ordering::Acquire) >= n)?;
        match self.decide(n, OUTCOME_COMMIT << 62 | n) {
            Decision::Commit => {
                self.exposed = None;
                Ok(())
            }
            Decision::Abort { rank, cause } => Err(self.failure_error(op, n, rank, cause)),
            Decision::Pending => Err(Error::Internal(format!(
                "{}: op #{n} of group '{}' is undecided after its decision",
                op.name(),
                self.name
            ))),
        }
    }

    /// Runs `f`; an error aborts the op and breaks the group (peers see this rank as failed).
    /// Where a peer's failure decided the op first, or the error is a failed read of a peer
    /// that died, the error names that peer: every rank blames the first failure.
    fn guarded<T>(&mut self, op: Op, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        f(self).map_err(|e| {
            if self.broken.is_some() || self.seq == 0 {
                return self.fail(e);
            }
            let n = self.seq;
            let peer_error = matches!(e, Error::PeerFailure(_) | Error::Timeout(_));
            let find_dead = |g: &Self| {
                (0..g.world)
                    .find(|&p| p != g.rank && !pid_alive(g.slot(p).pid.load(Ordering::Acquire)))
            };
            let mut dead = find_dead(self);
            // A read of a peer that is being killed can fail before its death shows (its memory
            // goes first): wait a little for the death or another rank's decision, so this rank
            // does not blame itself for the peer's end.
            let since = Instant::now();
            while peer_error
                && dead.is_none()
                && since.elapsed() < 4 * LIVENESS_PERIOD
                && decoded(self.decision_word().load(Ordering::Acquire), n) == Decision::Pending
            {
                std::thread::sleep(Duration::from_millis(1));
                dead = find_dead(self);
            }
            let want = match dead {
                Some(p) if peer_error => abort_word(n, p, Cause::Died),
                _ => abort_word(n, self.rank, Cause::Failed),
            };
            // The first failure explains a failed read of a peer (it may have exited since) and
            // any error of a late rank (it may have read buffers its peers reused); an argument
            // error every rank detects alike keeps its own message.
            let e = match self.decide(n, want) {
                Decision::Abort { rank, cause }
                    if !(rank == self.rank && cause == Cause::Failed)
                        && (peer_error || cause != Cause::Failed) =>
                {
                    self.failure_error(op, n, rank, cause)
                }
                Decision::Abort { .. } | Decision::Commit | Decision::Pending => e,
            };
            self.fail(e)
        })
    }
}

/// Checks the metadata words a rank published for `op` against its payload of `payload_len`
/// bytes, so the collectives can index and sum them without overflow or out-of-range access.
fn check_meta(
    op: Option<Op>,
    meta: &[u64],
    payload_len: usize,
    world: usize,
) -> std::result::Result<(), String> {
    fn sum(mut words: impl Iterator<Item = u64>) -> Option<u64> {
        words.try_fold(0u64, |a, w| a.checked_add(w))
    }
    let total = payload_len as u64;
    match op {
        None => Err("an unknown operation".into()),
        Some(Op::AllToAllv) => {
            if meta.len() != world {
                return Err(format!("{} send sizes for {world} ranks", meta.len()));
            }
            match sum(meta.iter().copied()) {
                Some(s) if s == total => Ok(()),
                s => Err(format!(
                    "send sizes summing to {s:?}, but a payload of {total} bytes"
                )),
            }
        }
        Some(Op::SendRecv) => {
            if meta.len() % 2 != 0 {
                return Err(format!("{} message words (expected pairs)", meta.len()));
            }
            if let Some(pair) = meta.chunks_exact(2).find(|pair| pair[0] >= world as u64) {
                return Err(format!("a message to rank {} of {world}", pair[0]));
            }
            match sum(meta.chunks_exact(2).map(|pair| pair[1])) {
                Some(s) if s == total => Ok(()),
                s => Err(format!(
                    "messages of {s:?} bytes in all, but a payload of {total} bytes"
                )),
            }
        }
        Some(Op::ExchangeRows | Op::ReduceRows) => {
            if meta.len() != 2 + 2 * world {
                return Err(format!("{} row-index words for {world} ranks", meta.len()));
            }
            let src = meta[1];
            let index_bytes = total
                .checked_sub(src)
                .ok_or_else(|| format!("a source of {src} bytes in a payload of {total} bytes"))?;
            for (r, pair) in meta[2..].chunks_exact(2).enumerate() {
                let end = pair[0].checked_add(pair[1]).and_then(|x| x.checked_mul(4));
                if end.is_none_or(|e| e > index_bytes) {
                    return Err(format!(
                        "row list for rank {r} at {} with {} rows, past the {index_bytes} bytes of row indices",
                        pair[0], pair[1]
                    ));
                }
            }
            Ok(())
        }
        Some(Op::Broadcast) => match meta.len() {
            1 => Ok(()),
            k => Err(format!("{k} root words (expected 1)")),
        },
        Some(Op::Join | Op::Barrier | Op::AllGatherv | Op::ReduceScatterv | Op::Leave) => Ok(()),
    }
}

/// Buffer tables of the thread ranks of one process, per group session: rank r's entry holds
/// (op, (address, length) of each buffer). Private memory, so no other process can forge it.
type LocalTables = Vec<Mutex<(u64, Vec<(u64, usize)>)>>;

fn local_tables(session: u64, world: usize) -> Arc<LocalTables> {
    static ALL: OnceLock<Mutex<HashMap<u64, Weak<LocalTables>>>> = OnceLock::new();
    let mut all = ALL
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(t) = all.get(&session).and_then(Weak::upgrade) {
        return t;
    }
    all.retain(|_, w| w.strong_count() > 0);
    let t: Arc<LocalTables> = Arc::new((0..world).map(|_| Mutex::new((0, Vec::new()))).collect());
    all.insert(session, Arc::downgrade(&t));
    t
}

fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Group for ShmGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.world
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn elastic(&self) -> bool {
        self.opts.elastic
    }

    fn barrier(&mut self) -> Result<()> {
        self.run_agreed(Op::Barrier, Ok(()), &[], &[], &[], |_| Ok(()))
    }

    fn reject(&mut self, op: Op, e: Error) -> Error {
        self.reject_op(op, e)
    }

    fn all_gatherv(&mut self, input: &[u8], sizes: &[usize], output: &mut [u8]) -> Result<()> {
        let op = Op::AllGatherv;
        self.check_usable(op)?;
        let me = self.rank;
        let local = check_sizes("sizes", op, sizes, self.world).and_then(|total| {
            check_len("input", op, input.len(), sizes[me], &format!("sizes[{me}]"))?;
            check_len("output", op, output.len(), total, "sum(sizes)")?;
            Ok(total)
        });
        let params = [
            agree::number("sum(sizes)", *local.as_ref().unwrap_or(&0)),
            agree::list("sizes", sizes),
        ];
        self.run_agreed(op, local.map(drop), &params, &[], &[input], |g| {
            let mut off = 0;
            for (p, &len) in sizes.iter().enumerate() {
                let dst = &mut output[off..off + len];
                if p == me {
                    dst.copy_from_slice(input);
                } else {
                    let (_, data) = g.parts(p)?;
                    if data.len() != len {
                        return Err(Error::InvalidArgument(format!(
                            "all_gatherv: rank {p} contributed {} bytes but sizes[{p}] on rank {me} is {len} (ranks disagree on sizes)",
                            data.len()
                        )));
                    }
                    data.copy_to(0, dst)?;
                }
                off += len;
            }
            Ok(())
        })
    }

    fn reduce_scatterv(
        &mut self,
        input: &[u8],
        rows: &[usize],
        row_elems: usize,
        kind: FloatKind,
        output: &mut [u8],
    ) -> Result<()> {
        let op = Op::ReduceScatterv;
        self.check_usable(op)?;
        let me = self.rank;
        let local = check_reduce_scatterv(
            me,
            self.world,
            input.len(),
            rows,
            row_elems,
            kind,
            output.len(),
        );
        let (row_bytes, first_row) = *local.as_ref().unwrap_or(&(0, 0));
        let params = [
            agree::dtype("dtype", kind),
            agree::number("row_elems", row_elems),
            agree::number(
                "sum(rows)",
                rows.iter().fold(0usize, |a, &r| a.wrapping_add(r)),
            ),
            agree::list("rows", rows),
        ];
        self.run_agreed(op, local.map(drop), &params, &[], &[input], |g| {
            let mut sources: Vec<Payload<'_>> = Vec::with_capacity(g.world);
            for p in 0..g.world {
                if p == me {
                    sources.push(Payload::Region(input));
                } else {
                    let (_, data) = g.parts(p)?;
                    if data.len() != input.len() {
                        return Err(Error::InvalidArgument(format!(
                            "reduce_scatterv: rank {p} contributed {} bytes but rank {me} expects {} (ranks disagree on rows or row size)",
                            data.len(),
                            input.len()
                        )));
                    }
                    sources.push(data);
                }
            }
            let start = first_row * row_bytes;
            reduce_into(&sources, start, kind, output)
        })
    }

    fn all_to_allv(
        &mut self,
        send: &[u8],
        send_sizes: &[usize],
        recv: &mut [u8],
        recv_sizes: &[usize],
    ) -> Result<()> {
        let op = Op::AllToAllv;
        self.check_usable(op)?;
        let local = (|| {
            let send_total = check_sizes("send_sizes", op, send_sizes, self.world)?;
            let recv_total = check_sizes("recv_sizes", op, recv_sizes, self.world)?;
            check_len("send", op, send.len(), send_total, "sum(send_sizes)")?;
            check_len("recv", op, recv.len(), recv_total, "sum(recv_sizes)")
        })();
        let me = self.rank;
        let meta: Vec<u64> = send_sizes.iter().map(|&s| s as u64).collect();
        self.run_agreed(op, local, &[], &meta, &[send], |g| {
            let mut off = 0;
            for (p, &len) in recv_sizes.iter().enumerate() {
                let dst = &mut recv[off..off + len];
                off += len;
                let (their_sizes, data) = g.parts(p)?;
                let theirs = their_sizes[me] as usize;
                if theirs != len {
                    return Err(Error::InvalidArgument(format!(
                        "all_to_allv: rank {p} sends {theirs} bytes to rank {me} but recv_sizes[{p}] on rank {me} is {len}"
                    )));
                }
                let start: usize = their_sizes[..me].iter().map(|&s| s as usize).sum();
                data.copy_to(start, dst)?;
            }
            Ok(())
        })
    }

    fn send_recv(&mut self, ops: &mut [P2p<'_>]) -> Result<()> {
        let op = Op::SendRecv;
        self.check_usable(op)?;
        if let Err(e) = check_p2p(ops, self.rank, self.world) {
            return Err(self.reject_op(op, e));
        }
        let me = self.rank;
        self.guarded(op, |g| {
            let n = g.begin(op)?;
            {
                // Metadata: (peer, bytes) per send in issue order; payload: the sends.
                let mut meta = Vec::new();
                let mut parts: Vec<&[u8]> = Vec::new();
                for o in ops.iter() {
                    if let P2p::Send { peer, data } = o {
                        meta.extend([*peer as u64, data.len() as u64]);
                        parts.push(data);
                    }
                }
                g.publish(op, n, &meta, &parts)?;
            }
            g.gather_published(op, n)?;
            if let Err(e) = g.verdict(op, n, &[]) {
                g.finish(op, n)?;
                return Err(e);
            }
            let mut matched = vec![0usize; g.world]; // receives matched so far, per source
            for o in ops.iter_mut() {
                let P2p::Recv { peer, data } = o else { continue };
                let p = *peer;
                let j = matched[p];
                let (their_meta, their_payload) = g.parts(p)?;
                // The j-th send from p to this rank.
                let mut off = 0usize;
                let mut found = None;
                let mut seen = 0usize;
                for pair in their_meta.chunks_exact(2) {
                    let (dst, len) = (pair[0] as usize, pair[1] as usize);
                    if dst == me {
                        if seen == j {
                            found = Some((off, len));
                            break;
                        }
                        seen += 1;
                    }
                    off += len;
                }
                let Some((off, len)) = found else {
                    return Err(Error::InvalidArgument(format!(
                        "send_recv: rank {me} posted receive #{j} from rank {p}, but rank {p} posted only {seen} send(s) to rank {me}"
                    )));
                };
                if len != data.len() {
                    return Err(Error::InvalidArgument(format!(
                        "send_recv: receive #{j} on rank {me} from rank {p} has {} bytes but the matching send has {len} bytes",
                        data.len()
                    )));
                }
                their_payload.copy_to(off, data)?;
                matched[p] += 1;
            }
            // Every message sent to this rank must have been received.
            for (p, &got) in matched.iter().enumerate() {
                let (their_meta, _) = g.parts(p)?;
                let sent = their_meta.chunks_exact(2).filter(|pair| pair[0] as usize == me).count();
                if sent != got {
                    return Err(Error::InvalidArgument(format!(
                        "send_recv: rank {p} sent {sent} message(s) to rank {me}, but rank {me} posted {got} receive(s) from it"
                    )));
                }
            }
            g.finish(op, n)
        })
    }

    fn exchange_rows(
        &mut self,
        src: &[u8],
        row_bytes: usize,
        give: &[Vec<u32>],
        dst: &mut [u8],
        take: &[Vec<u32>],
    ) -> Result<()> {
        let op = Op::ExchangeRows;
        self.check_usable(op)?;
        if !self.direct {
            return rows::exchange_packed(self, src, row_bytes, give, dst, take);
        }
        if let Err(e) = rows::check_exchange(self.rank, self.world, src, row_bytes, give, dst, take)
        {
            return Err(self.reject_op(op, e));
        }
        let me = self.rank;
        let (meta, index_bytes) = rows::index_table(src.len(), row_bytes, give);
        let params = [agree::number("row_bytes", row_bytes)];
        self.run_agreed(op, Ok(()), &params, &meta, &[src, &index_bytes], |g| {
            for (p, take_p) in take.iter().enumerate() {
                let (their_meta, payload) = g.parts(p)?;
                let src_idx = rows::read_index_list(
                    op,
                    &their_meta,
                    p,
                    me,
                    row_bytes,
                    take_p.len(),
                    |o, b| payload.copy_to(o, b),
                )?;
                let ranges: Vec<(usize, usize, usize)> = src_idx
                    .iter()
                    .zip(take_p)
                    .map(|(&s, &d)| (s as usize * row_bytes, d as usize * row_bytes, row_bytes))
                    .collect();
                payload.copy_scattered(dst, &ranges)?;
            }
            Ok(())
        })
    }

    fn reduce_rows(
        &mut self,
        src: &[u8],
        kind: FloatKind,
        row_elems: usize,
        give: &[Vec<u32>],
        out: &mut [u8],
        out_kind: FloatKind,
        take: &[Vec<(u32, f32)>],
    ) -> Result<()> {
        let op = Op::ReduceRows;
        self.check_usable(op)?;
        if !self.direct {
            return rows::reduce_packed(self, src, kind, row_elems, give, out, out_kind, take);
        }
        let row_bytes = row_elems * kind.size();
        let out_rows = match rows::check_reduce(
            self.world, src, row_bytes, row_elems, give, out, out_kind, take,
        ) {
            Ok(r) => r,
            Err(e) => return Err(self.reject_op(op, e)),
        };
        let me = self.rank;
        let (meta, index_bytes) = rows::index_table(src.len(), row_bytes, give);
        let params = [
            agree::dtype("row dtype", kind),
            agree::number("row_elems", row_elems),
            agree::dtype("output dtype", out_kind),
        ];
        self.run_agreed(op, Ok(()), &params, &meta, &[src, &index_bytes], |g| {
            // Each peer's payload and the source rows it gives this rank, read once.
            let mut payloads = Vec::with_capacity(g.world);
            for (p, take_p) in take.iter().enumerate() {
                let (their_meta, payload) = g.parts(p)?;
                let idx = rows::read_index_list(
                    op,
                    &their_meta,
                    p,
                    me,
                    row_bytes,
                    take_p.len(),
                    |o, b| payload.copy_to(o, b),
                )?;
                payloads.push((payload, idx));
            }
            let by_row = rows::ByRow::new(take, out_rows);
            let mut ranges = Vec::new();
            rows::reduce_blocked(
                kind,
                row_elems,
                &by_row,
                out,
                out_kind,
                Some((me, src, give[me].as_slice())),
                |peer: usize, positions: &[u32], scratch: &mut [u8]| {
                    let (payload, idx) = &payloads[peer];
                    ranges.clear();
                    ranges.extend(positions.iter().enumerate().map(|(i, &pos)| {
                        (
                            idx[pos as usize] as usize * row_bytes,
                            i * row_bytes,
                            row_bytes,
                        )
                    }));
                    payload.copy_scattered(scratch, &ranges)
                },
            )
        })
    }

    fn broadcast(&mut self, root: usize, data: &mut [u8]) -> Result<()> {
        let op = Op::Broadcast;
        self.check_usable(op)?;
        let local = check_rank("root", op, root, self.world);
        let me = self.rank;
        let mine: Vec<u8> = if me == root {
            data.to_vec()
        } else {
            Vec::new()
        };
        let params = [
            agree::number("root", root),
            agree::number("byte count", data.len()),
        ];
        self.run_agreed(op, local, &params, &[root as u64], &[&mine], |g| {
            if me == root {
                return Ok(());
            }
            let (_, payload) = g.parts(root)?;
            if payload.len() != data.len() {
                return Err(Error::InvalidArgument(format!(
                    "broadcast: root {root} sent {} bytes but rank {me} expects {}",
                    payload.len(),
                    data.len()
                )));
            }
            payload.copy_to(0, data)
        })
    }
}

/// A read of `len` bytes at `offset` of a payload (or buffer) of `size` bytes: the ranks'
/// published sizes disagree with what this read needs.
fn out_of_payload(offset: usize, len: usize, size: usize) -> Error {
    Error::InvalidArgument(format!(
        "a read of {len} bytes at offset {offset} goes past the end of a rank's published data ({size} bytes); the ranks disagree on sizes"
    ))
}

/// A rank's contribution to the current op: bytes in its shared region, or (direct mode)
/// ranges of its own memory to copy from.
enum Payload<'a> {
    Region(&'a [u8]),
    Direct {
        rank: usize,
        pid: u32,
        local: bool,
        pieces: Vec<(u64, usize)>,
        len: usize,
    },
}

impl Payload<'_> {
    fn len(&self) -> usize {
        match self {
            Payload::Region(b) => b.len(),
            Payload::Direct { len, .. } => *len,
        }
    }

    /// Copies `dst.len()` bytes starting at byte `offset` of the payload into `dst`.
    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        match self {
            Payload::Region(b) => {
                let src = offset
                    .checked_add(dst.len())
                    .and_then(|end| b.get(offset..end))
                    .ok_or_else(|| out_of_payload(offset, dst.len(), b.len()))?;
                dst.copy_from_slice(src);
                Ok(())
            }
            Payload::Direct {
                rank,
                pid,
                local,
                pieces,
                len,
            } => {
                if offset.checked_add(dst.len()).is_none_or(|end| end > *len) {
                    return Err(out_of_payload(offset, dst.len(), *len));
                }
                let (mut piece_start, mut done) = (0usize, 0usize);
                for &(addr, plen) in pieces {
                    let want = offset + done;
                    if done == dst.len() {
                        break;
                    }
                    if want < piece_start + plen {
                        let within = want - piece_start;
                        let n = (plen - within).min(dst.len() - done);
                        copy_from_process(
                            *pid,
                            *local,
                            addr + within as u64,
                            &mut dst[done..done + n],
                        )
                        .map_err(|e| {
                            Error::PeerFailure(format!(
                                "cannot read the data of rank {rank} (pid {pid}) directly: {e}"
                            ))
                        })?;
                        done += n;
                    }
                    piece_start += plen;
                }
                Ok(())
            }
        }
    }
}

impl Payload<'_> {
    /// Copies ranges (payload offset, offset in `dst`, length) of the payload into `dst`; each
    /// range lies within one published buffer.
    fn copy_scattered(&self, dst: &mut [u8], ranges: &[(usize, usize, usize)]) -> Result<()> {
        match self {
            Payload::Region(b) => {
                for &(src, off, len) in ranges {
                    let from = src
                        .checked_add(len)
                        .and_then(|end| b.get(src..end))
                        .ok_or_else(|| out_of_payload(src, len, b.len()))?;
                    let size = dst.len();
                    let to = off
                        .checked_add(len)
                        .and_then(|end| dst.get_mut(off..end))
                        .ok_or_else(|| out_of_payload(off, len, size))?;
                    to.copy_from_slice(from);
                }
                Ok(())
            }
            Payload::Direct {
                rank,
                pid,
                local,
                pieces,
                ..
            } => {
                let mut remote = Vec::with_capacity(ranges.len());
                for &(src, off, len) in ranges {
                    let mut start = 0usize;
                    let addr = pieces.iter().find_map(|&(addr, plen)| {
                        let hit = src >= start && src.saturating_add(len) <= start + plen;
                        let a = addr + (src - start.min(src)) as u64;
                        start += plen;
                        hit.then_some(a)
                    });
                    let addr = addr.ok_or_else(|| out_of_payload(src, len, self.len()))?;
                    if off.checked_add(len).is_none_or(|end| end > dst.len()) {
                        return Err(out_of_payload(off, len, dst.len()));
                    }
                    remote.push((addr, off, len));
                }
                copy_scattered_from_process(*pid, *local, dst, &remote).map_err(|e| {
                    Error::PeerFailure(format!(
                        "cannot read the data of rank {rank} (pid {pid}) directly: {e}"
                    ))
                })
            }
        }
    }
}

/// Sums `out.len()` bytes (elements of `kind`) starting at byte `start` of every source, in
/// source order, accumulating in f32, and stores the result in `out`. Works in cache-sized
/// chunks; direct sources are copied chunk by chunk into a small buffer first.
fn reduce_into(
    sources: &[Payload<'_>],
    start: usize,
    kind: FloatKind,
    out: &mut [u8],
) -> Result<()> {
    const CHUNK: usize = 8192; // elements
    let es = kind.size();
    let elems = out.len() / es;
    let mut acc = vec![0f32; CHUNK.min(elems)];
    let mut scratch = vec![0u8; CHUNK.min(elems) * es];
    let mut e0 = 0;
    while e0 < elems {
        let n = CHUNK.min(elems - e0);
        let acc = &mut acc[..n];
        acc.fill(0.0);
        let (b0, b1) = (start + e0 * es, start + (e0 + n) * es);
        for src in sources {
            match src {
                Payload::Region(b) => num::accumulate(acc, &b[b0..b1], kind),
                direct => {
                    let tmp = &mut scratch[..n * es];
                    direct.copy_to(b0, tmp)?;
                    num::accumulate(acc, tmp, kind);
                }
            }
        }
        num::store(acc, &mut out[e0 * es..(e0 + n) * es], kind);
        e0 += n;
    }
    Ok(())
}

impl Drop for ShmGroup {
    fn drop(&mut self) {
        if self.broken.is_none() {
            // Let peers finish reading this rank's last contribution before its region goes.
            let n = self.seq;
            let saved = self.opts.timeout;
            self.opts.timeout = saved.min(Duration::from_secs(5));
            let _ = self.wait_peers(Op::Leave, n, |s| {
                s.consumed.load(Ordering::Acquire) >= n
                    || s.state.load(Ordering::Acquire) != SLOT_ACTIVE
            });
            self.mark(SLOT_LEFT);
            // Give the others a moment to leave too, so a rank that dies right after its last
            // op is seen dead here and its region removed below.
            self.opts.timeout = saved.min(Duration::from_secs(1));
            let _ = self.wait_peers(Op::Leave, n, |s| {
                s.state.load(Ordering::Acquire) != SLOT_ACTIVE
            });
            self.opts.timeout = saved;
        }
        Segment::unlink(self.data.name());
        // Segments of peers that died after the last op anyone waited on.
        for p in (0..self.world).filter(|&p| p != self.rank) {
            let s = self.slot(p);
            let pid = s.pid.load(Ordering::Acquire);
            if pid != 0 && !pid_alive(pid) {
                let gen = s.data_gen.load(Ordering::Acquire);
                Segment::unlink(&Self::data_name(&self.name, self.session, p, gen, pid));
            }
        }
        if !self.control_unlinked
            && (self.rank == 0 || !pid_alive(self.header().creator_pid.load(Ordering::Acquire)))
        {
            self.unlink_own_control();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A forged decision word naming a rank outside the group is an error, never a panic.
    #[test]
    fn a_decision_word_naming_a_rank_out_of_range_is_an_error() {
        let name = format!("unit-forged-decision-{}", std::process::id());
        let mut g = ShmGroup::join(&name, 0, 1, GroupOptions::default()).unwrap();
        g.barrier().unwrap();
        g.decision_word()
            .store(abort_word(2, 1000, Cause::Died), Ordering::Release);
        let e = g.barrier().unwrap_err();
        assert_eq!(e.status(), crate::Status::PeerFailure);
        assert_eq!(
            e.to_string(),
            format!("barrier (op #2) of group '{name}' was aborted by a decision word naming rank 1000, outside the group of 1 ranks (the control segment was altered; seen from rank 0)")
        );
    }

    /// The mapping limit is an error at creation naming the need, the use and the limit.
    #[test]
    fn map_budget_names_the_limit() {
        assert!(map_budget("g", 3, 1024, 1000, 65530).is_ok());
        let e = map_budget("g", 3, 1024, 64500, 65530).unwrap_err();
        assert_eq!(e.status(), crate::Status::System);
        assert_eq!(
            e.to_string(),
            "group 'g' needs up to 1026 memory mappings on rank 3, but this process already has 64500 of the vm.max_map_count limit of 65530 (raise it with sysctl vm.max_map_count, or run fewer ranks per process)"
        );
    }

    /// A record reads back whole; a partial, altered or foreign one is not taken for a record;
    /// an older layout's first fields (version, world, creator) still read.
    #[test]
    fn records_round_trip_and_reject_partial_ones() {
        let r = Record {
            version: LAYOUT_VERSION,
            world: 3,
            creator: 1234,
            fd: 7,
            key: (11, 22),
            session: 0xabcdef,
            created_ns: 99,
        };
        let b = r.encode();
        assert_eq!(b.len(), RECORD_BYTES);
        let d = Record::decode(&b).unwrap();
        assert_eq!(
            (d.world, d.creator, d.fd, d.key, d.session, d.created_ns),
            (3, 1234, 7, (11, 22), 0xabcdef, 99)
        );
        assert!(Record::decode(&b[..40]).is_none());
        let mut altered = b.clone();
        altered[44] ^= 1;
        assert!(Record::decode(&altered).is_none());
        assert!(Record::decode(&[0u8; RECORD_BYTES]).is_none());
        let mut old = b.clone();
        old[8..12].copy_from_slice(&3u32.to_ne_bytes());
        let o = Record::decode(&old[..24]).unwrap();
        assert_eq!((o.version, o.world, o.creator), (3, 3, 1234));
    }
}
