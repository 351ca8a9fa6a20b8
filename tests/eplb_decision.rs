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

mod common;
mod ranks;

use std::process::Child;
use std::time::{Duration, Instant};

use epcomm::eplb::rearrange::rearrange;
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
            o.message
                .contains(&format!("{named} (this rank) was late for send_recv"))
                || o.message
                    .contains(&format!("{named} (this rank) was late for all_gatherv"))
        } else {
            o.message
                .contains(&format!("in send_recv of group '{group}'"))
                || o.message
                    .contains(&format!("in all_gatherv of group '{group}'"))
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
