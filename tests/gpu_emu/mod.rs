//! The host executor of the GPU manager's pipeline (`epcomm::gpu::transport::pipeline`),
//! shared by tests/gpu_pipeline_counts_emu.rs and tests/gpu_pipeline_emu.rs: the pipeline's
//! own code runs with the real kernel sources compiled for the host (the C++ emulation of
//! tests/common/cuda_emu.rs), ranks as threads, exchanges as host copies that follow the very
//! `ExchangePlan`s the pipeline hands NCCL.
//!
//! - Every launch is checked against the kernel's parameter table before it runs
//!   (`calls::check_args`, block sizes), as `launch::Kernels::run` does on a GPU.
//! - Device buffers are 256-aligned host allocations of exactly the requested size (the CUDA
//!   pool rounds up to 256: an overflow that rounding hides is still caught here), filled with
//!   0xCD (cuMemAlloc leaves garbage), followed by a guard band checked after every launch,
//!   copy and exchange: an overflow names the kernel and buffer. Every exchange range must lie
//!   inside one buffer.
//! - A rank left waiting in a collective the others never join (only some ranks failed) is a
//!   panic naming it, not a hang.
#![allow(dead_code)]

pub mod fake_nccl;

use std::alloc::Layout as AllocLayout;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use epcomm::gpu::calls::{check_args, Call, Calls, KernelId};
use epcomm::gpu::kernels::{self, IdDtype, SCAN_THREADS};
use epcomm::gpu::nccl::plan::ExchangePlan;
use epcomm::gpu::transport::gate::Gate;
use epcomm::gpu::transport::pipeline::Executor;
use epcomm::gpu::transport::pool::{Block, Pool};
use epcomm::num::FloatKind;

use crate::common::cuda_emu::{self, cxx, cxx_or_skip};

// ---- the emulated kernels -----------------------------------------------------------------

const EMU_LAUNCH: &str = r##"
template <class T> static T emu_conv(u64 v) {
    if constexpr (std::is_pointer<T>::value) return (T)(uintptr_t)v; else return (T)v;
}
template <class... P, size_t... I> static void emu_inv(void (*f)(P...), const u64* a, std::index_sequence<I...>) {
    f(emu_conv<P>(a[I])...);
}
template <class... P> static int emu_run(void (*f)(P...), unsigned grid, unsigned block, const u64* a, unsigned n, bool threads) {
    if (n != sizeof...(P)) return -2;
    auto body = [&] { emu_inv(f, a, std::index_sequence_for<P...>{}); };
    if (threads) emu_threads(grid, block, body); else emu_seq(grid, block, body);
    return 0;
}
"##;

/// One compiled module variant: `emu_launch(name, grid, block, slots, nslots)`.
type LaunchFn = unsafe extern "C" fn(*const c_char, u32, u32, *const u64, u32) -> i32;

/// The emulated modules, by key (`layout_i32`, `unpack_i64`, `combine_1_1`, ...).
pub struct Emu {
    fns: HashMap<String, LaunchFn>,
}

/// The .cu module `body` as an emulation translation unit exporting `emu_launch`.
fn unit_source(module: kernels::Module) -> String {
    // The kernels have C linkage on the device; here each variant is its own shared object
    // and only `emu_launch` is exported, so the linkage is dropped.
    let body = module.body().replace("extern \"C\" ", "");
    let mut s = String::from("#include \"emu_prelude.h\"\n#include \"prelude_tail.h\"\n");
    s.push_str(&body);
    s.push_str(EMU_LAUNCH);
    s.push_str("extern \"C\" __attribute__((visibility(\"default\"))) int emu_launch(const char* name, unsigned grid, unsigned block, const u64* a, unsigned n) {\n");
    for k in module.kernels() {
        let threads = k.name == "ep_scan_block";
        s.push_str(&format!(
            "    if (!strcmp(name, \"{0}\")) return emu_run({0}, grid, block, a, n, {1});\n",
            k.name, threads
        ));
    }
    s.push_str("    return -1;\n}\n");
    s
}

