//! The COUNTS-mode flow `GpuManager` issues (src/gpu/transport/manager.rs: `dispatch_counts`
//! and `combine`), for every layout, replayed with the real kernel sources compiled for the
//! host (the C++ emulation of tests/common/cuda_emu.rs), with R = 2 ranks and the exchanges done on
//! the host from the very `ExchangePlan`s the manager hands NCCL.
//!
//! What is the manager's own code and what is mirrored here:
//! - every launch comes from `epcomm::gpu::calls::Calls` (the builders `launch::Kernels`
//!   executes on a GPU: argument order, grids, the scan's recursion) and is checked against
//!   the kernel's parameter table before it runs;
//! - sizes, offsets and matrices come from `gpu::transport::plan` (`counts_row_len`,
//!   `Gathered::parse/check`, `dispatch_shape`, `recv_offsets`, `combine_counts`,
//!   `scan_scratch_elems`, `broadcast_plan`) and `nccl::plan::counts_plan`;
//! - the step sequence and the buffer sizes of `Pool::get` are copied from manager.rs (the
//!   manager itself needs CUDA and NCCL). Device buffers are 256-aligned host allocations of
//!   exactly the requested size, filled with 0xCD (cuMemAlloc leaves garbage), followed by a
//!   guard band checked after every launch and copy: an overflow names the kernel and buffer.
//!
//! Checked against the CPU `epcomm::moe::Manager` (two ranks on threads over an shm group):
//! every dispatch output field by field, and combine (f32 exact: the test values are dyadic,
//! so every sum is exact whatever the order; bf16 within one bf16 ulp). Routings: the two-rank
//! worked example, random ones with uneven T, T = 0 on one rank, masked -1 ids and an extra
//! payload; bad ids (out of range, duplicate) must come back from the device error word
//! naming the token on its rank and the rank on its peer.
//!
//! Capacity mode (`dispatch_capacity`, EXPERT_MAJOR) is replayed the same way, several rounds
//! on the same buffers as a CUDA-graph replay would (tests/gpu_pipeline_emu.rs has the
//! hand-written version of that flow).

mod common;
mod ranks;

use std::alloc::Layout as AllocLayout;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::sync::OnceLock;
use std::time::Duration;

use epcomm::gpu::calls::{check_args, Call, Calls, KernelId};
use epcomm::gpu::kernels::{self, decode_error_word, DeviceError, IdDtype, SCAN_THREADS};
use epcomm::gpu::nccl::plan::{counts_plan, ExchangeOptions, ExchangePlan};
use epcomm::gpu::transport::plan::{
    broadcast_plan, combine_counts, counts_row_len, dispatch_shape, recv_offsets,
    row_expert_counts, scan_scratch_elems, DispatchShape, Gathered, ShapeGeometry, ROW_ERROR,
    ROW_RANK_COUNTS,
};
use epcomm::group::shm::ShmGroup;
use epcomm::group::GroupOptions;
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::{self, FloatKind};
use epcomm::select::all2all::Layout;

use common::cuda_emu::{self, cxx, cxx_or_skip};

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
struct Emu {
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
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn emu() -> Option<&'static Emu> {
    static EMU: OnceLock<Option<Emu>> = OnceLock::new();
    EMU.get_or_init(build_emu).as_ref()
}

/// The emulation, or `None` after a SKIPPED line naming `test` (no C++ compiler).
fn emu_or_skip(test: &str) -> Option<&'static Emu> {
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

// ---- emulated device memory: the manager's Pool -------------------------------------------

const GUARD: usize = 64;

struct Buf {
    ptr: *mut u8,
    bytes: usize,
    layout: AllocLayout,
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in Pool::get.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// `Pool::get` of manager.rs, but exact sizes (the manager rounds up to 256: an overflow
/// that rounding hides is still caught here) and guard bands.
#[derive(Default)]
struct Pool {
    dev: HashMap<String, Buf>,
}

impl Pool {
    fn get(&mut self, name: &str, bytes: usize) -> u64 {
        let bytes = bytes.max(16);
        if let Some(b) = self.dev.get(name) {
            if b.bytes >= bytes {
                return b.ptr as u64;
            }
        }
        let layout = AllocLayout::from_size_align(bytes + GUARD, 256).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        assert!(!ptr.is_null());
        // SAFETY: the allocation holds bytes + GUARD.
        unsafe {
            std::ptr::write_bytes(ptr, 0xCD, bytes);
            std::ptr::write_bytes(ptr.add(bytes), 0xA5, GUARD);
        }
        self.dev.insert(name.to_owned(), Buf { ptr, bytes, layout });
        ptr as u64
    }

    fn check_guards(&self, what: &str) {
        for (name, b) in &self.dev {
            // SAFETY: the guard band of a live allocation.
            let g = unsafe { std::slice::from_raw_parts(b.ptr.add(b.bytes), GUARD) };
            assert!(
                g.iter().all(|&x| x == 0xA5),
                "{what} wrote past the end of device buffer '{name}' ({} bytes)",
                b.bytes
            );
        }
    }
}

fn memset_d8(p: u64, v: u8, bytes: usize) {
    // SAFETY: p is a pool buffer of at least `bytes` (guards catch the rest).
    unsafe { std::ptr::write_bytes(p as *mut u8, v, bytes) }
}

fn memset_d32(p: u64, v: u32, count: usize) {
    for i in 0..count {
        // SAFETY: as memset_d8.
        unsafe { (p as *mut u32).add(i).write(v) }
    }
}

fn memcpy(dst: u64, src: u64, bytes: usize) {
    if bytes > 0 {
        // SAFETY: pool buffers of at least `bytes`; distinct allocations.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) }
    }
}

fn read<T: Copy>(p: u64, n: usize) -> Vec<T> {
    if n == 0 {
        return Vec::new();
    }
    assert_ne!(p, 0, "reading {n} elements from a NULL output");
    // SAFETY: a pool buffer holding at least n T (the caller's shape).
    unsafe { std::slice::from_raw_parts(p as *const T, n).to_vec() }
}

fn read_bytes(p: u64, n: usize) -> Vec<u8> {
    read::<u8>(p, n)
}

// ---- one rank of the emulated manager ------------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct Setup {
    layout: Layout,
    id: IdDtype,
    kind: FloatKind,
    e: usize,
    h: usize,
    m: usize,
    extra: usize,
}

const K: usize = 2;

/// `ExchangeOptions::zero_size_p2p` of the emulated ranks (NCCL < 2.12.10 leaves empty
/// transfers out on both sides); tests run one at a time (`serial`).
static ZERO_SIZE_P2P: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);
const R: usize = 2;

fn backend(l: Layout) -> &'static str {
    match l {
        Layout::Replicated => "allgather_reducescatter",
        Layout::TokenMajor => "deepep_high_throughput",
        Layout::ExpertMajor => "deepep_low_latency",
        Layout::ExpertPacked => "deepep_v2",
        Layout::RankMajor => "flashinfer_nvlink_two_sided",
        Layout::MoonepSlots => unreachable!(),
    }
}

fn moe_cfg(s: &Setup) -> MoeConfig {
    MoeConfig {
        num_experts: s.e,
        top_k: K,
        hidden: s.h,
        hidden_dtype: s.kind.dtype(),
        expert_dtype: s.kind,
        out_dtype: s.kind,
        max_tokens_per_rank: s.m,
        extra_row_bytes: if s.extra > 0 { vec![s.extra] } else { vec![] },
        apply_router_weight_on_input: false,
    }
}

/// A rank's dispatch input (host copies; ids as i64, narrowed for int32).
#[derive(Clone, Debug)]
struct Input {
    hidden: Vec<u8>,
    ids: Vec<i64>,
    w: Vec<f32>,
    extra: Vec<u8>,
    t: usize,
}

