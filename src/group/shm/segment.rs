//! Shared-memory segments. The only `unsafe` of the shm transport lives here and in the
//! raw-byte accessors below.
//!
//! A segment is a sealed memfd (`memfd_create`, `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`):
//! it has no name in /dev/shm, so a crash at any moment leaves nothing behind, and its size
//! cannot change under a member (a truncation that would raise SIGBUS is refused by the
//! kernel). Its creator keeps the descriptor open until every peer has mapped it; peers open it
//! through `/proc/{pid}/fd/{fd}` (same-user access, not restricted by Yama's ptrace scope, which
//! only limits attaching) and check its inode, owner, mode and seals. Mappings are shared by
//! every rank of one process (a registry keyed by device and inode), so thread ranks map each
//! segment once. The only named object is a rendezvous record (`/dev/shm/epcomm.{name}`, read
//! with pread, never mapped), present while a group is joining: it appears whole (written
//! unnamed, then linked) and its creator holds an exclusive `flock` on it until it dies or
//! closes it, so a record that can be locked has no live creator ([`Segment::remove_record_if`]).
//!
//! Every size given to a file (ftruncate, posix_fallocate, the record's write) is checked
//! against RLIMIT_FSIZE first: beyond it the kernel would send SIGXFSZ, whose default action
//! kills the process. The error names the limit ([`FileSizeLimit`]); if the limit is lowered
//! between the check and the call, the signal is held back for this thread and taken, so the
//! call still ends in that error (the process's signal dispositions are never changed).

use std::collections::HashMap;
use std::ffi::CString;
use std::io;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

/// A mapping, unmapped when the last segment handle (of any rank in this process) drops it.
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory; concurrent access is coordinated by the protocol's
// atomics (see shm/mod.rs), and the pointer stays valid until the last Arc is dropped.
unsafe impl Send for Mapping {}
// SAFETY: as above; shared access goes through atomics or ranges the protocol keeps stable.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping this value owns.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// (st_dev, st_ino) of a segment's file.
pub(super) type FileKey = (u64, u64);

fn registry() -> &'static Mutex<HashMap<FileKey, Weak<Mapping>>> {
    static MAPS: OnceLock<Mutex<HashMap<FileKey, Weak<Mapping>>>> = OnceLock::new();
    MAPS.get_or_init(|| Mutex::new(HashMap::new()))
}

fn lookup(key: FileKey, min_len: usize) -> Option<Arc<Mapping>> {
    let maps = registry().lock().unwrap_or_else(|e| e.into_inner());
    maps.get(&key)
        .and_then(Weak::upgrade)
        .filter(|m| m.len >= min_len)
}

fn register(key: FileKey, map: &Arc<Mapping>) {
    let mut maps = registry().lock().unwrap_or_else(|e| e.into_inner());
    maps.retain(|_, w| w.strong_count() > 0);
    maps.insert(key, Arc::downgrade(map));
}

/// A mapped shared-memory segment.
#[derive(Debug)]
pub(super) struct Segment {
    name: String,
    map: Arc<Mapping>,
    key: FileKey,
    /// The creator's descriptor, kept open until every peer has mapped the segment.
    fd: Option<Fd>,
    /// The rendezvous record's descriptor and lock (rank 0's control segment), held while
    /// this segment lives: its creator is alive.
    record: Option<RecordLock>,
}

/// An open rendezvous record with its creator's exclusive `flock`: as long as it is held, no
/// other process takes the record for stale. It goes when the creator drops it or dies.
#[derive(Debug)]
pub(super) struct RecordLock {
    _fd: Fd,
}

/// How long a remover waits for the lock of a record whose creator looks dead: a killed
/// process's memory goes (and its pid may read as gone) before its descriptors are closed.
const DYING_CREATOR: std::time::Duration = std::time::Duration::from_secs(2);

/// Opens the shm object `name` read-only (no link followed; `flags` added) with its status;
/// None if it does not exist. Another user's object, or one with a mode wider than 0600, is
/// PermissionDenied.
fn open_record(name: &str, flags: libc::c_int) -> io::Result<Option<(Fd, libc::stat)>> {
    let c = cname(name)?;
    // SAFETY: valid C string.
    let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDONLY | libc::O_NOFOLLOW | flags, 0) };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENOENT) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    let fd = Fd(fd);
    let st = fstat(fd.0)?;
    check_owner(&st, &shm_path(name))?;
    Ok(Some((fd, st)))
}

/// Reads up to `max` bytes at offset 0 of `fd` (pread: never mapped, so a truncation cannot
/// fault).
fn read_at_start(fd: libc::c_int, max: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; max];
    // SAFETY: buf is writable for `max` bytes.
    let n = unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), max, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// The path of the shm object `name` ("/epcomm.G"): glibc's shm_open puts it in /dev/shm.
fn shm_path(name: &str) -> String {
    format!("/dev/shm{name}")
}

