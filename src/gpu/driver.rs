//! A thin, safe-ish wrapper over the CUDA driver API (`cudarc::driver::sys`, dynamic loading).
//!
//! cudarc has no `result`/`safe` wrappers for IPC and VMM, and its lazy loader *panics* on a
//! missing library or symbol. So every entry here first asks [`crate::probe::cuda`] (a plain
//! `dlopen`), runs `cuInit` once, and executes the driver calls under `catch_unwind`: a missing
//! library/symbol becomes [`Error::Unavailable`], a `CUresult` error an [`Error`] carrying the
//! driver's own text. Drops never panic (errors there are ignored: nothing can report them).
//!
//! Contexts: everything uses the device's *primary* context (the one PyTorch uses). An entry
//! point binds it for its own duration with [`PrimaryContext::enter`] (push, then pop when the
//! guard drops), so a host thread driving several GPUs keeps its current device. Streams are
//! usually the host's (`cudaStream_t` is the same handle as `CUstream`) and borrowed.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;

use crate::error::{Error, Result};
use crate::probe;

pub use cudarc::driver::sys::CUdevice_attribute as DeviceAttribute;

pub use crate::gpu::transport::pipeline::CAPTURE_SYNC_MESSAGE;

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Runs `f` (driver calls) under `catch_unwind`; a cudarc loader panic ("Missing symbol …",
/// "Unable to dynamically load …") becomes Unavailable.
fn no_panic<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(Error::Unavailable(format!(
            "CUDA is unavailable: {what}: {}",
            panic_text(p.as_ref())
        ))),
    }
}

/// For drops: run and ignore both errors and panics.
fn quietly(f: impl FnOnce()) {
    let _ = catch_unwind(AssertUnwindSafe(f));
}

/// The driver's name and text for `rc`.
fn describe(rc: sys::CUresult) -> String {
    let mut name: *const c_char = std::ptr::null();
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: both outputs are writable; the driver returns static strings or leaves NULL.
    unsafe {
        let _ = sys::cuGetErrorName(rc, &mut name);
        let _ = sys::cuGetErrorString(rc, &mut text);
    }
    let s = |p: *const c_char| {
        // SAFETY: non-NULL pointers from the driver are static NUL-terminated strings.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    match (s(name), s(text)) {
        (Some(n), Some(t)) => format!("{t} ({n})"),
        (Some(n), None) => n,
        (None, Some(t)) => t,
        (None, None) => format!("{rc:?}"),
    }
}

/// `Ok` for `CUDA_SUCCESS`, else an error naming the call.
pub fn check(rc: sys::CUresult, what: &str) -> Result<()> {
    check_detail(rc, what, "")
}

/// [`check`], with `detail` (e.g. a JIT log) appended to the message.
fn check_detail(rc: sys::CUresult, what: &str, detail: &str) -> Result<()> {
    use sys::CUresult as R;
    if rc == R::CUDA_SUCCESS {
        return Ok(());
    }
    let msg = format!("CUDA error in {what}: {}{detail}", describe(rc));
    Err(match rc {
        R::CUDA_ERROR_NO_DEVICE
        | R::CUDA_ERROR_NOT_SUPPORTED
        | R::CUDA_ERROR_NOT_PERMITTED
        | R::CUDA_ERROR_STUB_LIBRARY
        | R::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH => Error::Unavailable(msg),
        R::CUDA_ERROR_INVALID_VALUE | R::CUDA_ERROR_INVALID_HANDLE => Error::InvalidArgument(msg),
        R::CUDA_ERROR_NOT_READY => Error::InvalidState(msg),
        _ => Error::Runtime(msg),
    })
}

/// Loads the driver (via the probe) and runs `cuInit(0)` once per process; the outcome is
/// cached, since every wrapper calls this first (the probe's cudarc check `dlopen`s each time).
pub fn init() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        probe::cuda().map_err(|e| Error::Unavailable(format!("CUDA is unavailable: {e}")))?;
        // SAFETY: cuInit has no preconditions.
        no_panic("cuInit", || check(unsafe { sys::cuInit(0) }, "cuInit"))
    })
    .clone()
}

/// [`init`], then `f` under `catch_unwind`.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    init()?;
    no_panic(what, f)
}

