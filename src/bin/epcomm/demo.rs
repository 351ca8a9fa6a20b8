//! `epcomm demo`: the main job. Several MoE steps per backend on ranks that are real processes
//! over shared memory: skewed random routing, toy experts with real weights, every rank's
//! combined output checked against the single-process float32 reference, and a table.

use std::process::ExitCode;
use std::time::Duration;

use epcomm::group::shm::ShmGroup;
use epcomm::group::GroupOptions;
use epcomm::moe::reference::{unit, ToyExperts};
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num;
use epcomm::select::all2all::{self, Backend};
use epcomm::Error;

use crate::cli::{DemoArgs, DemoRouting};

/// The demo's parameters: its arguments, with `all` expanded and the shape checked.
type Params = DemoArgs;

/// The demo's parameters, with the checks clap's per-option parsers cannot make.
fn params(a: &DemoArgs) -> Result<Params, String> {
    let mut p = a.clone();
    crate::ranks::check_expert_shape(p.experts, p.ranks, p.topk)?;
    if p.backends == ["all"] {
        p.backends = Backend::ALL.iter().map(|b| b.name().to_owned()).collect();
    }
    for b in &p.backends {
        crate::ranks::resolve_backend(b)?;
    }
    Ok(p)
}

impl DemoArgs {
    fn skewed(&self) -> bool {
        match self.routing {
            DemoRouting::Skewed => true,
            DemoRouting::Uniform => false,
        }
    }

    /// The managers' configuration.
    fn config(&self) -> MoeConfig {
        crate::ranks::moe_config(self.experts, self.topk, self.hidden, self.kind, self.tokens)
    }
}

/// Tokens of `rank` at `step`: around T, uneven across ranks, never above T.
fn tokens_of(p: &Params, rank: usize, step: usize) -> usize {
    let u = (unit(p.seed ^ 0x5eed, (rank * 1000 + step) as u64) + 1.0) / 2.0;
    ((p.tokens as f32) * (0.5 + 0.5 * u)) as usize
}