/// The dispatch outputs read back, in the CPU view's terms.
#[derive(Clone, Debug, PartialEq)]
struct Out {
    shape: Vec<usize>,
    received_rows: usize,
    hidden: Vec<u8>,
    ids: Vec<i64>,
    w: Vec<f32>,
    counts: Vec<i32>,
    offsets: Vec<i64>,
    src_rank: Vec<i32>,
    src_token: Vec<i32>,
    extra: Vec<u8>,
}

struct Rank {
    s: Setup,
    d: usize,
    calls: Calls,
    pool: Pool,
    opts: ExchangeOptions,
    inp: Input,
    // dispatch state
    g: Option<Gathered>,
    shape: Option<DispatchShape>,
    widths: Vec<usize>,
    sends: Vec<u64>,
    recvs: Vec<u64>,
    items: Vec<(ExchangePlan, u64, u64)>,
    n_recv: usize,
    scratch: u64,
    out: HashMap<&'static str, u64>,
    // combine state
    comb: Option<(ExchangePlan, u64, u64)>,
}

impl Rank {
    fn new(s: Setup, d: usize, inp: Input) -> Rank {
        Rank {
            s,
            d,
            // A small grid cap so every grid-stride loop strides.
            calls: Calls {
                top_k: K as u32,
                max_blocks: 2,
            },
            pool: Pool::default(),
            opts: ExchangeOptions {
                zero_size_p2p: ZERO_SIZE_P2P.load(std::sync::atomic::Ordering::Relaxed),
                self_via_nccl: false,
            },
            inp,
            g: None,
            shape: None,
            widths: Vec::new(),
            sends: Vec::new(),
            recvs: Vec::new(),
            items: Vec::new(),
            n_recv: 0,
            scratch: 0,
            out: HashMap::new(),
            comb: None,
        }
    }

    fn lib(&self, k: KernelId) -> String {
        let id = match self.s.id {
            IdDtype::I32 => "i32",
            IdDtype::I64 => "i64",
        };
        let c = match self.s.kind {
            FloatKind::F32 => 0,
            _ => 1,
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
            _ => format!("combine_{c}_{c}"),
        }
    }

    /// `Kernels::run`: every call checked against its table, then executed.
    fn run(&self, calls: Vec<Call>) {
        let emu = emu().expect("emulation built");
        for c in calls {
            let sig = c.kernel.sig();
            check_args(sig, &c.args).unwrap_or_else(|e| panic!("{e}"));
            assert!(c.grid >= 1 && c.block >= 32 && c.block % 32 == 0);
            if c.kernel == KernelId::ScanBlock {
                assert_eq!(c.block, SCAN_THREADS);
            }
            let slots: Vec<u64> = c.args.iter().map(|a| a.slot()).collect();
            let f = emu.fns[&self.lib(c.kernel)];
            let name = CString::new(sig.name).unwrap();
            // SAFETY: the arguments match the entry point (checked); pointers are pool
            // buffers of this rank (sizes as the manager computes them; guards checked).
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
            self.pool.check_guards(sig.name);
        }
    }

    fn geometry(&self) -> ShapeGeometry {
        ShapeGeometry {
            world: R,
            rank: self.d,
            num_experts: self.s.e,
            top_k: K,
            hidden: self.s.h,
            max_tokens_per_rank: self.s.m,
        }
    }

    fn rb(&self) -> usize {
        self.s.h * self.s.kind.size()
    }

    /// Uploads the caller's tensors (what the host passes as device pointers). Empty
    /// tensors are NULL, as src/ffi/gpu.rs passes them (`addr`).
    fn inputs(&mut self) -> (u64, u64, u64, u64) {
        let t = self.inp.t;
        if t == 0 {
            return (0, 0, 0, 0);
        }
        let rb = self.rb();
        let hid = self.pool.get("in_hidden", t * rb);
        memcpy(hid, self.inp.hidden.as_ptr() as u64, t * rb);
        let ids = match self.s.id {
            IdDtype::I32 => {
                let v: Vec<i32> = self.inp.ids.iter().map(|&x| x as i32).collect();
                let p = self.pool.get("in_ids", 4 * v.len());
                memcpy(p, v.as_ptr() as u64, 4 * v.len());
                p
            }
            IdDtype::I64 => {
                let p = self.pool.get("in_ids", 8 * self.inp.ids.len());
                memcpy(p, self.inp.ids.as_ptr() as u64, 8 * self.inp.ids.len());
                p
            }
        };
        let w = self.pool.get("in_w", 4 * t * K);
        memcpy(w, self.inp.w.as_ptr() as u64, 4 * t * K);
        let x = self.pool.get("in_extra", t * self.s.extra);
        memcpy(x, self.inp.extra.as_ptr() as u64, t * self.s.extra);
        (hid, ids, w, x)
    }

    /// dispatch_counts steps 1–2 up to the all-gather: returns this rank's counts row.
    fn dispatch_row(&mut self) -> Vec<i32> {
        let (r, k, e) = (R, K, self.s.e);
        let el = e / r;
        let t = self.inp.t;
        let (_, in_ids, _, _) = self.inputs();
        let layout = self.s.layout;
        let row_len = counts_row_len(r, e);
        let p = &mut self.pool;
        let row = p.get("counts_row", 4 * row_len);
        let _all = p.get("counts_all", 4 * row_len * r);
        let err = p.get("err", 8);
        let rank_flag = p.get("rank_flag", 4 * r * t);
        let expert_layout = matches!(layout, Layout::ExpertMajor | Layout::ExpertPacked);
        let pair_flag = if expert_layout {
            p.get("pair_flag", 4 * r * t * k)
        } else {
            0
        };
        memset_d8(row, 0, 4 * row_len);
        memset_d8(err, 0, 8);
        let tt = t as i32;
        memcpy(row, &tt as *const i32 as u64, 4);
        let c = self.calls.layout(
            in_ids,
            t as i32,
            e as i32,
            el as i32,
            r as i32,
            rank_flag,
            pair_flag,
            row + 4 * ROW_RANK_COUNTS as u64,
            row + 4 * row_expert_counts(r) as u64,
            err,
        );
        self.run(c);
        memcpy(row + 4 * ROW_ERROR as u64, err, 8);
        read::<i32>(row, row_len)
    }

