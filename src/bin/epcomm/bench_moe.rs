//! `epcomm bench moe`: dispatch, combine and the pair per backend and tokens per rank, ranks as
//! processes pinned one per core, with a memcpy of the same bytes timed in the same run.
//!
//! Per iteration every rank waits at a barrier, then times dispatch and combine; an
//! iteration's time is the slowest rank's. Bytes follow DeepEP's two conventions: rank
//! deduplicated (a token counted once per destination rank) and per expert copy (once per
//! (token, expert) pair). After the timed iterations one more, untimed, runs toy experts on the
//! received rows and compares every rank's combined output with the single-process reference.
//!
//! Before each case rank 0 compares the memory the case needs with what the machine has and
//! broadcasts the verdict; a case that does not fit is refused with one line, and the rest run.
//! The parent prints each row as soon as every rank has reported it.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Instant;

use epcomm::group::shm::{pin_current_thread, ShmGroup};
use epcomm::group::{Group, GroupOptions, SharedBuf};
use epcomm::moe::reference::{unit, ToyExperts};
use epcomm::moe::{self, layout, Manager, MoeConfig};
use epcomm::num;
use epcomm::select::all2all::{self, Backend};

use crate::cli::{BenchRouting, MoeArgs};
use crate::memory::{self, Need};
use crate::palette;
use crate::plot::{self, Marker, Series};
use crate::stats::{decode, encode, median_p99, slowest, time_memcpy, tolerance};

/// The benchmark's parameters: its arguments, with `all` expanded and the shape checked.
type Params = MoeArgs;

/// The environment variable that tells a rank process which of `--ranks` its run is.
const RUN_RANKS_ENV: &str = "EPCOMM_BENCH_MOE_RANKS";

/// The largest T of `--sweep`.
const SWEEP_MAX_T: usize = 8192;

/// The suffix of a case's backend name that runs it with FP8 dispatch (`--fp8`).
const FP8_SUFFIX: &str = "+fp8";

