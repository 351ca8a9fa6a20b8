//! Two faults at once under fault tolerance (deepep_low_latency, `enable_fault_tolerance`, 4
//! rank processes): one rank SIGKILLed and another SIGSTOPped at the same moment, or two ranks
//! SIGSTOPped 5-80 ms apart, for a short stall (0.2-2.5 timeouts) or until the others finished.
//! Each rank retries a failed step after `clean_buffers`, as vLLM's sentinel does, up to
//! [`ATTEMPTS`] times. The rules (docs/reliability.md, "Two faults at once"):
//! - the healthy ranks (never signalled) finish every step, each step's last attempt OK, with
//!   outputs equal to the f32 reference with the masked ranks' experts left out, and they agree
//!   on every attempt's outcome and on the mask;
//! - a live rank is never masked by ranks that are not failing themselves: the mask holds
//!   victims only;
//! - no rank completes a step without every rank it did not mask, in the same collectives
//!   (a rank never returns OK for an op that a peer taking part in it failed);
//! - a masked victim never completes a call after it was masked;
//! - the healthy ranks serve again within 2 timeouts (+ slack) of their first failed attempt;
//! - nothing is left in /dev/shm.
//!
//! `overlap_campaign_sample` runs `EPCOMM_FT_OVERLAP_RUNS` runs (default 30 in the full tier,
//! CI; 15 in a plain `cargo test`);
//! `scripts/ft-campaign.sh --overlap RUNS [SEED]` runs more.

mod common;
mod ranks;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::ft_fixture::*;
use epcomm::group::shm::ShmGroup;
use epcomm::Status;

const STEPS: usize = 24;
/// Attempts per step (the first and the retries).
const ATTEMPTS: usize = 4;
/// Slack on top of the 2-timeout recovery bound, for a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(1500);

fn timeout() -> Duration {
    let ms = std::env::var("EPCOMM_FT_OVERLAP_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    Duration::from_millis(ms)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} unset"))
}

/// One attempt as a rank printed it.
#[derive(Debug, Clone)]
struct Attempt {
    attempt: usize,
    start_ms: u64,
    end_ms: u64,
    step: Step,
}

impl Attempt {
    fn parse(line: &str) -> Option<Attempt> {
        let rest = &line[line.find("ATT ")? + 4..];
        let mut f = rest.splitn(4, ' ');
        let attempt = f.next()?.parse().ok()?;
        let start_ms = f.next()?.parse().ok()?;
        let end_ms = f.next()?.parse().ok()?;
        Some(Attempt {
            attempt,
            start_ms,
            end_ms,
            step: Step::parse(f.next()?)?,
        })
    }

    fn key(&self) -> (usize, usize) {
        (self.step.step, self.attempt)
    }

    fn ok(&self) -> bool {
        self.step.status.is_none()
    }
}