/// The driver's CUDA version (`cuDriverGetVersion`, e.g. 12080 or 13000).
pub fn driver_version() -> Result<i32> {
    guarded("cuDriverGetVersion", || {
        let mut v: c_int = 0;
        // SAFETY: writable output.
        check(
            unsafe { sys::cuDriverGetVersion(&mut v) },
            "cuDriverGetVersion",
        )?;
        Ok(v)
    })
}

/// Number of visible devices.
pub fn device_count() -> Result<usize> {
    guarded("cuDeviceGetCount", || {
        let mut n: c_int = 0;
        // SAFETY: writable output.
        check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
        Ok(n.max(0) as usize)
    })
}

/// A device (ordinal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Device {
    ordinal: i32,
    raw: sys::CUdevice,
}

impl Device {
    /// Device `ordinal`.
    pub fn get(ordinal: usize) -> Result<Device> {
        guarded("cuDeviceGet", || {
            let ord = c_int::try_from(ordinal)
                .map_err(|_| Error::InvalidArgument(format!("device ordinal {ordinal}")))?;
            let mut raw: sys::CUdevice = 0;
            // SAFETY: writable output.
            check(unsafe { sys::cuDeviceGet(&mut raw, ord) }, "cuDeviceGet")?;
            Ok(Device { ordinal: ord, raw })
        })
    }

    /// The ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The raw `CUdevice`.
    pub fn raw(&self) -> sys::CUdevice {
        self.raw
    }