fn params(a: &MoeArgs) -> Result<Params, String> {
    let mut p = a.clone();
    if p.tokens.is_empty() {
        p.tokens = if p.sweep {
            std::iter::successors(Some(1), |t| Some(t * 2))
                .take_while(|&t| t <= SWEEP_MAX_T)
                .collect()
        } else {
            vec![128, 4096]
        };
    }
    if p.rank_counts.is_empty() {
        p.rank_counts = if p.sweep { vec![2, 4, 8] } else { vec![2] };
    }
    p.ranks = std::env::var(RUN_RANKS_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(p.rank_counts[0]);
    if p.backends == ["all"] {
        // Every backend whose layout epcomm implements.
        p.backends = Backend::ALL
            .iter()
            .filter(|b| layout::contract(b.layout()).is_some())
            .map(|b| b.name().to_owned())
            .collect();
    }
    for b in &p.backends {
        let r = crate::ranks::resolve_backend(b)?;
        if layout::contract(r.backend.layout()).is_none() {
            return Err("--backend moonep: MoonEP kernels are not part of epcomm".into());
        }
    }
    for &r in &p.rank_counts {
        crate::ranks::check_expert_shape(p.experts, r, p.topk)?;
    }
    Ok(p)
}

impl MoeArgs {
    /// The cases in the order they run: every T of each backend.
    fn cases(&self) -> Vec<(String, usize)> {
        let fp8 = self.fp8;
        self.backends
            .iter()
            .flat_map(|b| {
                [b.clone(), format!("{b}{FP8_SUFFIX}")]
                    .into_iter()
                    .take(1 + usize::from(fp8))
            })
            .flat_map(|b| self.tokens.iter().map(move |&t| (b.clone(), t)))
            .collect()
    }

    /// (warm-up, timed) iterations at `t`: as given, or with `--sweep` fewer at large T so
    /// that every case moves about as many bytes as T = 256 does (at least 3 timed).
    fn iters_at(&self, t: usize) -> (usize, usize) {
        if !self.sweep || t <= 256 {
            return (self.warmup, self.iters);
        }
        let timed = (self.iters * 256 / t).max(3).min(self.iters);
        (self.warmup.min(1), timed)
    }

    fn config(&self, t: usize) -> MoeConfig {
        crate::ranks::moe_config(self.experts, self.topk, self.hidden, self.kind, t)
    }

    /// Memory one rank needs for a case at its peak: the layout's buffers `b`, plus the
    /// reference check's float32 copies of the received rows (bounded by `b`) or the memcpy's
    /// two buffers, whichever is more, plus the tokens' own input, output and reference.
    fn need(&self, name: &str, t: usize) -> Need {
        let name = name.strip_suffix(FP8_SUFFIX).unwrap_or(name);
        let layout = all2all::resolve_quiet(name)
            .map_or(all2all::Layout::TokenMajor, |r| r.backend.layout());
        let b =
            moe::buffer_bytes(layout, &self.config(t), self.ranks, t).unwrap_or(usize::MAX) as u64;
        let es = self.kind.size() as u64;
        let check = (b / es).saturating_mul(8).max(b.saturating_mul(2));
        let tokens = (t as u64)
            .saturating_mul(self.hidden as u64)
            .saturating_mul(2 * es + 12);
        Need {
            memory: b.saturating_add(check).saturating_add(tokens),
            shm: b,
            parts: vec![
                (b, format!("the {} layout's buffers", layout.name())),
                (
                    check,
                    "the check's float32 copies of the received rows (or the memcpy's two buffers)"
                        .into(),
                ),
                (tokens, "the tokens' input, output and reference".into()),
            ],
        }
    }
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
            let e = match p.routing {
                BenchRouting::Skewed => ((u * u * u) * p.experts as f32) as usize,
                BenchRouting::Top2 => {
                    // Two experts of one rank, the rest masked.
                    if row.len() >= 2 {
                        row.push(-1);
                        continue;
                    }
                    let el = p.experts / p.ranks;
                    let dst = (rank + 1 + tok) % p.ranks;
                    dst * el + ((u * el as f32) as usize).min(el - 1)
                }
                BenchRouting::Uniform => (u * p.experts as f32) as usize,
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

/// Bytes per rank of the tokens' rows: (rank-deduplicated, per expert copy).
fn routed_bytes(p: &Params, ids: &[i64], t: usize) -> (u64, u64) {
    let row = (p.hidden * p.kind.size()) as u64;
    let el = p.experts / p.ranks;
    let (mut dedup, mut per_expert) = (0u64, 0u64);
    for tok in 0..t {
        let mut ranks: Vec<usize> = ids[tok * p.topk..(tok + 1) * p.topk]
            .iter()
            .filter(|&&e| e >= 0)
            .map(|&e| e as usize / el)
            .collect();
        per_expert += ranks.len() as u64 * row;
        ranks.sort_unstable();
        ranks.dedup();
        dedup += ranks.len() as u64 * row;
    }
    (dedup, per_expert)
}

/// The expert-output buffer the timed combines read (zeros: its contents do not change the
/// work).
enum ExpertOut {
    Heap(Vec<u8>),
    Shared(SharedBuf),
}

impl ExpertOut {
    /// Makes it `bytes` long, in `g`'s shared memory where `g` has some.
    fn fit(&mut self, g: &mut ShmGroup, bytes: usize) -> Result<(), String> {
        if self.bytes().len() == bytes {
            return Ok(());
        }
        *self = match g.alloc_shared(bytes).map_err(|e| e.to_string())? {
            Some(b) => ExpertOut::Shared(b),
            None => ExpertOut::Heap(vec![0u8; bytes]),
        };
        Ok(())
    }

    fn bytes(&self) -> &[u8] {
        match self {
            ExpertOut::Heap(v) => v,
            ExpertOut::Shared(b) => b,
        }
    }
}

/// The check of one case: toy experts on what dispatch delivered, combine, and the number of
/// output elements off the single-process float32 reference.
fn check_case(
    p: &Params,
    g: &mut ShmGroup,
    m: &mut Manager,
    x: &[u8],
    (ids, w): (&[i64], &[f32]),
    rank: usize,
    fp8: bool,
) -> Result<usize, String> {
    let experts = ToyExperts::new(p.experts, p.hidden, 0xbe7c);
    m.dispatch(g, x, ids, w, &[]).map_err(|e| e.to_string())?;
    let mut view = m.view();
    // FP8 rows are checked dequantised (value = element x its block's scale).
    let deq;
    if fp8 {
        let v = moe::fp8::dequantize(view.hidden, m.dispatch_scales(), p.hidden);
        deq = num::from_f32(&v, p.kind);
        view.hidden = &deq;
    }
    let y = num::from_f32(
        &experts.run_local(&view, p.kind, rank, p.ranks, p.topk),
        p.kind,
    );
    let mut out = vec![0u8; x.len()];
    m.combine(g, &y, &mut out).map_err(|e| e.to_string())?;
    let want = experts.reference(&num::to_f32(x, p.kind), ids, w, p.topk, false);
    // FP8: each input element within 2^-4 of itself or 16 x its scale (moe::fp8).
    let tol = if fp8 { 0.125 } else { tolerance(p.kind) };
    Ok(num::to_f32(&out, p.kind)
        .iter()
        .zip(&want)
        .filter(|(a, b)| {
            // NaN counts as wrong.
            let e = (*a - *b).abs() / b.abs().max(1.0);
            e.is_nan() || e > tol
        })
        .count())
}

/// One case on one rank: prints its `SAMPLE` line.
fn run_case(
    p: &Params,
    g: &mut ShmGroup,
    rank: usize,
    i: usize,
    name: &str,
    t: usize,
) -> Result<(), String> {
    let (backend, fp8) = match name.strip_suffix(FP8_SUFFIX) {
        Some(b) => (b, Some(moe::fp8::Scales::Exact)),
        None => (name, None),
    };
    let mut m = Manager::new(backend, p.config(t), rank, p.ranks).map_err(|e| e.to_string())?;
    m.set_dispatch_fp8(fp8).map_err(|e| e.to_string())?;
    let (ids, w) = routing(p, rank, t);
    let x32: Vec<f32> = (0..(t * p.hidden) as u64)
        .map(|j| unit(0x1234 ^ ((rank as u64) << 32), j))
        .collect();
    let x = num::from_f32(&x32, p.kind);
    drop(x32);
    let mut out = vec![0u8; t * p.hidden * p.kind.size()];
    // The experts' output, in the group's shared memory where it has some (as a caller would
    // allocate it): combine then reads it with plain loads.
    let mut y = ExpertOut::Heap(Vec::new());
    let ((warmup, iters), mut dispatch, mut combine) = (p.iters_at(t), Vec::new(), Vec::new());
    for it in 0..warmup + iters {
        g.barrier().map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        m.dispatch(g, &x, &ids, &w, &[])
            .map_err(|e| e.to_string())?;
        let t1 = Instant::now();
        // Expert outputs are --dtype rows, whatever the dispatch rows were (FP8).
        let bytes = m.combine_rows().unwrap_or(0) * p.hidden * p.kind.size();
        // The experts' output: the dispatch buffer's shape (not timed; checked below).
        y.fit(g, bytes)?;
        g.barrier().map_err(|e| e.to_string())?;
        let t2 = Instant::now();
        m.combine(g, y.bytes(), &mut out)
            .map_err(|e| e.to_string())?;
        let t3 = Instant::now();
        if it >= warmup {
            dispatch.push((t1 - t0).as_secs_f64());
            combine.push((t3 - t2).as_secs_f64());
        }
    }
    drop(y);
    let (dedup, per_expert) = routed_bytes(p, &ids, t);

    let wrong = check_case(p, g, &mut m, &x, (&ids, &w), rank, fp8.is_some())?;

    // memcpy of the bytes this rank received in dispatch, in the same run.
    let moved = m.stats().bytes_received.iter().sum::<u64>() as usize;
    drop(m);
    let copies = time_memcpy(g, moved, warmup, iters)?;
    println!(
        "SAMPLE {i} {name} {t} {dedup} {per_expert} {moved} {wrong} {} {} {}",
        encode(&dispatch),
        encode(&combine),
        encode(&copies)
    );
    Ok(())
}

fn rank_main(p: &Params, rank: usize, group: &str) -> Result<(), String> {
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let _ = pin_current_thread(rank % ncpu);
    let mut g =
        ShmGroup::join(group, rank, p.ranks, GroupOptions::default()).map_err(|e| e.to_string())?;
    for (i, (name, t)) in p.cases().into_iter().enumerate() {
        // Rank 0 decides for all: MemAvailable moves, and the ranks must agree.
        let refused = if rank == 0 {
            memory::refusal(
                &format!("{name} T={t}"),
                &p.need(&name, t),
                p.ranks,
                "--tokens or --hidden",
            )
        } else {
            None
        };
        let mut verdict = [u8::from(refused.is_some())];
        g.broadcast(0, &mut verdict).map_err(|e| e.to_string())?;
        if verdict[0] != 0 {
            if let Some(line) = refused {
                println!("REFUSED {i} {line}");
            }
            continue;
        }
        if rank == 0 {
            println!("START {i}");
        }
        run_case(p, &mut g, rank, i, &name, t)?;
    }
    g.barrier().map_err(|e| e.to_string())?;
    Ok(())
}

/// One measured case, summarised over ranks.
struct Measured {
    name: String,
    t: usize,
    /// Dispatch and combine of the median iteration (by their sum), and their sum.
    dispatch: f64,
    combine: f64,
    pair: f64,
    pair_p99: f64,
    memcpy: f64,
    /// Bytes per rank of the pair: the rank-deduplicated rows out and back.
    size: f64,
    /// The same per (token, expert) copy.
    size_per_expert: f64,
    wrong: u64,
}

/// Summarises one case from its `SAMPLE` fields after the tag (`i name t dedup per_expert
/// moved wrong dispatch combine memcpy`), one list per rank.
fn measure(p: &Params, fields: &[Vec<String>]) -> Measured {
    let series = |col: usize| -> Vec<Vec<f64>> { fields.iter().map(|f| decode(&f[col])).collect() };
    let mean = |col: usize| -> f64 {
        fields
            .iter()
            .map(|f| f[col].parse::<f64>().unwrap_or(0.0))
            .sum::<f64>()
            / p.ranks as f64
    };
    let (dv, cv) = (slowest(&series(7)), slowest(&series(8)));
    let pv: Vec<f64> = dv.iter().zip(&cv).map(|(a, b)| a + b).collect();
    // The median iteration (by its dispatch + combine): its sum is the time, and its dispatch
    // and combine are the columns, so they add up to the time.
    let mut order: Vec<usize> = (0..pv.len()).collect();
    order.sort_by(|&a, &b| pv[a].total_cmp(&pv[b]));
    let mid = order.get(order.len() / 2).copied().unwrap_or(0);
    let at = |v: &[f64]| v.get(mid).copied().unwrap_or(0.0);
    let (dispatch, combine) = (at(&dv), at(&cv));
    let pair_p99 = if pv.is_empty() { 0.0 } else { median_p99(pv).1 };
    Measured {
        name: fields[0][1].clone(),
        t: fields[0][2].parse().unwrap_or(0),
        dispatch,
        combine,
        pair: dispatch + combine,
        pair_p99,
        memcpy: median_p99(slowest(&series(9))).0,
        size: 2.0 * mean(3),
        size_per_expert: 2.0 * mean(4),
        wrong: fields
            .iter()
            .map(|f| f[6].parse::<u64>().unwrap_or(u64::MAX))
            .fold(0, u64::saturating_add),
    }
}

/// One line of the per-backend averages: the backend, R and the mean busbw.
fn row_text_avg(name: &str, ranks: usize, busbw: f64) -> String {
    format!("{name:<28} R={ranks:<3} {busbw:>10.3}")
}

/// One table line: the backend left-aligned, the numbers right-aligned.
fn row_text(cols: [&str; 12]) -> String {
    let w = [28usize, 6, 12, 12, 12, 10, 10, 11, 11, 10, 10, 7];
    let mut s = String::new();
    for (i, (c, w)) in cols.iter().zip(w).enumerate() {
        if i == 0 {
            s.push_str(&format!("{c:<w$}"));
        } else {
            s.push_str(&format!(" {c:>w$}"));
        }
    }
    s
}

/// The header lines of the text table.
fn print_header(p: &Params) {
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let tol = tolerance(p.kind);
    let oversub = if p.ranks > ncpu {
        ", oversubscribed"
    } else {
        ""
    };
    println!(
        "# epcomm bench moe: dispatch + combine over shared memory, {} ranks (processes, one per core{oversub})",
        p.ranks
    );
    println!(
        "# hidden {} {}, {} experts, top-{}, {} routing, {} iterations after {} warm-up{}; per iteration each step's time is the slowest rank's",
        p.hidden, p.kind.name(), p.experts, p.topk, p.routing.name(), p.iters, p.warmup,
        if p.sweep { " (at T > 256: iters x 256 / T, at least 3, after at most 1)" } else { "" }
    );
    println!("# size: bytes per rank of dispatch + combine (its rank-deduplicated rows out, the same rows back); time = dispatch + combine of the median iteration (the median of the per-iteration sums; dispatch and combine are that iteration's); p99: of the sums");
    println!(
        "# algbw = size / time; busbw = algbw * (n-1)/n with n = {} ranks (nccl-tests' alltoall); memcpy: one copy of the bytes dispatch received, same run",
        p.ranks
    );
    println!("# #wrong: elements of the combined output (toy experts on the received rows) off the single-process float32 reference by more than {tol:.0e} relative ({FP8_SUFFIX} rows: 0.125, the e4m3 bound), all ranks");
    println!("#");
    println!(
        "# {}",
        row_text([
            "backend",
            "T",
            "size(B)",
            "dispatch(us)",
            "combine(us)",
            "time(us)",
            "p99(us)",
            "algbw(GB/s)",
            "busbw(GB/s)",
            "memcpy(us)",
            "time/T(us)",
            "#wrong"
        ])
    );
}

/// A progress bar on a terminal, a hidden one elsewhere.
fn progress_bar(cases: usize) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let b = indicatif::ProgressBar::new(cases as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} cases {msg}",
    ) {
        b.set_style(style);
    }
    b.enable_steady_tick(std::time::Duration::from_millis(200));
    b
}

/// The parent's side of a run: the ranks' lines per case, and the cases reported so far.
struct Collector<'a> {
    p: &'a Params,
    json_out: bool,
    cases: Vec<(String, usize)>,
    bar: indicatif::ProgressBar,
    /// Per case: each rank's SAMPLE fields, or the refusal line.
    samples: Vec<Vec<Option<Vec<String>>>>,
    refused: Vec<Option<String>>,
    /// The first case not reported yet.
    next: usize,
    rows: Vec<Measured>,
    json: Vec<serde_json::Value>,
}

