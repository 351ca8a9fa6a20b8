//! POSIX shared-memory segments: create/open/map/unlink. The only `unsafe` of the shm transport
//! lives here and in the raw-byte accessors below.

use std::ffi::CString;
use std::io;

/// A mapped POSIX shared-memory object.
#[derive(Debug)]
pub struct Segment {
    name: String,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory; concurrent access is coordinated by the protocol's
// atomics (see shm/mod.rs), and the pointer is owned by this value until Drop.
unsafe impl Send for Segment {}

fn cname(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in name"))
}

fn map(fd: libc::c_int, len: usize) -> io::Result<*mut u8> {
    // SAFETY: fd is a valid shm descriptor; a shared read/write mapping of `len` bytes.
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

struct Fd(libc::c_int);
impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: closing a descriptor we own; the mapping stays valid after close.
        unsafe { libc::close(self.0) };
    }
}

impl Segment {
    /// Creates a new object of `len` bytes (fails with AlreadyExists if the name is taken).
    /// The memory is reserved up front (posix_fallocate), so a full /dev/shm is an error here
    /// and never a SIGBUS later.
    pub fn create(name: &str, len: usize) -> io::Result<Segment> {
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
        let result = (|| {
            // SAFETY: fd is valid.
            if unsafe { libc::ftruncate(fd.0, len as libc::off_t) } != 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: fd is valid; reserves the pages.
            let rc = unsafe { libc::posix_fallocate(fd.0, 0, len as libc::off_t) };
            if rc != 0 {
                return Err(io::Error::from_raw_os_error(rc));
            }
            map(fd.0, len)
        })();
        match result {
            Ok(ptr) => Ok(Segment {
                name: name.to_owned(),
                ptr,
                len,
            }),
            Err(e) => {
                Segment::unlink(name);
                Err(e)
            }
        }
    }

    /// Opens an existing object; `Ok(None)` if it does not exist.
    pub fn open(name: &str) -> io::Result<Option<Segment>> {
        let c = cname(name)?;
        // SAFETY: valid C string.
        let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return if e.raw_os_error() == Some(libc::ENOENT) {
                Ok(None)
            } else {
                Err(e)
            };
        }
        let fd = Fd(fd);
        // SAFETY: fd is valid; st is plain data.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.0, &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let len = st.st_size as usize;
        if len == 0 {
            // Being created right now: treat as not there yet.
            return Ok(None);
        }
        let ptr = map(fd.0, len)?;
        Ok(Some(Segment {
            name: name.to_owned(),
            ptr,
            len,
        }))
    }

    /// Removes a name (mappings stay valid). Missing names are fine.
    pub fn unlink(name: &str) {
        if let Ok(c) = cname(name) {
            // SAFETY: valid C string.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// A reference to a `T` at `offset`. `T` must consist of atomics only (shared mutation).
    pub fn at<T: SharedAtomics>(&self, offset: usize) -> &T {
        assert!(offset + std::mem::size_of::<T>() <= self.len);
        assert_eq!((self.ptr as usize + offset) % std::mem::align_of::<T>(), 0);
        // SAFETY: in bounds and aligned (checked); T is made of atomics (SharedAtomics), so
        // shared mutation from other processes is sound; zeroed memory is a valid T.
        unsafe { &*self.ptr.add(offset).cast::<T>() }
    }

    /// Copies `src` into the segment at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) {
        assert!(offset + src.len() <= self.len, "shm write out of bounds");
        // SAFETY: in bounds (checked); the protocol gives this rank exclusive write access to
        // the range until it publishes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) };
    }

    /// Copies from the segment at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        assert!(offset + dst.len() <= self.len, "shm read out of bounds");
        // SAFETY: in bounds (checked); the writer published the range before this read and
        // does not touch it until this rank reports it consumed.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
    }

    /// A read-only view of `len` bytes at `offset`, valid while the protocol keeps the range
    /// stable (between the writer's publish and this rank's consume).
    pub fn view(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.len, "shm view out of bounds");
        // SAFETY: in bounds (checked); stability is guaranteed by the publish/consume protocol.
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset), len) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping this value owns.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Marker for types made only of atomics (and padding), valid when zeroed, safe to share
/// between processes.
///
/// # Safety
/// Implementors must contain only atomic integers (any mix) and be valid when all-zero.
pub unsafe trait SharedAtomics {}

/// Whether process `pid` is alive (not gone and not a zombie).
pub fn pid_alive(pid: u32) -> bool {
    if pid == 0 {
        return false;
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
pub fn copy_from_process(
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
pub fn copy_scattered_from_process(
    pid: u32,
    same_process: bool,
    dst: &mut [u8],
    ranges: &[(u64, usize, usize)],
) -> io::Result<()> {
    // Merge ranges that are contiguous on both sides.
    let mut merged: Vec<(u64, usize, usize)> = Vec::with_capacity(ranges.len());
    for &(addr, off, len) in ranges {
        assert!(off + len <= dst.len(), "scattered copy out of bounds");
        if len == 0 {
            continue;
        }
        match merged.last_mut() {
            Some(last) if last.0 + last.2 as u64 == addr && last.1 + last.2 == off => last.2 += len,
            _ => merged.push((addr, off, len)),
        }
    }
    if same_process {
        // A transfer far larger than the caches is written past them (no read-for-ownership
        // of destination lines; see crate::copy).
        let total: usize = merged.iter().map(|m| m.2).sum();
        for &(addr, off, len) in &merged {
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
        return Ok(());
    }
    const BATCH: usize = 1024;
    let base = dst.as_mut_ptr();
    for chunk in merged.chunks(BATCH) {
        let local: Vec<libc::iovec> = chunk
            .iter()
            // SAFETY: off + len <= dst.len() (asserted above).
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
            // A partial transfer: finish range by range.
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
}
