//! The COUNTS-mode pipeline of `GpuManager` (`epcomm::gpu::transport::pipeline`, the code the
//! manager runs on a device), for every layout, run on the host through the host executor of
//! tests/gpu_emu (the real kernel sources compiled for the host, R = 2 ranks as threads,
//! exchanges done on the host from the very `ExchangePlan`s the pipeline hands NCCL).
//! Nothing of the pipeline is copied here: buffers, launches, copies, plans and the host
//! sync all come from the pipeline itself; the executor checks every launch against its
//! parameter table and every buffer's guard band (tests/gpu_emu module doc).
//!
//! Checked against the CPU `epcomm::moe::Manager` (two ranks on threads over an shm group):
//! every dispatch output field by field, and combine (f32 exact: the test values are dyadic,
//! so every sum is exact whatever the order; bf16 within one bf16 ulp). Routings: the two-rank
//! worked example, random ones with uneven T, T = 0 on one rank, masked -1 ids and an extra
//! payload; bad ids (out of range, duplicate) must come back from the device error word
//! naming the token on its rank and the rank on its peer.
//!
//! Capacity mode (EXPERT_MAJOR) runs the same way, several rounds on the same buffers as a
//! CUDA-graph replay would (tests/gpu_pipeline_emu.rs has the worked example of that flow).
//!
//! The manager's host orchestration, on the same executor: buffers sized at creation (a
//! graph captured at T = 32, a call at T = 64, the replay: no buffer moves; 50 random calls
//! per layout allocate nothing), growth refused while capturing, a failure after the
//! all-gather (allocation, launch, host-wait timeout) leaving every rank unusable with the
//! transport aborted, a failure before it reaching the peers as a rejection, and every entry
//! restoring the caller's context.

mod common;
mod gpu_emu;
mod ranks;

use std::sync::Arc;
use std::time::Duration;

use epcomm::gpu::kernels::{decode_error_word, DeviceError, IdDtype};
use epcomm::gpu::transport::pipeline::Pipeline;
use epcomm::gpu::transport::plan::Gathered;
use epcomm::gpu::transport::{DispatchInput, GpuDispatch, GpuMode};
use epcomm::group::shm::ShmGroup;
use epcomm::group::GroupOptions;
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::{self, FloatKind};
use epcomm::select::all2all::Layout;

use epcomm::error::Status;
use epcomm::gpu::calls::KernelId;
use epcomm::gpu::transport::pool::capture_growth_message;
use gpu_emu::{
    current_context, emu_or_skip, on_ranks, read, serial, set_current_context, Fabric, Faults,
    HostExec,
};

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

/// One rank: the manager's pipeline and its host executor.
struct Rank {
    s: Setup,
    pipe: Pipeline,
    x: HostExec,
    inp: Input,
}

impl Rank {
    fn new(s: Setup, d: usize, mode: GpuMode, fabric: Arc<Fabric>, inp: Input) -> Rank {
        let zero = ZERO_SIZE_P2P.load(std::sync::atomic::Ordering::Relaxed);
        let pipe = Pipeline::new(backend(s.layout), moe_cfg(&s), d, R, mode, zero)
            .unwrap_or_else(|e| panic!("{s:?}: {e}"));
        let mut x = HostExec::new(d, fabric, K as u32, s.kind);
        // What GpuManager::new does.
        pipe.reserve(&mut x).unwrap();
        Rank { s, pipe, x, inp }
    }

    fn rb(&self) -> usize {
        self.s.h * self.s.kind.size()
    }