/// Takes an exclusive `flock` on `fd` without waiting; false if another holds one.
fn try_lock(fd: libc::c_int) -> io::Result<bool> {
    // SAFETY: fd is a valid descriptor; flock has no memory arguments.
    if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// Writes all of `bytes` at offset 0 of `fd` (RLIMIT_FSIZE checked, see [`sized`]).
fn write_all_at(fd: libc::c_int, bytes: &[u8], what: &str) -> io::Result<()> {
    let mut short = false;
    sized(bytes.len() as u64, || {
        // SAFETY: fd is valid; `bytes` is readable for its length.
        let n = unsafe { libc::pwrite(fd, bytes.as_ptr().cast(), bytes.len(), 0) };
        if n < 0 {
            return errno_of(-1);
        }
        short = n as usize != bytes.len();
        0
    })?;
    if short {
        // The kernel shortens a write that crosses RLIMIT_FSIZE (lowered since the check).
        check_file_size(bytes.len() as u64)?;
        return Err(invalid(format!("short write of {what}")));
    }
    Ok(())
}

fn cname(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in name"))
}

fn map(fd: libc::c_int, len: usize) -> io::Result<*mut u8> {
    // SAFETY: fd is a valid descriptor; a shared read/write mapping of `len` bytes.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(io::Error::last_os_error())
    } else {
        Ok(p.cast())
    }
}

#[derive(Debug)]
struct Fd(libc::c_int);
impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: closing a descriptor we own; the mapping stays valid after close.
        unsafe { libc::close(self.0) };
    }
}

fn fstat(fd: libc::c_int) -> io::Result<libc::stat> {
    // SAFETY: st is plain data; fd is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Refuses a file that another user owns or that others may open: a same-name squatter must
/// not get a member to read or write its memory.
fn check_owner(st: &libc::stat, what: &str) -> io::Result<()> {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if st.st_uid != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{what} is owned by uid {}, not by this process's uid {me}",
                st.st_uid
            ),
        ));
    }
    let mode = st.st_mode & 0o777;
    if mode & 0o077 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{what} has mode {mode:04o}, wider than the expected 0600"),
        ));
    }
    Ok(())
}

pub(super) use crate::fsize::{check_file_size, file_size_limit_of};
use crate::fsize::{file_size_limit, too_large};

/// Runs `call`, a system call that sizes a file to `len` bytes and returns 0 or an errno, with
/// RLIMIT_FSIZE checked first and SIGXFSZ held back for this thread: should the limit have been
/// lowered since the check, the kernel's EFBIG is the [`FileSizeLimit`] error and the SIGXFSZ
/// it raised for this thread is taken (unless one was already pending), instead of killing the
/// process. Only this thread's signal mask changes, and only for the call.
fn sized(len: u64, call: impl FnOnce() -> libc::c_int) -> io::Result<()> {
    check_file_size(len)?;
    sized_unchecked(len, call)
}

fn sized_unchecked(len: u64, call: impl FnOnce() -> libc::c_int) -> io::Result<()> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it, sigaddset sets one signal.
    let xfsz = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGXFSZ);
        set
    };
    // SAFETY: both sets are valid; this changes only the calling thread's mask (restored
    // below) and reads what is pending for it.
    let (old, was_pending) = unsafe {
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, &xfsz, &mut old);
        let mut pending: libc::sigset_t = std::mem::zeroed();
        libc::sigpending(&mut pending);
        (old, libc::sigismember(&pending, libc::SIGXFSZ) == 1)
    };
    let rc = call();
    let zero = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid sets and timespec; sigtimedwait with a zero timeout takes the SIGXFSZ the
    // call raised (blocked, so pending) without waiting; then the old mask is back.
    unsafe {
        if rc == libc::EFBIG && !was_pending {
            libc::sigtimedwait(&xfsz, std::ptr::null_mut(), &zero);
        }
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
    match (rc, file_size_limit()) {
        (0, _) => Ok(()),
        (libc::EFBIG, Some(limit)) if len > limit => Err(too_large(limit, len)),
        (rc, _) => Err(io::Error::from_raw_os_error(rc)),
    }
}

/// 0, or the errno of a call that returned -1.
fn errno_of(rc: libc::c_int) -> libc::c_int {
    if rc == 0 {
        0
    } else {
        io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    }
}

/// Bytes of memory a new segment may take: MemAvailable (a memfd is charged to memory, not
/// to /dev/shm), so an impossible size is an error instead of a visit from the OOM killer.
fn memory_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