/// The emulated grid state (gridDim, blockIdx, ...) is global: one test at a time.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The emulation (built once per test binary), or `None` without a C++ compiler.
pub fn emu() -> Option<&'static Emu> {
    static EMU: OnceLock<Option<Emu>> = OnceLock::new();
    EMU.get_or_init(build_emu).as_ref()
}

/// The emulation, or `None` after a SKIPPED line naming `test` (no C++ compiler).
pub fn emu_or_skip(test: &str) -> Option<&'static Emu> {
    if emu().is_none() {
        // build_emu only fails for a missing compiler; this names the test that skips.
        cxx_or_skip(test);
    }
    emu()
}

fn build_emu() -> Option<Emu> {
    cuda_emu::cxx_available()?;
    let dir = cuda_emu::temp_dir("counts-emu");
    cuda_emu::write_sources(&dir, &[]);
    use kernels::Module as M;
    // (key, module, -D defines); K = 2 everywhere.
    let mut units: Vec<(String, M, Vec<String>)> = Vec::new();
    for (id, code) in [("i32", 0), ("i64", 1)] {
        units.push((
            format!("layout_{id}"),
            M::Layout,
            vec![format!("-DID_DTYPE={code}")],
        ));
        units.push((
            format!("pack_{id}"),
            M::Pack,
            vec![format!("-DID_DTYPE={code}")],
        ));
    }
    units.push(("unpack_i64".into(), M::Unpack, vec!["-DID_DTYPE=1".into()]));
    units.push(("scan".into(), M::Scan, vec![]));
    for c in [0, 1] {
        units.push((
            format!("combine_{c}_{c}"),
            M::Combine,
            vec![format!("-DIN_DTYPE={c}"), format!("-DOUT_DTYPE={c}")],
        ));
    }
    let handles: Vec<_> = units
        .into_iter()
        .map(|(key, module, defs)| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let src = dir.join(format!("{key}.cpp"));
                std::fs::write(&src, unit_source(module)).expect("write");
                let so = dir.join(format!("lib{key}.so"));
                let out = cuda_emu::cxx_command(&cxx(), &dir)
                    .args(["-fPIC", "-shared", "-fvisibility=hidden"])
                    .args(&defs)
                    .arg("-o")
                    .arg(&so)
                    .arg(&src)
                    .output()
                    .expect("run the C++ compiler");
                assert!(
                    out.status.success(),
                    "{key}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                (key, so)
            })
        })
        .collect();
    let mut fns = HashMap::new();
    for h in handles {
        let (key, so) = h.join().expect("compile");
        let path = CString::new(so.to_str().unwrap()).unwrap();
        // SAFETY: a shared object just built from our sources; kept loaded for the process.
        let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!lib.is_null(), "dlopen {key}");
        // SAFETY: the symbol is `emu_launch` with the LaunchFn signature (unit_source).
        let f = unsafe { libc::dlsym(lib, c"emu_launch".as_ptr()) };
        assert!(!f.is_null(), "dlsym {key}");
        // SAFETY: see above.
        fns.insert(key, unsafe {
            std::mem::transmute::<*mut c_void, LaunchFn>(f)
        });
    }
    let _ = std::fs::remove_dir_all(&dir);
    Some(Emu { fns })
}