    /// The rest of dispatch_counts up to the exchange: parse, check, pack, the plans.
    fn dispatch_pack(&mut self, gathered: &[i32]) -> epcomm::Result<()> {
        let (r, d, k, e) = (R, self.d, K, self.s.e);
        let el = e / r;
        let t = self.inp.t;
        let rb = self.rb();
        let (in_hidden, in_ids, in_w, in_extra) = self.inputs();
        let all = self.pool.get("counts_all", 4 * gathered.len());
        memcpy(all, gathered.as_ptr() as u64, 4 * gathered.len());
        let raw = read::<i32>(all, gathered.len());
        let g = Gathered::parse(&raw, r, e)?;
        g.check(d)?;
        let layout = self.s.layout;
        let shape = dispatch_shape(layout, &self.geometry(), &g)?;
        let replicated = layout == Layout::Replicated;
        let matrix = if replicated {
            g.replicated_counts()
        } else {
            g.rank_counts.clone()
        };
        let rank_flag = self.pool.get("rank_flag", 4 * r * t);
        let (pack_r, flags) = if replicated {
            let ones = self.pool.get("ones_t", 4 * t);
            memset_d32(ones, 1, t);
            (1usize, ones)
        } else {
            (r, rank_flag)
        };
        let n_send: usize = if replicated {
            t
        } else {
            (0..r).map(|x| matrix[d * r + x] as usize).sum()
        };
        let n_recv: usize = (0..r).map(|x| matrix[x * r + d] as usize).sum();
        let scan_n = (pack_r * t).max(r * t * k).max(el * n_recv).max(n_recv * k);
        let scratch = self
            .pool
            .get("scan_scratch", 4 * scan_scratch_elems(scan_n));
        let send_pos = self.pool.get("send_pos", 4 * (pack_r * t + 1));
        let c = self.calls.scan(flags, send_pos, pack_r * t, scratch);
        self.run(c);
        let extra_row_bytes: Vec<usize> = moe_cfg(&self.s).extra_row_bytes;
        let widths: Vec<usize> = [rb, 4 * k, 4 * k, 4]
            .into_iter()
            .chain(extra_row_bytes.iter().copied())
            .collect();
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for (i, w) in widths.iter().enumerate() {
            sends.push(self.pool.get(&format!("send{i}"), n_send * w));
            recvs.push(self.pool.get(&format!("recv{i}"), n_recv * w));
        }
        let c = self.calls.pack(
            in_hidden,
            rb as u64,
            in_ids,
            in_w,
            t as i32,
            pack_r as i32,
            flags,
            send_pos,
            sends[0],
            sends[1],
            sends[2],
            sends[3],
        );
        self.run(c);
        for (i, &x) in [in_extra].iter().take(extra_row_bytes.len()).enumerate() {
            let c = self.calls.pack(
                x,
                extra_row_bytes[i] as u64,
                0,
                0,
                t as i32,
                pack_r as i32,
                flags,
                send_pos,
                sends[4 + i],
                0,
                0,
                0,
            );
            self.run(c);
        }
        let mut items = Vec::new();
        for (i, &w) in widths.iter().enumerate() {
            let plan = if replicated {
                broadcast_plan(&g.tokens, d, w, self.opts.zero_size_p2p)
            } else {
                counts_plan(&matrix, r, d, w, self.opts)?
            };
            assert!(plan.send_bytes <= n_send * w, "send plan past the buffer");
            assert!(plan.recv_bytes <= n_recv * w, "recv plan past the buffer");
            items.push((plan, sends[i], recvs[i]));
        }
        self.g = Some(g);
        self.shape = Some(shape);
        self.widths = widths;
        self.sends = sends;
        self.recvs = recvs;
        self.items = items;
        self.n_recv = n_recv;
        self.scratch = scratch;
        Ok(())
    }