    /// The marketing name ("NVIDIA H200").
    pub fn name(&self) -> Result<String> {
        guarded("cuDeviceGetName", || {
            let mut buf = [0 as c_char; 256];
            // SAFETY: the buffer holds `len` chars; the driver NUL-terminates.
            check(
                unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, self.raw) },
                "cuDeviceGetName",
            )?;
            // SAFETY: NUL-terminated by the driver (the last byte stays 0 regardless).
            buf[buf.len() - 1] = 0;
            Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .into_owned())
        })
    }

    /// One attribute (`cuDeviceGetAttribute`).
    pub fn attribute(&self, attr: DeviceAttribute) -> Result<i32> {
        guarded("cuDeviceGetAttribute", || {
            let mut v: c_int = 0;
            // SAFETY: writable output; `attr` is a valid enum value.
            check(
                unsafe { sys::cuDeviceGetAttribute(&mut v, attr, self.raw) },
                &format!("cuDeviceGetAttribute({attr:?})"),
            )?;
            Ok(v)
        })
    }

    /// (major, minor) compute capability.
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        Ok((
            self.attribute(DeviceAttribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(DeviceAttribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> Result<i32> {
        self.attribute(DeviceAttribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    }
}

/// The device's primary context, retained (released on drop).
#[derive(Debug)]
pub struct PrimaryContext {
    device: Device,
    raw: sys::CUcontext,
}

// SAFETY: a CUcontext may be used (made current) from any thread.
unsafe impl Send for PrimaryContext {}
// SAFETY: as above; the driver synchronises internally.
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    /// Retains `device`'s primary context (`cuDevicePrimaryCtxRetain`).
    pub fn retain(device: Device) -> Result<PrimaryContext> {
        guarded("cuDevicePrimaryCtxRetain", || {
            let mut raw: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: writable output; a valid device.
            check(
                unsafe { sys::cuDevicePrimaryCtxRetain(&mut raw, device.raw) },
                "cuDevicePrimaryCtxRetain",
            )?;
            Ok(PrimaryContext { device, raw })
        })
    }

    /// Makes it current on the calling thread for good (`cuCtxSetCurrent`): for threads that
    /// only ever use this device (tests, the device check); entry points use
    /// [`PrimaryContext::enter`].
    pub fn set_current(&self) -> Result<()> {
        guarded("cuCtxSetCurrent", || {
            // SAFETY: a retained context.
            check(unsafe { sys::cuCtxSetCurrent(self.raw) }, "cuCtxSetCurrent")
        })
    }

    /// Makes it current on the calling thread until the guard drops, which restores the
    /// caller's context (`cuCtxPushCurrent` / `cuCtxPopCurrent`).
    pub fn enter(&self) -> Result<ContextGuard<'_>> {
        guarded("cuCtxPushCurrent", || {
            // SAFETY: a retained context; popped by the guard on this thread.
            check(
                unsafe { sys::cuCtxPushCurrent_v2(self.raw) },
                "cuCtxPushCurrent",
            )?;
            Ok(ContextGuard {
                _ctx: self,
                _not_send: std::marker::PhantomData,
            })
        })
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The raw `CUcontext`.
    pub fn raw(&self) -> sys::CUcontext {
        self.raw
    }
}

/// The context [`PrimaryContext::enter`] pushed, popped on drop (on the same thread: the
/// guard is not `Send`).
#[derive(Debug)]
pub struct ContextGuard<'a> {
    _ctx: &'a PrimaryContext,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for ContextGuard<'_> {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context `enter` pushed on this thread.
        quietly(|| unsafe {
            let _ = sys::cuCtxPopCurrent_v2(&mut popped);
        });
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        let dev = self.device.raw;
        // SAFETY: balanced with the retain in `retain`.
        quietly(|| unsafe {
            let _ = sys::cuDevicePrimaryCtxRelease_v2(dev);
        });
    }
}

/// Capture state of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CaptureStatus {
    /// Not capturing.
    None,
    /// Capturing into a graph.
    Active,
    /// A capture that failed and must be ended.
    Invalidated,
}

/// A stream: borrowed from the host (never destroyed) or created here (destroyed on drop).
#[derive(Debug)]
pub struct Stream {
    raw: sys::CUstream,
    owned: bool,
}

// SAFETY: CUstream handles may be used from any thread.
unsafe impl Send for Stream {}
// SAFETY: as above; enqueueing is thread-safe in the driver.
unsafe impl Sync for Stream {}

impl Stream {
    /// Wraps a host stream (`cudaStream_t`/`CUstream`; NULL = the legacy default stream).
    ///
    /// # Safety
    /// `raw` is NULL or a live stream of the current context, and outlives the value.
    pub unsafe fn borrowed(raw: *mut c_void) -> Stream {
        Stream {
            raw: raw.cast(),
            owned: false,
        }
    }

    /// A new non-blocking stream in the current context.
    pub fn create() -> Result<Stream> {
        guarded("cuStreamCreate", || {
            let mut raw: sys::CUstream = std::ptr::null_mut();
            // SAFETY: writable output; flag 1 = CU_STREAM_NON_BLOCKING.
            check(
                unsafe { sys::cuStreamCreate(&mut raw, 1) },
                "cuStreamCreate",
            )?;
            Ok(Stream { raw, owned: true })
        })
    }

    /// The raw handle.
    pub fn raw(&self) -> *mut c_void {
        self.raw.cast()
    }

    /// `cuStreamIsCapturing`.
    fn capture_status(&self) -> Result<CaptureStatus> {
        guarded("cuStreamIsCapturing", || {
            let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            // SAFETY: a valid stream, writable output.
            check(
                unsafe { sys::cuStreamIsCapturing(self.raw, &mut st) },
                "cuStreamIsCapturing",
            )?;
            Ok(match st {
                sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
                sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => {
                    CaptureStatus::Active
                }
                _ => CaptureStatus::Invalidated,
            })
        })
    }

    /// Whether the stream is being captured into a CUDA graph (`cuStreamIsCapturing`; an
    /// invalidated capture counts: it still must be ended).
    pub fn is_capturing(&self) -> Result<bool> {
        Ok(match self.capture_status()? {
            CaptureStatus::None => false,
            CaptureStatus::Active | CaptureStatus::Invalidated => true,
        })
    }

    /// InvalidState ([`CAPTURE_SYNC_MESSAGE`]) when the stream is being captured: a host sync
    /// (counts mode) is impossible inside a CUDA graph.
    pub fn ensure_not_capturing(&self) -> Result<()> {
        match self.capture_status()? {
            CaptureStatus::None => Ok(()),
            CaptureStatus::Active | CaptureStatus::Invalidated => {
                Err(Error::InvalidState(CAPTURE_SYNC_MESSAGE.into()))
            }
        }
    }

    /// `cuStreamSynchronize`.
    pub fn synchronize(&self) -> Result<()> {
        guarded("cuStreamSynchronize", || {
            // SAFETY: a valid stream.
            check(
                unsafe { sys::cuStreamSynchronize(self.raw) },
                "cuStreamSynchronize",
            )
        })
    }

    /// Makes later work on this stream wait for `event` (`cuStreamWaitEvent`).
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        guarded("cuStreamWaitEvent", || {
            // SAFETY: valid stream and event.
            check(
                unsafe { sys::cuStreamWaitEvent(self.raw, event.raw, 0) },
                "cuStreamWaitEvent",
            )
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.owned {
            let raw = self.raw;
            // SAFETY: created by us, not used after this.
            quietly(|| unsafe {
                let _ = sys::cuStreamDestroy_v2(raw);
            });
        }
    }
}

/// Device memory from `cuMemAlloc` (freed on drop).
#[derive(Debug)]
pub struct DeviceMemory {
    ptr: u64,
    bytes: usize,
}

impl DeviceMemory {
    /// Allocates `bytes` (at least 1) in the current context.
    pub fn alloc(bytes: usize) -> Result<DeviceMemory> {
        guarded("cuMemAlloc", || {
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: writable output.
            check(
                unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) },
                &format!("cuMemAlloc({bytes} bytes)"),
            )?;
            Ok(DeviceMemory { ptr, bytes })
        })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The size asked for.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        let p = self.ptr;
        // SAFETY: allocated by cuMemAlloc, freed once.
        quietly(|| unsafe {
            let _ = sys::cuMemFree_v2(p);
        });
    }
}