/// A rank of a run (this binary run again): join, report readiness, run the steps, retrying a
/// failed one after `clean_buffers`; print each attempt at once.
#[test]
fn overlap_rank_process() {
    let Ok(name) = std::env::var("OV_GROUP") else {
        return;
    };
    let rank: usize = env("OV_RANK").parse().unwrap();
    let mut g = ShmGroup::join(&name, rank, WORLD, opts(timeout())).unwrap();
    let mut m = manager(rank);
    let ex = experts();
    std::fs::write(format!("{}.{rank}", env("OV_READY")), b"ready").unwrap();
    let mut stdout = std::io::stdout();
    for step in 0..STEPS {
        for attempt in 0..ATTEMPTS {
            let start = now_ms();
            let s = one_step(&mut m, &mut g, &ex, step);
            let ok = s.status.is_none();
            writeln!(stdout, "ATT {attempt} {start} {} {}", now_ms(), s.line()).unwrap();
            stdout.flush().unwrap();
            if ok {
                break;
            }
            m.clean_buffers();
        }
        std::thread::sleep(Duration::from_millis(8));
    }
    println!("DONE");
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Pair {
    /// SIGKILL one rank and SIGSTOP another at the same moment.
    KillStop,
    /// SIGSTOP two ranks 5-80 ms apart.
    StopStop,
}

/// A victim: its rank, its signal, and when a stopped one is resumed (None: after the healthy
/// ranks finished).
#[derive(Debug, Clone, Copy)]
struct Victim {
    rank: usize,
    kill: bool,
    resume_after: Option<Duration>,
}

struct Rng(u64);

impl Rng {
    fn draw(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

fn plan(run: usize, seed: u64) -> (Pair, Vec<Victim>, Duration, Duration) {
    let pair = if run.is_multiple_of(2) {
        Pair::KillStop
    } else {
        Pair::StopStop
    };
    let mut rng = Rng(seed ^ (run as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let a = rng.draw(WORLD as u64) as usize;
    let b = (a + 1 + rng.draw(WORLD as u64 - 1) as usize) % WORLD;
    let t = timeout().as_millis() as u64;
    let stall = |rng: &mut Rng| {
        (rng.draw(2) == 0).then(|| Duration::from_millis(t / 5 + rng.draw(t * 23 / 10)))
    };
    let first = Victim {
        rank: a,
        kill: pair == Pair::KillStop,
        resume_after: if pair == Pair::KillStop {
            None
        } else {
            stall(&mut rng)
        },
    };
    let second = Victim {
        rank: b,
        kill: false,
        resume_after: stall(&mut rng),
    };
    let delay = Duration::from_millis(rng.draw(120));
    let gap = match pair {
        Pair::KillStop => Duration::ZERO,
        Pair::StopStop => Duration::from_millis(5 + rng.draw(76)),
    };
    (pair, vec![first, second], delay, gap)
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: a child of this process.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

/// What one run showed; `Err` names the rule it broke.
fn run_once(run: usize, seed: u64) -> Result<String, String> {
    let (pair, victims, delay, gap) = plan(run, seed);
    let name = format!("ftov{}r{run}", std::process::id());
    let ready = ranks::Ready::new(&name, WORLD);
    let children = ranks::spawn_ranks("overlap_rank_process", 0..WORLD, |r| {
        vec![
            ("OV_GROUP", name.clone()),
            ("OV_RANK", r.to_string()),
            ("OV_READY", ready.path()),
        ]
    });
    let pids: Vec<u32> = children.iter().map(|(_, c)| c.id()).collect();
    ready.wait(Duration::from_secs(20));
    std::thread::sleep(delay);
    let fault_ms = now_ms();
    for (i, v) in victims.iter().enumerate() {
        if i == 1 {
            std::thread::sleep(gap);
        }
        signal(
            pids[v.rank],
            if v.kill { libc::SIGKILL } else { libc::SIGSTOP },
        );
    }
    // Short stalls end on their own schedule.
    let resumers: Vec<_> = victims
        .iter()
        .filter_map(|v| v.resume_after.map(|d| (pids[v.rank], d)))
        .map(|(pid, d)| {
            std::thread::spawn(move || {
                std::thread::sleep(d);
                signal(pid, libc::SIGCONT);
            })
        })
        .collect();
    let is_victim = |r: usize| victims.iter().any(|v| v.rank == r);
    let (v, healthy): (Vec<_>, Vec<_>) = children.into_iter().partition(|(r, _)| is_victim(*r));
    let mut done = ranks::wait_all(healthy, Duration::from_secs(90));
    resumers.into_iter().for_each(|h| h.join().unwrap());
    for x in &victims {
        if !x.kill {
            signal(pids[x.rank], libc::SIGCONT);
        }
    }
    done.extend(ranks::wait_all(v, Duration::from_secs(60)));
    done.sort_by_key(|f| f.rank);
    drop(ready);
    let leftovers = ranks::shm_leftovers(&name);
    let describe = || {
        let all: Vec<String> = done.iter().map(ranks::Finished::output).collect();
        format!(
            "run {run} ({pair:?} {victims:?}, after {delay:?}, gap {gap:?}):\n{}",
            all.join("\n")
        )
    };
    if !leftovers.is_empty() {
        return Err(format!("left in /dev/shm: {leftovers:?}; {}", describe()));
    }
    check_run(&done, &victims, fault_ms).map_err(|e| format!("{e}; {}", describe()))
}

/// The rules of one run (see the module's doc).
fn check_run(
    done: &[ranks::Finished],
    victims: &[Victim],
    fault_ms: u64,
) -> Result<String, String> {
    let attempts = |f: &ranks::Finished| -> Vec<Attempt> {
        f.stdout.lines().filter_map(Attempt::parse).collect()
    };
    let is_victim = |r: usize| victims.iter().any(|v| v.rank == r);
    let healthy: Vec<&ranks::Finished> = done.iter().filter(|f| !is_victim(f.rank)).collect();
    let mut outcomes = BTreeMap::new();
    let mut recovery_ms = 0u64;
    for f in &healthy {
        let a = attempts(f);
        if !f.success() || !f.stdout.contains("DONE") {
            return Err(format!("healthy rank {} did not finish", f.rank));
        }
        for s in 0..STEPS {
            if !a.iter().any(|x| x.step.step == s && x.ok()) {
                return Err(format!(
                    "healthy rank {} never completed step {s} in {ATTEMPTS} attempts",
                    f.rank
                ));
            }
        }
        for x in a.iter().filter(|x| x.ok()) {
            let st = &x.step;
            if st.error > TOL || st.dropped != st.expected_dropped {
                return Err(format!("healthy rank {} wrong output {x:?}", f.rank));
            }
            if st
                .mask
                .iter()
                .enumerate()
                .any(|(r, &m)| m == 1 && !is_victim(r))
            {
                return Err(format!(
                    "healthy rank {} masks a live, healthy rank: {x:?}",
                    f.rank
                ));
            }
        }
        // Recovery: from the first failed attempt's start to the next OK attempt's end.
        if let Some(i) = a.iter().position(|x| !x.ok()) {
            let back = a[i..].iter().find(|x| x.ok()).map(|x| x.end_ms);
            let took = back.unwrap_or(u64::MAX) - a[i].start_ms.max(fault_ms);
            recovery_ms = recovery_ms.max(took);
            let bound = (2 * timeout() + SLACK).as_millis() as u64;
            if took > bound {
                return Err(format!(
                    "healthy rank {} served again {took} ms after its first failure (bound {bound} ms)",
                    f.rank
                ));
            }
        }
        let key: Vec<((usize, usize), Option<Status>)> =
            a.iter().map(|x| (x.key(), x.step.status)).collect();
        let mask = a.last().map(|x| x.step.mask.clone());
        outcomes.insert(f.rank, (key, mask));
    }
    let first = outcomes.values().next().cloned().unwrap_or_default();
    if let Some((r, o)) = outcomes.iter().find(|(_, o)| **o != first) {
        return Err(format!(
            "healthy ranks disagree: rank {r} {o:?} vs {first:?}"
        ));
    }
    // No rank (victims included) completes a step without every rank it did not mask: each of
    // those completed the same step in the same collectives (their OK calls overlap in time;
    // a call paired with a peer's other step or attempt would not).
    let ok_at: Vec<BTreeMap<usize, Attempt>> = (0..WORLD)
        .map(|r| {
            done.iter()
                .filter(|f| f.rank == r)
                .flat_map(|f| attempts(f).into_iter().filter(Attempt::ok))
                .map(|x| (x.step.step, x))
                .collect()
        })
        .collect();
    for (o, steps) in ok_at.iter().enumerate() {
        for (s, x) in steps {
            for q in (0..WORLD).filter(|&q| q != o && x.step.mask.get(q) != Some(&1)) {
                let Some(y) = ok_at[q].get(s) else {
                    // A killed rank may complete a step and die before it prints it: the step
                    // of its last printed line (a retry) or the next one.
                    let printed = done
                        .iter()
                        .filter(|f| f.rank == q)
                        .flat_map(|f| attempts(f).into_iter().map(|x| x.step.step))
                        .max();
                    let killed = victims.iter().any(|v| v.rank == q && v.kill);
                    if killed && printed.is_none_or(|p| *s == p || *s == p + 1) {
                        continue;
                    }
                    return Err(format!(
                        "rank {o} completed step {s} (attempt {}, mask {:?}) but rank {q}, which it did not mask, never did",
                        x.attempt, x.step.mask
                    ));
                };
                if x.start_ms > y.end_ms + 1 || y.start_ms > x.end_ms + 1 {
                    return Err(format!(
                        "rank {o} completed step {s} at {}-{} ms but rank {q} at {}-{} ms: not in the same collectives",
                        x.start_ms, x.end_ms, y.start_ms, y.end_ms
                    ));
                }
            }
        }
    }
    // A masked victim never completes a call after it was masked.
    let mask = first.1.clone().unwrap_or_default();
    for v in victims.iter().filter(|v| !v.kill) {
        if mask.get(v.rank) != Some(&1) {
            continue;
        }
        let f = done.iter().find(|f| f.rank == v.rank).unwrap();
        let a = attempts(f);
        if let Some(i) = a.iter().position(|x| !x.ok()) {
            if let Some(x) = a[i..].iter().find(|x| x.ok()) {
                return Err(format!(
                    "masked rank {} completed step {} attempt {} after it was masked",
                    v.rank, x.step.step, x.attempt
                ));
            }
        }
    }
    let masked = mask.iter().filter(|&&m| m == 1).count();
    Ok(format!("{masked} masked, recovery {recovery_ms} ms"))
}

#[test]
fn overlap_campaign_sample() {
    let runs = common::skip::campaign_runs("EPCOMM_FT_OVERLAP_RUNS", 30) as usize;
    let seed: u64 = std::env::var("EPCOMM_FT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x07e7_5eed);
    let mut tally: BTreeMap<String, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut slowest = 0u64;
    let start = Instant::now();
    for run in 0..runs {
        match run_once(run, seed) {
            Ok(what) => {
                let (masked, rec) = what.split_once(", recovery ").unwrap();
                slowest = slowest.max(rec.trim_end_matches(" ms").parse().unwrap_or(0));
                *tally.entry(masked.to_string()).or_default() += 1;
            }
            Err(e) => failures.push(e),
        }
    }
    println!(
        "ft overlap campaign: {runs} runs (seed {seed}) in {:.1} s: {tally:?}, slowest recovery {slowest} ms, {} violations",
        start.elapsed().as_secs_f64(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