    /// dispatch_counts after the exchange: the layout's unpack (and combine's source side).
    fn dispatch_unpack(&mut self) {
        let (r, d, k, e) = (R, self.d, K, self.s.e);
        let el = e / r;
        let t = self.inp.t;
        let rb = self.rb();
        let layout = self.s.layout;
        let replicated = layout == Layout::Replicated;
        let g = self.g.clone().unwrap();
        let shape = self.shape.clone().unwrap();
        let matrix = if replicated {
            g.replicated_counts()
        } else {
            g.rank_counts.clone()
        };
        let (_, in_ids, in_w, _) = self.inputs();
        let err = self.pool.get("err", 8);
        let scratch = self.scratch;
        let n_recv = self.n_recv;
        let widths = self.widths.clone();
        let recvs = self.recvs.clone();
        let extra_row_bytes = moe_cfg(&self.s).extra_row_bytes;
        let offsets = recv_offsets(&matrix, r, d);
        let d_off = self.pool.get("recv_offsets", 4 * (r + 1));
        memcpy(d_off, offsets.as_ptr() as u64, 4 * (r + 1));
        let (rows, ids, w, src) = (recvs[0], recvs[1], recvs[2], recvs[3]);
        let n = n_recv as i32;
        let m = self.s.m;
        let mut o: HashMap<&'static str, u64> = HashMap::new();
        o.insert("hidden", rows);
        if recvs.len() > 4 {
            o.insert("extra", recvs[4]);
        }
        match layout {
            Layout::Replicated | Layout::TokenMajor => {
                let out_ids = self.pool.get("out_ids", 8 * n_recv * k);
                let out_w = self.pool.get("out_w", 4 * n_recv * k);
                let (el_u, rank_u) = if replicated {
                    (e, 0)
                } else {
                    let counts = self.pool.get("out_counts", 4 * el);
                    memset_d8(counts, 0, 4 * el);
                    let c = self
                        .calls
                        .recv_flags(ids, n, el as i32, d as i32, 0, 0, counts);
                    self.run(c);
                    o.insert("counts", counts);
                    (el, d)
                };
                let c = self.calls.unpack_token_major(
                    rows,
                    ids,
                    w,
                    n,
                    rb as u64,
                    el_u as i32,
                    rank_u as i32,
                    0,
                    out_ids,
                    out_w,
                );
                self.run(c);
                o.insert("ids", out_ids);
                o.insert("w", if replicated { w } else { out_w });
            }
            Layout::ExpertMajor | Layout::ExpertPacked => {
                let eflag = self.pool.get("expert_flag", 4 * el * n_recv);
                let epos = self.pool.get("expert_pos", 4 * (el * n_recv + 1));
                let rpflag = self.pool.get("recv_pair_flag", 4 * n_recv * k);
                let rppos = self.pool.get("recv_pair_pos", 4 * (n_recv * k + 1));
                let c = self
                    .calls
                    .recv_flags(ids, n, el as i32, d as i32, eflag, rpflag, 0);
                self.run(c);
                let c = self.calls.scan(eflag, epos, el * n_recv, scratch);
                self.run(c);
                let c = self.calls.scan(rpflag, rppos, n_recv * k, scratch);
                self.run(c);
                let recv5 = [rows, ids, w, src, d_off];
                let hid_and_extras: Vec<(usize, u64)> = [(rb, rows)]
                    .into_iter()
                    .chain(
                        extra_row_bytes
                            .iter()
                            .copied()
                            .zip(recvs[4..].iter().copied()),
                    )
                    .collect();
                if layout == Layout::ExpertMajor {
                    let cap = m * r;
                    let counts = self.pool.get("out_counts", 4 * el);
                    let outs: Vec<u64> = widths
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| *i == 0 || *i >= 4)
                        .map(|(i, w)| self.pool.get(&format!("out_rows{i}"), el * cap * w))
                        .collect();
                    for (&out_rows, &(wb, src_rows)) in outs.iter().zip(&hid_and_extras) {
                        let mut r5 = recv5;
                        r5[0] = src_rows;
                        let c = self.calls.unpack_expert_major(
                            r5, n, r as i32, wb as u64, el as i32, d as i32, eflag, epos,
                            cap as i32, out_rows, counts, 0, 0, 0, err,
                        );
                        self.run(c);
                    }
                    o.insert("hidden", outs[0]);
                    if outs.len() > 1 {
                        o.insert("extra", outs[1]);
                    }
                    o.insert("counts", counts);
                } else {
                    let nr = shape.received_rows;
                    let offs = self.pool.get("out_offsets", 4 * (el + 1));
                    let out_w = self.pool.get("out_w", 4 * nr);
                    let sr = self.pool.get("out_src_rank", 4 * nr);
                    let st = self.pool.get("out_src_token", 4 * nr);
                    let outs: Vec<u64> = widths
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| *i == 0 || *i >= 4)
                        .map(|(i, w)| self.pool.get(&format!("out_rows{i}"), nr * w))
                        .collect();
                    for (&out_rows, &(wb, src_rows)) in outs.iter().zip(&hid_and_extras) {
                        let mut r5 = recv5;
                        r5[0] = src_rows;
                        let c = self.calls.unpack_expert_packed(
                            r5, n, r as i32, wb as u64, el as i32, d as i32, eflag, epos, out_rows,
                            offs, out_w, sr, st,
                        );
                        self.run(c);
                    }
                    o.insert("hidden", outs[0]);
                    if outs.len() > 1 {
                        o.insert("extra", outs[1]);
                    }
                    o.insert("offsets", offs);
                    o.insert("w", out_w);
                    o.insert("src_rank", sr);
                    o.insert("src_token", st);
                }
                // Source side of combine.
                let pair_flag = self.pool.get("pair_flag", 4 * r * t * k);
                let ppos = self.pool.get("pair_pos", 4 * (r * t * k + 1));
                let crow = self.pool.get("combine_rows", 4 * t * k);
                let wcopy = self.pool.get("weights_copy", 4 * t * k);
                let c = self.calls.scan(pair_flag, ppos, r * t * k, scratch);
                self.run(c);
                let c = self
                    .calls
                    .pair_rows(false, in_ids, t as i32, e as i32, el as i32, ppos, crow);
                self.run(c);
                memcpy(wcopy, in_w, 4 * t * k);
            }
            Layout::RankMajor => {
                let out_ids = self.pool.get("out_ids", 8 * r * m * k);
                let out_w = self.pool.get("out_w", 4 * r * m * k);
                let counts = self.pool.get("out_counts", 4 * r);
                let outs: Vec<u64> = widths
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i == 0 || *i >= 4)
                    .map(|(i, w)| self.pool.get(&format!("out_rows{i}"), r * m * w))
                    .collect();
                let srcs: Vec<(usize, u64)> = [(rb, rows)]
                    .into_iter()
                    .chain(
                        extra_row_bytes
                            .iter()
                            .copied()
                            .zip(recvs[4..].iter().copied()),
                    )
                    .collect();
                for (&out_rows, &(wb, src_rows)) in outs.iter().zip(&srcs) {
                    let c = self.calls.unpack_rank_major(
                        src_rows, ids, w, d_off, r as i32, m as i32, wb as u64, out_rows, out_ids,
                        out_w, counts, err,
                    );
                    self.run(c);
                }
                o.insert("hidden", outs[0]);
                if outs.len() > 1 {
                    o.insert("extra", outs[1]);
                }
                o.insert("ids", out_ids);
                o.insert("w", out_w);
                o.insert("counts", counts);
            }
            Layout::MoonepSlots => unreachable!(),
        }
        assert_eq!(
            read::<u64>(err, 1)[0],
            0,
            "device error word after dispatch"
        );
        self.out = o;
    }

    /// The dispatch outputs read back as the CPU view shapes them.
    fn read_out(&self) -> Out {
        let shape = self.shape.as_ref().unwrap();
        let s = &self.s;
        let el = s.e / R;
        let rows = shape.buffer_rows;
        let get = |n: &str| self.out.get(n).copied().unwrap_or(0);
        let nr = shape.received_rows;
        let id_rows = shape.topk_ids.first().copied().unwrap_or(0);
        Out {
            shape: shape.hidden.clone(),
            received_rows: nr,
            hidden: read_bytes(get("hidden"), rows * self.rb()),
            ids: if id_rows > 0 {
                read::<i64>(get("ids"), id_rows * K)
            } else {
                vec![]
            },
            w: if shape.topk_weights.is_empty() {
                vec![]
            } else {
                read::<f32>(get("w"), shape.topk_weights.iter().product())
            },
            counts: if shape.counts > 0 {
                read::<i32>(get("counts"), shape.counts)
            } else {
                vec![]
            },
            offsets: if shape.expert_offsets > 0 {
                read::<i32>(get("offsets"), el + 1)
                    .into_iter()
                    .map(i64::from)
                    .collect()
            } else {
                vec![]
            },
            src_rank: if shape.src > 0 {
                read::<i32>(get("src_rank"), nr)
            } else {
                vec![]
            },
            src_token: if shape.src > 0 {
                read::<i32>(get("src_token"), nr)
            } else {
                vec![]
            },
            extra: if s.extra > 0 {
                read_bytes(get("extra"), rows * s.extra)
            } else {
                vec![]
            },
        }
    }

    /// combine up to the exchange: the layout's return kernel and the plan.
    fn combine_send(&mut self, y: &[u8]) {
        let (r, d, k, e) = (R, self.d, K, self.s.e);
        let el = e / r;
        let erb = self.s.h * self.s.kind.size();
        let n = self.n_recv;
        let layout = self.s.layout;
        let shape = self.shape.clone().unwrap();
        assert_eq!(y.len(), shape.buffer_rows * erb, "expert output size");
        // An empty tensor is NULL (src/ffi/gpu.rs `addr`).
        let expert_output = if y.is_empty() {
            0
        } else {
            self.pool.get("expert_output", y.len())
        };
        memcpy(expert_output, y.as_ptr() as u64, y.len());
        let g = self.g.clone().unwrap();
        let cm = combine_counts(layout, &g);
        let n_back: usize = (0..r).map(|x| cm[d * r + x] as usize).sum();
        let n_home: usize = (0..r).map(|x| cm[x * r + d] as usize).sum();
        let recv = self.pool.get("comb_recv", n_home * erb);
        let send = match layout {
            Layout::Replicated | Layout::TokenMajor => expert_output,
            Layout::RankMajor => {
                let send = self.pool.get("comb_send", n_back * erb);
                let d_off = self.pool.get("recv_offsets", 4 * (r + 1));
                let c = self.calls.combine_return_rank_major(
                    expert_output,
                    erb as u64,
                    d_off,
                    r as i32,
                    self.s.m as i32,
                    send,
                );
                self.run(c);
                send
            }
            Layout::ExpertMajor | Layout::ExpertPacked => {
                let send = self.pool.get("comb_send", n_back * erb);
                let ids = self.pool.get("recv1", 0);
                let epos = self.pool.get("expert_pos", 0);
                let rppos = self.pool.get("recv_pair_pos", 0);
                let cap = if layout == Layout::ExpertMajor {
                    self.s.m * r
                } else {
                    0
                };
                let c = self.calls.combine_return_expert(
                    expert_output,
                    erb as u64,
                    ids,
                    n as i32,
                    el as i32,
                    d as i32,
                    epos,
                    cap as i32,
                    rppos,
                    send,
                );
                self.run(c);
                send
            }
            Layout::MoonepSlots => unreachable!(),
        };
        let plan = counts_plan(&cm, r, d, erb, self.opts).unwrap();
        assert!(plan.send_bytes <= n_back * erb.max(1) || plan.send_bytes == 0);
        let _ = k;
        self.comb = Some((plan, send, recv));
    }

    /// combine after the exchange: the reduction into `[T, H]`.
    fn combine_reduce(&mut self) -> Vec<u8> {
        let (r, t, h) = (R, self.inp.t, self.s.h);
        let ob = h * self.s.kind.size();
        let out = if t == 0 {
            0
        } else {
            self.pool.get("comb_out", t * ob)
        };
        let recv = self.comb.as_ref().unwrap().2;
        let c = match self.s.layout {
            Layout::Replicated => self
                .calls
                .sum_ranks(recv, 0, 0, t as i32, r as i32, h as i32, out),
            Layout::TokenMajor | Layout::RankMajor => {
                let flag = self.pool.get("rank_flag", 0);
                let pos = self.pool.get("send_pos", 0);
                self.calls
                    .sum_ranks(recv, flag, pos, t as i32, r as i32, h as i32, out)
            }
            _ => {
                let crow = self.pool.get("combine_rows", 0);
                let w = self.pool.get("weights_copy", 0);
                self.calls
                    .weighted_combine(recv, crow, w, t as i32, h as i32, out)
            }
        };
        self.run(c);
        read_bytes(out, t * ob)
    }
}

// ---- capacity mode (manager.rs `dispatch_capacity` and combine's capacity branch) -------

