//! `epcomm bench eplb`: the rebalancing policy's time for a DeepSeek-V3-sized shape (58 MoE
//! layers, 256 experts on 288 slots in 8 groups, 4 nodes, 32 GPUs), then the weight transfer
//! of a rearrangement between rank processes (shm group, torch_gloo communicator) against a
//! memcpy of the same bytes timed in the same run.
//!
//! Transfer: every rank holds `layers` × `experts-per-rank` experts of `expert-mib` MiB; the new
//! placement shifts every slot by half a rank's experts, so each rank receives half its slots
//! from its neighbour and moves the other half locally. Iterations alternate the two
//! placements, so each one moves the same bytes; a barrier precedes each, and an iteration's
//! time is the slowest rank's. Every expert's bytes identify it, so after the warm-up iterations
//! and the last one each rank checks that every slot holds the expert the placement names.
//!
//! Each iteration runs three paths from one placement to the other, interleaved so they see
//! the same machine load: staged (`rearrange`: receives and local moves into a staging buffer,
//! then into the live weights, which are ordinary memory as a caller without shared memory
//! has them), then twice double-buffered (`rearrange_into`: every row written once into a next
//! buffer) from live weights in shared memory: into next buffers in ordinary memory (the
//! receivers read the rows from the senders through the kernel), and into next buffers in
//! shared memory from the group (`Group::alloc_shared`, as a fast-path caller allocates them:
//! the senders store the rows straight into them), which then become the live ones (the swap).
//! A memcpy of the placed bytes closes each iteration. The table's `double_buf` row is the path into
//! shared memory; the one into ordinary memory is summarised below the table.

use std::process::ExitCode;
use std::time::Instant;

use epcomm::dtype::DType;
use epcomm::eplb::communicator;
use epcomm::eplb::communicator::EplbCommunicator;
use epcomm::eplb::policy::rebalance_experts;
use epcomm::eplb::rearrange::{rearrange, rearrange_into, RearrangeOptions, Summary};
use epcomm::group::shm::{pin_current_thread, ShmGroup};
use epcomm::group::{Group, GroupOptions, SharedBuf};
use epcomm::moe::reference::unit;
use epcomm::select::eplb::DeviceKind;

use crate::cli::EplbArgs;
use crate::memory::{self, Need};
use crate::stats::{decode, encode, median_p99, slowest, tagged};

/// The two placements iterations alternate between (physical slot → logical expert).
fn placements(p: &EplbArgs) -> (Vec<Vec<i64>>, Vec<Vec<i64>>) {
    let slots = p.ranks * p.per_rank;
    let shift = p.per_rank / 2;
    let old: Vec<i64> = (0..slots as i64).collect();
    let new: Vec<i64> = (0..slots).map(|s| ((s + shift) % slots) as i64).collect();
    (vec![old; p.layers], vec![new; p.layers])
}

/// Byte `i` of logical expert `e` in layer `l`.
fn pattern(l: usize, e: i64, i: usize) -> u8 {
    (e as usize)
        .wrapping_mul(7)
        .wrapping_add(l * 13)
        .wrapping_add(i.wrapping_mul(3)) as u8
}

/// Bytes of `layers` that differ from the experts `placement` puts on `rank`.
fn wrong_bytes<B: std::ops::Deref<Target = [u8]>>(
    p: &EplbArgs,
    rank: usize,
    placement: &[Vec<i64>],
    layers: &[B],
) -> u64 {
    let row = p.expert_mib << 20;
    let mut wrong = 0u64;
    for (l, data) in layers.iter().enumerate() {
        for (j, slot) in data.chunks(row).enumerate() {
            let e = placement[l][rank * p.per_rank + j];
            wrong += slot
                .iter()
                .enumerate()
                .filter(|(i, &b)| b != pattern(l, e, *i))
                .count() as u64;
        }
    }
    wrong
}

/// The live and the next weights of every layer, layer after layer, in one buffer (live first
/// or second, as `live_second` says): shared memory from the group, or ordinary memory where
/// the group has none (`EPCOMM_SHM_DIRECT=0`). One allocation for both, as a fast-path caller
/// makes it: a peer keeps an owner's windows mapped while they are in use, but one left unused
/// for a few ops is unmapped when another is mapped, and mapping it again costs a page fault
/// per page on the senders' first stores (two windows used by turns would be remapped on
/// every rearrangement).
struct Double {
    buf: Layers,
    live_second: bool,
}

