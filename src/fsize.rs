//! RLIMIT_FSIZE, the file size limit (`ulimit -f`): a process may not make a file (a memfd
//! included) larger than its soft limit, and the kernel answers a write or truncation beyond it
//! with SIGXFSZ, whose default action kills the process. Every file epcomm sizes or writes is
//! checked here first, so the limit is an error that names it, never a signal.

use std::io;

/// RLIMIT_FSIZE refused a file size: a process may not make a file (a memfd included) larger
/// than its soft limit; the kernel answers with SIGXFSZ, which by default kills it.
#[derive(Debug)]
pub struct FileSizeLimit {
    /// The soft limit, in bytes.
    pub limit: u64,
    /// The size asked for, in bytes.
    pub len: u64,
}

impl std::fmt::Display for FileSizeLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the file size limit RLIMIT_FSIZE (ulimit -f) is {} bytes, below the {} bytes needed; raise it (ulimit -f unlimited)",
            self.limit, self.len
        )
    }
}

impl std::error::Error for FileSizeLimit {}

/// The soft RLIMIT_FSIZE in bytes, or None when unlimited. Read at every use: it can change.
pub fn file_size_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: r is a valid rlimit for getrlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut r) } != 0
        || r.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    #[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not everywhere
    Some(r.rlim_cur as u64)
}

/// The [`FileSizeLimit`] error of a file of `len` bytes under a limit of `limit` bytes.
pub fn too_large(limit: u64, len: u64) -> io::Error {
    io::Error::new(io::ErrorKind::FileTooLarge, FileSizeLimit { limit, len })
}

/// Fails with [`FileSizeLimit`] if a file of `len` bytes exceeds RLIMIT_FSIZE.
pub fn check_file_size(len: u64) -> io::Result<()> {
    match file_size_limit() {
        Some(limit) if len > limit => Err(too_large(limit, len)),
        Some(_) | None => Ok(()),
    }
}

/// The limit an error of a sizing call reports, if it is one (see [`FileSizeLimit`]).
pub fn file_size_limit_of(e: &io::Error) -> Option<&FileSizeLimit> {
    e.get_ref()?.downcast_ref::<FileSizeLimit>()
}