/// The emulated module that holds kernel `k` for caller ids `id` and float `kind`.
fn lib(k: KernelId, id: IdDtype, kind: FloatKind) -> String {
    let id = match id {
        IdDtype::I32 => "i32",
        IdDtype::I64 => "i64",
    };
    let c = match kind {
        FloatKind::F32 => 0,
        FloatKind::Bf16 | FloatKind::F16 => 1,
    };
    match k {
        KernelId::Layout | KernelId::PairRows | KernelId::RecvFlags => format!("layout_{id}"),
        KernelId::PairRowsWire => "layout_i32".into(),
        KernelId::Pack | KernelId::LocalCopy => format!("pack_{id}"),
        KernelId::ScanBlock | KernelId::ScanAdd => "scan".into(),
        KernelId::UnpackTokenMajor
        | KernelId::UnpackExpertMajor
        | KernelId::UnpackExpertPacked
        | KernelId::UnpackRankMajor => "unpack_i64".into(),
        KernelId::CombineReturnExpert
        | KernelId::CombineReturnRankMajor
        | KernelId::WeightedCombine
        | KernelId::SumRanks => format!("combine_{c}_{c}"),
    }
}

// ---- emulated device memory ---------------------------------------------------------------

const GUARD: usize = 64;

/// One emulated allocation: `bytes` usable, then a guard band. The last request's size
/// (`used`) is where the guard starts, so an overflow past what a call asked for is caught
/// even in a buffer reserved larger.
pub struct Buf {
    ptr: *mut u8,
    bytes: usize,
    used: Cell<usize>,
    layout: AllocLayout,
}

// SAFETY: the allocation is owned by the buffer; ranks touch each other's buffers only inside
// an exchange, between two barriers.
unsafe impl Send for Buf {}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in Buf::alloc.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

impl Block for Buf {
    fn ptr(&self) -> u64 {
        self.ptr as u64
    }

    fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Buf {
    /// `bytes` filled with 0xCD (cuMemAlloc leaves garbage), then the guard band.
    fn alloc(bytes: usize) -> Buf {
        let layout = AllocLayout::from_size_align(bytes + GUARD, 256).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        assert!(!ptr.is_null());
        // SAFETY: the allocation holds bytes + GUARD.
        unsafe {
            std::ptr::write_bytes(ptr, 0xCD, bytes);
            std::ptr::write_bytes(ptr.add(bytes), 0xA5, GUARD);
        }
        Buf {
            ptr,
            bytes,
            used: Cell::new(bytes),
            layout,
        }
    }

    /// A request of `bytes` (> 0): the guard band starts there.
    fn request(&self, bytes: usize) {
        if bytes == self.used.get() {
            return;
        }
        assert!(bytes <= self.bytes);
        // SAFETY: [bytes, self.bytes + GUARD) lies inside the allocation.
        unsafe { std::ptr::write_bytes(self.ptr.add(bytes), 0xA5, self.bytes + GUARD - bytes) };
        self.used.set(bytes);
    }

    fn guard(&self) -> &[u8] {
        let used = self.used.get();
        // SAFETY: the guard band of a live allocation.
        unsafe { std::slice::from_raw_parts(self.ptr.add(used), self.bytes + GUARD - used) }
    }

    fn holds(&self, addr: u64, bytes: usize) -> bool {
        let start = self.ptr as u64;
        addr >= start && addr + bytes as u64 <= start + self.used.get() as u64
    }
}

/// The pipeline's buffers (the library's own pool policy over emulated allocations) and the
/// test's inputs and outputs.
#[derive(Default)]
pub struct Memory {
    /// What the pipeline asked for, as the CUDA executor's pool holds it.
    pub pool: Pool<Buf>,
    inputs: HashMap<String, Buf>,
}

impl Memory {
    fn all(&self) -> impl Iterator<Item = (&str, &Buf)> {
        self.pool
            .iter()
            .chain(self.inputs.iter().map(|(n, b)| (n.as_str(), b)))
    }

    /// A test buffer `name` of `bytes` (inputs and outputs the host passes in).
    pub fn input(&mut self, name: &str, bytes: usize) -> u64 {
        let bytes = bytes.max(16);
        if let Some(b) = self.inputs.get(name).filter(|b| b.bytes >= bytes) {
            b.request(bytes);
            return b.ptr as u64;
        }
        let b = Buf::alloc(bytes);
        let p = b.ptr as u64;
        self.inputs.insert(name.to_owned(), b);
        p
    }