impl Double {
    /// (live, next).
    fn split(&mut self) -> (&mut [u8], &mut [u8]) {
        let half = self.buf.len() / 2;
        let (first, second) = self.buf.split_at_mut(half);
        if self.live_second {
            (second, first)
        } else {
            (first, second)
        }
    }

    /// The swap: the next weights become the live ones.
    fn swap(&mut self) {
        self.live_second = !self.live_second;
    }
}

enum Layers {
    Shared(SharedBuf),
    Heap(Vec<u8>),
}

impl std::ops::Deref for Layers {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Layers::Shared(b) => b,
            Layers::Heap(v) => v,
        }
    }
}

impl std::ops::DerefMut for Layers {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Layers::Shared(b) => b,
            Layers::Heap(v) => v,
        }
    }
}

/// `len` bytes of shared memory from `g` (ordinary memory where it has none).
fn shared_layers(g: &mut ShmGroup, len: usize) -> Result<Layers, String> {
    match g.alloc_shared(len).map_err(|e| e.to_string())? {
        Some(b) => Ok(Layers::Shared(b)),
        None => Ok(Layers::Heap(vec![0u8; len])),
    }
}

/// What a rank measured: the three paths' and the memcpy's seconds per iteration, the bytes placed and
/// received, the wrong bytes and the rows stored into shared next buffers per iteration.
#[derive(Default)]
struct Measured {
    staged: Vec<f64>,
    heap: Vec<f64>,
    shared: Vec<f64>,
    copies: Vec<f64>,
    moved: usize,
    received: usize,
    wrong: u64,
    rows_into_shared: usize,
}

fn rank_main(p: &EplbArgs, rank: usize, group: &str) -> Result<(), String> {
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let _ = pin_current_thread(rank % ncpu);
    let mut g =
        ShmGroup::join(group, rank, p.ranks, GroupOptions::default()).map_err(|e| e.to_string())?;
    let mut comm = communicator::create(
        Some("torch_gloo"),
        false,
        DeviceKind::Cpu,
        &[DType::BF16],
        false,
        false,
    )
    .map_err(|e| e.to_string())?;
    let m = measure(p, rank, &mut g, comm.as_mut())?;
    println!("MOVED {}", m.moved);
    println!("RECEIVED {}", m.received);
    println!("WRONG {}", m.wrong);
    println!("INTOSHARED {}", m.rows_into_shared);
    println!("XFER {}", encode(&m.staged));
    println!("XFERDB {}", encode(&m.heap));
    println!("XFERSH {}", encode(&m.shared));
    println!("COPY {}", encode(&m.copies));
    g.barrier().map_err(|e| e.to_string())?;
    Ok(())
}