impl Rank {
    /// dispatch_capacity up to the exchange (no host sync, static sizes).
    fn cap_dispatch_pack(&mut self) {
        let (r, d, k, e) = (R, self.d, K, self.s.e);
        let el = e / r;
        let (t, m) = (self.inp.t, self.s.m);
        assert!(t <= m);
        let rb = self.rb();
        let n = r * m;
        let (in_hidden, in_ids, in_w, in_extra) = self.inputs();
        let p = &mut self.pool;
        let err = p.get("err", 8);
        let ones = p.get("cap_ones", 4 * n * k);
        let iota = p.get("cap_iota", 4 * (n * k + 1));
        let mvals = p.get("cap_mvals", 4 * r);
        let d_off = p.get("cap_offsets", 4 * (r + 1));
        let dummy = p.get("cap_rank_flag", 4 * r * t);
        let scratch = p.get(
            "scan_scratch_cap",
            4 * scan_scratch_elems(n * k * el.max(1)),
        );
        memset_d8(err, 0, 8);
        memset_d32(ones, 1, n * k);
        memset_d32(mvals, m as u32, r);
        self.run(self.calls.scan(ones, iota, n * k, scratch));
        self.run(self.calls.scan(mvals, d_off, r, scratch));
        self.run(self.calls.layout(
            in_ids, t as i32, e as i32, el as i32, r as i32, dummy, 0, 0, 0, err,
        ));
        let extra_row_bytes = moe_cfg(&self.s).extra_row_bytes;
        let widths: Vec<usize> = [rb, 4 * k, 4 * k, 4]
            .into_iter()
            .chain(extra_row_bytes.iter().copied())
            .collect();
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        for (i, w) in widths.iter().enumerate() {
            sends.push(self.pool.get(&format!("cap_send{i}"), m * w));
            recvs.push(self.pool.get(&format!("cap_recv{i}"), n * w));
        }
        memset_d8(sends[1], 0xff, 4 * m * k);
        memset_d8(sends[2], 0, 4 * m * k);
        self.run(self.calls.pack(
            in_hidden, rb as u64, in_ids, in_w, t as i32, 1, ones, iota, sends[0], sends[1],
            sends[2], sends[3],
        ));
        for (i, &wb) in extra_row_bytes.iter().enumerate() {
            self.run(self.calls.pack(
                in_extra,
                wb as u64,
                0,
                0,
                t as i32,
                1,
                ones,
                iota,
                sends[4 + i],
                0,
                0,
                0,
            ));
        }
        let rows_per = vec![m; r];
        self.items = widths
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                (
                    broadcast_plan(&rows_per, d, w, self.opts.zero_size_p2p),
                    sends[i],
                    recvs[i],
                )
            })
            .collect();
        self.widths = widths;
        self.sends = sends;
        self.recvs = recvs;
        self.n_recv = n;
        self.scratch = scratch;
    }

    /// dispatch_capacity after the exchange: buckets, counts, the source side of combine.
    fn cap_dispatch_unpack(&mut self) -> Out {
        let (r, d, k, e) = (R, self.d, K, self.s.e);
        let el = e / r;
        let m = self.s.m;
        let n = r * m;
        let rb = self.rb();
        let (sends, recvs) = (self.sends.clone(), self.recvs.clone());
        let extra_row_bytes = moe_cfg(&self.s).extra_row_bytes;
        let err = self.pool.get("err", 8);
        let d_off = self.pool.get("cap_offsets", 0);
        let iota = self.pool.get("cap_iota", 0);
        let eflag = self.pool.get("cap_expert_flag", 4 * el * n);
        let epos = self.pool.get("cap_expert_pos", 4 * (el * n + 1));
        let counts = self.pool.get("cap_counts", 4 * el);
        self.run(
            self.calls
                .recv_flags(recvs[1], n as i32, el as i32, d as i32, eflag, 0, 0),
        );
        self.run(self.calls.scan(eflag, epos, el * n, self.scratch));
        let cap = m * r;
        let mut outs = Vec::new();
        for (j, src_rows) in [recvs[0]].iter().chain(&recvs[4..]).enumerate() {
            let wb = if j == 0 { rb } else { extra_row_bytes[j - 1] };
            let out_rows = self.pool.get(&format!("cap_out{j}"), el * cap * wb);
            self.run(self.calls.unpack_expert_major(
                [*src_rows, recvs[1], recvs[2], recvs[3], d_off],
                n as i32,
                r as i32,
                wb as u64,
                el as i32,
                d as i32,
                eflag,
                epos,
                cap as i32,
                out_rows,
                counts,
                0,
                0,
                0,
                err,
            ));
            outs.push(out_rows);
        }
        let crow = self.pool.get("cap_combine_rows", 4 * m * k);
        let wcopy = self.pool.get("cap_weights", 4 * m * k);
        self.run(
            self.calls
                .pair_rows(true, sends[1], m as i32, e as i32, el as i32, iota, crow),
        );
        memcpy(wcopy, sends[2], 4 * m * k);
        assert_eq!(
            read::<u64>(err, 1)[0],
            0,
            "device error word after dispatch"
        );
        Out {
            shape: vec![el, cap, self.s.h],
            received_rows: read::<i32>(counts, el).iter().map(|&c| c as usize).sum(),
            hidden: read_bytes(outs[0], el * cap * rb),
            ids: vec![],
            w: vec![],
            counts: read::<i32>(counts, el),
            offsets: vec![],
            src_rank: vec![],
            src_token: vec![],
            extra: if self.s.extra > 0 {
                read_bytes(outs[1], el * cap * self.s.extra)
            } else {
                vec![]
            },
        }
    }

    /// combine's capacity branch up to the exchange.
    fn cap_combine_send(&mut self, y: &[u8]) {
        let (r, d, k, e) = (R, self.d, K, self.s.e);
        let el = e / r;
        let m = self.s.m;
        let erb = self.s.h * self.s.kind.size();
        let n = self.n_recv;
        assert_eq!(y.len(), el * m * r * erb, "expert output size");
        let expert_output = self.pool.get("expert_output", y.len());
        memcpy(expert_output, y.as_ptr() as u64, y.len());
        let send = self.pool.get("cap_comb_send", r * m * k * erb);
        let recv = self.pool.get("cap_comb_recv", r * m * k * erb);
        let ids = self.pool.get("cap_recv1", 0);
        let epos = self.pool.get("cap_expert_pos", 0);
        let iota = self.pool.get("cap_iota", 0);
        self.run(self.calls.combine_return_expert(
            expert_output,
            erb as u64,
            ids,
            n as i32,
            el as i32,
            d as i32,
            epos,
            (m * r) as i32,
            iota,
            send,
        ));
        let cm = vec![(m * k) as i32; r * r];
        let plan = counts_plan(&cm, r, d, erb, self.opts).unwrap();
        self.comb = Some((plan, send, recv));
    }

    /// combine's capacity branch after the exchange.
    fn cap_combine_reduce(&mut self) -> Vec<u8> {
        let (t, h) = (self.inp.t, self.s.h);
        let ob = h * self.s.kind.size();
        let out = if t == 0 {
            0
        } else {
            self.pool.get("comb_out", t * ob)
        };
        let recv = self.comb.as_ref().unwrap().2;
        let crow = self.pool.get("cap_combine_rows", 0);
        let w = self.pool.get("cap_weights", 0);
        self.run(
            self.calls
                .weighted_combine(recv, crow, w, t as i32, h as i32, out),
        );
        read_bytes(out, t * ob)
    }
}

/// Capacity mode on both ranks against the CPU manager (EXPERT_MAJOR), twice in a row on the
/// same buffers (what a CUDA-graph replay does: same addresses, new data).
fn check_capacity_case(s: Setup, rounds: &[Vec<Input>]) {
    let mut ranks: Vec<Rank> = (0..R)
        .map(|d| Rank::new(s, d, rounds[0][d].clone()))
        .collect();
    for inputs in rounds {
        let cpu = cpu_run(s, inputs.clone());
        for (r, i) in ranks.iter_mut().zip(inputs) {
            r.inp = i.clone();
            r.cap_dispatch_pack();
        }
        let items: Vec<_> = ranks.iter().map(|r| r.items.clone()).collect();
        exchange(&items);
        let mut ys = Vec::new();
        for (d, r) in ranks.iter_mut().enumerate() {
            let go = r.cap_dispatch_unpack();
            let (co, cy, _) = cpu[d].as_ref().unwrap_or_else(|e| panic!("CPU {s:?}: {e}"));
            compare_dispatch(&s, d, &go, co);
            ys.push(cy.clone());
        }
        for (r, y) in ranks.iter_mut().zip(&ys) {
            r.cap_combine_send(y);
        }
        let items: Vec<_> = ranks
            .iter()
            .map(|r| vec![r.comb.clone().unwrap()])
            .collect();
        exchange(&items);
        for (d, r) in ranks.iter_mut().enumerate() {
            let out = r.cap_combine_reduce();
            compare_combine(&s, d, &out, &cpu[d].as_ref().unwrap().2);
        }
    }
}