    /// The pipeline's buffer `name` (allocated by now).
    pub fn get(&self, name: &str) -> u64 {
        self.pool
            .find(name)
            .unwrap_or_else(|| panic!("no pipeline buffer '{name}'"))
            .ptr as u64
    }

    /// Every pipeline buffer's address, by name (graphs capture these).
    pub fn addresses(&self) -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = self
            .pool
            .iter()
            .map(|(n, b)| (n.to_owned(), b.ptr as u64))
            .collect();
        v.sort();
        v
    }

    /// Panics naming `what` when a guard band was overwritten.
    pub fn check_guards(&self, what: &str) {
        for (name, b) in self.all() {
            assert!(
                b.guard().iter().all(|&x| x == 0xA5),
                "{what} wrote past the end of device buffer '{name}' ({} bytes)",
                b.used.get()
            );
        }
    }

    /// Panics unless `[addr, addr + bytes)` lies inside one buffer (0 bytes: anything).
    pub fn check_range(&self, addr: u64, bytes: usize, what: &str) {
        if bytes == 0 {
            return;
        }
        let inside = self.all().any(|(_, b)| b.holds(addr, bytes));
        assert!(
            inside,
            "{what}: {bytes} bytes at {addr:#x} lie outside every buffer"
        );
    }
}

/// `n` elements of `T` at `p` (a pool buffer; NULL only when `n == 0`).
pub fn read<T: Copy>(p: u64, n: usize) -> Vec<T> {
    if n == 0 {
        return Vec::new();
    }
    assert_ne!(p, 0, "reading {n} elements from a NULL output");
    // SAFETY: a pool buffer holding at least n T (the caller's shape).
    unsafe { std::slice::from_raw_parts(p as *const T, n).to_vec() }
}

fn memcpy(dst: u64, src: u64, bytes: usize) {
    if bytes > 0 {
        // SAFETY: pool buffers (or the caller's data) of at least `bytes`; distinct.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) }
    }
}

// ---- the ranks' fabric --------------------------------------------------------------------

/// What the ranks publish to each other in a collective: per rank, its exchange items (or
/// its all-gather row).
pub struct Fabric {
    world: usize,
    gate: Gate,
    aborted: AtomicBool,
    items: Mutex<Vec<Vec<(ExchangePlan, u64, u64)>>>,
    rows: Mutex<Vec<Vec<i32>>>,
}

/// How long a rank waits in a collective before it is a failure (a peer never came).
const WAIT: Duration = Duration::from_secs(30);

impl Fabric {
    /// The fabric of `world` ranks.
    pub fn new(world: usize) -> Arc<Fabric> {
        Arc::new(Fabric {
            world,
            gate: Gate::new(),
            aborted: AtomicBool::new(false),
            items: Mutex::new(vec![Vec::new(); world]),
            rows: Mutex::new(vec![Vec::new(); world]),
        })
    }

    /// A peer that aborted (its manager failed mid-call) makes this an error, as NCCL reports
    /// a peer's abort; a peer that never comes is a panic (a hang on a GPU).
    fn barrier(&self, rank: usize, what: &str) -> epcomm::Result<()> {
        match self.gate.wait(self.world, rank, WAIT) {
            Ok(()) => Ok(()),
            Err(e) if self.aborted.load(Ordering::SeqCst) => Err(epcomm::Error::PeerFailure(
                format!("rank {rank} in {what}: a peer aborted the communicator ({e})"),
            )),
            Err(e) => panic!("rank {rank} waits in {what} the other ranks never join (only some ranks failed?): {e}"),
        }
    }

    /// What `ncclCommAbort` does to the peers: their collectives fail.
    fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        self.gate.poison();
    }
}

