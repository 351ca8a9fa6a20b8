//! Our own NVRTC loader and compiler front end for the GPU path's kernels.
//!
//! Why not cudarc's: built with `cuda-12080` it never tries `libnvrtc.so.13` (the only NVRTC in a
//! torch+cu13 environment), and its `Program` panics on drop failures. Here every failure is an
//! [`Error`], never a panic, and the crate builds without the `cuda` feature (plain `dlopen`).
//!
//! Candidates ([`Nvrtc::select`]): `EPCOMM_NVRTC_PATH` (a file, or a directory holding
//! `libnvrtc.so.*`) — when set only what it names; otherwise `libnvrtc.so.13`,
//! `libnvrtc.so.12`, `libnvrtc.so`, each noted as already loaded (the host's copy) or not.
//! [`choose`] then keeps one for the driver (`cuDriverGetVersion`): a driver runs code from
//! NVRTC of its CUDA major or older, so the newest such (an already-loaded one first); only
//! newer ones is an error naming both versions; an unknown driver takes the newest. `libnvrtc` `dlopen`s `libnvrtc-builtins.so.X.Y` at compile time;
//! when we load it by path we first load the builtins found next to it by full path, so no
//! `LD_LIBRARY_PATH` is needed (the wheel's `$ORIGIN` RUNPATH would usually find it too).
//!
//! [`Compiler`] compiles to CUBIN for `sm_XX` (PTX for the closest older `compute_YY` when this
//! NVRTC does not know `sm_XX`) and caches results in memory and on disk
//! (`$EPCOMM_CACHE_DIR`, else `$XDG_CACHE_HOME/epcomm`, else `~/.cache/epcomm`).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{Error, Result};
use crate::probe::{self, leak, Library};

/// Environment variable naming the NVRTC library file or its directory.
const ENV_NVRTC_PATH: &str = crate::env::NVRTC_PATH;
/// Library names tried (in this order) when `EPCOMM_NVRTC_PATH` is not set.
const DEFAULT_NAMES: [&str; 3] = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

type Program = *mut c_void;
type FnVersion = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
type FnCreate = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type FnCompile = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
type FnSize = unsafe extern "C" fn(Program, *mut usize) -> c_int;
type FnGet = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
type FnDestroy = unsafe extern "C" fn(*mut Program) -> c_int;
type FnErrStr = unsafe extern "C" fn(c_int) -> *const c_char;
type FnNumArchs = unsafe extern "C" fn(*mut c_int) -> c_int;
type FnArchs = unsafe extern "C" fn(*mut c_int) -> c_int;

/// `NVRTC_ERROR_INVALID_OPTION`: returned for an unknown `--gpu-architecture`.
const NVRTC_ERROR_INVALID_OPTION: c_int = 5;

/// A loaded NVRTC: its function table, where it came from and its version.
#[derive(Clone, Copy)]
pub struct Nvrtc {
    /// The path or name that was opened.
    pub path: &'static str,
    /// `nvrtcVersion()` as (major, minor).
    pub version: (i32, i32),
    create: FnCreate,
    compile: FnCompile,
    log_size: FnSize,
    log: FnGet,
    cubin_size: FnSize,
    cubin: FnGet,
    ptx_size: FnSize,
    ptx: FnGet,
    destroy: FnDestroy,
    err_str: FnErrStr,
    archs: Option<(FnNumArchs, FnArchs)>,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// The `libnvrtc.so*` files of `dir` that may be NVRTC, one per major in the name, highest
/// first, then `libnvrtc.so` (never the `.alt` build, which differs only in C++ symbol
/// demangling).
fn libs_in_dir(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<(u32, String, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("libnvrtc.so") else {
            continue;
        };
        let rank = if rest.is_empty() {
            0
        } else if let Some(v) = rest.strip_prefix('.') {
            match v.split('.').next().and_then(|m| m.parse::<u32>().ok()) {
                Some(m) => m + 1,
                None => continue,
            }
        } else {
            continue;
        };
        found.push((rank, name, entry.path()));
    }
    // Highest major first; within one major the shortest name (the soname link).
    found.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.len().cmp(&b.1.len())));
    found.dedup_by_key(|f| f.0);
    found.into_iter().map(|(_, _, p)| p).collect()
}