    /// Uploads the caller's tensors (what the host passes as device pointers). Empty
    /// tensors are NULL, as src/ffi/gpu.rs passes them (`addr`).
    fn input(&mut self) -> DispatchInput {
        let inp = self.inp.clone();
        let ids = match self.s.id {
            IdDtype::I32 => {
                let v: Vec<i32> = inp.ids.iter().map(|&x| x as i32).collect();
                self.x.put("in_ids", epcomm::bytes::as_bytes(&v))
            }
            IdDtype::I64 => self.x.put("in_ids", epcomm::bytes::as_bytes(&inp.ids)),
        };
        let extras = if self.s.extra > 0 {
            vec![self.x.put("in_extra", &inp.extra)]
        } else {
            vec![]
        };
        DispatchInput {
            hidden: self.x.put("in_hidden", &inp.hidden),
            topk_ids: ids,
            id_dtype: self.s.id,
            topk_weights: self.x.put("in_w", epcomm::bytes::as_bytes(&inp.w)),
            tokens: inp.t,
            extras,
        }
    }

    /// The pipeline's dispatch (collective), read back; the device error word must be 0.
    fn dispatch(&mut self) -> epcomm::Result<Out> {
        let input = self.input();
        let o = self.pipe.dispatch(&mut self.x, &input)?;
        let err = self.x.mem.get("err");
        assert_eq!(
            read::<u64>(err, 1)[0],
            0,
            "device error word after dispatch"
        );
        Ok(self.read_out(&o))
    }

    /// The dispatch outputs read back as the CPU view shapes them.
    fn read_out(&self, o: &GpuDispatch) -> Out {
        let shape = &o.shape;
        let s = &self.s;
        let el = s.e / R;
        let rows = shape.buffer_rows;
        let counts = if shape.counts > 0 {
            read::<i32>(o.counts, shape.counts)
        } else {
            vec![]
        };
        // Capacity mode: the host does not know the received rows; the counts have them.
        let nr = if shape.received_rows == usize::MAX {
            counts.iter().map(|&c| c as usize).sum()
        } else {
            shape.received_rows
        };
        let id_rows = shape.topk_ids.first().copied().unwrap_or(0);
        Out {
            shape: shape.hidden.clone(),
            received_rows: nr,
            hidden: read_bytes(o.hidden, rows * self.rb()),
            ids: if id_rows > 0 {
                read::<i64>(o.topk_ids, id_rows * K)
            } else {
                vec![]
            },
            w: if shape.topk_weights.is_empty() {
                vec![]
            } else {
                read::<f32>(o.topk_weights, shape.topk_weights.iter().product())
            },
            counts,
            offsets: if shape.expert_offsets > 0 {
                read::<i32>(o.expert_offsets, el + 1)
                    .into_iter()
                    .map(i64::from)
                    .collect()
            } else {
                vec![]
            },
            src_rank: if shape.src > 0 {
                read::<i32>(o.src_rank, nr)
            } else {
                vec![]
            },
            src_token: if shape.src > 0 {
                read::<i32>(o.src_token, nr)
            } else {
                vec![]
            },
            extra: if s.extra > 0 {
                read_bytes(o.extras[0], rows * s.extra)
            } else {
                vec![]
            },
        }
    }

    /// The pipeline's combine (collective) of the expert outputs `y`: `[T, H]` read back.
    fn combine(&mut self, y: &[u8]) -> Vec<u8> {
        let erb = self.s.h * self.s.kind.size();
        let shape = self.pipe.last_shape().expect("a dispatch before combine");
        assert_eq!(y.len(), shape.buffer_rows * erb, "expert output size");
        let expert_output = self.x.put("expert_output", y);
        let (t, ob) = (self.inp.t, self.s.h * self.s.kind.size());
        let out = if t == 0 {
            0
        } else {
            self.x.mem.input("comb_out", t * ob)
        };
        self.pipe
            .combine(&mut self.x, expert_output, out)
            .unwrap_or_else(|e| panic!("combine {:?}: {e}", self.s));
        read_bytes(out, t * ob)
    }
}

/// The emulated manager pair: dispatch then (optionally) combine with `ys`.
struct Pair {
    ranks: Vec<Rank>,
}

impl Pair {
    fn new(s: Setup, inputs: &[Input]) -> Pair {
        Pair::with_mode(s, GpuMode::Counts, inputs)
    }