thread_local! {
    /// The emulated driver's context stack of this thread (cuCtxPushCurrent / PopCurrent).
    static CONTEXTS: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// The emulated current context of this thread.
pub fn current_context() -> Option<usize> {
    CONTEXTS.with(|c| c.borrow().last().copied())
}

/// Makes `ctx` current on this thread (cuCtxSetCurrent: replaces the top).
pub fn set_current_context(ctx: usize) {
    CONTEXTS.with(|c| {
        let mut c = c.borrow_mut();
        c.pop();
        c.push(ctx);
    })
}

/// What an executor may inject: a failing allocation, launch or host sync.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Faults {
    /// Allocating (or growing) this buffer fails (cuMemAlloc's out of memory).
    pub alloc: Option<String>,
    /// Launching this kernel fails.
    pub launch: Option<KernelId>,
    /// The counts host sync times out.
    pub read: bool,
}

/// One rank's host executor.
pub struct HostExec {
    /// This rank.
    pub rank: usize,
    /// Its device memory.
    pub mem: Memory,
    /// The float kind of the expert outputs (which combine module runs).
    pub kind: FloatKind,
    /// The launch builders: top-k, and a small grid cap so every grid-stride loop strides.
    pub calls: Calls,
    /// The last all-gather's result (every rank's counts row).
    pub gathered: Vec<i32>,
    /// Whether the stream is being captured into a CUDA graph (cuStreamIsCapturing).
    pub capturing: bool,
    /// Failures to inject.
    pub faults: Faults,
    /// The emulated context of this rank's device (what `enter` pushes).
    pub ctx: usize,
    /// Whether the pipeline aborted this rank's transport.
    pub aborted: bool,
    fabric: Arc<Fabric>,
}

impl HostExec {
    /// Rank `rank` on `fabric`, kernels for `top_k` and `kind`.
    pub fn new(rank: usize, fabric: Arc<Fabric>, top_k: u32, kind: FloatKind) -> HostExec {
        HostExec {
            rank,
            mem: Memory::default(),
            kind,
            calls: Calls {
                top_k,
                max_blocks: 2,
            },
            gathered: Vec::new(),
            capturing: false,
            faults: Faults::default(),
            ctx: 1000 + rank,
            aborted: false,
            fabric,
        }
    }

    /// Copies `data` into the test buffer `name` (a test input); NULL for no data, as
    /// src/ffi/gpu.rs passes empty tensors.
    pub fn put(&mut self, name: &str, data: &[u8]) -> u64 {
        if data.is_empty() {
            return 0;
        }
        let p = self.mem.input(name, data.len());
        memcpy(p, data.as_ptr() as u64, data.len());
        p
    }

    /// Device work runs in this rank's context (the pipeline entered it).
    fn in_context(&self, what: &str) {
        assert_eq!(
            current_context(),
            Some(self.ctx),
            "rank {}: {what} outside the manager's context",
            self.rank
        );
    }

    /// Copies this rank's receives of item `i` from the peers' send buffers.
    fn receive(&self, all: &[Vec<(ExchangePlan, u64, u64)>], i: usize) {
        let d = self.rank;
        let (plan, send, recv) = &all[d][i];
        for rv in &plan.recvs {
            let (pp, psend, _) = &all[rv.peer][i];
            let sd = pp.sends.iter().find(|s| s.peer == d).unwrap_or_else(|| {
                panic!("rank {d} receives from {} which sends nothing", rv.peer)
            });
            assert_eq!(
                sd.bytes, rv.bytes,
                "send/recv sizes differ ({} -> {d})",
                rv.peer
            );
            assert!(rv.offset + rv.bytes <= plan.recv_bytes);
            memcpy(recv + rv.offset as u64, psend + sd.offset as u64, rv.bytes);
        }
        for sd in &plan.sends {
            assert!(
                all[sd.peer][i].0.recvs.iter().any(|r| r.peer == d),
                "rank {d} sends to {} which does not receive",
                sd.peer
            );
        }
        if let Some(l) = &plan.local {
            memcpy(
                recv + l.recv_offset as u64,
                send + l.send_offset as u64,
                l.bytes,
            );
        }
    }
}

