//! `epcomm bench moe`: dispatch, combine and the pair per backend, ranks as processes pinned one
//! per core, with a memcpy of the same bytes timed in the same run.
//!
//! Per iteration every rank waits at a barrier, then times dispatch and combine; an
//! iteration's time is the slowest rank's. Bytes follow DeepEP's two conventions: rank
//! deduplicated (a token counted once per destination rank) and per expert copy (once per
//! (token, expert) pair).

use std::process::ExitCode;
use std::time::Instant;

use epcomm::group::shm::{pin_current_thread, ShmGroup};
use epcomm::group::{Group, GroupOptions};
use epcomm::moe::reference::unit;
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::FloatKind;
use epcomm::select::all2all::{self, Backend};

use crate::stats::{decode, encode, median_p99, slowest, time_memcpy};

#[derive(Clone, Debug)]
struct Params {
    backends: Vec<String>,
    ranks: usize,
    tokens: Vec<usize>,
    hidden: usize,
    experts: usize,
    topk: usize,
    kind: FloatKind,
    routing: String,
    iters: usize,
    warmup: usize,
    json: bool,
    /// Where to write the SVG chart of GB/s against T, if anywhere.
    svg: Option<String>,
}

const USAGE: &str = "usage: epcomm bench moe [--backend NAME[,NAME..]|all] [--ranks N] [--tokens T[,T..]] [--hidden H] [--experts E] [--topk K] [--dtype bf16|f16|f32] [--routing uniform|skewed|top2] [--iters N] [--warmup N] [--json] [--svg FILE]";

fn parse(args: &[String]) -> Result<Params, String> {
    let mut p = Params {
        backends: vec!["deepep_high_throughput".into()],
        ranks: 2,
        tokens: vec![128, 4096],
        hidden: 7168,
        experts: 256,
        topk: 8,
        kind: FloatKind::Bf16,
        routing: "uniform".into(),
        iters: 50,
        warmup: 5,
        json: false,
        svg: None,
    };
    for (name, value) in crate::opts::pairs(args, &["--json"])? {
        let count = |v: &str| crate::opts::count(&name, v);
        match name.as_str() {
            "--json" => p.json = true,
            "--svg" => p.svg = Some(value),
            "--backend" => p.backends = value.split(',').map(str::to_owned).collect(),
            "--ranks" => p.ranks = count(&value)?,
            "--tokens" => p.tokens = value.split(',').map(count).collect::<Result<_, _>>()?,
            "--hidden" => p.hidden = count(&value)?,
            "--experts" => p.experts = count(&value)?,
            "--topk" => p.topk = count(&value)?,
            "--iters" => p.iters = count(&value)?,
            "--warmup" => p.warmup = count(&value)?,
            "--dtype" => p.kind = crate::opts::dtype(&value)?,
            "--routing" => {
                if !matches!(value.as_str(), "uniform" | "skewed" | "top2") {
                    return Err(format!(
                        "--routing {value}: expected uniform, skewed or top2"
                    ));
                }
                p.routing = value;
            }
            other => return Err(format!("unknown option '{other}'")),
        }
    }
    if p.backends == ["all"] {
        p.backends = Backend::ALL
            .iter()
            .filter(|b| **b != Backend::Moonep)
            .map(|b| b.name().to_owned())
            .collect();
    }
    for b in &p.backends {
        all2all::resolve_quiet(b).map_err(|e| format!("--backend: {e}"))?;
    }
    if p.ranks == 0 || p.iters == 0 || p.experts % p.ranks.max(1) != 0 || p.topk > p.experts {
        return Err(
            "need --ranks > 0, --iters > 0, --experts a multiple of --ranks, --topk <= --experts"
                .into(),
        );
    }
    Ok(p)
}

/// Routing of one rank: uniform, skewed (Zipf-like) or top-2 (every token picks two of its
/// experts on one other rank).
fn routing(p: &Params, rank: usize, t: usize) -> (Vec<i64>, Vec<f32>) {
    let k = p.topk;
    let mut ids = Vec::with_capacity(t * k);
    for tok in 0..t {
        let mut row: Vec<i64> = Vec::new();
        let mut i = 0u64;
        while row.len() < k {
            let u = (unit(0xbe7c ^ (rank as u64) << 32, (tok as u64) << 12 | i) + 1.0) / 2.0;
            i += 1;
            let e = match p.routing.as_str() {
                "skewed" => ((u * u * u) * p.experts as f32) as usize,
                "top2" => {
                    // Two experts of one rank, the rest masked.
                    if row.len() >= 2 {
                        row.push(-1);
                        continue;
                    }
                    let el = p.experts / p.ranks;
                    let dst = (rank + 1 + tok) % p.ranks;
                    dst * el + ((u * el as f32) as usize).min(el - 1)
                }
                _ => (u * p.experts as f32) as usize,
            }
            .min(p.experts - 1) as i64;
            if !row.contains(&e) {
                row.push(e);
            }
        }
        ids.extend(row);
    }
    let w = vec![1.0 / k as f32; t * k];
    (ids, w)
}