/// Whether the process already has `name` loaded (`RTLD_NOLOAD`; the reference is dropped).
fn is_loaded(name: &str) -> bool {
    let Ok(c) = CString::new(name) else {
        return false;
    };
    // SAFETY: a valid C string; RTLD_NOLOAD never loads anything.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
    if h.is_null() {
        return false;
    }
    // SAFETY: `h` came from the dlopen above; this drops only the reference it took.
    unsafe { libc::dlclose(h) };
    true
}

/// One NVRTC library found: the name or path that opened it, its major version
/// (`nvrtcVersion`) and whether the process had already loaded it (the host's copy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The name or path.
    pub name: String,
    /// `nvrtcVersion`'s major (12, 13).
    pub major: i32,
    /// Already loaded before epcomm looked (`RTLD_NOLOAD`).
    pub loaded: bool,
}

/// Which candidate [`choose`] picked and why, in words (the capability JSON shows it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// Index into the candidates.
    pub index: usize,
    /// Why this one.
    pub reason: String,
}

fn describe(c: &Candidate) -> String {
    format!("{} (NVRTC {})", c.name, c.major)
}

/// The preferred candidate among those `ok` accepts: an already-loaded one (reusing the host's
/// copy, no second NVRTC in the process), then the highest major, then search order.
fn best(c: &[Candidate], ok: impl Fn(&Candidate) -> bool) -> Option<usize> {
    c.iter()
        .enumerate()
        .filter(|(_, c)| ok(c))
        .max_by_key(|(i, c)| (c.loaded, c.major, std::cmp::Reverse(*i)))
        .map(|(i, _)| i)
}

fn why_this(c: &Candidate) -> &'static str {
    if c.loaded {
        "already loaded in this process"
    } else {
        "the newest such found"
    }
}

/// Picks the NVRTC to load, a pure function of the driver's `cuDriverGetVersion` (12080 =
/// CUDA 12.8; `None` when unknown, e.g. no driver on a CPU-only compile check) and the
/// libraries found, in search order. A driver runs code from NVRTC of its own CUDA major or
/// older (CUBIN of the same major loads under CUDA's minor-version compatibility; a newer
/// major's does not), so: of the candidates of major ≤ the driver's, an already-loaded one,
/// then the highest major, then the first; when the driver is unknown, the same over all.
/// Only newer majors than the driver: an [`Error::Unavailable`] naming both versions.
pub fn choose(driver_version: Option<i32>, available: &[Candidate]) -> Result<Choice> {
    let Some(v) = driver_version else {
        let index = best(available, |_| true)
            .ok_or_else(|| Error::Unavailable("NVRTC not found: no library to choose".into()))?;
        let c = &available[index];
        let reason = format!(
            "the CUDA driver version is unknown: {}, {}",
            describe(c),
            why_this(c)
        );
        return Ok(Choice { index, reason });
    };
    let major = v / 1000;
    let driver = format!(
        "CUDA {major}.{} driver (cuDriverGetVersion {v})",
        (v % 1000) / 10
    );
    let newer: Vec<String> = available
        .iter()
        .filter(|c| c.major > major)
        .map(describe)
        .collect();
    let Some(index) = best(available, |c| c.major <= major) else {
        let found = if newer.is_empty() {
            "no NVRTC library".to_string()
        } else {
            newer.join(", ")
        };
        // The wheels: nvidia-cuda-nvrtc-cu11/-cu12, then nvidia-cuda-nvrtc 13.x and later.
        let pip = if major >= 13 {
            format!("nvidia-cuda-nvrtc=={major}.*")
        } else {
            format!("nvidia-cuda-nvrtc-cu{major}")
        };
        return Err(Error::Unavailable(format!(
            "NVRTC does not match the CUDA driver: found {found}; the {driver} runs code from NVRTC {major} or older. Install NVRTC {major} (pip: {pip}) and set {ENV_NVRTC_PATH} to it, or update the driver"
        )));
    };
    let c = &available[index];
    let mut reason = format!(
        "the {driver} runs code from NVRTC {major} or older: {}, {}",
        describe(c),
        why_this(c)
    );
    if !newer.is_empty() {
        reason.push_str(&format!(
            "; not {} (newer than the driver)",
            newer.join(", ")
        ));
    }
    Ok(Choice { index, reason })
}

