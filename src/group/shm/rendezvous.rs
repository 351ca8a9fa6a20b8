//! Rendezvous: group names and unique ids, the record `/dev/shm/epcomm.{name}` naming rank 0's
//! control segment, and creating or opening that segment (stale records, layouts, conflicts
//! with another job under the same name).

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::layout::{
    control_bytes, now_ns, Header, ABANDONED, FORMED, HEADER_BYTES, LAYOUT_VERSION, MAGIC,
};
use super::segment::{self, pid_alive, Segment};
use super::wait::{Backoff, Deadline};
use super::waiting::{self, WARN_AFTER};
use super::ShmGroup;
use crate::bytes;
use crate::error::{Error, Result};

/// A rank maps the control segment and every rank's data segment (at most `world + 1` new
/// mappings; thread ranks of one process share them). Refuses a group that would exceed
/// `vm.max_map_count` with the mappings this process already has, so the limit is an error
/// here instead of a failed mmap (or an abort) later.
pub(super) fn check_map_budget(name: &str, rank: usize, world: usize) -> Result<()> {
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

/// Refuses a join whose first region (`capacity` bytes) or, on rank 0, control segment would
/// exceed RLIMIT_FSIZE (the kernel would kill the process with SIGXFSZ). Checked before the
/// rank waits for anyone, so every rank of a job started under the limit fails at once with
/// this error, instead of the others waiting for a rank 0 that failed.
pub(super) fn check_file_size(
    name: &str,
    rank: usize,
    world: usize,
    capacity: usize,
) -> Result<()> {
    let len = if rank == 0 {
        capacity.max(control_bytes(world))
    } else {
        capacity
    };
    match segment::check_file_size(len as u64) {
        Ok(()) => Ok(()),
        Err(e) => Err(match segment::file_size_limit_of(&e) {
            Some(l) => Error::System(format!(
                "group '{name}' needs a shared-memory region of {len} bytes on rank {rank}, but the file size limit RLIMIT_FSIZE (ulimit -f) is {} bytes; raise it (ulimit -f unlimited)",
                l.limit
            )),
            None => sys_err(format!("group '{name}' on rank {rank}"), e),
        }),
    }
}

/// The rendezvous record `/dev/shm/epcomm.{name}`: where rank 0's control segment is, and who
/// made it (pid and start time, so any later process can tell that its creator is gone, even
/// if the pid was reused). Written once (it appears whole, see `Segment::create_record`) and
/// read with pread (never mapped); checksums tell a complete record from a damaged one.
#[derive(Clone, Copy, Debug)]
struct Record {
    version: u32,
    world: u32,
    creator: u32,
    fd: u32,
    key: segment::FileKey,
    session: u64,
    created_ns: u64,
    /// The creator's start time (`segment::start_time`); 0 if unknown or in a record of an
    /// epcomm that did not write it.
    start: u64,
}

/// Bytes of a record: the 64 of the first layout-5 records (whose readers read only those and
/// check the first checksum), then the creator's start time and a checksum over all before it.
const RECORD_BYTES: usize = 80;
const RECORD_V1_BYTES: usize = 64;

/// FNV-1a over the words of `b` (a record's bytes before one of its checksums).
fn record_checksum(b: &[u8]) -> u64 {
    bytes::words::<u64>(b).fold(0xcbf2_9ce4_8422_2325, |h, w| {
        (h ^ w).wrapping_mul(0x100_0000_01b3)
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
        b.extend(self.start.to_ne_bytes());
        let sum = record_checksum(&b);
        b.extend(sum.to_ne_bytes());
        b
    }

    /// A complete record of any epcomm layout (the first fields have kept their places since
    /// layout 3, whose control segment sat under this name), or None for a partial or foreign
    /// one. A 64-byte record (an epcomm before the start time) has start 0.
    fn decode(b: &[u8]) -> Option<Record> {
        let u32_at = |i: usize| bytes::word_at::<u32>(b, i);
        let u64_at = |i: usize| bytes::word_at::<u64>(b, i);
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
            start: 0,
        };
        if version != LAYOUT_VERSION {
            return Some(r);
        }
        if b.len() < RECORD_V1_BYTES || u64_at(56)? != record_checksum(&b[..56]) {
            return None;
        }
        match b.len() {
            RECORD_V1_BYTES => {}
            n if n >= RECORD_BYTES && u64_at(72)? == record_checksum(&b[..72]) => {
                r.start = u64_at(64)?;
            }
            _ => return None,
        }
        r.fd = u32_at(20)?;
        r.key = (u64_at(24)?, u64_at(32)?);
        r.session = u64_at(40)?;
        r.created_ns = u64_at(48)?;
        Some(r)
    }

    /// Whether the process that made this record is alive (its pid, and its start time where
    /// the record has one).
    fn creator_alive(&self) -> bool {
        segment::process_alive(self.creator, self.start)
    }
}

/// How often one process sweeps /dev/shm for records whose creators are gone, and how many
/// `epcomm.*` entries one sweep examines (a few system calls each).
const SWEEP_PERIOD: Duration = Duration::from_secs(10);
const SWEEP_MAX: usize = 256;
/// An empty record is stale after this long: only where /dev/shm has no unnamed files can a
/// creator die between creating its record and writing it.
const EMPTY_RECORD_GRACE: Duration = Duration::from_secs(10);

/// Removes the rendezvous records of any group whose creator is gone (killed during group
/// creation: nothing else leaves one), at most every [`SWEEP_PERIOD`] per process and
/// [`SWEEP_MAX`] entries per sweep; logs one info line per record removed. Never a record that
/// is locked (its creator lives, whatever its pid looks like from here), another user's, or a
/// file that is not a record.
pub(super) fn sweep_stale_records() {
    static LAST: Mutex<Option<Instant>> = Mutex::new(None);
    // Thread ranks joining together: one sweeps, the others go on.
    let Ok(mut last) = LAST.try_lock() else {
        return;
    };
    if last.is_some_and(|t| t.elapsed() < SWEEP_PERIOD) {
        return;
    }
    *last = Some(Instant::now());
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    let names = dir
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|f| {
            f.strip_prefix("epcomm.")
                .is_some_and(|g| check_name(g).is_ok())
        })
        .take(SWEEP_MAX);
    for file in names {
        let mut why = String::new();
        let stale = |b: &[u8], _key, st: &libc::stat| match Record::decode(b) {
            Some(r) => {
                why = format!("its creator, pid {}, is gone", r.creator);
                !r.creator_alive()
            }
            None => {
                why = "it is empty: its creator died while writing it".into();
                st.st_size == 0 && modified_before(st, EMPTY_RECORD_GRACE)
            }
        };
        if let Ok(Some(_)) = Segment::remove_record_if(&format!("/{file}"), RECORD_BYTES, stale) {
            crate::log::info(&format!(
                "removed the stale rendezvous record /dev/shm/{file} of group '{}': {why}",
                &file["epcomm.".len()..]
            ));
        }
    }
}

