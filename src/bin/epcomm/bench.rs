//! `epcomm bench group`: all_to_allv bandwidth over shared memory against a plain memcpy of the
//! same bytes, measured in the same run (ratios, not absolute times, are the result).
//!
//! The parent spawns one process per rank (this binary again), pinned one per core; each rank
//! times every iteration after a barrier, and the parent takes, per iteration, the slowest rank.

use std::process::ExitCode;
use std::time::Instant;

use epcomm::group::shm::{pin_current_thread, ShmGroup};
use epcomm::group::{Group, GroupOptions};

use crate::stats::{decode, encode, median_p99, slowest, tagged, time_memcpy};

struct Params {
    ranks: usize,
    mib: usize,
    iters: usize,
    json: bool,
}

fn parse(args: &[String]) -> Result<Params, String> {
    let mut p = Params {
        ranks: 2,
        mib: 64,
        iters: 30,
        json: false,
    };
    for (name, value) in crate::opts::pairs(args, &["--json"])? {
        match name.as_str() {
            "--ranks" => p.ranks = crate::opts::count(&name, &value)?,
            "--mib" => p.mib = crate::opts::count(&name, &value)?,
            "--iters" => p.iters = crate::opts::count(&name, &value)?,
            "--json" => p.json = true,
            other => {
                return Err(format!(
                    "unknown bench option '{other}' (--ranks --mib --iters --json)"
                ))
            }
        }
    }
    if p.ranks == 0 || p.mib == 0 || p.iters == 0 {
        return Err("--ranks, --mib and --iters must be positive".into());
    }
    Ok(p)
}

/// One rank: returns (all_to_allv seconds per iteration, memcpy seconds per iteration).
fn rank_main(group: &str, rank: usize, p: &Params) -> Result<(Vec<f64>, Vec<f64>), String> {
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let _ = pin_current_thread(rank % ncpu);
    let bytes = p.mib << 20;
    let chunk = bytes / p.ranks;
    let total = chunk * p.ranks;
    let opts = GroupOptions {
        initial_capacity: total + (1 << 20),
        ..GroupOptions::default()
    };
    let mut g = ShmGroup::join(group, rank, p.ranks, opts).map_err(|e| e.to_string())?;
    let send: Vec<u8> = (0..total).map(|i| (i * 31 + rank) as u8).collect();
    let mut recv = vec![0u8; total];
    let sizes = vec![chunk; p.ranks];
    let mut a2a = Vec::new();
    for it in 0..p.iters + 3 {
        g.barrier().map_err(|e| e.to_string())?;
        let t = Instant::now();
        g.all_to_allv(&send, &sizes, &mut recv, &sizes)
            .map_err(|e| e.to_string())?;
        if it >= 3 {
            a2a.push(t.elapsed().as_secs_f64());
        }
    }
    // Check one chunk so the benchmark cannot silently measure garbage.
    let src = (rank + 1) % p.ranks;
    let expect = ((rank * chunk) * 31 + src) as u8;
    if recv[src * chunk] != expect {
        return Err(format!("rank {rank}: wrong data from rank {src}"));
    }
    let copy = time_memcpy(&mut g, total, 3, p.iters)?;
    g.barrier().map_err(|e| e.to_string())?;
    Ok((a2a, copy))
}

const USAGE: &str = "usage: epcomm bench group [--ranks N] [--mib MiB-per-rank] [--iters N] [--json]\n       epcomm bench moe --help\n       epcomm bench eplb --help";

pub fn cmd_bench(args: &[String]) -> ExitCode {
    let help = |a: &String| a == "--help" || a == "-h";
    match args.first().map(String::as_str) {
        Some("group") if args[1..].iter().any(help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some("group") => {}
        Some("moe") => return crate::bench_moe::cmd_moe(&args[1..]),
        Some("eplb") => return crate::bench_eplb::cmd_eplb(&args[1..]),
        Some("--help" | "-h" | "help") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    }
    let p = match parse(&args[1..]) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("epcomm: error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some((rank, group)) = crate::ranks::this_rank() {
        return match rank_main(&group, rank, &p) {
            Ok((a, c)) => {
                println!("A2A {}", encode(&a));
                println!("COPY {}", encode(&c));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("rank {rank}: {e}");
                ExitCode::from(1)
            }
        };
    }
    let outputs = match crate::ranks::run(&["bench"], args, p.ranks, "bench", &[]) {
        Ok(o) if o.iter().all(|o| o.status.success()) => o,
        _ => {
            eprintln!("epcomm: a benchmark rank failed");
            return ExitCode::from(1);
        }
    };
    let mut a2a: Vec<Vec<f64>> = Vec::new();
    let mut copy: Vec<Vec<f64>> = Vec::new();
    for out in outputs {
        let text = String::from_utf8_lossy(&out.stdout);
        a2a.push(decode(tagged(&text, "A2A ")));
        copy.push(decode(tagged(&text, "COPY ")));
    }
    let bytes = ((p.mib << 20) / p.ranks * p.ranks) as f64;
    let (am, ap) = median_p99(slowest(&a2a));
    let (cm, cp) = median_p99(slowest(&copy));
    if p.json {
        println!(
            "{}",
            serde_json::json!({
                "ranks": p.ranks, "bytes_per_rank": bytes, "iters": p.iters,
                "all_to_allv_median_s": am, "all_to_allv_p99_s": ap,
                "memcpy_median_s": cm, "memcpy_p99_s": cp,
                "all_to_allv_gbps": bytes / am / 1e9, "memcpy_gbps": bytes / cm / 1e9,
                "time_ratio_vs_memcpy": am / cm,
            })
        );
    } else {
        println!(
            "all_to_allv over shm: {} ranks, {:.1} MiB received per rank, {} iterations (median / p99, slowest rank)",
            p.ranks,
            bytes / (1 << 20) as f64,
            p.iters
        );
        println!(
            "{:<14} {:>10} {:>10} {:>9}",
            "", "median ms", "p99 ms", "GB/s"
        );
        println!(
            "{:<14} {:>10.2} {:>10.2} {:>9.2}",
            "all_to_allv",
            am * 1e3,
            ap * 1e3,
            bytes / am / 1e9
        );
        println!(
            "{:<14} {:>10.2} {:>10.2} {:>9.2}",
            "memcpy",
            cm * 1e3,
            cp * 1e3,
            bytes / cm / 1e9
        );
        println!("time ratio all_to_allv / memcpy: {:.2}", am / cm);
    }
    ExitCode::SUCCESS
}
