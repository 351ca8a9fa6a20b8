//! Finds optional native libraries (NCCL, NIXL, CUDA) without panicking: cudarc panics when a
//! library is missing, so availability is checked here first, with `dlopen`.
//!
//! NCCL is looked up in this order: an already-loaded `libnccl.so.2` (RTLD_NOLOAD, so the host's
//! copy is reused), then `VLLM_NCCL_SO_PATH`, `libnccl.so.2`, `libnccl.so`.

use std::ffi::{c_void, CStr, CString};
use std::sync::OnceLock;

/// A library handle that stays loaded for the life of the process (never dlclosed: symbols
/// taken from it may be cached).
#[derive(Debug, Clone, Copy)]
pub struct Library {
    handle: usize,
    /// The name or path that opened it.
    pub name: &'static str,
}

fn dlopen(name: &str, flags: libc::c_int) -> Option<usize> {
    let c = CString::new(name).ok()?;
    // SAFETY: `c` is a valid NUL-terminated string; dlopen has no other preconditions. Loading
    // runs the library's initialisers, which is the point of the call.
    let h = unsafe { libc::dlopen(c.as_ptr(), flags) };
    (!h.is_null()).then_some(h as usize)
}

/// The last `dlerror()` text, if any.
pub fn last_dl_error() -> Option<String> {
    // SAFETY: dlerror returns NULL or a valid C string owned by libc (thread-local in glibc).
    let e = unsafe { libc::dlerror() };
    (!e.is_null()).then(|| unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned())
}

/// Opens the first loadable library among `names` (already-loaded ones first).
pub fn open_first(names: &[&'static str]) -> Option<Library> {
    for name in names {
        if let Some(h) = dlopen(name, libc::RTLD_NOLOAD | libc::RTLD_LAZY) {
            return Some(Library { handle: h, name });
        }
    }
    for name in names {
        if let Some(h) = dlopen(name, libc::RTLD_NOW | libc::RTLD_LOCAL) {
            return Some(Library { handle: h, name });
        }
    }
    None
}

impl Library {
    /// The address of `symbol`, if the library has it.
    pub fn symbol(&self, symbol: &str) -> Option<*mut c_void> {
        let c = CString::new(symbol).ok()?;
        // SAFETY: the handle came from a successful dlopen and is never closed.
        let p = unsafe { libc::dlsym(self.handle as *mut c_void, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }
}

/// A `'static` copy of `s`, for names kept as long as the library they name stays loaded.
pub(crate) fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

/// NCCL, found once per process. `Err` says what was tried.
pub fn nccl() -> Result<Library, String> {
    static NCCL: OnceLock<Result<Library, String>> = OnceLock::new();
    NCCL.get_or_init(|| {
        let mut names: Vec<&'static str> = Vec::new();
        if let Ok(p) = std::env::var("VLLM_NCCL_SO_PATH") {
            if !p.is_empty() {
                names.push(leak(p));
            }
        }
        names.extend(["libnccl.so.2", "libnccl.so"]);
        open_first(&names).ok_or_else(|| format!("NCCL not found (tried {})", names.join(", ")))
    })
    .clone()
}

/// The runtime NCCL version code (e.g. 22809 for 2.28.9) through `ncclGetVersion`.
pub fn nccl_version() -> Result<i32, String> {
    let lib = nccl()?;
    let f = lib
        .symbol("ncclGetVersion")
        .ok_or_else(|| format!("{} has no ncclGetVersion", lib.name))?;
    // SAFETY: ncclGetVersion has the C signature `ncclResult_t ncclGetVersion(int *version)`.
    let get: extern "C" fn(*mut libc::c_int) -> libc::c_int = unsafe { std::mem::transmute(f) };
    let mut v: libc::c_int = 0;
    match get(&mut v) {
        0 => Ok(v),
        rc => Err(format!("ncclGetVersion failed with ncclResult_t {rc}")),
    }
}

/// NIXL's C++ library, found once per process.
pub fn nixl() -> Option<Library> {
    static NIXL: OnceLock<Option<Library>> = OnceLock::new();
    *NIXL.get_or_init(|| open_first(&["libnixl.so"]))
}

/// Whether this build can run NCCL work at all and NCCL is loadable here.
pub fn nccl_usable() -> bool {
    cfg!(feature = "nccl") && nccl().is_ok()
}

/// Whether NIXL is loadable in this process.
pub fn nixl_usable() -> bool {
    nixl().is_some()
}

/// The CUDA driver library, when this build has the `cuda` feature; `Err` says why not.
pub fn cuda() -> Result<Library, String> {
    if !cfg!(feature = "cuda") {
        return Err("epcomm was built without the 'cuda' feature".into());
    }
    static CUDA: OnceLock<Option<Library>> = OnceLock::new();
    let lib = CUDA
        .get_or_init(|| open_first(&["libcuda.so.1", "libcuda.so"]))
        .ok_or_else(|| "CUDA driver library libcuda.so.1 not found".to_owned())?;
    if !cudarc_sees_driver() {
        return Err("cudarc cannot load the CUDA driver library".into());
    }
    Ok(lib)
}

/// cudarc panics on first use when it cannot load the driver; ask it first (its own search
/// list), and keep a panic from escaping.
#[cfg(feature = "cuda")]
fn cudarc_sees_driver() -> bool {
    // SAFETY: is_culib_present only tries to dlopen candidate names.
    std::panic::catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() }).unwrap_or(false)
}

#[cfg(not(feature = "cuda"))]
fn cudarc_sees_driver() -> bool {
    false
}

/// Memory the kernel reports as available for new allocations (MemAvailable), in bytes.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Ends this process at once with SIGKILL (fault injection; see `fault.rs`).
pub fn kill_self() -> ! {
    // SAFETY: raising a signal on our own process has no memory-safety preconditions.
    unsafe { libc::raise(libc::SIGKILL) };
    std::process::abort()
}
