//! Every rank reaches the same outcome of an EPLB rearrangement when one rank of three is
//! stopped (SIGSTOP, SIGCONT 1.3 s later, past the 1 s timeout) or killed at a random moment
//! of a multi-layer rearrangement: either every live rank returns OK with every layer in the
//! new placement, or every live rank returns an error naming the same last rearranged layer,
//! with exactly the layers before it in the new placement and the rest in the old. A resumed
//! rank never reports OK after its peers failed, and never applies a layer they did not. Every
//! failing rank names the victim and how it failed (died; stalled: the others timed out waiting
//! for it), never another survivor.
//!
//! Ranks are child processes (this test binary run again as `rank_process`). The number of
//! runs is `EPLB_DECISION_RUNS` (default 30, in CI), the random moments come from
//! `EPLB_DECISION_SEED` (default: the clock; printed); `scripts/eplb-decision.sh` runs more.
//!
//! With migration batching (vLLM v0.33.0's `enable_migration_batching`: one communicator
//! execute per batch of its migration scheduler), four ranks rearrange 8 layers of 4 to 6
//! batches each while, at a random pass of the fault point `eplb:between_batches` (after an
//! execute, before the next batch), one rank SIGKILLs itself, or SIGSTOPs itself (the parent
//! resumes it 1.3 s later), or one does each at the same pass, or one is killed through
//! `EPCOMM_FAULT_POINT` at its first pass. Every live rank fails with the same error (the
//! same words but for the rank it was seen from; a resumed rank says it was late) naming the
//! victim, at the same layer: the interrupted one, or the next when the pass followed a
//! layer's last batch; every rank's weights are exactly the layers before it new and the
//! rest old (never a part of a layer's batches), and nothing is left in /dev/shm. The runs
//! are `EPLB_DECISION_BATCHED_RUNS` (default 6); the passes come from the same seed. The
//! ranks act at the point through `epcomm::fault::set_hook`.

mod common;
mod ranks;

use std::os::unix::process::ExitStatusExt;
use std::process::Child;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use epcomm::eplb::migration::schedule_migration_batches;
use epcomm::eplb::rearrange::{rearrange, rearrange_with, RearrangeOptions};
use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions};

use common::eplb_fixture::{self, Weights};
use ranks::{shm_leftovers, wait_all, Finished};

const WORLD: usize = 3;
const LAYERS: usize = 24;
const PHYSICAL: usize = 12;
const LOGICAL: usize = 9;
const ROW_BYTES: [usize; 2] = [16384, 4096];
/// `EPCOMM_TIMEOUT_S` of every rank, and how long a stopped rank stays stopped.
const TIMEOUT_S: &str = "1";
const STOPPED: Duration = Duration::from_millis(1300);
const PHASE_DEADLINE: Duration = Duration::from_secs(30);
const CHILD_TEST: &str = "rank_process";

const WEIGHTS: Weights = Weights {
    world: WORLD,
    row_bytes: &ROW_BYTES,
};

/// Layer l: the old map rotated by l + 1 slots, so every layer moves experts between ranks.
fn new_map(l: usize) -> Vec<i64> {
    let old = &eplb_fixture::modulo_placement(1, PHYSICAL, LOGICAL)[0];
    (0..PHYSICAL).map(|i| old[(i + l + 1) % PHYSICAL]).collect()
}

fn env(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| panic!("{key} is not set"))
}

