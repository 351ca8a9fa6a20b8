//! `epcomm bench eplb`: the rebalancing policy's time for a DeepSeek-V3-sized shape (58 MoE
//! layers, 256 experts on 288 slots in 8 groups, 4 nodes, 32 GPUs), then the weight transfer
//! of a rearrangement between rank processes (shm group, torch_gloo communicator) against a
//! memcpy of the same bytes timed in the same run.
//!
//! Transfer: every rank holds `layers` × `experts-per-rank` experts of `expert-mib` MiB; the new
//! placement shifts every slot by half a rank's experts, so each rank receives half its slots
//! from its neighbour and moves the other half locally. Iterations alternate the two
//! placements, so each one moves the same bytes; a barrier precedes each, and an iteration's
//! time is the slowest rank's. Every expert's bytes identify it, so after the first and the
//! last iteration each rank checks that every slot holds the expert the placement names.
//!
//! Each iteration runs both paths, interleaved so they see the same machine load: staged
//! (`rearrange`: receives and local moves into a staging buffer, then into the live weights)
//! from the first placement to the second, then double-buffered (`rearrange_into`: every row
//! written once into a next buffer, which then becomes the live one: the swap) back.

use std::process::ExitCode;
use std::time::Instant;

use epcomm::dtype::DType;
use epcomm::eplb::communicator;
use epcomm::eplb::communicator::EplbCommunicator;
use epcomm::eplb::policy::rebalance_experts;
use epcomm::eplb::rearrange::{rearrange, rearrange_into, RearrangeOptions, Summary};
use epcomm::group::shm::{pin_current_thread, ShmGroup};
use epcomm::group::{Group, GroupOptions};
use epcomm::moe::reference::unit;
use epcomm::select::eplb::DeviceKind;

use crate::cli::EplbArgs;
use crate::memory::{self, Need};
use crate::stats::{decode, encode, median_p99, slowest, tagged, time_memcpy};

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
fn wrong_bytes(p: &EplbArgs, rank: usize, placement: &[Vec<i64>], layers: &[Vec<u8>]) -> u64 {
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
    let row = p.expert_mib << 20;
    let (a, b) = placements(p);
    let mut layers: Vec<Vec<u8>> = (0..p.layers)
        .map(|l| {
            (0..p.per_rank * row)
                .map(|i| pattern(l, a[l][rank * p.per_rank + i / row], i % row))
                .collect()
        })
        .collect();
    let mut next: Vec<Vec<u8>> = layers.iter().map(|l| vec![0u8; l.len()]).collect();
    let (mut staged, mut double, mut wrong) = (Vec::new(), Vec::new(), 0);
    let (mut moved, mut received) = (0usize, 0usize);
    // Each iteration: staged a -> b in place, then double-buffered b -> a into `next`, swapped
    // in; interleaved so both paths see the same load. The first iteration warms up (first
    // touch of the staging and next buffers) and checks both results.
    for it in 0..p.iters + 1 {
        let (dt, s) = staged_once(&mut g, comm.as_mut(), (&a, &b), &mut layers, row)?;
        if it == 0 {
            wrong += wrong_bytes(p, rank, &b, &layers);
        }
        let db = double_once(&mut g, comm.as_mut(), (&b, &a), &layers, &mut next, row)?;
        std::mem::swap(&mut layers, &mut next);
        if it == 0 {
            wrong += wrong_bytes(p, rank, &a, &layers);
        } else {
            staged.push(dt);
            double.push(db);
        }
        moved = (s.rows_received + s.rows_copied_locally) * row;
        received = s.rows_received * row;
    }
    wrong += wrong_bytes(p, rank, &a, &layers);
    drop((layers, next));
    // The first iteration warms up, as for the transfer.
    let copies = time_memcpy(&mut g, moved, 1, p.iters)?;
    println!("MOVED {moved}");
    println!("RECEIVED {received}");
    println!("WRONG {wrong}");
    println!("XFER {}", encode(&staged));
    println!("XFERDB {}", encode(&double));
    println!("COPY {}", encode(&copies));
    g.barrier().map_err(|e| e.to_string())?;
    Ok(())
}

type Maps = Vec<Vec<i64>>;