/// The process's NVRTC and how it was chosen.
#[derive(Debug, Clone)]
pub struct Selection {
    /// The NVRTC loaded.
    pub nvrtc: Nvrtc,
    /// `cuDriverGetVersion`, or why it is unknown.
    pub driver_version: std::result::Result<i32, String>,
    /// Every library found, in search order.
    pub candidates: Vec<Candidate>,
    /// Which one and why.
    pub choice: Choice,
}

/// `cuDriverGetVersion`, or why it is unknown.
#[cfg(feature = "cuda")]
fn driver_version() -> std::result::Result<i32, String> {
    crate::gpu::driver::driver_version().map_err(|e| e.to_string())
}

/// `cuDriverGetVersion`, or why it is unknown.
#[cfg(not(feature = "cuda"))]
fn driver_version() -> std::result::Result<i32, String> {
    Err("epcomm was built without the 'cuda' feature".into())
}

/// Loads the `libnvrtc-builtins.so*` next to `lib` by full path (best effort) so that NVRTC's
/// own `dlopen` of it finds the already-loaded copy whatever `LD_LIBRARY_PATH` says.
fn preload_builtins(lib: &Path) {
    let Some(dir) = lib.parent() else { return };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .map(|n| {
                    let n = n.to_string_lossy();
                    // The `.alt` build is for the `.alt` libnvrtc, which we never load.
                    n.starts_with("libnvrtc-builtins.so") && !n.contains(".alt.")
                })
                .unwrap_or(false)
        })
        .collect();
    found.sort();
    // The handles stay loaded for the life of the process (NVRTC looks the library up later);
    // they are kept here so their names stay referenced (no leak for LeakSanitizer).
    static PRELOADED: Mutex<Vec<probe::Library>> = Mutex::new(Vec::new());
    for p in found {
        if let Some(lib) = probe::open_first(&[leak(p.to_string_lossy().into_owned())]) {
            PRELOADED
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(lib);
        }
    }
}

impl Nvrtc {
    /// Finds and loads NVRTC without a driver version (the newest found; see [`Nvrtc::select`]).
    pub fn open(explicit: Option<&str>) -> Result<Nvrtc> {
        Ok(Self::select(explicit, Err("not asked".into()))?.nvrtc)
    }

    /// Finds every NVRTC `explicit` (the role of `EPCOMM_NVRTC_PATH`: a file, or a directory)
    /// or, when `None`, the default names offer, and keeps the one [`choose`] picks for the
    /// driver. Errors name what was tried, or both versions on a driver mismatch.
    pub fn select(
        explicit: Option<&str>,
        driver_version: std::result::Result<i32, String>,
    ) -> Result<Selection> {
        let found = Self::discover(explicit.filter(|p| !p.is_empty()))?;
        let candidates: Vec<Candidate> = found.iter().map(|(c, _)| c.clone()).collect();
        let choice = choose(driver_version.as_ref().ok().copied(), &candidates)?;
        Ok(Selection {
            nvrtc: found[choice.index].1,
            driver_version,
            candidates,
            choice,
        })
    }

    /// Every NVRTC that loads, in search order (at least one, else the error).
    fn discover(explicit: Option<&str>) -> Result<Vec<(Candidate, Nvrtc)>> {
        let names: Vec<&'static str> = match explicit {
            None => DEFAULT_NAMES.to_vec(),
            Some(p) => Self::explicit_files(p)?,
        };
        let mut found = Vec::new();
        let mut first_error = None;
        for name in names {
            let loaded = is_loaded(name);
            if explicit.is_some() {
                preload_builtins(Path::new(name));
            }
            let opened = probe::open_first(&[name]).ok_or_else(|| {
                Error::Unavailable(format!(
                    "NVRTC could not be loaded from {name}: {}",
                    probe::last_dl_error().unwrap_or_else(|| "dlopen failed".into())
                ))
            });
            match opened.and_then(Self::bind) {
                Ok(n) => found.push((
                    Candidate {
                        name: name.to_string(),
                        major: n.version.0,
                        loaded,
                    },
                    n,
                )),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match (found.is_empty(), explicit, first_error) {
            (false, _, _) => Ok(found),
            (true, Some(_), Some(e)) => Err(e),
            (true, _, _) => Err(Error::Unavailable(format!(
                "NVRTC not found (tried {}); set {ENV_NVRTC_PATH} to libnvrtc.so.* or its directory",
                DEFAULT_NAMES.join(", ")
            ))),
        }
    }

    /// The files `EPCOMM_NVRTC_PATH=p` names: `p` itself, or the NVRTCs of directory `p`.
    fn explicit_files(p: &str) -> Result<Vec<&'static str>> {
        let path = Path::new(p);
        if !path.exists() {
            return Err(Error::Unavailable(format!(
                "NVRTC not found: {ENV_NVRTC_PATH}={p} does not exist"
            )));
        }
        let files = if path.is_dir() {
            libs_in_dir(path)
        } else {
            vec![path.to_path_buf()]
        };
        if files.is_empty() {
            return Err(Error::Unavailable(format!(
                "NVRTC not found: {ENV_NVRTC_PATH}={p} is a directory without libnvrtc.so*"
            )));
        }
        Ok(files
            .into_iter()
            .map(|f| leak(f.to_string_lossy().into_owned()))
            .collect())
    }