impl Collector<'_> {
    fn new(p: &Params, json_out: bool) -> Collector<'_> {
        let cases = p.cases();
        Collector {
            p,
            json_out,
            bar: progress_bar(cases.len()),
            samples: vec![vec![None; p.ranks]; cases.len()],
            refused: vec![None; cases.len()],
            cases,
            next: 0,
            rows: Vec::new(),
            json: Vec::new(),
        }
    }

    /// Takes one line of rank `rank`'s stdout.
    fn take(&mut self, rank: usize, line: &str) {
        let mut f = line.split_whitespace();
        let (tag, idx) = (f.next(), f.next().and_then(|s| s.parse::<usize>().ok()));
        let Some(i) = idx.filter(|&i| i < self.cases.len()) else {
            return;
        };
        match tag {
            Some("START") => self
                .bar
                .set_message(format!("{} T={}", self.cases[i].0, self.cases[i].1)),
            Some("REFUSED") => {
                self.refused[i] = Some(line.splitn(3, ' ').nth(2).unwrap_or("").into())
            }
            Some("SAMPLE") => {
                self.samples[i][rank] =
                    Some(line.split_whitespace().skip(1).map(String::from).collect())
            }
            _ => return,
        }
        self.report_complete();
    }

    /// Reports every case that is complete, in order, as soon as it is.
    fn report_complete(&mut self) {
        while self.next < self.cases.len() {
            if let Some(why) = &self.refused[self.next] {
                self.bar.suspend(|| eprintln!("epcomm bench moe: {why}"));
            } else if self.samples[self.next].iter().all(Option::is_some) {
                let fields: Vec<Vec<String>> =
                    self.samples[self.next].iter().flatten().cloned().collect();
                let r = measure(self.p, &fields);
                self.report(r);
            } else {
                break;
            }
            self.next += 1;
            self.bar.inc(1);
        }
    }

    /// One measured case: its table line or JSON object, and its chart points.
    fn report(&mut self, r: Measured) {
        let n = self.p.ranks as f64;
        let algbw = r.size / r.pair / 1e9;
        let busbw = algbw * (n - 1.0) / n;
        if self.json_out {
            self.json.push(serde_json::json!({
                "backend": r.name, "tokens": r.t, "ranks": self.p.ranks,
                "size_bytes": r.size, "time_us": r.pair * 1e6,
                "algbw_gbps": algbw, "busbw_gbps": busbw, "wrong": r.wrong,
                "dispatch_ms": r.dispatch * 1e3, "combine_ms": r.combine * 1e3,
                "pair_ms": r.pair * 1e3, "pair_p99_ms": r.pair_p99 * 1e3,
                "gbps_dedup": algbw, "gbps_per_expert": r.size_per_expert / r.pair / 1e9,
                "memcpy_ms": r.memcpy * 1e3,
                "us_per_token": r.pair * 1e6 / r.t.max(1) as f64,
            }));
        } else {
            let us = |s: f64| format!("{:.1}", s * 1e6);
            let text = row_text([
                &r.name,
                &r.t.to_string(),
                &format!("{:.0}", r.size),
                &us(r.dispatch),
                &us(r.combine),
                &us(r.pair),
                &us(r.pair_p99),
                &format!("{algbw:.2}"),
                &format!("{busbw:.2}"),
                &us(r.memcpy),
                &format!("{:.2}", r.pair * 1e6 / r.t.max(1) as f64),
                &r.wrong.to_string(),
            ]);
            self.bar.suspend(|| {
                println!("  {text}");
                let _ = std::io::stdout().flush();
            });
        }
        self.rows.push(r);
    }

    /// Hands this run's rows, JSON objects and counts to `sweep`.
    fn into_sweep(self, sweep: &mut Sweep, failed_ranks: usize) {
        sweep.cases += self.cases.len();
        sweep.refused += self.refused.iter().flatten().count();
        sweep.failed_ranks += failed_ranks;
        sweep.incomplete |= self.next < self.cases.len();
        sweep.json.extend(self.json);
        let refused = self
            .cases
            .iter()
            .zip(&self.refused)
            .filter(|(_, r)| r.is_some())
            .map(|(c, _)| c.clone())
            .collect();
        sweep.runs.push(Run {
            ranks: self.p.ranks,
            rows: self.rows,
            refused,
        });
    }
}