/// One staged rearrangement of `layers` in place; its seconds and summary.
fn staged_once(
    g: &mut ShmGroup,
    comm: &mut dyn EplbCommunicator,
    (from, to): (&Maps, &Maps),
    layers: &mut [Vec<u8>],
    row: usize,
) -> Result<(f64, Summary), String> {
    let mut views: Vec<Vec<&mut [u8]>> =
        layers.iter_mut().map(|l| vec![l.as_mut_slice()]).collect();
    g.barrier().map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let s = rearrange(g, comm, from, to, &mut views, &[row], None).map_err(|e| e.to_string())?;
    Ok((t0.elapsed().as_secs_f64(), s))
}

/// One double-buffered rearrangement from `live` into `next`; its seconds.
fn double_once(
    g: &mut ShmGroup,
    comm: &mut dyn EplbCommunicator,
    (from, to): (&Maps, &Maps),
    live: &[Vec<u8>],
    next: &mut [Vec<u8>],
    row: usize,
) -> Result<f64, String> {
    let live: Vec<Vec<&[u8]>> = live.iter().map(|l| vec![l.as_slice()]).collect();
    let mut views: Vec<Vec<&mut [u8]>> = next.iter_mut().map(|l| vec![l.as_mut_slice()]).collect();
    let options = RearrangeOptions::default();
    g.barrier().map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let out = rearrange_into(g, comm, from, to, &live, &mut views, &[row], &options);
    let dt = t0.elapsed().as_secs_f64();
    out.result.map_err(|e| e.to_string())?;
    Ok(dt)
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
            "# policy ({shape}): median {:.3} ms, p99 {:.3} ms over {} runs (target <= 1 ms)",
            pm * 1e3,
            pp * 1e3,
            p.iters
        );
    }
    let weights = (p.layers * p.per_rank * (p.expert_mib << 20)) as u64;
    // The weights, one layer of staging, the next weights, then the memcpy's two buffers of
    // the placed bytes.
    let need = Need {
        memory: 2 * weights + weights / p.layers as u64 + 2 * weights,
        shm: weights / p.layers as u64,
        detail: String::new(),
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
fn report(p: &EplbArgs, policy: (f64, f64, &str), outputs: &[crate::ranks::RankOutput]) -> u64 {
    let (pm, pp, shape) = policy;
    let (mut xfer, mut db, mut copy) = (Vec::new(), Vec::new(), Vec::new());
    let (mut moved, mut received, mut wrong) = (0u64, 0u64, 0u64);
    for out in outputs {
        let text = &out.stdout;
        xfer.push(decode(tagged(text, "XFER ")));
        db.push(decode(tagged(text, "XFERDB ")));
        copy.push(decode(tagged(text, "COPY ")));
        let num = |tag: &str| tagged(text, tag).trim().parse::<u64>().unwrap_or(0);
        moved = moved.max(num("MOVED "));
        received = received.max(num("RECEIVED "));
        wrong += tagged(text, "WRONG ")
            .trim()
            .parse::<u64>()
            .unwrap_or(u64::MAX / 4);
    }
    let staged = median_p99(slowest(&xfer));
    let double = median_p99(slowest(&db));
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
                "double_buffered_time_us": double.0 * 1e6, "double_buffered_p99_us": double.1 * 1e6,
                "double_buffered_algbw_gbps": algbw(double.0),
                "double_buffered_busbw_gbps": busbw(double.0),
                "memcpy_us": cm * 1e6, "memcpy_gbps": moved as f64 / cm / 1e9, "wrong": wrong,
            })
        );
        return wrong;
    }
    table_header(p);
    for (op, (xm, xp)) in [("rearrange", staged), ("double_buf", double)] {
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
        "# double-buffered transfer/memcpy bandwidth: {:.2}",
        cm / double.0
    );
    crate::stats::nccl_summary(wrong, busbw(double.0));
    wrong
}

/// The table's comment lines and column names.
fn table_header(p: &EplbArgs) {
    println!(
        "# transfer: {} ranks, {} layers x {} experts of {} MiB per rank, half received from a peer, half moved locally; torch_gloo over shm; {} iterations after 1 warm-up; times: median over iterations of the slowest rank",
        p.ranks, p.layers, p.per_rank, p.expert_mib, p.iters
    );
    println!("# rearrange: staged (receives and local moves into staging, then into the live weights); double_buf: rearrange_into, every row written once into the next weights, then swapped in");
    println!("# size: bytes placed per rank (received from peers + moved locally); memcpy: one copy of size bytes in the same run");
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