    fn with_mode(s: Setup, mode: GpuMode, inputs: &[Input]) -> Pair {
        let fabric = Fabric::new(R);
        Pair {
            ranks: inputs
                .iter()
                .enumerate()
                .map(|(d, i)| Rank::new(s, d, mode, fabric.clone(), i.clone()))
                .collect(),
        }
    }

    /// Every pipeline buffer's address per rank (what a captured graph holds).
    fn addresses(&self) -> Vec<Vec<(String, u64)>> {
        self.ranks.iter().map(|r| r.x.mem.addresses()).collect()
    }

    /// Allocations after creation per rank.
    fn reallocations(&self) -> Vec<u64> {
        self.ranks
            .iter()
            .map(|r| r.x.mem.pool.stats().reallocations)
            .collect()
    }

    /// Marks every rank's stream as capturing (or not).
    fn capturing(&mut self, on: bool) {
        for r in &mut self.ranks {
            r.x.capturing = on;
        }
    }

    fn dispatch(&mut self) -> Vec<epcomm::Result<Out>> {
        let res = on_ranks(&mut self.ranks, Rank::dispatch);
        if res.iter().any(|r| r.is_err()) {
            // A collective error: every rank must fail the same call (no rank waits in an
            // exchange the others never join: the host fabric panics then).
            assert!(
                res.iter().all(|r| r.is_err()),
                "only some ranks failed: {res:?}"
            );
        }
        res
    }

    fn combine(&mut self, ys: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let mut pairs: Vec<(&mut Rank, &Vec<u8>)> = self.ranks.iter_mut().zip(ys).collect();
        on_ranks(&mut pairs, |(r, y)| r.combine(y))
    }
}

/// Capacity mode on both ranks against the CPU manager (EXPERT_MAJOR), several rounds on the
/// same buffers (what a CUDA-graph replay does: same addresses, new data).
fn check_capacity_case(s: Setup, rounds: &[Vec<Input>]) {
    let mut pair = Pair::with_mode(s, GpuMode::Capacity, &rounds[0]);
    for inputs in rounds {
        check_round(&mut pair, s, inputs);
    }
}