/// Whether the file `st` was last modified more than `age` ago.
fn modified_before(st: &libc::stat, age: Duration) -> bool {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    (st.st_mtime as u64).saturating_add(age.as_secs()) < now
}

/// Group names: 1..=64 of [A-Za-z0-9_.-], so they are valid shm names on every system.
pub(super) fn check_name(name: &str) -> Result<()> {
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

pub(super) fn random_u64() -> u64 {
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

/// The error of rank `rank`, which found group `name` (created by pid `creator`) already met
/// by pid `met` of another job.
fn met_conflict(name: &str, met: u64, creator: u32, rank: usize) -> Error {
    Error::InvalidState(format!(
        "group name '{name}' is in use by another job: pid {met} met the group that pid {creator} created under this name, so neither forms (seen from rank {rank}); jobs that run at the same time need distinct group names"
    ))
}

pub(super) fn sys_err(what: String, e: std::io::Error) -> Error {
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

impl ShmGroup {
    pub(super) fn data_name(name: &str, session: u64, rank: usize, gen: u64, pid: u32) -> String {
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

    pub(super) fn create_control(
        name: &str,
        control_name: &str,
        world: usize,
        deadline: &Deadline,
    ) -> Result<Segment> {
        sweep_stale_records();
        let bytes = control_bytes(world);
        let mut seg = Segment::create(&format!("{control_name}.control"), bytes).map_err(|e| {
            sys_err(
                format!(
                    "cannot create the control segment of group '{name}' ({bytes} bytes) on rank 0"
                ),
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
            start: segment::own_start_time(),
        }
        .encode();
        loop {
            match Segment::create_record(control_name, &record) {
                Ok((key, lock)) => {
                    seg.hold_record(lock);
                    let h: &Header = seg.at(0);
                    h.record_dev.store(key.0, Ordering::Relaxed);
                    h.record_ino.store(key.1, Ordering::Release);
                    Self::remove_stale_data(name);
                    return Ok(seg);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    Self::replace_stale_record(name, control_name)?;
                }
                Err(e) => {
                    return Err(sys_err(
                        format!("cannot create the rendezvous record /dev/shm{control_name} of group '{name}'"),
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

    /// Someone else's record holds the name: removes it if it is stale (its creator is gone,
    /// or it is garbage nobody holds), else fails with the conflict (another job with the same
    /// name is joining).
    fn replace_stale_record(name: &str, control_name: &str) -> Result<()> {
        // A partial record (an epcomm that writes it by name) gets a moment to complete.
        let seen = Self::read_record(name, control_name)?;
        let mut live = None;
        let removed = Segment::remove_record_if(control_name, RECORD_BYTES, |b, _, _| {
            match Record::decode(b) {
                Some(r) if r.creator_alive() => {
                    live = Some(r);
                    false
                }
                Some(_) | None => true,
            }
        });
        let conflict = |pid: String| {
            Error::InvalidState(format!(
                "group name '{name}' is in use by another job: its rank 0 ({pid}) is still waiting for its ranks to join; jobs that run at the same time need distinct group names"
            ))
        };
        match removed {
            Ok(Some(_)) => {
                crate::log::info(&format!(
                    "replacing stale shared-memory segment {control_name} left by a crashed run"
                ));
                Ok(())
            }
            // Gone meanwhile: try again.
            Ok(None) if Segment::record_key(control_name).is_none() => Ok(()),
            // Held by a live creator (locked, or its pid alive); a group another job met
            // already is refused as the other ranks that find it are.
            Ok(None) => match live.or(seen) {
                Some(r) => match Self::mark_conflict(&r) {
                    Some(met) => Err(met_conflict(name, met, r.creator, 0)),
                    None => Err(conflict(format!("pid {}", r.creator))),
                },
                None => Err(conflict("whose record cannot be read".into())),
            },
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Err(Error::InvalidState(
                format!("group name '{name}' is in use by another job or user, refused: {e}"),
            )),
            Err(e) => Err(sys_err(format!("cannot read /dev/shm{control_name}"), e)),
        }
    }

    /// Removes the record of `name` if it is still the one of `session` (or, with session 0,
    /// any record) and its creator is gone.
    fn remove_dead_record(name: &str, control_name: &str, session: u64) {
        let _ = Segment::remove_record_if(control_name, RECORD_BYTES, |b, _, _| {
            Record::decode(b)
                .is_some_and(|r| (session == 0 || r.session == session) && !r.creator_alive())
        });
        Self::remove_stale_data(name);
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

    /// Tells the live group behind record `r` that another job met it, so it does not form;
    /// returns the pid that met it earlier, if one did.
    fn mark_conflict(r: &Record) -> Option<u64> {
        if r.version != LAYOUT_VERSION {
            return None;
        }
        let seg = Self::try_map_control(r, HEADER_BYTES).ok()?;
        let h: &Header = seg.at(0);
        h.conflict_pid
            .compare_exchange(
                0,
                u64::from(std::process::id()),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .err()
            .filter(|met| !matches!(*met, FORMED | ABANDONED))
    }

    pub(super) fn open_control(
        name: &str,
        control_name: &str,
        rank: usize,
        world: usize,
        deadline: &Deadline,
    ) -> Result<Segment> {
        sweep_stale_records();
        let mut backoff = Backoff::new();
        // A record created after this rank started waiting is this group's.
        let started_ns = now_ns();
        // Why rank 0's live segment could not be mapped, for the timeout's message.
        let mut unmapped: Option<String> = None;
        let started = Instant::now();
        let mut warned = false;
        loop {
            if let Some(r) = Self::read_record(name, control_name)? {
                let alive = r.creator_alive();
                if r.version != LAYOUT_VERSION && alive {
                    return Err(Error::InvalidArgument(format!(
                        "group '{name}' was created by an epcomm with shared-memory layout {}; this epcomm uses layout {LAYOUT_VERSION}",
                        r.version
                    )));
                }
                if r.version == LAYOUT_VERSION && !alive && r.created_ns >= started_ns {
                    // Created for this join, then rank 0 died: not a stale segment to wait
                    // out. Remove what the dead creator left.
                    Self::remove_dead_record(name, control_name, r.session);
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
                        // Another job met this group under the same name: it will not form,
                        // and this rank (of either job) says so rather than waiting it out.
                        let met = h.conflict_pid.load(Ordering::Acquire);
                        if !matches!(met, 0 | FORMED | ABANDONED) {
                            return Err(met_conflict(name, met, r.creator, rank));
                        }
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
                Self::remove_dead_record(name, control_name, 0);
                return Err(Error::Timeout(waiting::create_timeout(
                    deadline.timeout,
                    name,
                    rank,
                    world,
                    unmapped.as_deref(),
                )));
            }
            if !warned && deadline.timeout > WARN_AFTER && started.elapsed() >= WARN_AFTER {
                warned = true;
                crate::log::warn(&waiting::create_warning(
                    started.elapsed(),
                    deadline.timeout,
                    name,
                    rank,
                    world,
                ));
            }
            backoff.snooze();
            if backoff.iter > 64 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// Unlinks the rendezvous record if it still belongs to this group's session (a new group
    /// of the same name may have replaced it).
    pub(super) fn unlink_own_control(&self) {
        let h = self.header();
        let created = (
            h.record_dev.load(Ordering::Relaxed),
            h.record_ino.load(Ordering::Acquire),
        );
        let session = self.session;
        // Unreadable as a record (overwritten, truncated): still ours if it is the file rank 0
        // created.
        let ours = move |b: &[u8], key: segment::FileKey| {
            Record::decode(b).is_some_and(|r| r.session == session)
                || (created != (0, 0) && key == created)
        };
        if self.rank != 0 {
            // Rank 0 (gone) held the record's lock; whoever removes it for it takes the lock.
            let _ = Segment::remove_record_if(&self.control_name, RECORD_BYTES, |b, key, _| {
                ours(b, key)
            });
            return;
        }
        // Rank 0 holds the lock: nobody else removes or replaces the record meanwhile.
        let read = Segment::read_record(&self.control_name, RECORD_BYTES);
        let key = Segment::record_key(&self.control_name);
        if let (Ok(Some(b)), Some(key)) = (read, key) {
            if ours(&b, key) {
                Segment::unlink(&self.control_name);
            }
        } else if key.is_some_and(|k| created != (0, 0) && k == created) {
            // Another user's or unreadable: still ours if it is the file rank 0 created.
            Segment::unlink(&self.control_name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            start: 4321,
        };
        let b = r.encode();
        assert_eq!(b.len(), RECORD_BYTES);
        let d = Record::decode(&b).unwrap();
        assert_eq!(
            (
                d.world,
                d.creator,
                d.fd,
                d.key,
                d.session,
                d.created_ns,
                d.start
            ),
            (3, 1234, 7, (11, 22), 0xabcdef, 99, 4321)
        );
        assert!(Record::decode(&b[..40]).is_none());
        assert!(Record::decode(&b[..70]).is_none());
        for at in [44, 66] {
            let mut altered = b.clone();
            altered[at] ^= 1;
            assert!(Record::decode(&altered).is_none(), "byte {at} altered");
        }
        // A record of the first layout-5 epcomm (64 bytes, no start time) still reads, and
        // what it reads of a new record is the same first fields.
        let v1 = Record::decode(&b[..RECORD_V1_BYTES]).unwrap();
        assert_eq!((v1.creator, v1.session, v1.start), (1234, 0xabcdef, 0));
        assert_eq!(record_checksum(&b[..56]).to_ne_bytes(), b[56..64]);
        assert!(Record::decode(&[0u8; RECORD_BYTES]).is_none());
        let mut old = b.clone();
        old[8..12].copy_from_slice(&3u32.to_ne_bytes());
        let o = Record::decode(&old[..24]).unwrap();
        assert_eq!((o.version, o.world, o.creator), (3, 3, 1234));
    }
}