impl Executor for HostExec {
    fn enter(&mut self) -> epcomm::Result<()> {
        CONTEXTS.with(|c| c.borrow_mut().push(self.ctx));
        Ok(())
    }

    fn leave(&mut self) {
        let popped = CONTEXTS.with(|c| c.borrow_mut().pop());
        assert_eq!(popped, Some(self.ctx), "leave pops what enter pushed");
    }

    fn reserve(&mut self, name: &str, bytes: usize) -> epcomm::Result<()> {
        self.mem
            .pool
            .reserve(name, bytes, |n| Ok(Buf::alloc(n)))
            .map(|_| ())
    }

    fn calls(&mut self, _id: IdDtype) -> epcomm::Result<Calls> {
        Ok(self.calls)
    }

    fn buffer(&mut self, name: &str, bytes: usize) -> epcomm::Result<u64> {
        self.in_context("a buffer request");
        let capturing = self.capturing;
        let fail = self.faults.alloc.as_deref() == Some(name);
        let p = self.mem.pool.get(
            name,
            bytes,
            || Ok(capturing),
            |n| {
                if fail {
                    return Err(epcomm::Error::Runtime(format!(
                        "CUDA error in cuMemAlloc({n} bytes): out of memory (CUDA_ERROR_OUT_OF_MEMORY) [injected for '{name}']"
                    )));
                }
                Ok(Buf::alloc(n))
            },
        )?;
        if bytes > 0 {
            self.mem
                .pool
                .find(name)
                .expect("just got")
                .request(bytes.max(16));
        }
        Ok(p)
    }

    /// `Kernels::run`: every call checked against its table, then executed.
    fn launch(&mut self, id: IdDtype, calls: &[Call]) -> epcomm::Result<()> {
        // The emulated grid state of a module is global: one launch at a time.
        static LAUNCH: Mutex<()> = Mutex::new(());
        self.in_context("a launch");
        let emu = emu().expect("emulation built");
        for c in calls {
            let sig = c.kernel.sig();
            if self.faults.launch == Some(c.kernel) {
                return Err(epcomm::Error::Runtime(format!(
                    "launching {}: CUDA error in cuLaunchKernel: unspecified launch failure (CUDA_ERROR_LAUNCH_FAILED) [injected]",
                    sig.name
                )));
            }
            check_args(sig, &c.args).unwrap_or_else(|e| panic!("{e}"));
            assert!(c.grid >= 1 && c.block >= 32 && c.block % 32 == 0);
            if c.kernel == KernelId::ScanBlock {
                assert_eq!(c.block, SCAN_THREADS);
            }
            let slots: Vec<u64> = c.args.iter().map(|a| a.slot()).collect();
            let f = emu.fns[&lib(c.kernel, id, self.kind)];
            let name = CString::new(sig.name).unwrap();
            let _one = LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the arguments match the entry point (checked); pointers are pool
            // buffers of this rank (sizes as the pipeline computes them; guards checked).
            let rc = unsafe {
                f(
                    name.as_ptr(),
                    c.grid,
                    c.block,
                    slots.as_ptr(),
                    slots.len() as u32,
                )
            };
            assert_eq!(rc, 0, "emu_launch {}", sig.name);
            self.mem.check_guards(sig.name);
        }
        Ok(())
    }

    unsafe fn fill8(&mut self, dst: u64, value: u8, bytes: usize) -> epcomm::Result<()> {
        self.in_context("fill8");
        self.mem.check_range(dst, bytes, "fill8");
        // SAFETY: inside one pool buffer (checked).
        unsafe { std::ptr::write_bytes(dst as *mut u8, value, bytes) };
        Ok(())
    }