struct Sample {
    dispatch: f64,
    combine: f64,
}

fn rank_main(p: &Params, rank: usize, group: &str) -> Result<(), String> {
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let _ = pin_current_thread(rank % ncpu);
    let mut g =
        ShmGroup::join(group, rank, p.ranks, GroupOptions::default()).map_err(|e| e.to_string())?;
    let es = p.kind.size();
    for name in &p.backends {
        for &t in &p.tokens {
            let cfg = MoeConfig {
                num_experts: p.experts,
                top_k: p.topk,
                hidden: p.hidden,
                hidden_dtype: p.kind.dtype(),
                expert_dtype: p.kind,
                out_dtype: p.kind,
                max_tokens_per_rank: t,
                extra_row_bytes: vec![],
                apply_router_weight_on_input: false,
            };
            let mut m = Manager::new(name, cfg, rank, p.ranks).map_err(|e| e.to_string())?;
            let (ids, w) = routing(p, rank, t);
            let x: Vec<u8> = (0..t * p.hidden * es)
                .map(|i| (i % 251) as u8 & 0x3f)
                .collect();
            let mut out = vec![0u8; t * p.hidden * es];
            let mut y: Vec<u8> = Vec::new();
            let mut samples = Vec::new();
            let (mut dedup, mut per_expert) = (0u64, 0u64);
            for it in 0..p.warmup + p.iters {
                g.barrier().map_err(|e| e.to_string())?;
                let t0 = Instant::now();
                let bytes = m
                    .dispatch(&mut g, &x, &ids, &w, &[])
                    .map_err(|e| e.to_string())?
                    .hidden
                    .len();
                let t1 = Instant::now();
                // The experts' output: the dispatch buffer's shape, same dtype (not timed).
                y.resize(bytes, 0);
                g.barrier().map_err(|e| e.to_string())?;
                let t2 = Instant::now();
                m.combine(&mut g, &y, &mut out).map_err(|e| e.to_string())?;
                let t3 = Instant::now();
                if it >= p.warmup {
                    samples.push(Sample {
                        dispatch: (t1 - t0).as_secs_f64(),
                        combine: (t3 - t2).as_secs_f64(),
                    });
                }
                if it == 0 {
                    let row = (p.hidden * es) as u64;
                    let el = p.experts / p.ranks;
                    for tok in 0..t {
                        let r = &ids[tok * p.topk..(tok + 1) * p.topk];
                        let mut ranks: Vec<usize> = r
                            .iter()
                            .filter(|&&e| e >= 0)
                            .map(|&e| e as usize / el)
                            .collect();
                        per_expert += ranks.len() as u64 * row;
                        ranks.sort();
                        ranks.dedup();
                        dedup += ranks.len() as u64 * row;
                    }
                }
            }
            // memcpy of the bytes this rank received in dispatch, in the same run.
            let moved = m.stats().bytes_received.iter().sum::<u64>() as usize;
            let copies = time_memcpy(&mut g, moved, p.warmup, p.iters)?;
            println!(
                "SAMPLE {name} {t} {dedup} {per_expert} {moved} {} {} {}",
                encode(&samples.iter().map(|s| s.dispatch).collect::<Vec<_>>()),
                encode(&samples.iter().map(|s| s.combine).collect::<Vec<_>>()),
                encode(&copies)
            );
        }
    }
    g.barrier().map_err(|e| e.to_string())?;
    Ok(())
}