/// What NCCL does with the ranks' plans: every recv matched by the peer's send of the same
/// size, plus each rank's self copy (`local_copies`).
fn exchange(items: &[Vec<(ExchangePlan, u64, u64)>]) {
    let n_items = items[0].len();
    for it in items {
        assert_eq!(
            it.len(),
            n_items,
            "ranks issue different numbers of exchanges"
        );
    }
    for i in 0..n_items {
        for (d, it) in items.iter().enumerate() {
            let (plan, send, recv) = &it[i];
            for rv in &plan.recvs {
                let (pp, psend, _) = &items[rv.peer][i];
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
                    items[sd.peer][i].0.recvs.iter().any(|r| r.peer == d),
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
}

/// The emulated manager pair: dispatch then (optionally) combine with `ys`.
struct Pair {
    ranks: Vec<Rank>,
}

impl Pair {
    fn new(s: Setup, inputs: &[Input]) -> Pair {
        Pair {
            ranks: inputs
                .iter()
                .enumerate()
                .map(|(d, i)| Rank::new(s, d, i.clone()))
                .collect(),
        }
    }

    fn dispatch(&mut self) -> Vec<epcomm::Result<Out>> {
        let rows: Vec<Vec<i32>> = self.ranks.iter_mut().map(|r| r.dispatch_row()).collect();
        let gathered: Vec<i32> = rows.concat();
        let res: Vec<epcomm::Result<()>> = self
            .ranks
            .iter_mut()
            .map(|r| r.dispatch_pack(&gathered))
            .collect();
        if res.iter().any(|r| r.is_err()) {
            // A collective error: every rank must fail the same call (no rank waits in an
            // exchange the others never join).
            assert!(
                res.iter().all(|r| r.is_err()),
                "only some ranks failed: {res:?}"
            );
            return res.into_iter().map(|r| Err(r.unwrap_err())).collect();
        }
        let items: Vec<_> = self.ranks.iter().map(|r| r.items.clone()).collect();
        exchange(&items);
        for r in &mut self.ranks {
            r.pool.check_guards("the dispatch exchange");
            r.dispatch_unpack();
        }
        self.ranks.iter().map(|r| Ok(r.read_out())).collect()
    }

    fn combine(&mut self, ys: &[Vec<u8>]) -> Vec<Vec<u8>> {
        for (r, y) in self.ranks.iter_mut().zip(ys) {
            r.combine_send(y);
        }
        let items: Vec<_> = self
            .ranks
            .iter()
            .map(|r| vec![r.comb.clone().unwrap()])
            .collect();
        exchange(&items);
        self.ranks.iter_mut().map(|r| r.combine_reduce()).collect()
    }
}

// ---- the CPU reference ---------------------------------------------------------------------

/// The expert computation: expert e computes y = (e+1)·x. Per the layout contract the
/// token layouts return rows already reduced over this rank's experts (weighted), the expert
/// layouts raw expert outputs. Padding rows get 7777 (must never reach an output).
fn expert_output(s: &Setup, d: usize, o: &Out) -> Vec<u8> {
    let el = s.e / R;
    let h = s.h;
    let x = num::to_f32(&o.hidden, s.kind);
    let rows = x.len() / h.max(1);
    let mut y = vec![7777f32; x.len()];
    let owned = |e: i64| e >= 0 && (e as usize) / el == d;
    match s.layout {
        Layout::Replicated | Layout::TokenMajor => {
            for i in 0..rows {
                let mut acc = vec![0f32; h];
                for k in 0..K {
                    let e = o.ids[i * K + k];
                    if owned(e) {
                        for c in 0..h {
                            acc[c] += o.w[i * K + k] * ((e + 1) as f32 * x[i * h + c]);
                        }
                    }
                }
                y[i * h..(i + 1) * h].copy_from_slice(&acc);
            }
        }
        Layout::RankMajor => {
            for src in 0..R {
                for slot in 0..o.counts[src] as usize {
                    let i = src * s.m + slot;
                    let mut acc = vec![0f32; h];
                    for k in 0..K {
                        let e = o.ids[i * K + k];
                        if owned(e) {
                            for c in 0..h {
                                acc[c] += o.w[i * K + k] * ((e + 1) as f32 * x[i * h + c]);
                            }
                        }
                    }
                    y[i * h..(i + 1) * h].copy_from_slice(&acc);
                }
            }
        }
        Layout::ExpertMajor => {
            let cap = s.m * R;
            for j in 0..el {
                let e = (d * el + j) as f32;
                for slot in 0..o.counts[j] as usize {
                    let i = j * cap + slot;
                    for c in 0..h {
                        y[i * h + c] = (e + 1.0) * x[i * h + c];
                    }
                }
            }
        }
        Layout::ExpertPacked => {
            for j in 0..el {
                let e = (d * el + j) as f32;
                for i in o.offsets[j] as usize..o.offsets[j + 1] as usize {
                    for c in 0..h {
                        y[i * h + c] = (e + 1.0) * x[i * h + c];
                    }
                }
            }
        }
        Layout::MoonepSlots => unreachable!(),
    }
    num::from_f32(&y, s.kind)
}

fn group_opts() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(30),
        ..GroupOptions::default()
    }
}

/// The CPU manager on two threads: dispatch outputs and combine outputs (or the errors).
/// Per rank: the dispatch view, the expert output given to combine, combine's output.
type CpuResult = Result<(Out, Vec<u8>, Vec<u8>), String>;

fn cpu_run(s: Setup, inputs: Vec<Input>) -> Vec<CpuResult> {
    let name = ranks::unique("gce", "g");
    ranks::on_threads(R, move |d| {
        let mut g = ShmGroup::join(&name, d, R, group_opts()).unwrap();
        let mut m = Manager::new(backend(s.layout), moe_cfg(&s), d, R).unwrap();
        let inp = &inputs[d];
        let extras: Vec<&[u8]> = if s.extra > 0 {
            vec![&inp.extra]
        } else {
            vec![]
        };
        let v = match m.dispatch(&mut g, &inp.hidden, &inp.ids, &inp.w, &extras) {
            Ok(v) => v,
            Err(e) => return Err(e.to_string()),
        };
        let o = Out {
            shape: v.shape.to_vec(),
            received_rows: v.received_rows,
            hidden: v.hidden.to_vec(),
            ids: v.topk_ids.to_vec(),
            w: v.topk_weights.to_vec(),
            counts: v.counts.to_vec(),
            offsets: v.expert_offsets.to_vec(),
            src_rank: v.src_rank.to_vec(),
            src_token: v.src_token.to_vec(),
            extra: v.extras.first().cloned().unwrap_or_default(),
        };
        let y = expert_output(&s, d, &o);
        let mut out = vec![0u8; inp.t * s.h * s.kind.size()];
        m.combine(&mut g, &y, &mut out).map_err(|e| e.to_string())?;
        Ok((o, y, out))
    })
}

/// Field-by-field comparison; fixed-capacity rows past the counts are unspecified (compared
/// only where the contract defines them).
fn compare_dispatch(s: &Setup, d: usize, gpu: &Out, cpu: &Out) {
    let ctx = format!("{s:?} rank {d}");
    assert_eq!(gpu.shape, cpu.shape, "shape, {ctx}");
    assert_eq!(gpu.received_rows, cpu.received_rows, "received_rows, {ctx}");
    assert_eq!(gpu.counts, cpu.counts, "counts, {ctx}");
    assert_eq!(gpu.offsets, cpu.offsets, "expert_offsets, {ctx}");
    assert_eq!(gpu.src_rank, cpu.src_rank, "src_rank, {ctx}");
    assert_eq!(gpu.src_token, cpu.src_token, "src_token, {ctx}");
    assert_eq!(gpu.ids, cpu.ids, "topk_ids, {ctx}");
    assert_eq!(gpu.w, cpu.w, "topk_weights, {ctx}");
    let rb = s.h * s.kind.size();
    let valid_rows: Vec<usize> = match s.layout {
        Layout::ExpertMajor => (0..s.e / R)
            .flat_map(|j| (0..cpu.counts[j] as usize).map(move |i| j * s.m * R + i))
            .collect(),
        Layout::RankMajor => (0..R)
            .flat_map(|src| (0..cpu.counts[src] as usize).map(move |i| src * s.m + i))
            .collect(),
        _ => (0..cpu.hidden.len() / rb.max(1)).collect(),
    };
    assert_eq!(gpu.hidden.len(), cpu.hidden.len(), "hidden bytes, {ctx}");
    for &i in &valid_rows {
        assert_eq!(
            gpu.hidden[i * rb..(i + 1) * rb],
            cpu.hidden[i * rb..(i + 1) * rb],
            "hidden row {i}, {ctx}"
        );
        if s.extra > 0 {
            let xb = s.extra;
            assert_eq!(
                gpu.extra[i * xb..(i + 1) * xb],
                cpu.extra[i * xb..(i + 1) * xb],
                "extra row {i}, {ctx}"
            );
        }
    }
}

fn compare_combine(s: &Setup, d: usize, gpu: &[u8], cpu: &[u8]) {
    let ctx = format!("{s:?} rank {d}");
    let (g, c) = (num::to_f32(gpu, s.kind), num::to_f32(cpu, s.kind));
    assert_eq!(g.len(), c.len(), "combine length, {ctx}");
    for (i, (a, b)) in g.iter().zip(&c).enumerate() {
        let ok = match s.kind {
            // Dyadic inputs: every sum is exact, whatever the order.
            FloatKind::F32 => a.to_bits() == b.to_bits(),
            // One bf16 ulp.
            _ => (a - b).abs() <= b.abs() / 128.0 + 1e-6,
        };
        assert!(ok, "combine out[{i}] = {a}, CPU {b}, {ctx}");
        assert!(
            a.abs() < 7000.0,
            "padding leaked into combine out[{i}] = {a}, {ctx}"
        );
    }
}

/// Runs one case on both paths and compares everything; returns the GPU combine outputs.
fn check_case(s: Setup, inputs: &[Input]) -> Vec<Vec<u8>> {
    eprintln!(
        "case {s:?} T = {:?}",
        inputs.iter().map(|i| i.t).collect::<Vec<_>>()
    );
    let cpu = cpu_run(s, inputs.to_vec());
    let mut pair = Pair::new(s, inputs);
    let gpu = pair.dispatch();
    let mut ys = Vec::new();
    for d in 0..R {
        let (co, cy, _) = cpu[d].as_ref().unwrap_or_else(|e| panic!("CPU {s:?}: {e}"));
        let go = gpu[d].as_ref().unwrap_or_else(|e| panic!("GPU {s:?}: {e}"));
        compare_dispatch(&s, d, go, co);
        ys.push(cy.clone());
    }
    let outs = pair.combine(&ys);
    for d in 0..R {
        let (_, _, cout) = cpu[d].as_ref().unwrap();
        compare_combine(&s, d, &outs[d], cout);
    }
    outs
}

// ---- inputs --------------------------------------------------------------------------------

fn input(kind: FloatKind, h: usize, x: &[f32], ids: &[i64], w: &[f32], extra: usize) -> Input {
    let t = ids.len() / K;
    let hidden = num::from_f32(x, kind);
    assert_eq!(hidden.len(), t * h * kind.size());
    Input {
        hidden,
        ids: ids.to_vec(),
        w: w.to_vec(),
        extra: (0..t * extra).map(|i| (i * 7 + 3) as u8).collect(),
        t,
    }
}

fn worked_example(kind: FloatKind) -> Vec<Input> {
    vec![
        input(
            kind,
            1,
            &[10., 11., 12.],
            &[0, 2, 1, 0, 3, -1],
            &[0.5, 0.5, 0.25, 0.75, 1.0, 0.0],
            0,
        ),
        input(
            kind,
            1,
            &[20., 21.],
            &[2, 3, 1, -1],
            &[0.5, 0.5, 1.0, 0.0],
            0,
        ),
    ]
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Random routing with distinct ids, some masked; dyadic values (exact in bf16 too).
fn random_input(rng: &mut Rng, s: &Setup, t: usize) -> Input {
    let mut ids = Vec::new();
    let mut w = Vec::new();
    for _ in 0..t {
        let mut row: Vec<i64> = Vec::new();
        for _ in 0..K {
            if rng.below(5) == 0 {
                row.push(-1);
                continue;
            }
            loop {
                let e = rng.below(s.e as u64) as i64;
                if !row.contains(&e) {
                    row.push(e);
                    break;
                }
            }
        }
        ids.extend(row);
        // Masked entries keep a nonzero weight: no kernel may use it.
        w.extend((0..K).map(|_| (1 + rng.below(8)) as f32 / 8.0));
    }
    let x: Vec<f32> = (0..t * s.h)
        .map(|_| (rng.below(33) as f32 - 16.0) / 4.0)
        .collect();
    input(s.kind, s.h, &x, &ids, &w, s.extra)
}

const LAYOUTS: [Layout; 5] = [
    Layout::TokenMajor,
    Layout::ExpertMajor,
    Layout::ExpertPacked,
    Layout::RankMajor,
    Layout::Replicated,
];

fn setups(h_f32: usize, h_bf16: usize, e: usize, m: usize, extra: usize) -> Vec<Setup> {
    let mut v = Vec::new();
    for layout in LAYOUTS {
        for id in [IdDtype::I32, IdDtype::I64] {
            for (kind, h) in [(FloatKind::F32, h_f32), (FloatKind::Bf16, h_bf16)] {
                v.push(Setup {
                    layout,
                    id,
                    kind,
                    e,
                    h,
                    m,
                    extra,
                });
            }
        }
    }
    v
}

// ---- tests ---------------------------------------------------------------------------------

#[test]
fn counts_mode_reproduces_the_worked_example_in_every_layout() {
    let _serial = serial();
    if emu_or_skip("counts_mode_reproduces_the_worked_example_in_every_layout").is_none() {
        return;
    }
    let want = [vec![20f32, 13.75, 48.0], vec![70f32, 42.0]];
    for s in setups(1, 1, 4, 3, 0) {
        let outs = check_case(s, &worked_example(s.kind));
        for d in 0..R {
            assert_eq!(num::to_f32(&outs[d], s.kind), want[d], "{s:?} rank {d}");
        }
    }
}

#[test]
fn counts_mode_random_routings_match_the_cpu_manager() {
    let _serial = serial();
    if emu_or_skip("counts_mode_random_routings_match_the_cpu_manager").is_none() {
        return;
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // f32 rows of 8 elements (32 bytes: the 16-byte vector copies), bf16 rows of 3 (6
    // bytes: the byte copies); a 12-byte extra payload (the 4-byte copies).
    for s in setups(8, 3, 8, 40, 12) {
        for (t0, t1) in [(5usize, 3usize), (0, 7), (6, 0), (40, 33)] {
            let inputs = vec![
                random_input(&mut rng, &s, t0),
                random_input(&mut rng, &s, t1),
            ];
            check_case(s, &inputs);
        }
    }
}

#[test]
fn counts_mode_scans_span_several_tiles() {
    let _serial = serial();
    if emu_or_skip("counts_mode_scans_span_several_tiles").is_none() {
        return;
    }
    // E_local * N_recv and R * T * K above SCAN_TILE = 1024: the scan recurses over block
    // sums (ep_scan_block on 2+ blocks, then ep_scan_add).
    let mut rng = Rng(12345);
    for layout in [
        Layout::ExpertPacked,
        Layout::ExpertMajor,
        Layout::TokenMajor,
    ] {
        let s = Setup {
            layout,
            id: IdDtype::I64,
            kind: FloatKind::F32,
            e: 16,
            h: 4,
            m: 300,
            extra: 0,
        };
        let inputs = vec![
            random_input(&mut rng, &s, 300),
            random_input(&mut rng, &s, 290),
        ];
        check_case(s, &inputs);
    }
}

#[test]
fn counts_mode_bad_ids_fail_every_rank_naming_the_token() {
    let _serial = serial();
    if emu_or_skip("counts_mode_bad_ids_fail_every_rank_naming_the_token").is_none() {
        return;
    }
    for layout in LAYOUTS {
        for id in [IdDtype::I32, IdDtype::I64] {
            let s = Setup {
                layout,
                id,
                kind: FloatKind::F32,
                e: 4,
                h: 1,
                m: 3,
                extra: 0,
            };
            // (rank 1's ids, expected error on rank 1)
            let cases: [(Vec<i64>, DeviceError); 4] = [
                (
                    vec![2, 3, 1, 4],
                    DeviceError::IdOutOfRange { token: 1, k: 1 },
                ),
                (
                    vec![2, -2, 1, -1],
                    DeviceError::IdOutOfRange { token: 0, k: 1 },
                ),
                (
                    vec![2, 3, 1, 1],
                    DeviceError::DuplicateId { token: 1, k: 1 },
                ),
                (
                    // Two bad tokens: the first in (token, k) order is reported, as the CPU
                    // path's validation does (not the lowest error code).
                    vec![3, 3, 9, 0],
                    DeviceError::DuplicateId { token: 0, k: 1 },
                ),
            ];
            for (ids1, want) in cases {
                let mut inputs = worked_example(FloatKind::F32);
                inputs[1].ids = ids1.clone();
                let mut pair = Pair::new(s, &inputs);
                let res = pair.dispatch();
                let e1 = res[1].as_ref().unwrap_err().to_string();
                assert_eq!(e1, want.to_error().to_string(), "{s:?} ids {ids1:?}");
                let e0 = res[0].as_ref().unwrap_err().to_string();
                assert!(
                    e0.contains("rank 1 rejected its dispatch input")
                        && e0.contains(&want.to_string()),
                    "{s:?}: {e0}"
                );
                // The word itself, as the counts row carries it.
                let g = Gathered::parse(
                    &[pair.ranks[0].dispatch_row(), pair.ranks[1].dispatch_row()].concat(),
                    R,
                    4,
                )
                .unwrap();
                assert_eq!(g.first_error(), Some((1, want)));
                assert_eq!(decode_error_word(g.errors[0]), None);
            }
        }
    }
}

#[test]
fn counts_mode_fixed_capacity_overflow_fails_every_rank() {
    let _serial = serial();
    if emu_or_skip("counts_mode_fixed_capacity_overflow_fails_every_rank").is_none() {
        return;
    }
    for layout in [Layout::ExpertMajor, Layout::RankMajor] {
        let s = Setup {
            layout,
            id: IdDtype::I32,
            kind: FloatKind::F32,
            e: 4,
            h: 1,
            m: 2,
            extra: 0,
        };
        // Rank 0 has 3 tokens > M = 2.
        let mut pair = Pair::new(s, &worked_example(FloatKind::F32));
        let res = pair.dispatch();
        for r in &res {
            let e = r.as_ref().unwrap_err().to_string();
            assert!(e.contains("max_tokens_per_rank = 2"), "{layout:?}: {e}");
        }
    }
}

#[test]
fn capacity_mode_matches_the_cpu_manager_and_replays() {
    let _serial = serial();
    if emu_or_skip("capacity_mode_matches_the_cpu_manager_and_replays").is_none() {
        return;
    }
    let mut rng = Rng(77);
    for id in [IdDtype::I32, IdDtype::I64] {
        for (kind, h) in [(FloatKind::F32, 8), (FloatKind::Bf16, 3)] {
            let s = Setup {
                layout: Layout::ExpertMajor,
                id,
                kind,
                e: 8,
                h,
                m: 12,
                extra: 12,
            };
            let rounds: Vec<Vec<Input>> = [(12usize, 5usize), (0, 12), (7, 7)]
                .iter()
                .map(|&(a, b)| vec![random_input(&mut rng, &s, a), random_input(&mut rng, &s, b)])
                .collect();
            check_capacity_case(s, &rounds);
        }
    }
    // The worked example.
    let s = Setup {
        layout: Layout::ExpertMajor,
        id: IdDtype::I32,
        kind: FloatKind::F32,
        e: 4,
        h: 1,
        m: 3,
        extra: 0,
    };
    check_capacity_case(s, &[worked_example(FloatKind::F32)]);
}

#[test]
fn counts_mode_f32_combine_is_bit_identical_to_the_cpu_with_arbitrary_values() {
    let _serial = serial();
    if emu_or_skip("counts_mode_f32_combine_is_bit_identical_to_the_cpu_with_arbitrary_values")
        .is_none()
    {
        return;
    }
    // combine.cu promises the CPU path's order (f32, no FMA): with values whose sums round,
    // any difference in the order of additions shows up in the bits.
    let mut rng = Rng(4242);
    for layout in LAYOUTS {
        let s = Setup {
            layout,
            id: IdDtype::I64,
            kind: FloatKind::F32,
            e: 8,
            h: 8,
            m: 24,
            extra: 0,
        };
        let inputs: Vec<Input> = [17usize, 24]
            .iter()
            .map(|&t| {
                let mut i = random_input(&mut rng, &s, t);
                let x: Vec<f32> = (0..t * s.h)
                    .map(|_| (rng.below(1 << 24) as f32 / 7.0 - 1e6) * 1e-4)
                    .collect();
                i.hidden = num::from_f32(&x, s.kind);
                i.w = (0..t * K)
                    .map(|_| rng.below(1 << 20) as f32 / 1_048_583.0)
                    .collect();
                i
            })
            .collect();
        check_case(s, &inputs);
    }
}

#[test]
fn counts_mode_without_zero_size_p2p() {
    let _serial = serial();
    if emu_or_skip("counts_mode_without_zero_size_p2p").is_none() {
        return;
    }
    // Older NCCL: empty sends/receives are left out on both sides (T = 0 ranks, ranks that
    // route nothing to a peer).
    ZERO_SIZE_P2P.store(false, std::sync::atomic::Ordering::Relaxed);
    let mut rng = Rng(99);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        for s in setups(8, 3, 8, 16, 0)
            .into_iter()
            .filter(|s| s.id == IdDtype::I64)
        {
            for (t0, t1) in [(0usize, 5usize), (9, 0), (4, 4)] {
                let inputs = vec![
                    random_input(&mut rng, &s, t0),
                    random_input(&mut rng, &s, t1),
                ];
                check_case(s, &inputs);
            }
        }
        // Every token of rank 0 stays home: nothing at all goes to rank 1.
        let s = Setup {
            layout: Layout::TokenMajor,
            id: IdDtype::I32,
            kind: FloatKind::F32,
            e: 4,
            h: 1,
            m: 4,
            extra: 0,
        };
        let inputs = vec![
            input(
                s.kind,
                1,
                &[1., 2.],
                &[0, 1, 1, -1],
                &[0.5, 0.5, 1.0, 0.0],
                0,
            ),
            input(s.kind, 1, &[3.], &[2, 3], &[0.25, 0.75], 0),
        ];
        check_case(s, &inputs);
    }));
    ZERO_SIZE_P2P.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}