/// One run of `--ranks`: its rank count, its measured rows and its refused (backend, T) cases.
struct Run {
    ranks: usize,
    rows: Vec<Measured>,
    refused: Vec<(String, usize)>,
}

/// Everything measured over the runs of `--ranks`, one run per R.
#[derive(Default)]
struct Sweep {
    runs: Vec<Run>,
    json: Vec<serde_json::Value>,
    cases: usize,
    refused: usize,
    failed_ranks: usize,
    /// Some run ended before every case was reported.
    incomplete: bool,
}

impl Sweep {
    /// The closing lines (or the JSON array), the charts, and the exit code.
    fn finish(self, p: &Params, json_out: bool, svg: Option<&str>) -> ExitCode {
        let rows = || {
            self.runs
                .iter()
                .flat_map(|run| run.rows.iter().map(|r| (run.ranks, r)))
        };
        let wrong = rows().map(|(_, r)| r.wrong).fold(0, u64::saturating_add);
        let measured = rows().count();
        if json_out {
            let all = serde_json::Value::Array(self.json.clone());
            println!("{}", serde_json::to_string_pretty(&all).unwrap_or_default());
        } else {
            // One average per backend and R: backends move what their layouts need, so an
            // average across them would mix contracts.
            let mut avgs: Vec<(String, usize, f64, usize)> = Vec::new();
            for (n, r) in rows() {
                let busbw = r.size / r.pair / 1e9 * (n as f64 - 1.0) / n as f64;
                match avgs.iter_mut().find(|a| a.0 == r.name && a.1 == n) {
                    Some(a) => (a.2, a.3) = (a.2 + busbw, a.3 + 1),
                    None => avgs.push((r.name.clone(), n, busbw, 1)),
                }
            }
            crate::stats::wrong_summary(wrong);
            println!("# Avg bus bandwidth per backend (GB/s, the mean busbw over its T; none across backends, which move different bytes):");
            for (name, n, sum, count) in avgs {
                println!("#   {}", row_text_avg(&name, n, sum / count as f64));
            }
            if self.refused > 0 {
                println!(
                    "# {} of {} cases refused for memory (see stderr)",
                    self.refused, self.cases
                );
            }
        }
        if let Some(path) = svg {
            if let Err(e) = write_charts(p, path, &self.runs) {
                eprintln!("epcomm: cannot write the charts at {path}: {e}");
                return ExitCode::from(1);
            }
        }
        if self.failed_ranks > 0 || self.incomplete {
            let n = self.failed_ranks;
            eprintln!("epcomm: {n} benchmark rank(s) failed (their errors are above)");
            ExitCode::from(1)
        } else if wrong > 0 {
            eprintln!("epcomm: {wrong} wrong values in the combined outputs");
            ExitCode::from(1)
        } else if measured == 0 {
            eprintln!("epcomm: every case was refused; nothing was measured");
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        }
    }
}