    /// Chooses and loads NVRTC once per process for this driver ([`Nvrtc::select`] with
    /// `EPCOMM_NVRTC_PATH` and `cuDriverGetVersion`).
    pub fn global_selection() -> Result<&'static Selection> {
        static SELECTION: OnceLock<Result<Selection>> = OnceLock::new();
        SELECTION
            .get_or_init(|| Nvrtc::select(crate::env::nvrtc_path().as_deref(), driver_version()))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The process's NVRTC ([`Nvrtc::global_selection`]).
    pub fn global() -> Result<&'static Nvrtc> {
        Self::global_selection().map(|s| &s.nvrtc)
    }

    fn bind(lib: Library) -> Result<Nvrtc> {
        let sym = |name: &str| {
            lib.symbol(name).ok_or_else(|| {
                Error::Unavailable(format!("{} has no symbol {name} (not an NVRTC?)", lib.name))
            })
        };
        // SAFETY (all transmutes below): each symbol is the NVRTC C function of that name, whose
        // C signature is the function-pointer type it is transmuted to (nvrtc.h, CUDA 11–13).
        let version: FnVersion = unsafe { std::mem::transmute(sym("nvrtcVersion")?) };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers.
        let rc = unsafe { version(&mut major, &mut minor) };
        if rc != 0 {
            return Err(Error::Unavailable(format!(
                "{}: nvrtcVersion failed with nvrtcResult {rc}",
                lib.name
            )));
        }
        let archs = match (
            lib.symbol("nvrtcGetNumSupportedArchs"),
            lib.symbol("nvrtcGetSupportedArchs"),
        ) {
            // SAFETY: see above.
            (Some(n), Some(a)) => Some(unsafe {
                (
                    std::mem::transmute::<*mut c_void, FnNumArchs>(n),
                    std::mem::transmute::<*mut c_void, FnArchs>(a),
                )
            }),
            _ => None,
        };
        // SAFETY: see above.
        unsafe {
            Ok(Nvrtc {
                path: lib.name,
                version: (major, minor),
                create: std::mem::transmute::<*mut c_void, FnCreate>(sym("nvrtcCreateProgram")?),
                compile: std::mem::transmute::<*mut c_void, FnCompile>(sym("nvrtcCompileProgram")?),
                log_size: std::mem::transmute::<*mut c_void, FnSize>(sym(
                    "nvrtcGetProgramLogSize",
                )?),
                log: std::mem::transmute::<*mut c_void, FnGet>(sym("nvrtcGetProgramLog")?),
                cubin_size: std::mem::transmute::<*mut c_void, FnSize>(sym("nvrtcGetCUBINSize")?),
                cubin: std::mem::transmute::<*mut c_void, FnGet>(sym("nvrtcGetCUBIN")?),
                ptx_size: std::mem::transmute::<*mut c_void, FnSize>(sym("nvrtcGetPTXSize")?),
                ptx: std::mem::transmute::<*mut c_void, FnGet>(sym("nvrtcGetPTX")?),
                destroy: std::mem::transmute::<*mut c_void, FnDestroy>(sym("nvrtcDestroyProgram")?),
                err_str: std::mem::transmute::<*mut c_void, FnErrStr>(sym("nvrtcGetErrorString")?),
                archs,
            })
        }
    }

    /// The text of an `nvrtcResult`.
    pub fn error_string(&self, rc: i32) -> String {
        // SAFETY: nvrtcGetErrorString returns a static string (or NULL) for any value.
        let p = unsafe { (self.err_str)(rc) };
        if p.is_null() {
            format!("nvrtcResult {rc}")
        } else {
            // SAFETY: non-NULL static NUL-terminated string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    /// The SM versions this NVRTC can generate CUBIN for (e.g. `[50, …, 90, 100, 120]`), when
    /// it exports `nvrtcGetSupportedArchs` (CUDA ≥ 11.2).
    pub fn supported_archs(&self) -> Option<Vec<i32>> {
        let (num, get) = self.archs?;
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer.
        if unsafe { num(&mut n) } != 0 || n <= 0 {
            return None;
        }
        let mut v = vec![0 as c_int; n as usize];
        // SAFETY: `v` holds exactly the number of entries NVRTC reported.
        if unsafe { get(v.as_mut_ptr()) } != 0 {
            return None;
        }
        Some(v)
    }

    /// Compiles once, without any cache. `gpu_arch` is the full `--gpu-architecture` value
    /// (`sm_90` gives CUBIN, `compute_90` PTX only).
    fn compile_raw(
        &self,
        source: &str,
        name: &str,
        options: &[String],
        gpu_arch: &str,
    ) -> std::result::Result<(Image, String), (i32, String)> {
        let to_c = |s: &str| CString::new(s).map_err(|_| (-1, format!("NUL byte in {s:?}")));
        let src = to_c(source)?;
        let cname = to_c(name)?;
        let mut opts: Vec<CString> = Vec::with_capacity(options.len() + 1);
        opts.push(to_c(&format!("--gpu-architecture={gpu_arch}"))?);
        for o in options {
            opts.push(to_c(o)?);
        }
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: valid NUL-terminated strings; no headers (count 0, NULL arrays).
        let rc = unsafe {
            (self.create)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if rc != 0 {
            return Err((rc, String::new()));
        }
        let result = (|| {
            // SAFETY: `prog` is a live program; `opt_ptrs` point into `opts`, alive here.
            let rc = unsafe { (self.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
            let log = self.read(prog, self.log_size, self.log).unwrap_or_default();
            let log = String::from_utf8_lossy(&log)
                .trim_end_matches('\0')
                .to_string();
            if rc != 0 {
                return Err((rc, log));
            }
            let cubin = if gpu_arch.starts_with("sm_") {
                self.read(prog, self.cubin_size, self.cubin)
                    .map_err(|rc| (rc, log.clone()))?
            } else {
                Vec::new()
            };
            if !cubin.is_empty() {
                return Ok((Image::Cubin(cubin), log));
            }
            let ptx = self
                .read(prog, self.ptx_size, self.ptx)
                .map_err(|rc| (rc, log.clone()))?;
            let ptx = String::from_utf8_lossy(&ptx)
                .trim_end_matches('\0')
                .to_string();
            Ok((Image::Ptx(ptx), log))
        })();
        // SAFETY: `prog` came from nvrtcCreateProgram and is destroyed exactly once.
        unsafe { (self.destroy)(&mut prog) };
        result
    }

    fn read(&self, prog: Program, size: FnSize, get: FnGet) -> std::result::Result<Vec<u8>, i32> {
        let mut n: usize = 0;
        // SAFETY: live program, valid out-pointer.
        let rc = unsafe { size(prog, &mut n) };
        if rc != 0 {
            return Err(rc);
        }
        let mut buf = vec![0u8; n];
        if n > 0 {
            // SAFETY: `buf` has the `n` bytes NVRTC asked for.
            let rc = unsafe { get(prog, buf.as_mut_ptr().cast()) };
            if rc != 0 {
                return Err(rc);
            }
        }
        Ok(buf)
    }
}

/// What a compile produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Image {
    /// An ELF cubin for an exact `sm_XX`.
    Cubin(Vec<u8>),
    /// PTX text (the driver JIT-compiles it) for `compute_XX`.
    Ptx(String),
}

impl Image {
    /// The bytes to hand to `cuModuleLoadData` (PTX gets its terminating NUL).
    pub fn module_bytes(&self) -> Vec<u8> {
        match self {
            Image::Cubin(b) => b.clone(),
            Image::Ptx(s) => {
                let mut b = s.as_bytes().to_vec();
                b.push(0);
                b
            }
        }
    }
}

/// A compiled kernel module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compiled {
    /// CUBIN or PTX.
    pub image: Image,
    /// NVRTC's log (ptxas `-v` output included when requested).
    pub log: String,
    /// The `--gpu-architecture` actually used (`sm_90`, or `compute_YY` on fallback).
    pub target: String,
}

impl Compiled {
    /// Register/spill figures from the log (needs `--ptxas-options=-v`; CUBIN only).
    pub fn resources(&self) -> Vec<KernelResources> {
        parse_ptxas_log(&self.log)
    }
}

/// Per-kernel figures reported by `ptxas -v`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// Kernel (entry function) name.
    pub name: String,
    /// Target (`sm_90`).
    pub arch: String,
    /// Registers per thread.
    pub registers: u32,
    /// Stack frame bytes.
    pub stack_bytes: u32,
    /// Spill store bytes.
    pub spill_stores: u32,
    /// Spill load bytes.
    pub spill_loads: u32,
    /// Static shared memory bytes (`smem`).
    pub shared_bytes: u32,
}

/// Parses a `--ptxas-options=-v` log into one entry per entry function, e.g. from
/// `Compiling entry function 'k' for 'sm_90'` / `0 bytes stack frame, 0 bytes spill stores,
/// 0 bytes spill loads` / `Used 18 registers, … 4096 bytes smem`.
pub fn parse_ptxas_log(log: &str) -> Vec<KernelResources> {
    fn num_before(line: &str, unit: &str) -> Option<u32> {
        let idx = line.find(unit)?;
        line[..idx].split_whitespace().last()?.parse().ok()
    }
    let mut out: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let mut parts = rest.split('\'');
            let name = parts.next().unwrap_or_default().to_string();
            let arch = parts.nth(1).unwrap_or_default().to_string();
            out.push(KernelResources {
                name,
                arch,
                ..Default::default()
            });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        if line.contains("bytes stack frame") {
            cur.stack_bytes = num_before(line, "bytes stack frame").unwrap_or(0);
            cur.spill_stores = num_before(line, "bytes spill stores").unwrap_or(0);
            cur.spill_loads = num_before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains("Used ") && line.contains(" registers") {
            cur.registers = num_before(line, "registers").unwrap_or(0);
            cur.shared_bytes = num_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

/// FNV-1a 64: stable across Rust versions and processes (the on-disk key must be).
fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = seed;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// What identifies a compiled module.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheKey {
    /// Requested arch (`sm_90`).
    pub arch: String,
    /// NVRTC (major, minor).
    pub nvrtc_version: (i32, i32),
    /// FNV-1a of the source.
    pub source_hash: u64,
    /// Compile options, in order.
    pub options: Vec<String>,
}

impl CacheKey {
    /// A stable 64-bit hash of the whole key (the on-disk file name and header check).
    pub fn hash64(&self) -> u64 {
        let mut h = fnv1a(FNV_OFFSET, self.arch.as_bytes());
        h = fnv1a(h, &[0]);
        h = fnv1a(h, &self.nvrtc_version.0.to_le_bytes());
        h = fnv1a(h, &self.nvrtc_version.1.to_le_bytes());
        h = fnv1a(h, &self.source_hash.to_le_bytes());
        for o in &self.options {
            h = fnv1a(h, o.as_bytes());
            h = fnv1a(h, &[0]);
        }
        h
    }
}

const DISK_MAGIC: &[u8; 8] = b"EPCNVRT1";
const HEADER_LEN: usize = 8 + 8 + 1 + 8 + 8 + 8 + 8;

/// Serialises a cache entry: magic, key hash, kind (0 CUBIN / 1 PTX), image length, target
/// length, log length, FNV-1a of everything after the header, then image, target, log.
pub fn encode_entry(key_hash: u64, c: &Compiled) -> Vec<u8> {
    let (kind, image): (u8, &[u8]) = match &c.image {
        Image::Cubin(b) => (0, b),
        Image::Ptx(s) => (1, s.as_bytes()),
    };
    let mut body = Vec::with_capacity(image.len() + c.target.len() + c.log.len());
    body.extend_from_slice(image);
    body.extend_from_slice(c.target.as_bytes());
    body.extend_from_slice(c.log.as_bytes());
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(DISK_MAGIC);
    out.extend_from_slice(&key_hash.to_le_bytes());
    out.push(kind);
    out.extend_from_slice(&(image.len() as u64).to_le_bytes());
    out.extend_from_slice(&(c.target.len() as u64).to_le_bytes());
    out.extend_from_slice(&(c.log.len() as u64).to_le_bytes());
    out.extend_from_slice(&fnv1a(FNV_OFFSET, &body).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Parses a cache entry written by [`encode_entry`]; `None` when anything does not match
/// (magic, key hash, sizes, checksum, UTF-8).
pub fn decode_entry(key_hash: u64, bytes: &[u8]) -> Option<Compiled> {
    let u64_at = |o: usize| -> Option<u64> {
        Some(u64::from_le_bytes(bytes.get(o..o + 8)?.try_into().ok()?))
    };
    if bytes.get(..8)? != DISK_MAGIC || u64_at(8)? != key_hash {
        return None;
    }
    let kind = *bytes.get(16)?;
    let (li, lt, ll) = (
        usize::try_from(u64_at(17)?).ok()?,
        usize::try_from(u64_at(25)?).ok()?,
        usize::try_from(u64_at(33)?).ok()?,
    );
    let sum = u64_at(41)?;
    let body = &bytes[HEADER_LEN..];
    if body.len() != li.checked_add(lt)?.checked_add(ll)? || fnv1a(FNV_OFFSET, body) != sum {
        return None;
    }
    let image = &body[..li];
    let target = std::str::from_utf8(&body[li..li + lt]).ok()?.to_string();
    let log = std::str::from_utf8(&body[li + lt..]).ok()?.to_string();
    let image = match kind {
        0 => Image::Cubin(image.to_vec()),
        1 => Image::Ptx(std::str::from_utf8(image).ok()?.to_string()),
        _ => return None,
    };
    Some(Compiled { image, log, target })
}

/// The default on-disk cache directory: `$EPCOMM_CACHE_DIR`, `$XDG_CACHE_HOME/epcomm`,
/// `~/.cache/epcomm`; `None` when none can be derived.
pub fn default_cache_dir() -> Option<PathBuf> {
    if let Some(d) = crate::env::cache_dir() {
        return Some(d);
    }
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(d) = var("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("epcomm"));
    }
    var("HOME").map(|h| PathBuf::from(h).join(".cache").join("epcomm"))
}

/// Counters of a [`Compiler`]'s cache.
#[derive(Debug, Default)]
pub struct CacheStats {
    /// Served from memory.
    pub memory_hits: AtomicU64,
    /// Served from disk.
    pub disk_hits: AtomicU64,
    /// Compiled by NVRTC.
    pub compiles: AtomicU64,
    /// Entries written to disk.
    pub disk_writes: AtomicU64,
    /// Disk files that failed verification (ignored and rewritten).
    pub disk_rejected: AtomicU64,
}

/// NVRTC plus the in-memory and on-disk caches. Shareable between threads.
#[derive(Debug)]
pub struct Compiler {
    nvrtc: Nvrtc,
    disk: Option<PathBuf>,
    memory: Mutex<HashMap<CacheKey, Arc<Compiled>>>,
    /// Cache counters (for tests and diagnostics).
    pub stats: CacheStats,
}

impl Compiler {
    /// A compiler over `nvrtc` with an optional on-disk cache directory (created on first write).
    pub fn new(nvrtc: Nvrtc, disk: Option<PathBuf>) -> Compiler {
        Compiler {
            nvrtc,
            disk,
            memory: Mutex::new(HashMap::new()),
            stats: CacheStats::default(),
        }
    }

    /// The process-wide compiler: [`Nvrtc::global`] and [`default_cache_dir`].
    pub fn global() -> Result<&'static Compiler> {
        static COMPILER: OnceLock<Result<Compiler>> = OnceLock::new();
        COMPILER
            .get_or_init(|| Ok(Compiler::new(*Nvrtc::global()?, default_cache_dir())))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The NVRTC in use.
    pub fn nvrtc(&self) -> &Nvrtc {
        &self.nvrtc
    }

    /// The cache key of a compile request.
    pub fn key(&self, source: &str, options: &[String], arch: &str) -> CacheKey {
        CacheKey {
            arch: arch.to_string(),
            nvrtc_version: self.nvrtc.version,
            source_hash: fnv1a(FNV_OFFSET, source.as_bytes()),
            options: options.to_vec(),
        }
    }

    /// Where the entry for `key` lives on disk, if there is a disk cache.
    pub fn disk_path(&self, key: &CacheKey) -> Option<PathBuf> {
        self.disk
            .as_ref()
            .map(|d| d.join(format!("{:016x}.epk", key.hash64())))
    }

    /// Compiles `source` for `arch` (`sm_XX`): CUBIN when this NVRTC knows `sm_XX`, else PTX for
    /// the newest `compute_YY` with YY ≤ XX it knows. Cached in memory and on disk. A compile
    /// error is [`Error::Runtime`] carrying NVRTC's log.
    pub fn compile(&self, source: &str, options: &[String], arch: &str) -> Result<Arc<Compiled>> {
        let key = self.key(source, options, arch);
        if let Some(hit) = self.lock().get(&key) {
            self.stats.memory_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(hit.clone());
        }
        let path = self.disk_path(&key);
        if let Some(p) = &path {
            if let Ok(bytes) = std::fs::read(p) {
                match decode_entry(key.hash64(), &bytes) {
                    Some(c) => {
                        self.stats.disk_hits.fetch_add(1, Ordering::Relaxed);
                        let c = Arc::new(c);
                        self.lock().insert(key, c.clone());
                        return Ok(c);
                    }
                    None => {
                        self.stats.disk_rejected.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        let compiled = Arc::new(self.compile_uncached(source, options, arch)?);
        self.stats.compiles.fetch_add(1, Ordering::Relaxed);
        if let Some(p) = &path {
            // A cache that cannot be written only costs a recompile next time.
            if write_atomic(p, &encode_entry(key.hash64(), &compiled)).is_ok() {
                self.stats.disk_writes.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.lock().insert(key, compiled.clone());
        Ok(compiled)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<CacheKey, Arc<Compiled>>> {
        // A poisoned map only means another thread panicked mid-insert; the data is still valid.
        self.memory.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn compile_uncached(&self, source: &str, options: &[String], arch: &str) -> Result<Compiled> {
        let cc: i32 = arch
            .strip_prefix("sm_")
            .and_then(|s| s.trim_end_matches(['a', 'f']).parse().ok())
            .ok_or_else(|| {
                Error::InvalidArgument(format!("GPU arch must look like 'sm_90', got '{arch}'"))
            })?;
        let target = match self.nvrtc.supported_archs() {
            Some(list) if !list.contains(&cc) => match list.iter().filter(|a| **a <= cc).max() {
                Some(best) => format!("compute_{best}"),
                None => {
                    return Err(Error::Unavailable(format!(
                        "NVRTC {}.{} ({}) cannot compile for {arch} (supported: {:?})",
                        self.nvrtc.version.0, self.nvrtc.version.1, self.nvrtc.path, list
                    )))
                }
            },
            _ => arch.to_string(),
        };
        let name = "epcomm_kernels.cu";
        match self.nvrtc.compile_raw(source, name, options, &target) {
            Ok((image, log)) => Ok(Compiled { image, log, target }),
            Err((rc, log)) => {
                let what = self.nvrtc.error_string(rc);
                let hint = if rc == NVRTC_ERROR_INVALID_OPTION {
                    format!(
                        " (options: --gpu-architecture={target} {})",
                        options.join(" ")
                    )
                } else {
                    String::new()
                };
                Err(Error::Runtime(format!(
                    "NVRTC {}.{} failed to compile {name} for {target}: {what}{hint}\n{}",
                    self.nvrtc.version.0,
                    self.nvrtc.version.1,
                    log.trim_end()
                )))
            }
        }
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so a
/// reader never sees a half-written entry.
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.{:?}.tmp",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        std::process::id(),
        std::thread::current().id()
    ));
    // A cache entry beyond RLIMIT_FSIZE would kill the process with SIGXFSZ: not cached.
    crate::fsize::check_file_size(bytes.len() as u64)?;
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}