pub fn cmd_moe(args: &[String]) -> ExitCode {
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
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let outputs = match crate::ranks::run(&["bench", "moe"], args, p.ranks, "benchmoe", &[]) {
        Ok(o) if o.iter().all(|o| o.status.success()) => o,
        _ => {
            eprintln!("epcomm: a benchmark rank failed");
            return ExitCode::from(1);
        }
    };
    // Per rank, its sample lines.
    let lines: Vec<Vec<String>> = outputs
        .iter()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| l.strip_prefix("SAMPLE ").map(str::to_owned))
                .collect()
        })
        .collect();
    let oversub = if p.ranks > ncpu {
        " (oversubscribed)"
    } else {
        ""
    };
    if !p.json {
        println!(
            "epcomm bench moe: {} ranks{oversub}, hidden {}, {} experts, top-{}, {}, {} routing, {} iterations (median / p99 of the slowest rank)",
            p.ranks, p.hidden, p.experts, p.topk, p.kind.name(), p.routing, p.iters
        );
        println!(
            "{:<28} {:>6} {:>11} {:>11} {:>11} {:>11} {:>10} {:>10} {:>9}",
            "backend",
            "T",
            "dispatch ms",
            "combine ms",
            "pair ms",
            "pair p99",
            "GB/s dedup",
            "GB/s copy",
            "memcpy ms"
        );
    }
    let mut json = Vec::new();
    // Chart lines: per backend GB/s (rank-deduplicated bytes of the pair) against T, and the
    // memcpy roofline of the same bytes.
    let mut chart: Vec<crate::plot::Series> = Vec::new();
    let mut roofline: Vec<(f64, f64)> = Vec::new();
    for i in 0..lines[0].len() {
        let parsed: Vec<Vec<String>> = lines
            .iter()
            .map(|l| l[i].split_whitespace().map(str::to_owned).collect())
            .collect();
        let name = parsed[0][0].clone();
        let t: usize = parsed[0][1].parse().unwrap_or(0);
        let series =
            |col: usize| -> Vec<Vec<f64>> { parsed.iter().map(|f| decode(&f[col])).collect() };
        let (d, c, m) = (series(5), series(6), series(7));
        let (dv, cv) = (slowest(&d), slowest(&c));
        let pv: Vec<f64> = dv.iter().zip(&cv).map(|(a, b)| a + b).collect();
        let (dm, _) = median_p99(dv);
        let (cm, _) = median_p99(cv);
        let (pm, pp) = median_p99(pv);
        let (mm, _) = median_p99(slowest(&m));
        let dedup: f64 = parsed
            .iter()
            .map(|f| f[2].parse::<f64>().unwrap_or(0.0))
            .sum::<f64>()
            / p.ranks as f64;
        let per_exp: f64 = parsed
            .iter()
            .map(|f| f[3].parse::<f64>().unwrap_or(0.0))
            .sum::<f64>()
            / p.ranks as f64;
        // Bytes per rank moved by the pair: dispatch out and combine back.
        let gbps = |b: f64| 2.0 * b / pm / 1e9;
        match chart.iter_mut().find(|s| s.label == name) {
            Some(s) => s.points.push((t as f64, gbps(dedup))),
            None => chart.push(crate::plot::Series {
                label: name.clone(),
                points: vec![(t as f64, gbps(dedup))],
                dashed: false,
            }),
        }
        if !roofline.iter().any(|r| r.0 == t as f64) && mm > 0.0 {
            roofline.push((t as f64, dedup / mm / 1e9));
        }
        if p.json {
            json.push(serde_json::json!({
                "backend": name, "tokens": t, "ranks": p.ranks, "dispatch_ms": dm * 1e3, "combine_ms": cm * 1e3,
                "pair_ms": pm * 1e3, "pair_p99_ms": pp * 1e3, "gbps_dedup": gbps(dedup), "gbps_per_expert": gbps(per_exp),
                "memcpy_ms": mm * 1e3,
            }));
        } else {
            println!(
                "{:<28} {:>6} {:>11.2} {:>11.2} {:>11.2} {:>11.2} {:>10.2} {:>10.2} {:>9.2}",
                name,
                t,
                dm * 1e3,
                cm * 1e3,
                pm * 1e3,
                pp * 1e3,
                gbps(dedup),
                gbps(per_exp),
                mm * 1e3
            );
        }
    }
    if p.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::Value::Array(json)).unwrap_or_default()
        );
    }
    if let Some(path) = &p.svg {
        roofline.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart.push(crate::plot::Series {
            label: "memcpy (same bytes)".into(),
            points: roofline,
            dashed: true,
        });
        let title = format!(
            "dispatch+combine, {} ranks, H={} {}, E={}, top-{}, {} routing",
            p.ranks,
            p.hidden,
            p.kind.name(),
            p.experts,
            p.topk,
            p.routing
        );
        let svg = crate::plot::line_chart(
            &title,
            "tokens per rank (T)",
            "GB/s per rank (rank-deduplicated bytes)",
            &chart,
        );
        if let Err(e) = std::fs::write(path, svg) {
            eprintln!("epcomm: cannot write {path}: {e}");
            return ExitCode::from(1);
        }
    }
    ExitCode::SUCCESS
}