/// Top-k routing with a skewed (Zipf-like) or uniform expert popularity.
fn routing(p: &Params, rank: usize, step: usize, t: usize) -> (Vec<i64>, Vec<f32>) {
    let cdf: Vec<f32> = {
        let w: Vec<f32> = (0..p.experts)
            .map(|e| {
                if p.skewed() {
                    1.0 / ((e + 1) as f32).powf(1.1)
                } else {
                    1.0
                }
            })
            .collect();
        let total: f32 = w.iter().sum();
        w.iter()
            .scan(0.0, |a, x| {
                *a += x / total;
                Some(*a)
            })
            .collect()
    };
    // Spread hot experts over ranks: popularity rank i maps to expert (i * stride) % E.
    let stride = (1..p.experts)
        .find(|s| gcd(*s, p.experts) == 1 && *s * 3 > p.experts)
        .unwrap_or(1);
    let mut ids = Vec::with_capacity(t * p.topk);
    let mut ws = Vec::with_capacity(t * p.topk);
    for tok in 0..t {
        let mut row: Vec<i64> = Vec::new();
        let mut i = 0u64;
        while row.len() < p.topk {
            let u = (unit(
                p.seed ^ ((rank as u64) << 20) ^ ((step as u64) << 40),
                (tok as u64) << 10 | i,
            ) + 1.0)
                / 2.0;
            i += 1;
            let pop = cdf.iter().position(|&c| u <= c).unwrap_or(p.experts - 1);
            let e = ((pop * stride) % p.experts) as i64;
            if !row.contains(&e) {
                row.push(e);
            }
        }
        let raw: Vec<f32> = (0..p.topk)
            .map(|j| 1.0 + (unit(p.seed ^ 0xfeed, (tok * 64 + j) as u64) + 1.0))
            .collect();
        let s: f32 = raw.iter().sum();
        ids.extend(row);
        ws.extend(raw.iter().map(|r| r / s));
    }
    (ids, ws)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// One rank: prints `RESULT backend max_err dispatch_s combine_s tokens bytes` per backend.
fn rank_main(p: &Params, rank: usize, group: &str) -> Result<(), String> {
    let opts = GroupOptions {
        timeout: Duration::from_secs(60),
        ..GroupOptions::default()
    };
    let mut g = ShmGroup::join(group, rank, p.ranks, opts).map_err(|e| e.to_string())?;
    let experts = ToyExperts::new(p.experts, p.hidden, p.seed);
    for name in &p.backends {
        let cfg = p.config();
        let mut m = match Manager::new(name, cfg, rank, p.ranks) {
            Ok(m) => m,
            // The one backend whose kernels epcomm does not implement: not a failure.
            Err(Error::MoonEpUnavailable) => {
                println!("UNAVAILABLE {name}");
                continue;
            }
            Err(e) => {
                println!("FAIL {name} {}: {e}", e.exception());
                continue;
            }
        };
        let (mut err, mut dt, mut ct, mut tokens, mut bytes) = (0f32, 0f64, 0f64, 0u64, 0u64);
        for step in 0..p.steps {
            let t = tokens_of(p, rank, step);
            let (ids, ws) = routing(p, rank, step, t);
            let x32: Vec<f32> = (0..(t * p.hidden) as u64)
                .map(|i| unit(p.seed ^ ((rank as u64) << 32) ^ step as u64, i))
                .collect();
            let x = num::from_f32(&x32, p.kind);
            // A failed collective leaves the group unusable: report it and stop this rank.
            let v = m.dispatch(&mut g, &x, &ids, &ws, &[]).map_err(|e| {
                println!("FAIL {name} {}: {e}", e.exception());
                format!("{name}: {e}")
            })?;
            let y = num::from_f32(
                &experts.run_local(&v, p.kind, rank, p.ranks, p.topk),
                p.kind,
            );
            let mut out = vec![0u8; t * p.hidden * p.kind.size()];
            m.combine(&mut g, &y, &mut out).map_err(|e| {
                println!("FAIL {name} {}: {e}", e.exception());
                format!("{name}: {e}")
            })?;
            let want = experts.reference(&num::to_f32(&x, p.kind), &ids, &ws, p.topk, false);
            let got = num::to_f32(&out, p.kind);
            for (a, b) in got.iter().zip(&want) {
                err = err.max((a - b).abs() / b.abs().max(1.0));
            }
            let s = m.stats();
            dt += s.dispatch_time.as_secs_f64();
            ct += s.combine_time.as_secs_f64();
            tokens += t as u64;
            bytes +=
                s.bytes_received.iter().sum::<u64>() + s.combine_bytes_received.iter().sum::<u64>();
        }
        println!("RESULT {name} {err:e} {dt:e} {ct:e} {tokens} {bytes}");
    }
    Ok(())
}

struct Row {
    err: f32,
    dispatch: f64,
    combine: f64,
    tokens: u64,
    bytes: u64,
}

/// What became of one backend in the demo.
enum Outcome {
    /// Every rank's output matched the reference.
    Passed,
    /// A rank failed, or an output was off the reference (the reason).
    Failed(String),
    /// epcomm does not implement its kernels.
    Unavailable,
}

/// What the rank processes reported.
struct Reports {
    /// Per backend (in the order asked), each rank's result line.
    rows: Vec<(String, Vec<Row>)>,
    /// Backends epcomm has no kernels for.
    unavailable: Vec<String>,
    /// The first failure reported for a backend.
    failures: Vec<(String, String)>,
    /// Whether a rank process failed.
    rank_failed: bool,
}

impl Reports {
    fn new(p: &Params) -> Reports {
        // A backend whose manager cannot exist here is unavailable whatever the ranks did
        // (creating a manager only validates; nothing is allocated before the first dispatch).
        let unavailable = p
            .backends
            .iter()
            .filter(|name| {
                matches!(
                    Manager::new(name, p.config(), 0, p.ranks),
                    Err(Error::MoonEpUnavailable)
                )
            })
            .cloned()
            .collect();
        Reports {
            rows: p.backends.iter().map(|b| (b.clone(), Vec::new())).collect(),
            unavailable,
            failures: Vec::new(),
            rank_failed: false,
        }
    }

    /// Takes one line of a rank's stdout.
    fn take(&mut self, line: &str) {
        if let Some(rest) = line.strip_prefix("RESULT ") {
            let f: Vec<&str> = rest.split_whitespace().collect();
            if let (Some(slot), [_, e, d, c, t, b]) =
                (self.rows.iter_mut().find(|r| r.0 == f[0]), f.as_slice())
            {
                slot.1.push(Row {
                    err: e.parse().unwrap_or(f32::INFINITY),
                    dispatch: d.parse().unwrap_or(0.0),
                    combine: c.parse().unwrap_or(0.0),
                    tokens: t.parse().unwrap_or(0),
                    bytes: b.parse().unwrap_or(0),
                });
            }
        } else if let Some(name) = line.strip_prefix("UNAVAILABLE ") {
            if !self.unavailable.iter().any(|s| s == name) {
                self.unavailable.push(name.to_owned());
            }
        } else if let Some(rest) = line.strip_prefix("FAIL ") {
            let (name, why) = rest.split_once(' ').unwrap_or((rest, ""));
            if !self.failures.iter().any(|f| f.0 == name) {
                self.failures.push((name.to_owned(), why.to_owned()));
            }
        }
    }

    /// What became of backend `name`, whose ranks reported `r`.
    fn outcome(&self, p: &Params, name: &str, r: &[Row]) -> Outcome {
        let tol = crate::stats::tolerance(p.kind);
        if self.unavailable.iter().any(|u| u == name) {
            Outcome::Unavailable
        } else if let Some((_, why)) = self.failures.iter().find(|f| f.0 == name) {
            Outcome::Failed(why.clone())
        } else if r.len() != p.ranks {
            Outcome::Failed(format!(
                "{} of {} ranks finished (see the rank errors above)",
                r.len(),
                p.ranks
            ))
        } else {
            let err = r.iter().map(|x| x.err).fold(0.0, f32::max);
            if err <= tol {
                Outcome::Passed
            } else {
                Outcome::Failed(format!("max relative error {err:.2e} above {tol:.0e}"))
            }
        }
    }
}

/// One line of the table.
fn print_row(p: &Params, name: &str, r: &[Row], outcome: &Outcome) {
    let layout = all2all::resolve_quiet(name).map_or("?", |x| x.backend.layout().name());
    match outcome {
        Outcome::Unavailable => {
            println!("{name:<28} {layout:<14} unavailable: MoonEP kernels are not part of epcomm")
        }
        Outcome::Failed(why) if r.len() != p.ranks => {
            println!("{name:<28} {layout:<14} FAILED: {why}")
        }
        Outcome::Passed | Outcome::Failed(_) => {
            // Wall time of a step is the slowest rank's.
            let time = r.iter().map(|x| x.dispatch + x.combine).fold(0.0, f64::max);
            let tokens: u64 = r.iter().map(|x| x.tokens).sum();
            let bytes: u64 = r.iter().map(|x| x.bytes).sum();
            let err = r.iter().map(|x| x.err).fold(0.0, f32::max);
            println!(
                "{:<28} {:<14} {:>12.0} {:>9.2} {:>12.2e} {:>10.2}  {}",
                name,
                layout,
                tokens as f64 / time,
                bytes as f64 / time / 1e9,
                err,
                time * 1e3 / p.steps as f64,
                match outcome {
                    Outcome::Passed => "ok",
                    Outcome::Failed(_) | Outcome::Unavailable => "FAILED",
                }
            );
        }
    }
}

/// The closing lines and the exit code.
fn summary(p: &Params, reports: &Reports, outcomes: &[Outcome]) -> ExitCode {
    let (mut ran, mut passed) = (0, 0);
    for o in outcomes {
        match o {
            Outcome::Passed => (ran, passed) = (ran + 1, passed + 1),
            Outcome::Failed(_) => ran += 1,
            Outcome::Unavailable => {}
        }
    }
    println!(
        "\nEvery rank's combined output was compared with a single-process float32 reference (tolerance {:.0e} relative for {}).",
        crate::stats::tolerance(p.kind),
        p.kind.name()
    );
    let plural = if ran == 1 { "" } else { "s" };
    let mut summary = format!("{ran} backend{plural} ran, {passed} passed");
    let unavailable = &reports.unavailable;
    if !unavailable.is_empty() {
        summary.push_str(&format!(
            "; {} unavailable ({})",
            unavailable.len(),
            unavailable.join(", ")
        ));
    }
    println!("{summary}");
    if ran == 0 {
        eprintln!("epcomm demo: no backend ran");
        ExitCode::from(1)
    } else if passed < ran || reports.rank_failed {
        eprintln!("epcomm demo: FAILED");
        ExitCode::from(1)
    } else {
        println!("All checks passed.");
        ExitCode::SUCCESS
    }
}

/// `epcomm demo`.
pub fn cmd_demo(a: &DemoArgs) -> ExitCode {
    let p = match crate::ranks::start(params(a), rank_main) {
        Ok(p) => p,
        Err(code) => return code,
    };
    println!(
        "epcomm demo: {} ranks (processes) over shared memory, ~{} tokens/rank, hidden {}, {} experts, top-{}, {}, {} routing, {} steps per backend",
        p.ranks,
        p.tokens,
        p.hidden,
        p.experts,
        p.topk,
        p.kind.name(),
        if p.skewed() { "skewed" } else { "uniform" },
        p.steps
    );
    let outputs = match crate::ranks::run(p.ranks, "demo", &[("EPCOMM_LOG_LEVEL", "error")]) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("epcomm: {e}");
            return ExitCode::from(1);
        }
    };
    let mut reports = Reports::new(&p);
    for out in outputs {
        reports.rank_failed |= !out.success;
        out.stdout.lines().for_each(|line| reports.take(line));
    }
    println!(
        "\n{:<28} {:<14} {:>12} {:>9} {:>12} {:>10}  check",
        "backend", "layout", "tokens/s", "GB/s", "max rel err", "ms/step"
    );
    let mut outcomes = Vec::new();
    for (name, r) in &reports.rows {
        let outcome = reports.outcome(&p, name, r);
        print_row(&p, name, r, &outcome);
        outcomes.push(outcome);
    }
    summary(&p, &reports, &outcomes)
}