/// The series labelled `label` of `chart`, started (with `color`, `marker`, `dashed`) if new.
fn series<'c>(
    chart: &'c mut Vec<Series>,
    label: &str,
    color: &'static str,
    marker: Marker,
    dashed: bool,
) -> &'c mut Series {
    let i = match chart.iter().position(|s| s.label == label) {
        Some(i) => i,
        None => {
            chart.push(Series {
                label: label.to_owned(),
                points: Vec::new(),
                dashed,
                color,
                marker,
                refused: Vec::new(),
            });
            chart.len() - 1
        }
    };
    &mut chart[i]
}

/// A case's series style: its backend's colour (the same in every chart), dashed for FP8
/// dispatch.
fn style(name: &str) -> (&'static str, bool) {
    match name.strip_suffix(FP8_SUFFIX) {
        Some(base) => (palette::color(base), true),
        None => (palette::color(name), false),
    }
}

/// One GB/s chart per run (one line per backend, the memcpy of the same bytes dashed black)
/// and one chart of microseconds per token of every (backend, R) with memcpy's; both with a
/// log y axis, each backend in its own colour in every chart, one marker per R, a tick at each
/// measured T only, and a cross on the x axis for each refused case.
fn write_charts(p: &Params, path: &str, runs: &[Run]) -> std::io::Result<()> {
    let stem = path.strip_suffix(".svg").unwrap_or(path);
    let shape = format!(
        "H={} {}, E={}, top-{}, {} routing",
        p.hidden,
        p.kind.name(),
        p.experts,
        p.topk,
        p.routing.name()
    );
    let mut per_token = Vec::new();
    for (k, run) in runs.iter().enumerate() {
        let (n, mark) = (run.ranks, palette::marker(k));
        let mut chart = Vec::new();
        let mut memcpy: Vec<(f64, f64)> = Vec::new();
        let mut memcpy_us: Vec<(f64, f64)> = Vec::new();
        for r in &run.rows {
            let (t, (color, dashed)) = (r.t as f64, style(&r.name));
            series(&mut chart, &r.name, color, Marker::Circle, dashed)
                .points
                .push((t, r.size / r.pair / 1e9));
            series(
                &mut per_token,
                &format!("{}, R={n}", r.name),
                color,
                mark,
                dashed,
            )
            .points
            .push((t, r.pair * 1e6 / t));
            if r.memcpy > 0.0 && !memcpy.iter().any(|&(x, _)| x == t) {
                // The pair moves the received bytes twice: two copies of them.
                memcpy.push((t, r.size / 2.0 / r.memcpy / 1e9));
                memcpy_us.push((t, 2.0 * r.memcpy * 1e6 / t));
            }
        }
        for (name, t) in &run.refused {
            let (color, dashed) = style(name);
            series(&mut chart, name, color, Marker::Circle, dashed)
                .refused
                .push(*t as f64);
            series(
                &mut per_token,
                &format!("{name}, R={n}"),
                color,
                mark,
                dashed,
            )
            .refused
            .push(*t as f64);
        }
        memcpy.sort_by(|a, b| a.0.total_cmp(&b.0));
        memcpy_us.sort_by(|a, b| a.0.total_cmp(&b.0));
        if !memcpy.is_empty() {
            series(
                &mut chart,
                "memcpy (same bytes)",
                palette::MEMCPY,
                Marker::Circle,
                true,
            )
            .points = memcpy;
            series(
                &mut per_token,
                &format!("2 x memcpy, R={n}"),
                palette::MEMCPY,
                mark,
                true,
            )
            .points = memcpy_us;
        }
        for s in &mut chart {
            s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        let file = if runs.len() == 1 {
            path.to_owned()
        } else {
            format!("{stem}-r{n}.svg")
        };
        let svg = plot::line_chart(
            &format!("dispatch+combine, {n} ranks, {shape}"),
            "tokens per rank (T, measured values only)",
            "GB/s per rank (algbw: rank-deduplicated bytes, log scale)",
            &chart,
        );
        std::fs::write(file, svg)?;
    }
    for s in &mut per_token {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let svg = plot::line_chart(
        &format!("dispatch+combine per token, {shape}"),
        "tokens per rank (T, measured values only)",
        "microseconds per token (time / T, log scale)",
        &per_token,
    );
    std::fs::write(format!("{stem}-us-per-token.svg"), svg)
}

/// One run of every case on `p.ranks` rank processes, its rows printed as they come.
fn run_ranks(p: &Params, json_out: bool, sweep: &mut Sweep) {
    if !json_out {
        print_header(p);
    }
    let _ = std::io::stdout().flush();
    let mut c = Collector::new(p, json_out);
    let n = p.ranks.to_string();
    let ranks = match crate::ranks::Ranks::spawn(p.ranks, "benchmoe", &[(RUN_RANKS_ENV, &n)]) {
        Ok(r) => r,
        Err(e) => {
            c.bar.finish_and_clear();
            eprintln!("epcomm: {e}");
            sweep.incomplete = true;
            return;
        }
    };
    while let Some((rank, line)) = ranks.next_line() {
        c.take(rank, &line);
    }
    c.bar.finish_and_clear();
    let failed_ranks = ranks
        .wait()
        .iter()
        .filter(|s| !s.as_ref().is_ok_and(|s| s.success()))
        .count();
    c.into_sweep(sweep, failed_ranks);
}

/// `epcomm bench moe`: one run per `--ranks` entry, one table each.
pub fn cmd_moe(a: &MoeArgs) -> ExitCode {
    let mut p = match crate::ranks::start(params(a), rank_main) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let mut sweep = Sweep::default();
    for n in p.rank_counts.clone() {
        p.ranks = n;
        run_ranks(&p, a.json, &mut sweep);
    }
    sweep.finish(&p, a.json, a.svg.as_deref())
}