/// A child rank: builds its weights, waits until every rank did, joins, signals it started,
/// rearranges every layer, and prints
/// `ED_LAYERS <N|O|B|X per layer>` and `ED_RESULT ok -` or `ED_RESULT err <message>`.
#[test]
fn rank_process() {
    let Ok(group) = std::env::var("ED_GROUP") else {
        return;
    };
    let rank: usize = env("ED_RANK").parse().unwrap();
    let old = eplb_fixture::modulo_placement(LAYERS, PHYSICAL, LOGICAL);
    let new: Vec<Vec<i64>> = (0..LAYERS).map(new_map).collect();
    let mut w = WEIGHTS.all(&old, rank);
    let mut c = eplb_fixture::gloo_cpu().unwrap();
    // Ready; then wait for the others, so a slow start (a loaded machine) is not a stall.
    let ready = env("ED_READY");
    std::fs::write(format!("{ready}.{rank}"), b"ready").unwrap();
    let wait = Instant::now();
    while !(0..WORLD).all(|r| std::path::Path::new(&format!("{ready}.{r}")).exists())
        && wait.elapsed() < PHASE_DEADLINE
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut g = ShmGroup::join(&group, rank, WORLD, GroupOptions::default()).expect("join");
    g.barrier().expect("barrier after join");
    // Started: the parent's random moment counts from here.
    std::fs::write(format!("{ready}.started.{rank}"), b"started").unwrap();
    let start = Instant::now();
    let r = {
        let mut views = eplb_fixture::views(&mut w);
        rearrange(&mut g, c.as_mut(), &old, &new, &mut views, &ROW_BYTES, None)
    };
    let pattern = WEIGHTS.pattern(&w, &old, &new, rank);
    println!("\nED_MS {}", start.elapsed().as_millis());
    println!("\nED_LAYERS {pattern}");
    match r {
        Ok(_) => println!("\nED_RESULT ok -"),
        Err(e) => println!("\nED_RESULT err {e}"),
    }
}

/// A small deterministic generator for the random moments (xorshift64*).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: sending a signal to a child process this test started.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

#[derive(Debug)]
struct Outcome {
    rank: usize,
    /// None: OK; Some(l): an error saying layers before l were rearranged.
    failed_at: Option<usize>,
    layers: String,
    message: String,
}

fn outcome(f: &Finished, all: &str) -> Outcome {
    let out = &f.stdout;
    let find = |prefix: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("rank {} printed no {prefix}line:\n{all}", f.rank))
    };
    let layers = find("ED_LAYERS ");
    let result = find("ED_RESULT ");
    let failed_at = if result == "ok -" {
        None
    } else if result.ends_with("(EPLB rearrangement: no layer was changed)") {
        Some(0)
    } else {
        let l = result
            .split("(EPLB rearrangement: layers before ")
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse::<usize>().ok())
            .unwrap_or_else(|| {
                panic!("rank {}: no EPLB layer report in {result:?}\n{all}", f.rank)
            });
        assert!(
            result.ends_with(&format!(
                "were rearranged; layer {l} and later keep the old placement)"
            )),
            "rank {}: {result}",
            f.rank
        );
        Some(l)
    };
    Outcome {
        rank: f.rank,
        failed_at,
        layers,
        message: result,
    }
}