/// Page-locked host memory from `cuMemHostAlloc` (freed on drop), e.g. for the counts D2H.
#[derive(Debug)]
pub struct PinnedHost {
    ptr: *mut c_void,
    bytes: usize,
}

// SAFETY: plain host memory.
unsafe impl Send for PinnedHost {}

impl PinnedHost {
    /// Allocates `bytes` (at least 1) of pinned host memory.
    pub fn alloc(bytes: usize) -> Result<PinnedHost> {
        guarded("cuMemHostAlloc", || {
            let mut ptr: *mut c_void = std::ptr::null_mut();
            // SAFETY: writable output; flags 0.
            check(
                unsafe { sys::cuMemHostAlloc(&mut ptr, bytes.max(1), 0) },
                &format!("cuMemHostAlloc({bytes} bytes)"),
            )?;
            Ok(PinnedHost { ptr, bytes })
        })
    }

    /// The host address.
    pub fn ptr(&self) -> *mut c_void {
        self.ptr
    }

    /// The size.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let p = self.ptr;
        // SAFETY: allocated by cuMemHostAlloc, freed once.
        quietly(|| unsafe {
            let _ = sys::cuMemFreeHost(p);
        });
    }
}

/// `cuMemcpyHtoDAsync`.
///
/// # Safety
/// `src` is readable for `bytes` (pinned for true asynchrony) until the copy ran; `dst` is
/// device memory of `bytes`.
pub unsafe fn memcpy_htod_async(
    dst: u64,
    src: *const c_void,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    guarded("cuMemcpyHtoDAsync", || {
        // SAFETY: caller contract.
        check(
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src, bytes, stream.raw) },
            "cuMemcpyHtoDAsync",
        )
    })
}

/// `cuMemcpyDtoHAsync`.
///
/// # Safety
/// `dst` is writable for `bytes` until the copy ran (pinned for true asynchrony).
pub unsafe fn memcpy_dtoh_async(
    dst: *mut c_void,
    src: u64,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    guarded("cuMemcpyDtoHAsync", || {
        // SAFETY: caller contract.
        check(
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst, src, bytes, stream.raw) },
            "cuMemcpyDtoHAsync",
        )
    })
}

/// `cuMemcpyDtoDAsync` (copy engine; also peers' mapped memory).
///
/// # Safety
/// Both ranges are device memory of `bytes` in this context's address space.
pub unsafe fn memcpy_dtod_async(dst: u64, src: u64, bytes: usize, stream: &Stream) -> Result<()> {
    guarded("cuMemcpyDtoDAsync", || {
        // SAFETY: caller contract.
        check(
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.raw) },
            "cuMemcpyDtoDAsync",
        )
    })
}

/// `cuMemsetD8Async`.
///
/// # Safety
/// `dst` is device memory of `bytes`.
pub unsafe fn memset_d8_async(dst: u64, value: u8, bytes: usize, stream: &Stream) -> Result<()> {
    guarded("cuMemsetD8Async", || {
        // SAFETY: caller contract.
        check(
            unsafe { sys::cuMemsetD8Async(dst, value, bytes, stream.raw) },
            "cuMemsetD8Async",
        )
    })
}