/// The iterations, from a to b and back by turns. Each: staged in place (in ordinary memory),
/// then double-buffered into ordinary memory and into shared memory, which is swapped in, then
/// a memcpy of the bytes placed; interleaved so every path and the memcpy see the same load.
/// The first [`WARMUP`] iterations warm up and check every result: the first
/// touches the staging and next buffers, the second makes each shared buffer a destination
/// once more (the two swap), so the peers have mapped both and touched their pages.
fn measure(
    p: &EplbArgs,
    rank: usize,
    g: &mut ShmGroup,
    comm: &mut dyn EplbCommunicator,
) -> Result<Measured, String> {
    let (row, layer) = (p.expert_mib << 20, p.per_rank * (p.expert_mib << 20));
    let (a, b) = placements(p);
    let buf = shared_layers(g, 2 * p.layers * layer)?;
    let shared = matches!(buf, Layers::Shared(_));
    let mut w = Double {
        buf,
        live_second: false,
    };
    for (l, data) in w.split().0.chunks_mut(layer).enumerate() {
        for (i, x) in data.iter_mut().enumerate() {
            *x = pattern(l, a[l][rank * p.per_rank + i / row], i % row);
        }
    }
    // The staged path's weights, in ordinary memory (as a caller without shared memory).
    let mut own = w.split().0.to_vec();
    let mut heap = vec![0u8; p.layers * layer];
    let each = |w: &[u8]| -> Vec<Vec<u8>> { w.chunks(layer).map(<[u8]>::to_vec).collect() };
    let mut m = Measured::default();
    let (mut from, mut to) = (Vec::new(), Vec::new());
    for it in 0..p.iters + WARMUP {
        let maps = if it % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let (dt, s) = staged_once(g, comm, maps, &mut own, row, layer)?;
        let (live, next) = w.split();
        let (dh, _) = double_once(g, comm, maps, (live, &mut heap), (row, layer), false)?;
        let (ds, sh) = double_once(g, comm, maps, (live, next), (row, layer), shared)?;
        w.swap();
        if it < WARMUP {
            m.wrong += wrong_bytes(p, rank, maps.1, &each(&own))
                + wrong_bytes(p, rank, maps.1, &each(&heap))
                + wrong_bytes(p, rank, maps.1, &each(w.split().0));
        }
        m.moved = (s.rows_received + s.rows_copied_locally) * row;
        m.received = s.rows_received * row;
        m.rows_into_shared = sh.rows_into_shared;
        if from.len() != m.moved {
            (from, to) = (vec![1u8; m.moved], vec![0u8; m.moved]);
        }
        g.barrier().map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        to.copy_from_slice(&from);
        std::hint::black_box(&to);
        let dc = t0.elapsed().as_secs_f64();
        if it >= WARMUP {
            m.staged.push(dt);
            m.heap.push(dh);
            m.shared.push(ds);
            m.copies.push(dc);
        }
    }
    let last = if (p.iters + WARMUP).is_multiple_of(2) {
        &a
    } else {
        &b
    };
    m.wrong +=
        wrong_bytes(p, rank, last, &each(&own)) + wrong_bytes(p, rank, last, &each(w.split().0));
    Ok(m)
}

type Maps = Vec<Vec<i64>>;

/// Untimed iterations before the timed ones (see [`measure`]).
const WARMUP: usize = 2;

/// One staged rearrangement of `layers` in place; its seconds and summary.
fn staged_once(
    g: &mut ShmGroup,
    comm: &mut dyn EplbCommunicator,
    (from, to): (&Maps, &Maps),
    layers: &mut [u8],
    row: usize,
    layer: usize,
) -> Result<(f64, Summary), String> {
    let mut views: Vec<Vec<&mut [u8]>> = layers.chunks_mut(layer).map(|l| vec![l]).collect();
    g.barrier().map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let s = rearrange(g, comm, from, to, &mut views, &[row], None).map_err(|e| e.to_string())?;
    Ok((t0.elapsed().as_secs_f64(), s))
}

/// One double-buffered rearrangement from `live` into `next` (layers of `layer` bytes, rows of
/// `row`; `shared`: `next` is shared memory from the group); its seconds and summary.
fn double_once(
    g: &mut ShmGroup,
    comm: &mut dyn EplbCommunicator,
    (from, to): (&Maps, &Maps),
    (live, next): (&[u8], &mut [u8]),
    (row, layer): (usize, usize),
    shared: bool,
) -> Result<(f64, Summary), String> {
    let live: Vec<Vec<&[u8]>> = live.chunks(layer).map(|l| vec![l]).collect();
    let mut views: Vec<Vec<&mut [u8]>> = next.chunks_mut(layer).map(|l| vec![l]).collect();
    let options = RearrangeOptions {
        next_shared: shared,
        ..RearrangeOptions::default()
    };
    g.barrier().map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let out = rearrange_into(g, comm, from, to, &live, &mut views, &[row], &options);
    let dt = t0.elapsed().as_secs_f64();
    Ok((dt, out.result.map_err(|e| e.to_string())?))
}

/// The policy's (median, p99) seconds over `iters` runs after 2 warm-up runs, and its shape.
fn policy(iters: usize) -> (f64, f64, String) {
    let (l, e, p, g, n, r) = (58, 256, 288, 8, 4, 32);
    let w: Vec<Vec<f32>> = (0..l)
        .map(|li| {
            (0..e)
                .map(|x| ((unit(li as u64, x as u64) + 1.0) * 5000.0).floor())
                .collect()
        })
        .collect();
    let mut times = Vec::new();
    for _ in 0..iters + 2 {
        let t0 = Instant::now();
        std::hint::black_box(rebalance_experts(&w, p, g, n, r, None).expect("valid shape"));
        times.push(t0.elapsed().as_secs_f64());
    }
    let (med, p99) = median_p99(times[2..].to_vec());
    (
        med,
        p99,
        format!("L={l}, E={e}, P={p}, G={g}, N={n}, R={r}"),
    )
}