/// One dispatch + combine of `inputs` on `pair`'s ranks (their buffers as earlier rounds
/// left them), both compared with the CPU manager.
fn check_round(pair: &mut Pair, s: Setup, inputs: &[Input]) {
    let cpu = cpu_run(s, inputs.to_vec());
    for (r, i) in pair.ranks.iter_mut().zip(inputs) {
        r.inp = i.clone();
    }
    let gpu = pair.dispatch();
    let mut ys = Vec::new();
    for (d, go) in gpu.iter().enumerate() {
        let go = go.as_ref().unwrap_or_else(|e| panic!("GPU {s:?}: {e}"));
        let (co, cy, _) = cpu[d].as_ref().unwrap_or_else(|e| panic!("CPU {s:?}: {e}"));
        compare_dispatch(&s, d, go, co);
        ys.push(cy.clone());
    }
    let outs = pair.combine(&ys);
    for (d, out) in outs.iter().enumerate() {
        compare_combine(&s, d, out, &cpu[d].as_ref().unwrap().2);
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
            extra: v.extras.first().map(<[u8]>::to_vec).unwrap_or_default(),
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
        Layout::TokenMajor | Layout::ExpertPacked | Layout::Replicated | Layout::MoonepSlots => {
            (0..cpu.hidden.len() / rb.max(1)).collect()
        }
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
            FloatKind::Bf16 | FloatKind::F16 => (a - b).abs() <= b.abs() / 128.0 + 1e-6,
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
                // The word itself, as the counts rows the ranks gathered carry it.
                let g = Gathered::parse(&pair.ranks[0].x.gathered, R, 4).unwrap();
                assert_eq!(pair.ranks[1].x.gathered, pair.ranks[0].x.gathered);
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

// ---- buffers, CUDA graphs, failures mid-call, contexts ------------------------------------

/// `t0`/`t1` random tokens on the two ranks.
fn random_pair(rng: &mut Rng, s: &Setup, t0: usize, t1: usize) -> Vec<Input> {
    vec![random_input(rng, s, t0), random_input(rng, s, t1)]
}

fn capacity_setup(m: usize) -> Setup {
    Setup {
        layout: Layout::ExpertMajor,
        id: IdDtype::I32,
        kind: FloatKind::F32,
        e: 8,
        h: 8,
        m,
        extra: 12,
    }
}

#[test]
fn capacity_mode_graph_at_t32_then_t64_then_replay_never_moves_a_buffer() {
    let _serial = serial();
    if emu_or_skip("capacity_mode_graph_at_t32_then_t64_then_replay_never_moves_a_buffer").is_none()
    {
        return;
    }
    // M = 64: every buffer was sized at creation, so a call at T = 64 after a graph captured
    // at T = 32 frees nothing that graph writes, and the capture itself allocates nothing.
    let s = capacity_setup(64);
    let mut rng = Rng(2026);
    let at32 = random_pair(&mut rng, &s, 32, 32);
    let mut pair = Pair::with_mode(s, GpuMode::Capacity, &at32);
    let created = pair.addresses();
    assert!(created[0].iter().any(|(n, _)| n == "cap_rank_flag"));
    pair.capturing(true);
    check_round(&mut pair, s, &at32);
    pair.capturing(false);
    check_round(&mut pair, s, &random_pair(&mut rng, &s, 64, 64));
    // The replay: the same addresses with the T = 32 inputs.
    pair.capturing(true);
    check_round(&mut pair, s, &at32);
    assert_eq!(pair.addresses(), created);
    assert_eq!(pair.reallocations(), vec![0, 0]);
}

#[test]
fn growing_a_buffer_while_capturing_is_refused() {
    let _serial = serial();
    if emu_or_skip("growing_a_buffer_while_capturing_is_refused").is_none() {
        return;
    }
    // Pipelines whose pools were never reserved (the old behaviour: buffers sized by the
    // first call): the first request during a capture would allocate, which is refused.
    let s = capacity_setup(8);
    let mut rng = Rng(5);
    let inputs = random_pair(&mut rng, &s, 8, 4);
    let fabric = Fabric::new(R);
    let mut pair = Pair {
        ranks: inputs
            .iter()
            .enumerate()
            .map(|(d, i)| {
                let mut r = Rank::new(s, d, GpuMode::Capacity, fabric.clone(), i.clone());
                r.x = HostExec::new(d, fabric.clone(), K as u32, s.kind);
                r
            })
            .collect(),
    };
    pair.capturing(true);
    let want = epcomm::Error::InvalidState(capture_growth_message("err", 0, 256)).to_string();
    for r in pair.dispatch() {
        assert_eq!(r.unwrap_err().to_string(), want);
    }
    assert_eq!(pair.reallocations(), vec![0, 0]);
    // A failure with the peers in the collective: the pipelines refuse every later call.
    pair.capturing(false);
    for r in pair.dispatch() {
        let e = r.unwrap_err();
        assert_eq!(e.status(), Status::InvalidState);
        assert!(e.to_string().contains(&format!("({want})")), "{e}");
    }
}

#[test]
fn fifty_random_routings_allocate_nothing_after_creation() {
    let _serial = serial();
    if emu_or_skip("fifty_random_routings_allocate_nothing_after_creation").is_none() {
        return;
    }
    let mut rng = Rng(0x5eed);
    let mut cases: Vec<(Setup, GpuMode)> = LAYOUTS
        .iter()
        .map(|&layout| {
            let s = Setup {
                layout,
                id: IdDtype::I64,
                kind: FloatKind::F32,
                e: 8,
                h: 8,
                m: 16,
                extra: 12,
            };
            (s, GpuMode::Counts)
        })
        .collect();
    cases.push((capacity_setup(16), GpuMode::Capacity));
    for (s, mode) in cases {
        let mut pair = Pair::with_mode(s, mode, &random_pair(&mut rng, &s, 1, 1));
        let created = pair.addresses();
        for _ in 0..50 {
            let (t0, t1) = (rng.below(17) as usize, rng.below(17) as usize);
            check_round(&mut pair, s, &random_pair(&mut rng, &s, t0, t1));
        }
        assert_eq!(pair.reallocations(), vec![0, 0], "{s:?} {mode:?}");
        assert_eq!(pair.addresses(), created, "{s:?} {mode:?}");
    }
}

/// TOKEN_MAJOR (exact sizes: T may exceed M) with M = 4 and 32-byte rows: rank 0 has 2
/// tokens, rank 1 has 8, every token routed to rank 0's experts, so rank 0 receives 10 rows,
/// more than the 8 (256 bytes) its buffers were sized for before the all-gather
/// (R × max(T, M) rows); rank 1's own send buffers grow before it (8 tokens > M).
fn overflow_setup() -> (Setup, Vec<Input>) {
    let s = Setup {
        layout: Layout::TokenMajor,
        id: IdDtype::I64,
        kind: FloatKind::F32,
        e: 4,
        h: 8,
        m: 4,
        extra: 0,
    };
    let ids = |t: usize| -> Vec<i64> { (0..t).flat_map(|_| [0i64, 1]).collect() };
    let x = |t: usize| -> Vec<f32> { (0..t * 8).map(|i| i as f32).collect() };
    let inputs = [2usize, 8]
        .iter()
        .map(|&t| input(s.kind, 8, &x(t), &ids(t), &vec![0.5; 2 * t], 0))
        .collect();
    (s, inputs)
}

/// Both ranks' errors after a mid-call failure on `failing`, whose error must contain
/// `first`: the peer's collective fails (the abort), and every later call of either rank is
/// refused naming the first failure.
fn check_out_of_step(pair: &mut Pair, failing: usize, first: &str) {
    let res = pair.dispatch();
    let e = res[failing].as_ref().unwrap_err().to_string();
    assert!(e.contains(first), "rank {failing}: {e}");
    let peer = res[1 - failing].as_ref().unwrap_err();
    assert_eq!(peer.status(), Status::PeerFailure, "{peer}");
    assert!(pair.ranks[failing].x.aborted);
    for (d, r) in pair.ranks.iter_mut().enumerate() {
        r.x.faults = Faults::default();
        assert!(r.pipe.failure().is_some(), "rank {d} still usable");
    }
    for (d, r) in pair.dispatch().into_iter().enumerate() {
        let e = r.unwrap_err();
        assert_eq!(e.status(), Status::InvalidState, "rank {d}: {e}");
        assert!(e.to_string().contains("is unusable"), "rank {d}: {e}");
    }
    let first_seen = pair.ranks[failing].pipe.failure().unwrap().to_owned();
    let r = &mut pair.ranks[failing];
    let again = r.pipe.combine(&mut r.x, 0, 0);
    assert!(again.unwrap_err().to_string().contains(&first_seen));
}

#[test]
fn an_allocation_failure_after_the_all_gather_leaves_every_rank_unusable() {
    let _serial = serial();
    if emu_or_skip("an_allocation_failure_after_the_all_gather_leaves_every_rank_unusable")
        .is_none()
    {
        return;
    }
    let (s, inputs) = overflow_setup();
    let mut pair = Pair::new(s, &inputs);
    pair.ranks[0].x.faults.alloc = Some("recv0".into());
    check_out_of_step(&mut pair, 0, "[injected for 'recv0']");
}

#[test]
fn a_launch_failure_after_the_all_gather_leaves_every_rank_unusable() {
    let _serial = serial();
    if emu_or_skip("a_launch_failure_after_the_all_gather_leaves_every_rank_unusable").is_none() {
        return;
    }
    let s = Setup {
        layout: Layout::ExpertPacked,
        id: IdDtype::I32,
        kind: FloatKind::F32,
        e: 4,
        h: 1,
        m: 3,
        extra: 0,
    };
    let mut pair = Pair::new(s, &worked_example(FloatKind::F32));
    pair.ranks[1].x.faults.launch = Some(KernelId::Pack);
    check_out_of_step(&mut pair, 1, "launching ep_pack");
}

#[test]
fn a_timed_out_host_wait_leaves_every_rank_unusable() {
    let _serial = serial();
    if emu_or_skip("a_timed_out_host_wait_leaves_every_rank_unusable").is_none() {
        return;
    }
    let s = Setup {
        layout: Layout::ExpertMajor,
        id: IdDtype::I64,
        kind: FloatKind::F32,
        e: 4,
        h: 1,
        m: 3,
        extra: 0,
    };
    let mut pair = Pair::new(s, &worked_example(FloatKind::F32));
    pair.ranks[0].x.faults.read = true;
    check_out_of_step(&mut pair, 0, "did not complete within");
}

#[test]
fn a_failure_before_the_all_gather_is_a_rejection_the_peers_are_told_of() {
    let _serial = serial();
    if emu_or_skip("a_failure_before_the_all_gather_is_a_rejection_the_peers_are_told_of").is_none()
    {
        return;
    }
    // Rank 1 has T = 8 > M = 4: its send buffers grow before the all-gather; that allocation
    // fails. Then the ep_layout launch (also before it) fails. Each time rank 1 sends its
    // rejection row instead, every rank fails the call, and the next call works.
    let (s, inputs) = overflow_setup();
    let mut pair = Pair::new(s, &inputs);
    type Inject = fn(&mut Faults);
    let faults: [(Inject, &str); 2] = [
        (|f| f.alloc = Some("send0".into()), "[injected for 'send0']"),
        (|f| f.launch = Some(KernelId::Layout), "launching ep_layout"),
    ];
    for (inject, why) in faults {
        inject(&mut pair.ranks[1].x.faults);
        let res = pair.dispatch();
        let e1 = res[1].as_ref().unwrap_err().to_string();
        assert!(e1.contains(why), "{e1}");
        let e0 = res[0].as_ref().unwrap_err().to_string();
        assert!(e0.contains("rank 1 rejected its dispatch input"), "{e0}");
        for r in &mut pair.ranks {
            assert_eq!(r.pipe.failure(), None);
            assert!(!r.x.aborted);
            r.x.faults = Faults::default();
        }
        check_round(&mut pair, s, &inputs);
    }
}

#[test]
fn every_entry_restores_the_callers_context() {
    let _serial = serial();
    if emu_or_skip("every_entry_restores_the_callers_context").is_none() {
        return;
    }
    // The executor asserts that every device operation runs in the rank's own context (the
    // pipeline entered it); the host thread's own (7) must be current again after each entry,
    // whether it succeeded or failed.
    const CALLER: usize = 7;
    let s = Setup {
        layout: Layout::ExpertMajor,
        id: IdDtype::I32,
        kind: FloatKind::F32,
        e: 4,
        h: 1,
        m: 3,
        extra: 0,
    };
    let mut pair = Pair::new(s, &worked_example(FloatKind::F32));
    on_ranks(&mut pair.ranks, |r| {
        set_current_context(CALLER);
        let o = r.dispatch().expect("dispatch");
        assert_eq!(current_context(), Some(CALLER));
        let y = expert_output(&r.s, r.x.rank, &o);
        r.combine(&y);
        assert_eq!(current_context(), Some(CALLER));
        // A rejected input (a missing extra payload) on both ranks.
        let mut input = r.input();
        input.extras.push(0);
        assert!(r.pipe.dispatch(&mut r.x, &input).is_err());
        assert_eq!(current_context(), Some(CALLER));
        // Combine without a dispatch.
        assert!(r.pipe.combine(&mut r.x, 0, 0).is_err());
        assert_eq!(current_context(), Some(CALLER));
    });
}