#[derive(Debug)]
struct ModuleInner(sys::CUmodule);

// SAFETY: module handles are usable from any thread.
unsafe impl Send for ModuleInner {}
// SAFETY: as above.
unsafe impl Sync for ModuleInner {}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        let m = self.0;
        // SAFETY: loaded by us; functions keep the Arc alive, so none is in use.
        quietly(|| unsafe {
            let _ = sys::cuModuleUnload(m);
        });
    }
}

/// Bytes of the JIT error log a failed module load reports.
const JIT_LOG_BYTES: usize = 8192;

/// The JIT's error log (NUL-terminated in `log`) as a message suffix; empty without one.
fn jit_log_suffix(log: &[u8]) -> String {
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    let text = String::from_utf8_lossy(&log[..end]);
    let text = text.trim();
    if text.is_empty() {
        return String::new();
    }
    format!("; JIT log: {text}")
}

/// A loaded module (CUBIN or PTX); unloaded when it and all its functions are dropped.
#[derive(Debug, Clone)]
pub struct Module(Arc<ModuleInner>);

impl Module {
    /// Loads a CUBIN (ELF) or PTX image into the current context (`cuModuleLoadDataEx`); a
    /// failure carries the JIT's error log (`CU_JIT_ERROR_LOG_BUFFER`). PTX is NUL-terminated
    /// here if needed.
    pub fn load(image: &[u8]) -> Result<Module> {
        let is_elf = image.starts_with(b"\x7fELF");
        let owned;
        let data: &[u8] = if is_elf || image.last() == Some(&0) {
            image
        } else {
            owned = [image, &[0u8]].concat();
            &owned
        };
        guarded("cuModuleLoadData", || {
            let mut m: sys::CUmodule = std::ptr::null_mut();
            let mut log = vec![0u8; JIT_LOG_BYTES];
            let mut opts = [
                sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
                sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
            ];
            // The size option's value is passed in the pointer itself (the driver's convention).
            let mut vals: [*mut c_void; 2] =
                [log.as_mut_ptr().cast(), JIT_LOG_BYTES as *mut c_void];
            // SAFETY: `data` is a complete image (ELF, or NUL-terminated PTX) alive for the call;
            // the log buffer holds JIT_LOG_BYTES bytes, as the second option says.
            let rc = unsafe {
                sys::cuModuleLoadDataEx(
                    &mut m,
                    data.as_ptr().cast(),
                    opts.len() as c_uint,
                    opts.as_mut_ptr(),
                    vals.as_mut_ptr(),
                )
            };
            let what = if is_elf {
                "cuModuleLoadDataEx(CUBIN)"
            } else {
                "cuModuleLoadDataEx(PTX)"
            };
            check_detail(rc, what, &jit_log_suffix(&log))?;
            Ok(Module(Arc::new(ModuleInner(m))))
        })
    }

    /// The kernel `name` (`extern "C"` name).
    pub fn function(&self, name: &str) -> Result<Function> {
        let c = CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("kernel name {name:?} contains NUL")))?;
        guarded("cuModuleGetFunction", || {
            let mut f: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: a loaded module, a C string, a writable output.
            check(
                unsafe { sys::cuModuleGetFunction(&mut f, self.0 .0, c.as_ptr()) },
                &format!("cuModuleGetFunction({name})"),
            )?;
            Ok(Function {
                raw: f,
                _module: self.0.clone(),
            })
        })
    }
}

/// A kernel; keeps its module loaded.
#[derive(Debug, Clone)]
pub struct Function {
    raw: sys::CUfunction,
    _module: Arc<ModuleInner>,
}

// SAFETY: function handles are usable from any thread.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Function {
    /// The raw `CUfunction`.
    pub fn raw(&self) -> sys::CUfunction {
        self.raw
    }
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchDims {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory bytes.
    pub shared_bytes: u32,
}