    unsafe fn fill32(&mut self, dst: u64, value: u32, count: usize) -> epcomm::Result<()> {
        self.in_context("fill32");
        self.mem.check_range(dst, 4 * count, "fill32");
        for i in 0..count {
            // SAFETY: inside one pool buffer (checked).
            unsafe { (dst as *mut u32).add(i).write(value) }
        }
        Ok(())
    }

    unsafe fn copy(&mut self, dst: u64, src: u64, bytes: usize) -> epcomm::Result<()> {
        self.in_context("copy");
        self.mem.check_range(dst, bytes, "copy destination");
        self.mem.check_range(src, bytes, "copy source");
        memcpy(dst, src, bytes);
        Ok(())
    }

    unsafe fn upload(
        &mut self,
        dst: u64,
        data: &[u8],
        _staging: &'static str,
    ) -> epcomm::Result<()> {
        self.in_context("upload");
        self.mem.check_range(dst, data.len(), "upload");
        memcpy(dst, data.as_ptr() as u64, data.len());
        Ok(())
    }

    unsafe fn all_gather_i32(&mut self, send: u64, recv: u64, count: usize) -> epcomm::Result<()> {
        self.in_context("the all-gather");
        let (d, world) = (self.rank, self.fabric.world);
        self.mem
            .check_range(recv, 4 * count * world, "all-gather receive");
        self.fabric.rows.lock().unwrap()[d] = read::<i32>(send, count);
        self.fabric.barrier(d, "an all-gather")?;
        let all: Vec<i32> = self.fabric.rows.lock().unwrap().concat();
        assert_eq!(
            all.len(),
            count * world,
            "ranks gather rows of different lengths"
        );
        memcpy(recv, all.as_ptr() as u64, 4 * all.len());
        self.gathered = all;
        self.fabric.barrier(d, "an all-gather")
    }

    /// What NCCL does with the ranks' plans: every recv matched by the peer's send of the
    /// same size, plus each rank's self copy.
    unsafe fn exchange(&mut self, items: &[(ExchangePlan, u64, u64)]) -> epcomm::Result<()> {
        self.in_context("an exchange");
        let d = self.rank;
        for (plan, send, recv) in items {
            self.mem.check_range(*send, plan.send_bytes, "send plan");
            self.mem.check_range(*recv, plan.recv_bytes, "recv plan");
        }
        self.fabric.items.lock().unwrap()[d] = items.to_vec();
        self.fabric.barrier(d, "an exchange")?;
        let all = self.fabric.items.lock().unwrap().clone();
        for it in &all {
            assert_eq!(
                it.len(),
                items.len(),
                "ranks issue different numbers of exchanges"
            );
        }
        for i in 0..items.len() {
            self.receive(&all, i);
        }
        // Nobody reuses a send buffer before every peer read it.
        self.fabric.barrier(d, "an exchange")?;
        self.mem.check_guards("the exchange");
        Ok(())
    }

    fn read_i32(&mut self, src: u64, count: usize) -> epcomm::Result<Vec<i32>> {
        self.in_context("the host sync");
        if self.faults.read {
            return Err(epcomm::Error::Timeout(
                "GPU all2all: the counts all-gather did not complete within 1s (a peer rank is not participating?) [injected]".into(),
            ));
        }
        Ok(read::<i32>(src, count))
    }

    fn ensure_not_capturing(&self) -> epcomm::Result<()> {
        if self.capturing {
            return Err(epcomm::Error::InvalidState(
                epcomm::gpu::transport::pipeline::CAPTURE_SYNC_MESSAGE.into(),
            ));
        }
        Ok(())
    }

    fn abort(&mut self) {
        self.aborted = true;
        self.fabric.abort();
    }
}

/// Runs `f` on every rank at once (each on its own thread), in rank order of the results.
pub fn on_ranks<S: Send, T: Send>(ranks: &mut [S], f: impl Fn(&mut S) -> T + Sync) -> Vec<T> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = ranks.iter_mut().map(|r| sc.spawn(|| f(r))).collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}