impl Segment {
    /// Creates a sealed memfd segment of `len` bytes (`label` names it in /proc/PID/maps and in
    /// messages). The memory is reserved up front (posix_fallocate), so a lack of memory is an
    /// error here and never a SIGBUS later.
    pub(super) fn create(label: &str, len: usize) -> io::Result<Segment> {
        check_file_size(len as u64)?;
        if let Some(avail) = memory_available() {
            if len as u64 > avail {
                return Err(io::Error::new(
                    io::ErrorKind::OutOfMemory,
                    format!("{len} bytes requested, {avail} bytes of memory available"),
                ));
            }
        }
        let c = cname(label.trim_start_matches('/'))?;
        // SAFETY: valid C string.
        let fd =
            unsafe { libc::memfd_create(c.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = Fd(fd);
        // SAFETY (each call below): fd is a valid descriptor we own.
        if unsafe { libc::fchmod(fd.0, 0o600) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a valid descriptor we own.
        sized(len as u64, || {
            errno_of(unsafe { libc::ftruncate(fd.0, len as libc::off_t) })
        })?;
        // SAFETY: fd is a valid descriptor we own; posix_fallocate returns an errno.
        sized(len as u64, || unsafe {
            libc::posix_fallocate(fd.0, 0, len as libc::off_t)
        })?;
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fd is a valid descriptor we own; F_ADD_SEALS takes an int.
        if unsafe { libc::fcntl(fd.0, libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let st = fstat(fd.0)?;
        let key = (st.st_dev, st.st_ino);
        let map = Arc::new(Mapping {
            ptr: map(fd.0, len)?,
            len,
        });
        register(key, &map);
        Ok(Segment {
            name: label.to_owned(),
            map,
            key,
            fd: Some(fd),
            record: None,
        })
    }

    /// Maps the segment that process `pid` created and holds as descriptor `fd`, which must be
    /// the file `key`, owned by this user with mode 0600, sealed against shrinking, and at
    /// least `min_len` bytes long. A segment this process already maps (a thread rank's) is
    /// shared, not mapped again.
    pub(super) fn open_peer(
        label: &str,
        pid: u32,
        fd: u32,
        key: FileKey,
        min_len: usize,
    ) -> io::Result<Segment> {
        let shared = |map: Arc<Mapping>| Segment {
            name: label.to_owned(),
            map,
            key,
            fd: None,
            record: None,
        };
        if let Some(m) = lookup(key, min_len) {
            return Ok(shared(m));
        }
        let path = cname(&format!("/proc/{pid}/fd/{fd}"))?;
        // SAFETY: valid C string.
        let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        let file = Fd(raw);
        let st = fstat(file.0)?;
        if (st.st_dev, st.st_ino) != key {
            return Err(invalid(format!(
                "/proc/{pid}/fd/{fd} is not the published segment (inode {} instead of {})",
                st.st_ino, key.1
            )));
        }
        check_owner(&st, &format!("/proc/{pid}/fd/{fd}"))?;
        // SAFETY: fd is valid.
        let seals = unsafe { libc::fcntl(file.0, libc::F_GET_SEALS) };
        let need = libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
        if seals < 0 || seals & need != need {
            return Err(invalid(format!(
                "/proc/{pid}/fd/{fd} is not sealed against shrinking (seals {seals:#x})"
            )));
        }
        let len = st.st_size as usize;
        if len < min_len {
            return Err(invalid(format!(
                "/proc/{pid}/fd/{fd} has {len} bytes, fewer than the published {min_len}"
            )));
        }
        let map = Arc::new(Mapping {
            ptr: map(file.0, len)?,
            len,
        });
        register(key, &map);
        Ok(shared(map))
    }

    /// Creates the rendezvous record `name` (a small named object, mode 0600) holding
    /// `bytes`; AlreadyExists if the name is taken. Returns the file's identity and its lock,
    /// taken before the record has a name: the record appears whole (written to an unnamed
    /// file, then linked) and locked, so no other process ever sees it partial or unlocked
    /// while its creator lives. Where the file system has no unnamed files, it is created by
    /// name and locked at once (another process may then see it empty for a moment).
    pub(super) fn create_record(name: &str, bytes: &[u8]) -> io::Result<(FileKey, RecordLock)> {
        check_file_size(bytes.len() as u64)?;
        let path = cname(&shm_path(name))?;
        let dir = cname("/dev/shm")?;
        // SAFETY: valid C string; an unnamed file in /dev/shm.
        let tmp = unsafe {
            libc::open(
                dir.as_ptr(),
                libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC,
                0o600,
            )
        };
        if tmp >= 0 {
            let fd = Fd(tmp);
            // SAFETY: fd is a valid descriptor we own.
            if unsafe { libc::fchmod(fd.0, 0o600) } != 0 {
                return Err(io::Error::last_os_error());
            }
            try_lock(fd.0)?;
            write_all_at(fd.0, bytes, name)?;
            let proc_path = cname(&format!("/proc/self/fd/{}", fd.0))?;
            // SAFETY: valid C strings; linkat fails with EEXIST if the name is taken.
            let rc = unsafe {
                libc::linkat(
                    libc::AT_FDCWD,
                    proc_path.as_ptr(),
                    libc::AT_FDCWD,
                    path.as_ptr(),
                    libc::AT_SYMLINK_FOLLOW,
                )
            };
            let e = io::Error::last_os_error();
            if rc == 0 {
                let st = fstat(fd.0)?;
                return Ok(((st.st_dev, st.st_ino), RecordLock { _fd: fd }));
            }
            // Without /proc the unnamed file cannot be linked: make the record by name.
            if e.raw_os_error() != Some(libc::ENOENT) {
                return Err(e);
            }
        }
        Self::create_record_by_name(name, bytes)
    }

    /// [`Segment::create_record`] where /dev/shm has no unnamed files: created by name, then
    /// locked and written (another process may see it empty for a moment).
    fn create_record_by_name(name: &str, bytes: &[u8]) -> io::Result<(FileKey, RecordLock)> {
        let c = cname(name)?;
        // SAFETY: valid C string; O_EXCL makes creation atomic.
        let fd = unsafe {
            libc::shm_open(
                c.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = Fd(fd);
        // A sweeper may hold the lock for a moment (it finds the record empty and recent,
        // so it keeps it): wait for it.
        // SAFETY: fd is a valid descriptor; flock has no memory arguments.
        let locked = if unsafe { libc::flock(fd.0, libc::LOCK_EX) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        };
        let written = locked.and_then(|()| write_all_at(fd.0, bytes, name));
        if let Err(e) = written {
            Segment::unlink(name);
            return Err(e);
        }
        let st = fstat(fd.0)?;
        Ok(((st.st_dev, st.st_ino), RecordLock { _fd: fd }))
    }

    /// Removes the record `name` if nobody holds its lock (its creator is dead, or an
    /// epcomm that does not lock made it) and `stale(contents, identity, stat)` says so;
    /// returns what was removed. The lock is held while the name is checked to still be that
    /// file and removed, so a record that replaced it meanwhile is never removed (every
    /// remover of a record it did not create takes the lock). A record of another user or
    /// with a wide mode is PermissionDenied; a missing one is `Ok(None)`.
    pub(super) fn remove_record_if(
        name: &str,
        max: usize,
        mut stale: impl FnMut(&[u8], FileKey, &libc::stat) -> bool,
    ) -> io::Result<Option<Vec<u8>>> {
        let Some((fd, st)) = open_record(name, libc::O_NONBLOCK)? else {
            return Ok(None);
        };
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Ok(None);
        }
        let read = || read_at_start(fd.0, max);
        let key = (st.st_dev, st.st_ino);
        if !try_lock(fd.0)? {
            // A killed creator loses its memory (and looks dead) before its descriptors close
            // and its lock goes: when the contents say it is gone, wait for that a moment.
            if !stale(&read()?, key, &st) {
                return Ok(None);
            }
            let until = std::time::Instant::now() + DYING_CREATOR;
            while !try_lock(fd.0)? {
                if std::time::Instant::now() > until {
                    return Ok(None);
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        let buf = read()?;
        if !stale(&buf, key, &st) || Segment::record_key(name) != Some(key) {
            return Ok(None);
        }
        Segment::unlink(name);
        Ok(Some(buf))
    }

    /// Keeps `lock` (the record this control segment's creator made) until this segment drops.
    pub(super) fn hold_record(&mut self, lock: RecordLock) {
        self.record = Some(lock);
    }

    /// The identity of the file named `name` now (None if there is none).
    pub(super) fn record_key(name: &str) -> Option<FileKey> {
        let c = cname(name).ok()?;
        // SAFETY: valid C string.
        let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDONLY | libc::O_NOFOLLOW, 0) };
        if fd < 0 {
            return None;
        }
        let fd = Fd(fd);
        fstat(fd.0).ok().map(|st| (st.st_dev, st.st_ino))
    }

    /// Reads up to `max` bytes of the rendezvous record `name` (never mapped, so a
    /// truncation cannot fault); `Ok(None)` if it does not exist. A record owned by another
    /// user or with a mode wider than 0600 is PermissionDenied.
    pub(super) fn read_record(name: &str, max: usize) -> io::Result<Option<Vec<u8>>> {
        match open_record(name, 0)? {
            Some((fd, _)) => read_at_start(fd.0, max).map(Some),
            None => Ok(None),
        }
    }

    /// Removes a name (mappings stay valid). Missing names are fine.
    pub(super) fn unlink(name: &str) {
        if let Ok(c) = cname(name) {
            // SAFETY: valid C string.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }

    pub(super) fn name(&self) -> &str {
        &self.name
    }

    pub(super) fn len(&self) -> usize {
        self.map.len
    }

    /// The file identity peers check when they open the segment.
    pub(super) fn key(&self) -> FileKey {
        self.key
    }

    /// The creator's descriptor number, while it is open.
    pub(super) fn fd(&self) -> Option<u32> {
        self.fd.as_ref().map(|f| f.0 as u32)
    }

    /// Closes the creator's descriptor once every peer has mapped the segment: from then on
    /// nothing but the mappings reaches it.
    pub(super) fn close_fd(&mut self) {
        self.fd = None;
    }

    fn ptr(&self) -> *mut u8 {
        self.map.ptr
    }

    /// A reference to a `T` at `offset`. `T` must consist of atomics only (shared mutation).
    pub(super) fn at<T: SharedAtomics>(&self, offset: usize) -> &T {
        assert!(offset + std::mem::size_of::<T>() <= self.len());
        assert_eq!(
            (self.ptr() as usize + offset) % std::mem::align_of::<T>(),
            0
        );
        // SAFETY: in bounds and aligned (checked); T is made of atomics (SharedAtomics), so
        // shared mutation from other processes is sound; zeroed memory is a valid T.
        unsafe { &*self.ptr().add(offset).cast::<T>() }
    }

    /// Copies `src` into the segment at `offset`.
    pub(super) fn write(&self, offset: usize, src: &[u8]) {
        assert!(offset + src.len() <= self.len(), "shm write out of bounds");
        // SAFETY: in bounds (checked); the protocol gives this rank exclusive write access to
        // the range until it publishes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr().add(offset), src.len()) };
    }

    /// Copies from the segment at `offset` into `dst`.
    pub(super) fn read(&self, offset: usize, dst: &mut [u8]) {
        assert!(offset + dst.len() <= self.len(), "shm read out of bounds");
        // SAFETY: in bounds (checked); the writer published the range before this read and
        // does not touch it until this rank reports it consumed.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr().add(offset), dst.as_mut_ptr(), dst.len())
        };
    }

    /// Copies `src` into the segment at `offset` with streaming stores (a transfer far larger
    /// than the caches); the caller fences the batch ([`crate::copy::streaming_fence`]).
    pub(super) fn write_streaming(&self, offset: usize, src: &[u8]) {
        assert!(offset + src.len() <= self.len(), "shm write out of bounds");
        // SAFETY: in bounds (checked); the protocol gives this rank exclusive write access to
        // the range for the op (a window's rows named by its owner's take list for this rank).
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr().add(offset), src.len()) };
        crate::copy::copy_streaming(dst, src);
    }

    /// The whole segment, for its owner (a window: see window.rs for when peers touch it).
    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` bytes; `&mut self` is the owner's exclusive handle, and
        // peers write it only inside an op in which the owner lent it as the destination.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len()) }
    }

    /// Where the mapping starts in this process.
    pub(super) fn addr(&self) -> usize {
        self.ptr() as usize
    }

    /// A read-only view of `len` bytes at `offset`, valid while the protocol keeps the range
    /// stable (between the writer's publish and this rank's consume).
    pub(super) fn view(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.len(), "shm view out of bounds");
        // SAFETY: in bounds (checked); stability is guaranteed by the publish/consume protocol.
        unsafe { std::slice::from_raw_parts(self.ptr().add(offset), len) }
    }
}

/// Marker for types made only of atomics (and padding), valid when zeroed, safe to share
/// between processes.
///
/// # Safety
/// Implementors must contain only atomic integers (any mix) and be valid when all-zero.
pub(super) unsafe trait SharedAtomics {}

/// Sleeps while `word` (in a shared mapping) holds `expected`, for at most `timeout`. A
/// process-shared futex (not FUTEX_PRIVATE: the sleepers' peers are other processes, and the
/// kernel keys a shared mapping's futex by the file and offset). It returns when woken, at once
/// if the word differs, on a signal or on the timeout: the caller re-checks what it waits for.
pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(1 << 30) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned u32 and `ts` a valid timespec for the call; FUTEX_WAIT
    // only reads them. Errors (EAGAIN, EINTR, ETIMEDOUT) all mean "re-check", so none is kept.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

/// Wakes every thread (of any process) sleeping in [`futex_wait`] on `word`.
pub(super) fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned u32; FUTEX_WAKE does not touch memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

/// Whether process `pid` is alive (not gone and not a zombie).
pub(super) fn pid_alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    if pid == std::process::id() {
        // A thread rank of this process: alive while we are (and no /proc read per check,
        // which for 1024 thread ranks would be a million reads per liveness round).
        return true;
    }
    // SAFETY: kill with signal 0 only checks for existence/permission.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    // A killed child that its parent has not reaped yet is a zombie: dead for us.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| !matches!(rest.trim_start().chars().next(), Some('Z' | 'X')))
            .unwrap_or(true),
        Err(_) => rc == 0,
    }
}

/// When process `pid` started (field 22 of /proc/PID/stat, clock ticks since boot): with its
/// pid, an identity that a later process reusing the pid does not share. None if unreadable.
pub(super) fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    // Fields from the third (state) on; starttime is the 22nd.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// This process's start time (see [`start_time`]), 0 if unknown.
pub(super) fn own_start_time() -> u64 {
    static START: OnceLock<u64> = OnceLock::new();
    *START.get_or_init(|| start_time(std::process::id()).unwrap_or(0))
}

/// Whether the process that was `pid` started at `start` (0: unknown) is still alive: its pid
/// is alive and, where both are known, started then (not a later process given the same pid).
pub(super) fn process_alive(pid: u32, start: u64) -> bool {
    if start != 0 {
        match start_time(pid) {
            Some(now) if now != start => return false,
            Some(_) | None => {}
        }
    }
    pid_alive(pid)
}

/// Whether another process `pid` has no memory left to read at `addr`: it is gone or exiting.
/// A process killed with a signal loses its memory before it shows as a zombie, so a peer whose
/// read of it failed learns of the death at once instead of taking it for its own failure.
pub(super) fn memory_gone(pid: u32, addr: u64) -> bool {
    if pid == 0 || pid == std::process::id() {
        return false;
    }
    let mut byte = [0u8; 1];
    matches!(
        copy_from_process(pid, false, addr, &mut byte),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH)
    )
}

/// Pins the calling thread to one CPU (benchmarks pin one rank per core).
pub fn pin_current_thread(cpu: usize) -> std::io::Result<()> {
    // SAFETY: cpu_set_t is plain data; CPU_SET writes within it for cpu < CPU_SETSIZE (checked).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "cpu index too large",
            ));
        }
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Copies `dst.len()` bytes from address `remote` of process `pid` into `dst`: a plain copy when
/// the peer is a thread of this process, else one `process_vm_readv` (cross-memory attach: a
/// single copy, no staging). The peer keeps the memory alive and unchanged until this rank
/// reports the op consumed (publish/consume protocol).
pub(super) fn copy_from_process(
    pid: u32,
    same_process: bool,
    remote: u64,
    dst: &mut [u8],
) -> io::Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    if same_process {
        // SAFETY: the peer thread published this range of a live buffer it does not modify
        // until the op is consumed; ranges of distinct buffers do not overlap `dst`.
        unsafe {
            std::ptr::copy_nonoverlapping(remote as usize as *const u8, dst.as_mut_ptr(), dst.len())
        };
        return Ok(());
    }
    let mut done = 0usize;
    while done < dst.len() {
        let local = libc::iovec {
            iov_base: dst[done..].as_mut_ptr().cast(),
            iov_len: dst.len() - done,
        };
        let remote_iov = libc::iovec {
            iov_base: (remote as usize + done) as *mut libc::c_void,
            iov_len: dst.len() - done,
        };
        // SAFETY: `local` covers writable memory we own; the kernel validates the remote range.
        let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote_iov, 1, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "process_vm_readv read 0 bytes",
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// Copies several ranges of process `pid` into `dst`: `ranges` holds (remote address, offset in
/// `dst`, length). Adjacent ranges are merged and the rest batched (up to 1024 per
/// `process_vm_readv`), so scattered rows cost few system calls and one copy each.
pub(super) fn copy_scattered_from_process(
    pid: u32,
    same_process: bool,
    dst: &mut [u8],
    ranges: &[(u64, usize, usize)],
) -> io::Result<()> {
    let merged = merge_ranges(dst.len(), ranges);
    if same_process {
        return copy_local_ranges(pid, dst, &merged);
    }
    const BATCH: usize = 1024;
    for chunk in merged.chunks(BATCH) {
        read_batch(pid, dst, chunk)?;
    }
    Ok(())
}

/// `ranges` without empty ones, those contiguous on both sides merged.
fn merge_ranges(dst_len: usize, ranges: &[(u64, usize, usize)]) -> Vec<(u64, usize, usize)> {
    let mut merged: Vec<(u64, usize, usize)> = Vec::with_capacity(ranges.len());
    for &(addr, off, len) in ranges {
        assert!(off + len <= dst_len, "scattered copy out of bounds");
        if len == 0 {
            continue;
        }
        match merged.last_mut() {
            Some(last) if last.0 + last.2 as u64 == addr && last.1 + last.2 == off => last.2 += len,
            _ => merged.push((addr, off, len)),
        }
    }
    merged
}

/// Copies `merged` ranges of this process's memory (`pid` is this process) into `dst`. A transfer far larger than the
/// caches is written past them (no read-for-ownership of destination lines; see crate::copy).
fn copy_local_ranges(pid: u32, dst: &mut [u8], merged: &[(u64, usize, usize)]) -> io::Result<()> {
    let total: usize = merged.iter().map(|m| m.2).sum();
    for &(addr, off, len) in merged {
        if total >= crate::copy::STREAMING_MIN_BYTES {
            // SAFETY: as in copy_from_process: the range belongs to a live buffer its
            // owner does not modify until the op is consumed, and it does not overlap `dst`.
            let src = unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len) };
            crate::copy::copy_streaming(&mut dst[off..off + len], src);
        } else {
            copy_from_process(pid, true, addr, &mut dst[off..off + len])?;
        }
    }
    if total >= crate::copy::STREAMING_MIN_BYTES {
        crate::copy::streaming_fence();
    }
    Ok(())
}

/// One `process_vm_readv` of the ranges `chunk` of process `pid` into `dst` (each within `dst`,
/// disjoint); a partial transfer is finished range by range.
fn read_batch(pid: u32, dst: &mut [u8], chunk: &[(u64, usize, usize)]) -> io::Result<()> {
    let base = dst.as_mut_ptr();
    let local: Vec<libc::iovec> = chunk
        .iter()
        // SAFETY: off + len <= dst.len() (asserted by merge_ranges).
        .map(|&(_, off, len)| libc::iovec {
            iov_base: unsafe { base.add(off) }.cast(),
            iov_len: len,
        })
        .collect();
    let remote: Vec<libc::iovec> = chunk
        .iter()
        .map(|&(addr, _, len)| libc::iovec {
            iov_base: addr as usize as *mut libc::c_void,
            iov_len: len,
        })
        .collect();
    let want: usize = chunk.iter().map(|c| c.2).sum();
    // SAFETY: the local iovecs cover disjoint writable parts of `dst`; the kernel checks
    // the remote ones.
    let n = unsafe {
        libc::process_vm_readv(
            pid as libc::pid_t,
            local.as_ptr(),
            local.len() as libc::c_ulong,
            remote.as_ptr(),
            remote.len() as libc::c_ulong,
            0,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != want {
        let mut done = n as usize;
        for &(addr, off, len) in chunk {
            if done >= len {
                done -= len;
                continue;
            }
            copy_from_process(
                pid,
                false,
                addr + done as u64,
                &mut dst[off + done..off + len],
            )?;
            done = 0;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Same-process scattered copies give the same bytes below and above the streaming
    /// threshold (rows out of order, some adjacent so they merge, odd sizes and offsets).
    #[test]
    fn scattered_same_process_copies_small_and_streaming() {
        for row in [3usize, 4099, (crate::copy::STREAMING_MIN_BYTES / 64) + 5] {
            let rows = 70;
            let src: Vec<u8> = (0..rows * row).map(|i| (i * 31 + 7) as u8).collect();
            let order: Vec<usize> = (0..rows).map(|i| (i * 37 + 11) % rows).collect();
            let mut ranges: Vec<(u64, usize, usize)> = order
                .iter()
                .enumerate()
                .map(|(k, &r)| (src.as_ptr() as u64 + (r * row) as u64, k * row, row))
                .collect();
            // Two adjacent on both sides: merged into one copy.
            ranges.push((src.as_ptr() as u64, rows * row, 2 * row));
            let mut dst = vec![0u8; (rows + 2) * row];
            copy_scattered_from_process(std::process::id(), true, &mut dst, &ranges).unwrap();
            for (k, &r) in order.iter().enumerate() {
                assert_eq!(&dst[k * row..(k + 1) * row], &src[r * row..(r + 1) * row]);
            }
            assert_eq!(&dst[rows * row..], &src[..2 * row]);
        }
    }

    /// Sets RLIMIT_FSIZE (soft and hard) of this process to `bytes`.
    fn limit_file_size(bytes: u64) {
        let r = libc::rlimit {
            rlim_cur: bytes,
            rlim_max: bytes,
        };
        // SAFETY: r is a valid rlimit.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &r) }, 0);
    }

    /// Every sizing call under RLIMIT_FSIZE is an error naming the limit, never SIGXFSZ: with
    /// the check (segments, records) and without it, as when the limit is lowered between the
    /// check and the call (the kernel's EFBIG; the signal it raised is taken). Runs in a child
    /// process (the limit is process-wide), which must exit normally.
    #[test]
    fn sizes_beyond_rlimit_fsize_are_errors_not_sigxfsz() {
        const NAME: &str =
            "group::shm::segment::tests::sizes_beyond_rlimit_fsize_are_errors_not_sigxfsz";
        if std::env::var_os("EPCOMM_FSIZE_CHILD").is_some() {
            limit_file_size(1 << 20);
            let e = Segment::create("/epcomm.fsize-test", 2 << 20).unwrap_err();
            assert_eq!(
                e.to_string(),
                "the file size limit RLIMIT_FSIZE (ulimit -f) is 1048576 bytes, below the 2097152 bytes needed; raise it (ulimit -f unlimited)"
            );
            let l = file_size_limit_of(&e).unwrap();
            assert_eq!((l.limit, l.len), (1 << 20, 2 << 20));
            assert!(Segment::create("/epcomm.fsize-test", 1 << 20).is_ok());
            // The kernel's own refusal (no check first): EFBIG and a SIGXFSZ, taken.
            let c = cname("epcomm.fsize-test").unwrap();
            // SAFETY: valid C string.
            let fd = Fd(unsafe { libc::memfd_create(c.as_ptr(), libc::MFD_CLOEXEC) });
            assert!(fd.0 >= 0);
            let len = 3u64 << 20;
            // SAFETY (both closures): fd is a valid descriptor we own.
            let e = sized_unchecked(len, || {
                errno_of(unsafe { libc::ftruncate(fd.0, len as i64) })
            });
            assert_eq!(file_size_limit_of(&e.unwrap_err()).unwrap().len, len);
            let e = sized_unchecked(len, || unsafe {
                libc::posix_fallocate(fd.0, 0, len as i64)
            });
            assert_eq!(file_size_limit_of(&e.unwrap_err()).unwrap().limit, 1 << 20);
            limit_file_size(0);
            let e = sized_unchecked(8, || {
                // SAFETY: fd is valid; the source is 8 readable bytes.
                let n = unsafe { libc::pwrite(fd.0, [1u8; 8].as_ptr().cast(), 8, 1 << 20) };
                errno_of(if n < 0 { -1 } else { 0 })
            });
            assert_eq!(file_size_limit_of(&e.unwrap_err()).unwrap().limit, 0);
            let e = Segment::create_record("/epcomm.fsize-test-record", &[0u8; 80]).unwrap_err();
            assert_eq!(file_size_limit_of(&e).unwrap().len, 80);
            assert!(!std::path::Path::new("/dev/shm/epcomm.fsize-test-record").exists());
            // No SIGXFSZ is left pending either.
            // SAFETY: a plain sigset_t filled by sigpending.
            let pending = unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigpending(&mut set);
                libc::sigismember(&set, libc::SIGXFSZ)
            };
            assert_eq!(pending, 0);
            println!("FSIZE_CHILD_OK");
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
            .env("EPCOMM_FSIZE_CHILD", "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{:?}\n{text}", out.status);
        assert!(text.contains("FSIZE_CHILD_OK"), "{text}");
    }

    /// A record appears whole and locked: while its creator holds it, no remover takes it,
    /// whatever it says; once the creator lets go, a remover that finds it stale removes it,
    /// and one that does not leaves it.
    #[test]
    fn a_record_is_removed_only_when_unlocked_and_stale() {
        let name = format!("/epcomm.unit-lock-{}", std::process::id());
        let path = shm_path(&name);
        // Where unnamed files are missing, the record is made by name: locked all the same.
        let (_, by_name) = Segment::create_record_by_name(&name, &[7u8; 80]).unwrap();
        assert!(Segment::remove_record_if(&name, 80, |_, _, _| true)
            .unwrap()
            .is_none());
        drop(by_name);
        assert!(Segment::remove_record_if(&name, 80, |_, _, _| true)
            .unwrap()
            .is_some());
        let (key, lock) = Segment::create_record(&name, &[7u8; 80]).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), [7u8; 80]);
        assert_eq!(Segment::record_key(&name), Some(key));
        assert!(Segment::create_record(&name, &[1u8; 80]).is_err());
        let removed = Segment::remove_record_if(&name, 80, |_, _, _| true).unwrap();
        assert!(removed.is_none(), "a locked record was removed");
        assert!(std::path::Path::new(&path).exists());
        drop(lock);
        assert!(Segment::remove_record_if(&name, 80, |_, _, _| false)
            .unwrap()
            .is_none());
        assert!(std::path::Path::new(&path).exists());
        let removed = Segment::remove_record_if(&name, 80, |b, k, _| b == [7u8; 80] && k == key);
        assert_eq!(removed.unwrap().as_deref(), Some(&[7u8; 80][..]));
        assert!(!std::path::Path::new(&path).exists());
        assert!(Segment::remove_record_if(&name, 80, |_, _, _| true)
            .unwrap()
            .is_none());
    }

    /// A record names its creator by pid and start time: a live pid with another start time
    /// (a reused pid) is a dead creator.
    #[test]
    fn a_reused_pid_is_not_the_creator() {
        let me = std::process::id();
        let start = own_start_time();
        assert_ne!(start, 0);
        assert!(process_alive(me, start));
        assert!(process_alive(me, 0));
        assert!(!process_alive(me, start + 1));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!process_alive(pid, 0));
    }

    /// A killed process that is not reaped yet (a zombie) has no memory: that is what a peer
    /// reading it sees at once; a live one (stopped or not) is not taken for gone.
    #[test]
    fn memory_gone_tells_a_killed_process_from_a_live_one() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(!memory_gone(pid, 0x1000));
        assert!(!memory_gone(std::process::id(), 0));
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) };
        assert!(!memory_gone(pid, 0x1000));
        // SAFETY: as above.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !memory_gone(pid, 0x1000) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(memory_gone(pid, 0x1000));
        child.wait().unwrap();
    }
}
