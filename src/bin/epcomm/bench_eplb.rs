//! `epcomm bench eplb`: the rebalancing policy's time for SPEC §7's shape, then the weight
//! transfer of a rearrangement between rank processes (shm group, torch_gloo communicator)
//! against a memcpy of the same bytes timed in the same run.
//!
//! Transfer: every rank holds `layers` × `experts-per-rank` experts of `expert-mib` MiB; the new
//! placement shifts every slot by half a rank's experts, so each rank receives half its slots
//! from its neighbour and moves the other half locally. Iterations alternate the two
//! placements, so each one moves the same bytes; a barrier precedes each, and an iteration's
//! time is the slowest rank's.

use std::process::ExitCode;
use std::time::Instant;

use epcomm::dtype::DType;
use epcomm::eplb::communicator;
use epcomm::eplb::policy::rebalance_experts;
use epcomm::eplb::rearrange::rearrange;
use epcomm::group::shm::{pin_current_thread, ShmGroup};
use epcomm::group::{Group, GroupOptions};
use epcomm::moe::reference::unit;
use epcomm::select::eplb::DeviceKind;

use crate::stats::{decode, encode, median_p99, slowest, tagged, time_memcpy};

const USAGE: &str = "usage: epcomm bench eplb [--iters N] [--ranks N] [--layers L] [--experts-per-rank N] [--expert-mib MiB]";

#[derive(Clone, Copy, Debug)]
struct Params {
    iters: usize,
    ranks: usize,
    layers: usize,
    per_rank: usize,
    expert_mib: usize,
}

fn parse(args: &[String]) -> Result<Params, String> {
    let mut p = Params {
        iters: 20,
        ranks: 2,
        layers: 4,
        per_rank: 16,
        expert_mib: 4,
    };
    for (name, value) in crate::opts::pairs(args, &[])? {
        let v = crate::opts::count(&name, &value)?;
        match name.as_str() {
            "--iters" => p.iters = v,
            "--ranks" => p.ranks = v,
            "--layers" => p.layers = v,
            "--experts-per-rank" => p.per_rank = v,
            "--expert-mib" => p.expert_mib = v,
            other => return Err(format!("unknown option '{other}'")),
        }
    }
    if p.iters == 0 {
        return Err("--iters must be positive".into());
    }
    if p.ranks < 2 || p.layers == 0 || p.per_rank < 2 || p.expert_mib == 0 {
        return Err(
            "need --ranks >= 2, --layers > 0, --experts-per-rank >= 2 and --expert-mib > 0".into(),
        );
    }
    Ok(p)
}

/// The two placements iterations alternate between (physical slot → logical expert).
fn placements(p: &Params) -> (Vec<Vec<i64>>, Vec<Vec<i64>>) {
    let slots = p.ranks * p.per_rank;
    let shift = p.per_rank / 2;
    let old: Vec<i64> = (0..slots as i64).collect();
    let new: Vec<i64> = (0..slots).map(|s| ((s + shift) % slots) as i64).collect();
    (vec![old; p.layers], vec![new; p.layers])
}

fn rank_main(p: &Params, rank: usize, group: &str) -> Result<(), String> {
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
    let mut layers: Vec<Vec<u8>> = (0..p.layers)
        .map(|l| vec![(l + rank) as u8; p.per_rank * row])
        .collect();
    let (a, b) = placements(p);
    let mut times = Vec::new();
    let mut moved = 0usize;
    for it in 0..p.iters + 1 {
        let (from, to) = if it % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let mut views: Vec<Vec<&mut [u8]>> =
            layers.iter_mut().map(|l| vec![l.as_mut_slice()]).collect();
        g.barrier().map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        let s = rearrange(&mut g, comm.as_mut(), from, to, &mut views, &[row], None)
            .map_err(|e| e.to_string())?;
        let dt = t0.elapsed().as_secs_f64();
        // The first iteration warms up (first touch of the staging buffers).
        if it > 0 {
            times.push(dt);
        }
        moved = (s.rows_received + s.rows_copied_locally) * row;
    }
    // The first iteration warms up, as for the transfer.
    let copies = time_memcpy(&mut g, moved, 1, p.iters)?;
    println!("MOVED {moved}");
    println!("XFER {}", encode(&times));
    println!("COPY {}", encode(&copies));
    g.barrier().map_err(|e| e.to_string())?;
    Ok(())
}

fn policy(iters: usize) {
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
    println!(
        "EPLB policy (L={l}, E={e}, P={p}, G={g}, N={n}, R={r}): median {:.3} ms, p99 {:.3} ms over {iters} runs (target <= 1 ms)",
        med * 1e3,
        p99 * 1e3
    );
}

/// `epcomm bench eplb`.
pub fn cmd_eplb(args: &[String]) -> ExitCode {
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let p = match parse(args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("epcomm: error: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if let Some(code) = crate::ranks::as_rank(|rank, group| rank_main(&p, rank, group)) {
        return code;
    }
    policy(p.iters);
    let outputs = match crate::ranks::run(&["bench", "eplb"], args, p.ranks, "bencheplb", &[]) {
        Ok(o) if o.iter().all(|o| o.status.success()) => o,
        Ok(o) => {
            for out in &o {
                eprint!("{}", String::from_utf8_lossy(&out.stderr));
            }
            eprintln!("epcomm: a benchmark rank failed");
            return ExitCode::from(1);
        }
        Err(e) => {
            eprintln!("epcomm: {e}");
            return ExitCode::from(1);
        }
    };
    let mut xfer = Vec::new();
    let mut copy = Vec::new();
    let mut moved = 0f64;
    for out in &outputs {
        let text = String::from_utf8_lossy(&out.stdout);
        xfer.push(decode(tagged(&text, "XFER ")));
        copy.push(decode(tagged(&text, "COPY ")));
        moved = moved.max(tagged(&text, "MOVED ").trim().parse().unwrap_or(0.0));
    }
    let (xm, xp) = median_p99(slowest(&xfer));
    let (cm, _) = median_p99(slowest(&copy));
    println!(
        "EPLB weight transfer ({} ranks, {} layers x {} experts of {} MiB per rank, half received from a peer, half moved locally; torch_gloo over shm): {:.1} MiB placed per rank in {:.2} ms (p99 {:.2}), {:.2} GB/s; memcpy of the same bytes {:.2} ms, {:.2} GB/s; transfer/memcpy bandwidth {:.2}",
        p.ranks,
        p.layers,
        p.per_rank,
        p.expert_mib,
        moved / (1 << 20) as f64,
        xm * 1e3,
        xp * 1e3,
        moved / xm / 1e9,
        cm * 1e3,
        moved / cm / 1e9,
        cm / xm
    );
    ExitCode::SUCCESS
}