/// `cuLaunchKernel` with a raw argument array (one pointer per kernel parameter, each pointing
/// at the argument's value; device pointers are `u64`s).
///
/// # Safety
/// `args` matches the kernel's parameter list exactly and every pointee lives until the call
/// returns; device memory the kernel touches is valid until it finished.
pub unsafe fn launch(
    f: &Function,
    dims: LaunchDims,
    stream: &Stream,
    args: *mut *mut c_void,
) -> Result<()> {
    guarded("cuLaunchKernel", || {
        let (g, b) = (dims.grid, dims.block);
        // SAFETY: caller contract.
        check(
            unsafe {
                sys::cuLaunchKernel(
                    f.raw,
                    g.0,
                    g.1,
                    g.2,
                    b.0,
                    b.1,
                    b.2,
                    dims.shared_bytes,
                    stream.raw,
                    args,
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )
    })
}

/// A CUDA event (destroyed on drop).
#[derive(Debug)]
pub struct Event {
    raw: sys::CUevent,
}

// SAFETY: event handles are usable from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

const EVENT_DISABLE_TIMING: c_uint = 2;

impl Event {
    fn with_flags(flags: c_uint) -> Result<Event> {
        guarded("cuEventCreate", || {
            let mut raw: sys::CUevent = std::ptr::null_mut();
            // SAFETY: writable output; valid flags.
            check(
                unsafe { sys::cuEventCreate(&mut raw, flags) },
                "cuEventCreate",
            )?;
            Ok(Event { raw })
        })
    }

    /// A new event; `timing` enables [`Event::elapsed_ms`] (slightly slower record).
    pub fn new(timing: bool) -> Result<Event> {
        Event::with_flags(if timing { 0 } else { EVENT_DISABLE_TIMING })
    }

    /// `cuEventRecord` on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        guarded("cuEventRecord", || {
            // SAFETY: valid event and stream.
            check(
                unsafe { sys::cuEventRecord(self.raw, stream.raw) },
                "cuEventRecord",
            )
        })
    }

    /// Blocks until the event completed.
    pub fn synchronize(&self) -> Result<()> {
        guarded("cuEventSynchronize", || {
            // SAFETY: a valid event.
            check(
                unsafe { sys::cuEventSynchronize(self.raw) },
                "cuEventSynchronize",
            )
        })
    }

    /// Whether the event completed (non-blocking; for poll loops that also check NCCL's async
    /// error and a timeout).
    pub fn query(&self) -> Result<bool> {
        guarded("cuEventQuery", || {
            // SAFETY: a valid event.
            match unsafe { sys::cuEventQuery(self.raw) } {
                sys::CUresult::CUDA_SUCCESS => Ok(true),
                sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                rc => check(rc, "cuEventQuery").map(|_| false),
            }
        })
    }

    /// Milliseconds between two completed timing events.
    pub fn elapsed_ms(start: &Event, end: &Event) -> Result<f32> {
        guarded("cuEventElapsedTime", || {
            let mut ms = 0f32;
            // SAFETY: valid events, writable output.
            check(
                unsafe { sys::cuEventElapsedTime(&mut ms, start.raw, end.raw) },
                "cuEventElapsedTime",
            )?;
            Ok(ms)
        })
    }

    /// The raw `CUevent`.
    pub fn raw(&self) -> sys::CUevent {
        self.raw
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let e = self.raw;
        // SAFETY: created by us, destroyed once.
        quietly(|| unsafe {
            let _ = sys::cuEventDestroy_v2(e);
        });
    }
}

// ---- VMM ------------------------------------------------------------------------------------

/// A reserved virtual address range (`cuMemAddressReserve`), freed on drop. The start of the
/// VMM path the one-sided transport will use to map every rank's workspace into one range
/// (`crate::gpu::onesided` module doc); tests/gpu_host.rs checks its "unavailable" error.
#[derive(Debug)]
pub struct VaRange {
    base: u64,
    bytes: usize,
}

impl VaRange {
    /// Reserves `bytes` aligned to `align` (0 = default).
    pub fn reserve(bytes: usize, align: usize) -> Result<VaRange> {
        guarded("cuMemAddressReserve", || {
            let mut base: sys::CUdeviceptr = 0;
            // SAFETY: writable output.
            check(
                unsafe { sys::cuMemAddressReserve(&mut base, bytes, align, 0, 0) },
                &format!("cuMemAddressReserve({bytes} bytes)"),
            )?;
            Ok(VaRange { base, bytes })
        })
    }

    /// The start address.
    pub fn base(&self) -> u64 {
        self.base
    }
}

impl Drop for VaRange {
    fn drop(&mut self) {
        let (base, bytes) = (self.base, self.bytes);
        // SAFETY: a range we reserved, released once.
        quietly(|| unsafe {
            let _ = sys::cuMemAddressFree(base, bytes);
        });
    }
}