/// `epcomm bench eplb`.
pub fn cmd_eplb(p: &EplbArgs) -> ExitCode {
    if p.ranks < 2 || p.per_rank < 2 {
        return crate::usage_error("need --ranks >= 2 and --experts-per-rank >= 2");
    }
    if let Some(code) = crate::ranks::as_rank(|rank, group| rank_main(p, rank, group)) {
        return code;
    }
    let (pm, pp, shape) = policy(p.iters);
    if !p.json {
        println!("# epcomm bench eplb: the EPLB rebalancing policy, then a rearrangement's expert-weight transfer between rank processes");
        println!(
            "# policy ({shape}): median {:.3} ms, p99 {:.3} ms over {} runs",
            pm * 1e3,
            pp * 1e3,
            p.iters
        );
    }
    let weights = (p.layers * p.per_rank * (p.expert_mib << 20)) as u64;
    // The weights and their next buffers in shared memory, the staged path's weights and the
    // next buffers in ordinary memory, one layer of staging, then the memcpy's two buffers of
    // the placed bytes.
    let need = Need {
        memory: 4 * weights + weights / p.layers as u64 + 2 * weights,
        shm: weights / p.layers as u64,
        parts: Vec::new(),
    };
    let what = format!(
        "eplb transfer of {} layers x {} experts of {} MiB",
        p.layers, p.per_rank, p.expert_mib
    );
    if let Some(line) = memory::refusal(
        &what,
        &need,
        p.ranks,
        "--layers, --experts-per-rank or --expert-mib",
    ) {
        eprintln!("epcomm bench eplb: {line}");
        return ExitCode::from(1);
    }
    let outputs = match crate::ranks::run(p.ranks, "bencheplb", &[]) {
        Ok(o) if o.iter().all(|o| o.success) => o,
        Ok(_) => {
            eprintln!("epcomm: a benchmark rank failed (its error is above)");
            return ExitCode::from(1);
        }
        Err(e) => {
            eprintln!("epcomm: {e}");
            return ExitCode::from(1);
        }
    };
    let wrong = report(p, (pm, pp, &shape), &outputs);
    if wrong > 0 {
        eprintln!("epcomm: {wrong} wrong bytes in the placed experts");
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

/// The JSON object or the nccl-tests style table of the transfer (and the policy's figures, in
/// JSON); returns the wrong bytes.
/// What the rank processes reported: per rank, the samples of each path; over all ranks, the
/// bytes moved and received, wrong bytes and rows stored into shared next weights.
#[derive(Default)]
struct Reports {
    xfer: Vec<Vec<f64>>,
    db: Vec<Vec<f64>>,
    sh: Vec<Vec<f64>>,
    copy: Vec<Vec<f64>>,
    moved: u64,
    received: u64,
    wrong: u64,
    into_shared: u64,
}

fn gather(outputs: &[crate::ranks::RankOutput]) -> Reports {
    let mut r = Reports::default();
    for out in outputs {
        let text = &out.stdout;
        r.xfer.push(decode(tagged(text, "XFER ")));
        r.db.push(decode(tagged(text, "XFERDB ")));
        r.sh.push(decode(tagged(text, "XFERSH ")));
        r.copy.push(decode(tagged(text, "COPY ")));
        let num = |tag: &str| tagged(text, tag).trim().parse::<u64>().unwrap_or(0);
        r.moved = r.moved.max(num("MOVED "));
        r.received = r.received.max(num("RECEIVED "));
        r.into_shared += num("INTOSHARED ");
        r.wrong += tagged(text, "WRONG ")
            .trim()
            .parse::<u64>()
            .unwrap_or(u64::MAX / 4);
    }
    r
}

fn report(p: &EplbArgs, policy: (f64, f64, &str), outputs: &[crate::ranks::RankOutput]) -> u64 {
    let (pm, pp, shape) = policy;
    let Reports {
        xfer,
        db,
        sh,
        copy,
        moved,
        received,
        wrong,
        into_shared,
    } = gather(outputs);
    let staged = median_p99(slowest(&xfer));
    let double = median_p99(slowest(&db));
    let shared = median_p99(slowest(&sh));
    let (cm, _) = median_p99(slowest(&copy));
    let algbw = |t: f64| moved as f64 / t / 1e9;
    let busbw = |t: f64| {
        if moved > 0 {
            algbw(t) * received as f64 / moved as f64
        } else {
            0.0
        }
    };
    if p.json {
        println!(
            "{}",
            serde_json::json!({
                "policy_shape": shape, "policy_median_ms": pm * 1e3, "policy_p99_ms": pp * 1e3,
                "ranks": p.ranks, "layers": p.layers, "experts_per_rank": p.per_rank,
                "expert_mib": p.expert_mib, "iters": p.iters,
                "size_bytes": moved, "received_bytes": received,
                "time_us": staged.0 * 1e6, "p99_us": staged.1 * 1e6,
                "algbw_gbps": algbw(staged.0), "busbw_gbps": busbw(staged.0),
                "double_buffered_time_us": shared.0 * 1e6, "double_buffered_p99_us": shared.1 * 1e6,
                "double_buffered_algbw_gbps": algbw(shared.0),
                "double_buffered_busbw_gbps": busbw(shared.0),
                "double_buffered_rows_into_shared": into_shared,
                "double_buffered_ordinary_time_us": double.0 * 1e6,
                "double_buffered_ordinary_p99_us": double.1 * 1e6,
                "double_buffered_ordinary_algbw_gbps": algbw(double.0),
                "memcpy_us": cm * 1e6, "memcpy_gbps": moved as f64 / cm / 1e9, "wrong": wrong,
            })
        );
        return wrong;
    }
    table_header(p);
    for (op, (xm, xp)) in [("rearrange", staged), ("double_buf", shared)] {
        println!(
            "  {:<10} {:>12} {:>12} {:>10.1} {:>10.1} {:>11.2} {:>11.2} {:>10.1} {:>7}",
            op,
            moved,
            received,
            xm * 1e6,
            xp * 1e6,
            algbw(xm),
            busbw(xm),
            cm * 1e6,
            wrong
        );
    }
    println!("# transfer/memcpy bandwidth: {:.2}", cm / staged.0);
    println!(
        "# double-buffered transfer/memcpy bandwidth: {:.2} ({into_shared} rows stored into the next weights by their senders per iteration, all ranks)",
        cm / shared.0
    );
    println!(
        "# double-buffered into next weights in ordinary memory: median {:.1} us, p99 {:.1} us, transfer/memcpy bandwidth {:.2}",
        double.0 * 1e6,
        double.1 * 1e6,
        cm / double.0
    );
    crate::stats::nccl_summary(wrong, busbw(shared.0));
    wrong
}

/// The table's comment lines and column names.
fn table_header(p: &EplbArgs) {
    println!(
        "# transfer: {} ranks, {} layers x {} experts of {} MiB per rank, half received from a peer, half moved locally; torch_gloo over shm; {} iterations after {WARMUP} warm-ups; times: median over iterations of the slowest rank",
        p.ranks, p.layers, p.per_rank, p.expert_mib, p.iters
    );
    println!("# rearrange: staged (receives and local moves into staging, then into the live weights); double_buf: rearrange_into, every row written once into next weights in shared memory from the group (received rows stored there by their senders), then swapped in; the same into next weights in ordinary memory (received rows read through the kernel) is summarised below the table");
    println!("# size: bytes placed per rank (received from peers + moved locally); memcpy: one copy of size bytes on every rank at once, timed in every iteration after the transfers (the same load)");
    println!("# algbw = size / time; busbw = algbw * received / size (the bytes that cross between ranks)");
    println!("# #wrong: bytes of the placed experts that differ from the expert the new placement names, all ranks, both paths");
    println!("#");
    println!(
        "# {:<10} {:>12} {:>12} {:>10} {:>10} {:>11} {:>11} {:>10} {:>7}",
        "op",
        "size(B)",
        "received(B)",
        "time(us)",
        "p99(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "memcpy(us)",
        "#wrong"
    );
}
