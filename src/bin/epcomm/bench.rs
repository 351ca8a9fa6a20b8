//! `epcomm bench group`: all_to_allv bandwidth over shared memory against a plain memcpy of the
//! same bytes, measured in the same run (ratios, not absolute times, are the result).
//!
//! The parent spawns one process per rank (this binary again), pinned one per core; each rank
//! times every iteration after a barrier, and the parent takes, per iteration, the slowest rank.
//! Every rank then checks every byte it received against what its sender wrote.

use std::process::ExitCode;
use std::time::Instant;

use epcomm::group::shm::{pin_current_thread, ShmGroup};
use epcomm::group::{AllToAllv, Group, GroupOptions};

use crate::cli::GroupArgs;
use crate::memory::{self, Need};
use crate::stats::{decode, encode, median_p99, slowest, tagged, time_memcpy};

/// The byte rank `src` sends at offset `i` of its send buffer.
fn pattern(i: usize, src: usize) -> u8 {
    (i.wrapping_mul(31) + src) as u8
}

/// One rank: (all_to_allv seconds per iteration, memcpy seconds per iteration, wrong bytes).
fn rank_main(group: &str, rank: usize, p: &GroupArgs) -> Result<(Vec<f64>, Vec<f64>, u64), String> {
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let _ = pin_current_thread(rank % ncpu);
    let chunk = (p.mib << 20) / p.ranks;
    let total = chunk * p.ranks;
    let opts = GroupOptions {
        initial_capacity: total + (1 << 20),
        ..GroupOptions::default()
    };
    let mut g = ShmGroup::join(group, rank, p.ranks, opts).map_err(|e| e.to_string())?;
    let send: Vec<u8> = (0..total).map(|i| pattern(i, rank)).collect();
    let mut recv = vec![0u8; total];
    let sizes = vec![chunk; p.ranks];
    let mut a2a = Vec::new();
    for it in 0..p.iters + 3 {
        g.barrier().map_err(|e| e.to_string())?;
        let t = Instant::now();
        g.all_to_allv(AllToAllv {
            send: &send,
            send_sizes: &sizes,
            recv: &mut recv,
            recv_sizes: &sizes,
        })
        .map_err(|e| e.to_string())?;
        if it >= 3 {
            a2a.push(t.elapsed().as_secs_f64());
        }
    }
    // Chunk `src` of recv is chunk `rank` of src's send buffer.
    let wrong = (0..p.ranks)
        .map(|src| {
            recv[src * chunk..(src + 1) * chunk]
                .iter()
                .enumerate()
                .filter(|(j, &b)| b != pattern(rank * chunk + j, src))
                .count() as u64
        })
        .sum();
    drop((send, recv));
    let copy = time_memcpy(&mut g, total, 3, p.iters)?;
    g.barrier().map_err(|e| e.to_string())?;
    Ok((a2a, copy, wrong))
}

/// In a rank process: the rank's samples on stdout, for the parent.
fn rank_report(p: &GroupArgs, rank: usize, group: &str) -> ExitCode {
    match rank_main(group, rank, p) {
        Ok((a, c, wrong)) => {
            println!("A2A {}", encode(&a));
            println!("COPY {}", encode(&c));
            println!("WRONG {wrong}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rank {rank}: {e}");
            ExitCode::from(1)
        }
    }
}

/// `epcomm bench group`.
pub fn cmd_group(p: &GroupArgs) -> ExitCode {
    if let Some((rank, group)) = crate::ranks::this_rank() {
        return rank_report(p, rank, &group);
    }
    let bytes = (p.mib << 20) / p.ranks * p.ranks;
    // Send and receive buffers, then the memcpy's two (the shm region holds one contribution).
    let need = Need {
        memory: 2 * bytes as u64,
        shm: bytes as u64,
        parts: Vec::new(),
    };
    let what = format!("all_to_allv of {} MiB per rank", p.mib);
    if let Some(line) = memory::refusal(&what, &need, p.ranks, "--mib") {
        eprintln!("epcomm bench group: {line}");
        return ExitCode::from(1);
    }
    let outputs = match crate::ranks::run(p.ranks, "bench", &[]) {
        Ok(o) if o.iter().all(|o| o.success) => o,
        _ => {
            eprintln!("epcomm: a benchmark rank failed");
            return ExitCode::from(1);
        }
    };
    let mut a2a: Vec<Vec<f64>> = Vec::new();
    let mut copy: Vec<Vec<f64>> = Vec::new();
    let mut wrong = 0u64;
    for out in &outputs {
        a2a.push(decode(tagged(&out.stdout, "A2A ")));
        copy.push(decode(tagged(&out.stdout, "COPY ")));
        wrong += tagged(&out.stdout, "WRONG ")
            .trim()
            .parse::<u64>()
            .unwrap_or(u64::MAX / 4);
    }
    report(p, bytes, &a2a, &copy, wrong);
    if wrong > 0 {
        eprintln!("epcomm: {wrong} wrong bytes received");
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

/// The JSON object or the nccl-tests style table of one run.
fn report(p: &GroupArgs, bytes: usize, a2a: &[Vec<f64>], copy: &[Vec<f64>], wrong: u64) {
    let size = bytes as f64;
    let n = p.ranks as f64;
    let (am, ap) = median_p99(slowest(a2a));
    let (cm, cp) = median_p99(slowest(copy));
    let algbw = size / am / 1e9;
    let busbw = algbw * (n - 1.0) / n;
    if p.json {
        println!(
            "{}",
            serde_json::json!({
                "ranks": p.ranks, "bytes_per_rank": size, "iters": p.iters,
                "size_bytes": size, "time_us": am * 1e6, "algbw_gbps": algbw, "busbw_gbps": busbw,
                "wrong": wrong,
                "all_to_allv_median_s": am, "all_to_allv_p99_s": ap,
                "memcpy_median_s": cm, "memcpy_p99_s": cp,
                "all_to_allv_gbps": algbw, "memcpy_gbps": size / cm / 1e9,
                "time_ratio_vs_memcpy": am / cm,
            })
        );
    } else {
        println!(
            "# epcomm bench group: all_to_allv over shared memory, {} ranks (processes, one per core), {} iterations after 3 warm-up; times: median over iterations of the slowest rank",
            p.ranks, p.iters
        );
        println!("# size: bytes each rank receives per all_to_allv (equal chunks from every rank, its own included)");
        println!(
            "# algbw = size / time; busbw = algbw * (n-1)/n with n = {} ranks (nccl-tests' alltoall); memcpy: one copy of size bytes in the same run",
            p.ranks
        );
        println!("# #wrong: received bytes that differ from what their sender wrote, all ranks");
        println!("#");
        println!(
            "# {:<12} {:>12} {:>10} {:>10} {:>11} {:>11} {:>10} {:>10} {:>7}",
            "op",
            "size(B)",
            "time(us)",
            "p99(us)",
            "algbw(GB/s)",
            "busbw(GB/s)",
            "memcpy(us)",
            "p99(us)",
            "#wrong"
        );
        println!(
            "  {:<12} {:>12} {:>10.1} {:>10.1} {:>11.2} {:>11.2} {:>10.1} {:>10.1} {:>7}",
            "all_to_allv",
            bytes,
            am * 1e6,
            ap * 1e6,
            algbw,
            busbw,
            cm * 1e6,
            cp * 1e6,
            wrong
        );
        println!("# time ratio all_to_allv / memcpy: {:.2}", am / cm);
        crate::stats::nccl_summary(wrong, busbw);
    }
}