/// One run: ranks 0..3 rearrange; `victim` is killed or stopped `delay` after every rank is
/// ready to start.
fn run_once(run: usize, victim: usize, kill: bool, delay: Duration) -> Vec<Outcome> {
    let group = ranks::unique("ed", &format!("r{run}"));
    let ready = std::env::temp_dir().join(format!("{group}.ready"));
    let ready_of = |r: usize| std::path::PathBuf::from(format!("{}.{r}", ready.display()));
    let started_of =
        |r: usize| std::path::PathBuf::from(format!("{}.started.{r}", ready.display()));
    let kids: Vec<(usize, Child)> = ranks::spawn_ranks(CHILD_TEST, 0..WORLD, |rank| {
        vec![
            ("ED_GROUP", group.clone()),
            ("ED_RANK", rank.to_string()),
            ("ED_READY", ready.display().to_string()),
            ("EPCOMM_TIMEOUT_S", TIMEOUT_S.to_owned()),
            ("RUST_BACKTRACE", "0".to_owned()),
        ]
    });
    let pid = kids[victim].1.id();
    let start = Instant::now();
    // Every rank is about to join and rearrange: the signal lands in the rearrangement.
    while !(0..WORLD).all(|r| started_of(r).exists()) && start.elapsed() < PHASE_DEADLINE {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(delay);
    if kill {
        signal(pid, libc::SIGKILL);
    } else {
        signal(pid, libc::SIGSTOP);
        std::thread::sleep(STOPPED);
        signal(pid, libc::SIGCONT);
    }
    let res = wait_all(kids, PHASE_DEADLINE);
    for r in 0..WORLD {
        let _ = std::fs::remove_file(ready_of(r));
        let _ = std::fs::remove_file(started_of(r));
    }
    let all: String = res
        .iter()
        .map(Finished::output)
        .collect::<Vec<_>>()
        .join("\n");
    let what = format!(
        "run {run}: {} rank {victim} {} ms after the start",
        if kill { "SIGKILL" } else { "SIGSTOP/SIGCONT" },
        delay.as_millis()
    );
    let mut outcomes = Vec::new();
    for f in &res {
        if kill && f.rank == victim && !f.success() {
            continue; // Killed (it may also have finished before the signal).
        }
        assert!(f.success(), "{what}: rank {} failed:\n{all}", f.rank);
        outcomes.push(outcome(f, &all));
    }
    assert!(
        outcomes.len() >= WORLD - 1,
        "{what}: survivors missing:\n{all}"
    );
    let first = outcomes[0].failed_at;
    // Every rank blames the victim, and says how it failed.
    let named = format!("rank {victim} of group '{group}'");
    for o in outcomes.iter().filter(|o| o.failed_at.is_some()) {
        let ok = if kill {
            o.message.contains(&format!("{named} died (pid "))
        } else if o.rank == victim {
            // The user's call, not the group primitive it was running.
            o.message
                .contains(&format!("{named} (this rank) was late for rearrange"))
        } else {
            o.message
                .contains(&format!("in rearrange of group '{group}'"))
        } && (kill
            || o.rank == victim
            || o.message
                .contains(&format!("waiting for rank(s) {victim} (")));
        assert!(
            ok,
            "{what}: rank {} does not blame rank {victim} for how it failed: {}\n{all}",
            o.rank, o.message
        );
    }
    for o in &outcomes {
        assert_eq!(
            o.failed_at, first,
            "{what}: ranks disagree on the outcome: {outcomes:#?}\n{all}"
        );
        let done = o.failed_at.unwrap_or(LAYERS);
        let fits = o
            .layers
            .chars()
            .enumerate()
            .all(|(l, c)| c == 'B' || c == if l < done { 'N' } else { 'O' });
        assert!(
            fits && o.layers.len() == LAYERS,
            "{what}: rank {}'s weights {} do not match its report {:?}\n{all}",
            o.rank,
            o.layers,
            o.message
        );
    }
    let left = shm_leftovers(&group);
    for f in &left {
        let _ = std::fs::remove_file(format!("/dev/shm/{f}"));
    }
    assert!(left.is_empty(), "{what}: left in /dev/shm: {left:?}");
    println!(
        "eplb_decision {what}: {}",
        match first {
            None => "all OK".to_owned(),
            Some(l) => format!(
                "all failed, layers before {l} rearranged ({} ranks)",
                outcomes.len()
            ),
        }
    );
    outcomes
}

#[test]
fn every_rank_reaches_the_same_eplb_outcome_under_stops_and_kills() {
    let runs: usize = std::env::var("EPLB_DECISION_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let seed: u64 = std::env::var("EPLB_DECISION_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
        | 1;
    println!("eplb_decision: {runs} runs, EPLB_DECISION_SEED={seed}");
    let mut rng = Rng(seed);
    let (mut ok, mut failed) = (0, 0);
    for run in 0..runs {
        let victim = run % WORLD;
        let kill = run % 2 == 1;
        let delay = Duration::from_micros(rng.below(40_000));
        match run_once(run, victim, kill, delay)[0].failed_at {
            None => ok += 1,
            Some(_) => failed += 1,
        }
    }
    println!("eplb_decision: {runs} runs: {ok} all OK, {failed} all failed alike, 0 divergent");
}

// ---- migration batching: 4 ranks, one killed and/or one stopped between two batches --------

const B_WORLD: usize = 4;
const B_LAYERS: usize = 8;
const B_PHYSICAL: usize = 16;
const B_LOGICAL: usize = 12;
const B_ROW_BYTES: [usize; 2] = [4096, 1024];
const B_CHILD: &str = "batched_rank_process";
const BETWEEN: &str = "eplb:between_batches";

const B_WEIGHTS: Weights = Weights {
    world: B_WORLD,
    row_bytes: &B_ROW_BYTES,
};

/// Layer l: the old map's slots in a fixed random order of its own, so experts move between
/// many rank pairs and every layer takes several batches.
fn batched_new_map(l: usize) -> Vec<i64> {
    let mut m = eplb_fixture::modulo_placement(1, B_PHYSICAL, B_LOGICAL).remove(0);
    let mut rng = Rng((0x9e37_79b9 + l as u64 * 0x1000_0001) | 1);
    for i in (1..m.len()).rev() {
        m.swap(i, rng.below(i as u64 + 1) as usize);
    }
    m
}

fn batched_maps() -> (Vec<Vec<i64>>, Vec<Vec<i64>>) {
    let old = eplb_fixture::modulo_placement(B_LAYERS, B_PHYSICAL, B_LOGICAL);
    (old, (0..B_LAYERS).map(batched_new_map).collect())
}

/// The batches of each layer (vLLM's scheduler); every rank runs one execute per batch, so
/// every rank passes `eplb:between_batches` once per batch.
fn batches_per_layer() -> Vec<usize> {
    let (old, new) = batched_maps();
    old.iter()
        .zip(&new)
        .map(|(o, n)| {
            schedule_migration_batches(B_PHYSICAL / B_WORLD, o, n)
                .unwrap()
                .len()
        })
        .collect()
}

/// What a rank does at its n-th pass of `eplb:between_batches` (`ED_ACT`="kill N"/"stop N").
static ACT: OnceLock<(libc::c_int, usize)> = OnceLock::new();
static PASSES: AtomicUsize = AtomicUsize::new(0);

fn act_between_batches(name: &str) {
    if name != BETWEEN {
        return;
    }
    let n = PASSES.fetch_add(1, Ordering::Relaxed);
    if let Some(&(sig, at)) = ACT.get() {
        if n == at {
            // SAFETY: raising a signal on this (child) process.
            unsafe { libc::raise(sig) };
        }
    }
}

fn arm_from_env() {
    let Ok(act) = std::env::var("ED_ACT") else {
        return;
    };
    let (what, n) = act.split_once(' ').expect("ED_ACT is 'kill N' or 'stop N'");
    let sig = match what {
        "kill" => libc::SIGKILL,
        "stop" => libc::SIGSTOP,
        other => panic!("ED_ACT: unknown action {other}"),
    };
    ACT.set((sig, n.parse().unwrap())).unwrap();
    assert!(epcomm::fault::set_hook(act_between_batches));
}

/// A child rank of the batched runs: like [`rank_process`], with migration batching on and the
/// `ED_ACT` hook armed; also prints `ED_EXECUTES <n>` when it ends OK.
#[test]
fn batched_rank_process() {
    let Ok(group) = std::env::var("ED_BGROUP") else {
        return;
    };
    let rank: usize = env("ED_RANK").parse().unwrap();
    arm_from_env();
    let (old, new) = batched_maps();
    let mut w = B_WEIGHTS.all(&old, rank);
    let mut c = eplb_fixture::gloo_cpu().unwrap();
    let ready = env("ED_READY");
    std::fs::write(format!("{ready}.{rank}"), b"ready").unwrap();
    let wait = Instant::now();
    while !(0..B_WORLD).all(|r| std::path::Path::new(&format!("{ready}.{r}")).exists())
        && wait.elapsed() < PHASE_DEADLINE
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut g = ShmGroup::join(&group, rank, B_WORLD, GroupOptions::default()).expect("join");
    g.barrier().expect("barrier after join");
    let options = RearrangeOptions {
        migration_batching: true,
        ..RearrangeOptions::default()
    };
    let r = {
        let mut views = eplb_fixture::views(&mut w);
        rearrange_with(
            &mut g,
            c.as_mut(),
            &old,
            &new,
            &mut views,
            &B_ROW_BYTES,
            &options,
        )
    };
    println!("\nED_LAYERS {}", B_WEIGHTS.pattern(&w, &old, &new, rank));
    match r {
        Ok(s) => println!("\nED_EXECUTES {}\nED_RESULT ok -", s.executes),
        Err(e) => println!("\nED_RESULT err {e}"),
    }
}

/// How a batched run interrupts its ranks: (rank, pass of `eplb:between_batches`).
#[derive(Debug, Clone, Copy, Default)]
struct Faults {
    kill: Option<(usize, usize)>,
    stop: Option<(usize, usize)>,
    /// Kill through `EPCOMM_FAULT_POINT=eplb:between_batches` (the first pass) instead.
    env_kill: Option<usize>,
}

impl Faults {
    fn killed(&self) -> Option<usize> {
        self.kill.map(|k| k.0).or(self.env_kill)
    }

    /// The layer every live rank must fail at: the layer of the first interrupted pass, or the
    /// next one when that pass followed the layer's last batch (every rank then finished the
    /// layer's transfers, so the others apply it).
    fn failing_layer(&self, per_layer: &[usize]) -> usize {
        let pass = [self.kill, self.stop]
            .iter()
            .flatten()
            .map(|k| k.1)
            .chain(self.env_kill.map(|_| 0))
            .min()
            .expect("a fault");
        let mut start = 0;
        for (l, &b) in per_layer.iter().enumerate() {
            if pass < start + b {
                return if pass == start + b - 1 { l + 1 } else { l };
            }
            start += b;
        }
        per_layer.len()
    }
}

/// The process's state letter in /proc (None once it is gone or reaped).
fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// Waits until `pid` stopped itself (SIGCONT after [`STOPPED`]) or ended without stopping.
fn resume_when_stopped(pid: u32) {
    let start = Instant::now();
    while start.elapsed() < PHASE_DEADLINE {
        match proc_state(pid) {
            Some('T') => {
                std::thread::sleep(STOPPED);
                signal(pid, libc::SIGCONT);
                return;
            }
            None | Some('Z') | Some('X') => return,
            Some(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

fn spawn_batched(group: &str, ready: &str, f: Faults) -> Vec<(usize, Child)> {
    ranks::spawn_ranks(B_CHILD, 0..B_WORLD, |rank| {
        let mut env = vec![
            ("ED_BGROUP", group.to_owned()),
            ("ED_RANK", rank.to_string()),
            ("ED_READY", ready.to_owned()),
            ("EPCOMM_TIMEOUT_S", TIMEOUT_S.to_owned()),
            ("RUST_BACKTRACE", "0".to_owned()),
        ];
        match (f.kill, f.stop) {
            (Some((r, n)), _) if r == rank => env.push(("ED_ACT", format!("kill {n}"))),
            (_, Some((r, n))) if r == rank => env.push(("ED_ACT", format!("stop {n}"))),
            _ => {}
        }
        if f.env_kill == Some(rank) {
            env.push(("EPCOMM_FAULT_POINT", BETWEEN.to_owned()));
        }
        env
    })
}

/// Whether `o`'s error names a victim of `f` and how it failed.
fn blames(o: &Outcome, f: Faults, group: &str) -> bool {
    let named = |v: usize| format!("rank {v} of group '{group}'");
    let died = f
        .killed()
        .is_some_and(|v| o.message.contains(&format!("{} died (pid ", named(v))));
    let stalled = f.stop.is_some_and(|(v, _)| {
        if o.rank == v {
            o.message
                .contains(&format!("{} (this rank) was late for ", named(v)))
        } else {
            o.message.contains(&format!("waiting for rank(s) {v} ("))
        }
    });
    died || stalled
}

/// One batched run; returns the layer every live rank failed at.
fn run_batched(run: usize, f: Faults, per_layer: &[usize]) -> usize {
    let group = ranks::unique("edb", &format!("r{run}"));
    let ready = std::env::temp_dir().join(format!("{group}.ready"));
    let kids = spawn_batched(&group, &ready.display().to_string(), f);
    let stopped = f.stop.map(|(r, _)| kids[r].1.id());
    if let Some(pid) = stopped {
        resume_when_stopped(pid);
    }
    let res = wait_all(kids, PHASE_DEADLINE);
    for r in 0..B_WORLD {
        let _ = std::fs::remove_file(format!("{}.{r}", ready.display()));
    }
    let all: String = res
        .iter()
        .map(Finished::output)
        .collect::<Vec<_>>()
        .join("\n");
    let what = format!("batched run {run}: {f:?}");
    let mut outcomes = Vec::new();
    for r in &res {
        if Some(r.rank) == f.killed() {
            assert_eq!(r.status.signal(), Some(libc::SIGKILL), "{what}:\n{all}");
            continue;
        }
        assert!(r.success(), "{what}: rank {} failed:\n{all}", r.rank);
        outcomes.push(outcome(r, &all));
    }
    let first = outcomes[0].failed_at;
    let expected = f.failing_layer(per_layer);
    assert_eq!(first, Some(expected), "{what}: the failing layer:\n{all}");
    for o in &outcomes {
        assert!(
            o.failed_at.is_some(),
            "{what}: rank {} reported OK:\n{all}",
            o.rank
        );
        assert_eq!(
            o.failed_at, first,
            "{what}: ranks disagree: {outcomes:#?}\n{all}"
        );
        assert!(
            blames(o, f, &group),
            "{what}: rank {} blames no victim:\n{all}",
            o.rank
        );
        let done = first.unwrap();
        let fits = o.layers.len() == B_LAYERS
            && (o.layers.chars().enumerate())
                .all(|(l, c)| c == 'B' || c == if l < done { 'N' } else { 'O' });
        assert!(
            fits,
            "{what}: rank {}'s weights {}:\n{all}",
            o.rank, o.layers
        );
    }
    // The ranks that were not stopped fail in the same op with the same words (each says
    // where it saw the failure from).
    let mut texts = (outcomes.iter())
        .filter(|o| f.stop.map(|s| s.0) != Some(o.rank))
        .map(|o| {
            o.message
                .replace(&format!(", seen from rank {})", o.rank), ")")
        });
    let one = texts.next();
    assert!(
        texts.all(|t| Some(&t) == one.as_ref()),
        "{what}: the survivors' errors differ:\n{all}"
    );
    let left = shm_leftovers(&group);
    for name in &left {
        let _ = std::fs::remove_file(format!("/dev/shm/{name}"));
    }
    assert!(left.is_empty(), "{what}: left in /dev/shm: {left:?}");
    let done = first.unwrap();
    println!(
        "eplb_decision {what}: all {} live ranks failed alike, layers 0..{done} rearranged",
        outcomes.len()
    );
    done
}

/// With migration batching, a rank SIGKILLed or SIGSTOPped (past the timeout, then resumed)
/// between two batches of a layer, or both in one run, leaves every live rank with the same
/// error naming the victim and the same prefix of rearranged layers (a layer is all new or all
/// old, never a part of its batches), and nothing in /dev/shm.
#[test]
fn batched_rearrangement_fails_alike_when_ranks_die_or_stall_between_batches() {
    let per_layer = batches_per_layer();
    assert!(
        per_layer.iter().all(|&b| b >= 2),
        "batches per layer: {per_layer:?}"
    );
    let passes: usize = per_layer.iter().sum();
    let runs: usize = std::env::var("EPLB_DECISION_BATCHED_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let seed: u64 = std::env::var("EPLB_DECISION_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
        | 1;
    println!("eplb_decision batched: {runs} runs, EPLB_DECISION_SEED={seed}, batches per layer {per_layer:?}");
    let mut rng = Rng(seed);
    let mut at = vec![0usize; B_LAYERS];
    for run in 0..runs {
        let a = rng.below(B_WORLD as u64) as usize;
        let b = (a + 1 + rng.below(B_WORLD as u64 - 1) as usize) % B_WORLD;
        // Not the last pass: after it the survivors may have committed every layer.
        let mut pass = || rng.below(passes as u64 - 1) as usize;
        let (p, q) = (pass(), pass());
        // Both at one pass: every rank reaches it (it follows an execute all of them finished).
        let f = match run % 4 {
            0 => Faults {
                kill: Some((a, p)),
                ..Faults::default()
            },
            1 => Faults {
                stop: Some((a, p)),
                ..Faults::default()
            },
            2 => Faults {
                kill: Some((a, q)),
                stop: Some((b, q)),
                env_kill: None,
            },
            _ => Faults {
                env_kill: Some(a),
                ..Faults::default()
            },
        };
        at[run_batched(run, f, &per_layer)] += 1;
    }
    println!("eplb_decision batched: {runs} runs, all failed alike; runs per failing layer {at:?}, 0 divergent");
}
