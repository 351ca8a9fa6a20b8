//! Fault-injection matrix over shared memory (docs/reliability.md).
//!
//! Every case runs a 3-rank group as three child processes (this test binary run again as
//! `rank_process`) with `EPCOMM_TIMEOUT_S=5`, and the parent bounds each phase with a deadline
//! (a straggler is killed and the case fails):
//!
//! - **kill**: `EPCOMM_FAULT_POINT=<point>` in rank 2's environment only, so rank 2 SIGKILLs
//!   itself at `join`, `dispatch:before_counts`, `dispatch:after_counts`, `combine`,
//!   `eplb:before_staging`, `eplb:between_batches` or `eplb:after_staging`. Both survivors must return PeerFailure naming
//!   rank 2 well within the timeout; after an EPLB fault each layer of their expert weights is
//!   byte-for-byte the old placement or (for layers the error message reports as done) the new
//!   one, never anything else.
//! - **stall**: the parent SIGSTOPs rank 2 after it joined; the survivors must return Timeout
//!   naming rank 2 after the 5 s timeout (not before, not much after). Then SIGCONT lets rank 2
//!   see the failure and clean up (SIGKILL if it does not end).
//! - **mismatch**: barrier against all_gatherv, dispatch against barrier, all_gatherv with sizes
//!   that disagree, dispatch with different configurations: every rank returns an error (no
//!   hang, no rank silently "succeeding").
//!
//! After every case nothing of the group is left in /dev/shm (survivors unlink a dead rank's
//! region), and a new group with the same name and all three ranks alive does a barrier and a
//! dispatch/combine checked against the single-process reference. The kill and mismatch cases
//! run with direct reads (the default) and with staging through the shared regions
//! (`EPCOMM_SHM_DIRECT=0`).
//!
//! Also: the survivors re-form the group in the same process with a replacement rank, and
//! buffers larger than memory are errors. Five tests are regressions for bugs these cases found
//! (docs/reliability.md, "Known gaps"): `a_failing_rank_does_not_free_buffers_its_peers_still_read`,
//! `different_sizes_fail_on_every_rank_when_staged`, `kill_after_the_last_eplb_transfer`,
//! `kill_rank_0_at_join` and `a_replacement_rank_joins_while_the_survivors_notice_the_death`;
//! they fail until the bugs are fixed.
//!
//! `cargo test --test fault_matrix -- --nocapture` prints one line per rank and case with the
//! status and the time the failing call took (the figures in docs/reliability.md).

mod common;
mod ranks;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use epcomm::eplb::rearrange::rearrange;
use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions};
use epcomm::moe::reference::{unit, ToyExperts};
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::{self, FloatKind};
use epcomm::Status;

use common::eplb_fixture::{self, Weights};
use common::moe_fixture::{round_trip_error, Tokens};
use ranks::{shm_leftovers, wait_all, Finished};

const WORLD: usize = 3;
/// The rank that is killed or stalled.
const VICTIM: usize = 2;
/// `EPCOMM_TIMEOUT_S` of every rank.
const TIMEOUT_S: u64 = 5;
/// How much longer than the timeout a survivor's failing call may take.
const MARGIN: Duration = Duration::from_secs(2);
/// The parent's bound on one phase (all ranks started to all ranks ended).
const PHASE_DEADLINE: Duration = Duration::from_secs(30);
/// The test that child processes run.
const CHILD_TEST: &str = "rank_process";

/// How peers read each other's contributions.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// The default: peers copy straight from the caller's buffers where the kernel allows.
    Direct,
    /// `EPCOMM_SHM_DIRECT=0`: every contribution is staged in the rank's shared region.
    Region,
}

impl Mode {
    fn tag(self) -> &'static str {
        match self {
            Mode::Direct => "d",
            Mode::Region => "r",
        }
    }
}

// ---- workloads shared by the child cases -----------------------------------------------------

const BACKEND: &str = "deepep_high_throughput";
const EXPERTS: usize = 6;
const TOP_K: usize = 2;
const HIDDEN: usize = 8;
const MAX_TOKENS: usize = 16;

fn moe_cfg(hidden: usize) -> MoeConfig {
    MoeConfig {
        num_experts: EXPERTS,
        top_k: TOP_K,
        hidden,
        hidden_dtype: FloatKind::F32.dtype(),
        expert_dtype: FloatKind::F32,
        out_dtype: FloatKind::F32,
        max_tokens_per_rank: MAX_TOKENS,
        extra_row_bytes: vec![],
        apply_router_weight_on_input: false,
    }
}

/// This rank's tokens: hidden rows, distinct top-k ids and weights.
fn tokens(rank: usize, hidden: usize) -> (Vec<f32>, Vec<i64>, Vec<f32>) {
    let t = 5 + rank;
    let x: Vec<f32> = (0..(t * hidden) as u64)
        .map(|i| unit(0x5eed ^ (rank as u64) << 32, i))
        .collect();
    let mut ids = Vec::new();
    let mut ws = Vec::new();
    for tok in 0..t {
        let first = (tok * 5 + rank) % EXPERTS;
        ids.extend([first as i64, ((first + 1 + tok % 3) % EXPERTS) as i64]);
        ws.extend([0.6f32, 0.4]);
    }
    (x, ids, ws)
}

/// One dispatch and combine checked against the single-process f32 reference.
fn dispatch_combine(g: &mut ShmGroup, rank: usize) -> epcomm::Result<()> {
    let experts = ToyExperts::new(EXPERTS, HIDDEN, 7);
    let mut m = Manager::new(BACKEND, moe_cfg(HIDDEN), rank, WORLD)?;
    let (x, ids, ws) = tokens(rank, HIDDEN);
    let t = Tokens { x, ids, ws };
    let err = round_trip_error(&mut m, g, &experts, &t, (rank, WORLD, TOP_K))?;
    assert!(
        err <= 1e-5,
        "rank {rank}: combine differs from the reference by {err}"
    );
    Ok(())
}

// EPLB: synthetic weights whose bytes encode (expert, layer, tensor, element)
// (tests/common/eplb_fixture.rs).
const ROW_BYTES: [usize; 2] = [16, 40];
const PHYSICAL: usize = 12;
const LOGICAL: usize = 8;

const WEIGHTS: Weights = Weights {
    world: WORLD,
    row_bytes: &ROW_BYTES,
};

fn new_placement(layers: usize) -> Vec<Vec<i64>> {
    let load = eplb_fixture::skewed_load(layers, LOGICAL, 1, 1.0);
    eplb_fixture::rebalanced(&load, PHYSICAL, WORLD)
}

// ---- the child side --------------------------------------------------------------------------

fn env(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| panic!("{key} is not set"))
}

fn mode_of(g: &ShmGroup) -> &'static str {
    if g.direct() {
        "direct"
    } else {
        "region"
    }
}

/// Prints the outcome of the call under test: `FM_RESULT ok|err <status> <ms> <mode> <message>`.
fn report(start: Instant, mode: &str, r: epcomm::Result<()>) {
    report_as("FM_RESULT", start, mode, r);
}

fn report_as(prefix: &str, start: Instant, mode: &str, r: epcomm::Result<()>) {
    let ms = start.elapsed().as_millis();
    match r {
        Ok(()) => println!("\n{prefix} ok 0 {ms} {mode} -"),
        Err(e) => println!("\n{prefix} err {} {ms} {mode} {e}", e.status() as i32),
    }
}

/// A fresh group of all ranks: barrier, dispatch/combine (checked), barrier.
fn new_group_works(group: &str, rank: usize, prefix: &str) {
    let start = Instant::now();
    let mut g = match ShmGroup::join(group, rank, WORLD, GroupOptions::default()) {
        Ok(g) => g,
        Err(e) => return report_as(prefix, start, "-", Err(e)),
    };
    let r = g
        .barrier()
        .and_then(|()| dispatch_combine(&mut g, rank))
        .and_then(|()| g.barrier());
    report_as(prefix, start, mode_of(&g), r);
}

fn join(group: &str, rank: usize) -> ShmGroup {
    ShmGroup::join(group, rank, WORLD, GroupOptions::default()).expect("join")
}

/// A child rank. Does nothing unless started by a case (`FM_CASE` set).
#[test]
fn rank_process() {
    let Ok(case) = std::env::var("FM_CASE") else {
        return;
    };
    let group = env("FM_GROUP");
    let rank: usize = env("FM_RANK").parse().unwrap();
    if env("FM_PHASE") == "after" {
        new_group_works(&group, rank, "FM_RESULT");
        return;
    }
    if let Some(point) = case.strip_prefix("kill:") {
        kill_case(&group, rank, point, 3);
    } else if let Some(point) = case.strip_prefix("rejoin:") {
        // Survivors re-form the group at once, in the same process, with a replacement rank 2.
        kill_case(&group, rank, point, 3);
        new_group_works(&group, rank, "FM_REJOIN");
    } else if let Some(point) = case.strip_prefix("kill0:") {
        kill_case(&group, rank, point, 3);
    } else if let Some(point) = case.strip_prefix("kill1:") {
        kill_case(&group, rank, point, 1);
    } else {
        let mut g = join(&group, rank);
        g.barrier().expect("barrier after join");
        let mode = mode_of(&g);
        match case.as_str() {
            "stall" => {
                std::fs::write(env("FM_READY"), b"joined").unwrap();
                // Barriers until one fails: the parent stops rank 2 somewhere in this loop.
                loop {
                    let start = Instant::now();
                    if let Err(e) = g.barrier() {
                        report(start, mode, Err(e));
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            "order" => {
                let start = Instant::now();
                let r = if rank == VICTIM {
                    g.all_gatherv(&[7; 8], &[8; WORLD], &mut [0; 8 * WORLD])
                } else {
                    g.barrier()
                };
                report(start, mode, r);
            }
            "order_dispatch" => {
                let start = Instant::now();
                let r = if rank == VICTIM {
                    g.barrier()
                } else {
                    let mut m = Manager::new(BACKEND, moe_cfg(HIDDEN), rank, WORLD).unwrap();
                    let (x, ids, ws) = tokens(rank, HIDDEN);
                    let xb = num::from_f32(&x, FloatKind::F32);
                    m.dispatch(&mut g, &xb, &ids, &ws, &[]).map(drop)
                };
                report(start, mode, r);
            }
            "sizes" => {
                // Rank 1 believes it contributes 16 bytes; ranks 0 and 2 expect 8 from it.
                let mine = if rank == 1 { 16 } else { 8 };
                let sizes: Vec<usize> = (0..WORLD)
                    .map(|p| if p == 1 && rank == 1 { 16 } else { 8 })
                    .collect();
                let input = vec![rank as u8 + 1; mine];
                let mut out = vec![0u8; sizes.iter().sum()];
                let start = Instant::now();
                let r = g.all_gatherv(&input, &sizes, &mut out);
                report(start, mode, r);
            }
            "config" => {
                // Rank 1's manager has another hidden size.
                let hidden = if rank == 1 { 2 * HIDDEN } else { HIDDEN };
                let mut m = Manager::new(BACKEND, moe_cfg(hidden), rank, WORLD).unwrap();
                let (x, ids, ws) = tokens(rank, hidden);
                let xb = num::from_f32(&x, FloatKind::F32);
                let start = Instant::now();
                let r = m.dispatch(&mut g, &xb, &ids, &ws, &[]).map(drop);
                report(start, mode, r);
            }
            other => panic!("unknown case {other}"),
        }
    }
}

/// Rank 2 carries `EPCOMM_FAULT_POINT=point` and dies there; the survivors report the call that
/// fails (and, for EPLB, what their weights look like afterwards).
fn kill_case(group: &str, rank: usize, point: &str, layers: usize) {
    if point == "join" {
        let start = Instant::now();
        let r = ShmGroup::join(group, rank, WORLD, GroupOptions::default()).map(drop);
        report(start, "-", r);
        return;
    }
    let mut g = join(group, rank);
    g.barrier().expect("barrier after join");
    let mode = mode_of(&g);
    match point {
        "dispatch:before_counts" | "dispatch:after_counts" => {
            let mut m = Manager::new(BACKEND, moe_cfg(HIDDEN), rank, WORLD).unwrap();
            let (x, ids, ws) = tokens(rank, HIDDEN);
            let xb = num::from_f32(&x, FloatKind::F32);
            let start = Instant::now();
            let r = m.dispatch(&mut g, &xb, &ids, &ws, &[]).map(drop);
            report(start, mode, r);
        }
        "combine" => {
            let mut m = Manager::new(BACKEND, moe_cfg(HIDDEN), rank, WORLD).unwrap();
            let (x, ids, ws) = tokens(rank, HIDDEN);
            let xb = num::from_f32(&x, FloatKind::F32);
            let rows = {
                let v = m.dispatch(&mut g, &xb, &ids, &ws, &[]).expect("dispatch");
                v.hidden.len() / (HIDDEN * 4)
            };
            let y = vec![0u8; rows * HIDDEN * 4];
            let mut out = vec![0u8; x.len() * 4];
            let start = Instant::now();
            let r = m.combine(&mut g, &y, &mut out);
            report(start, mode, r);
        }
        "eplb:before_staging" | "eplb:between_batches" | "eplb:after_staging" => {
            let old = eplb_fixture::modulo_placement(layers, PHYSICAL, LOGICAL);
            let new = new_placement(layers);
            let mut w = WEIGHTS.all(&old, rank);
            let mut c = eplb_fixture::gloo_cpu().unwrap();
            let start = Instant::now();
            let r = {
                let mut views = eplb_fixture::views(&mut w);
                rearrange(&mut g, c.as_mut(), &old, &new, &mut views, &ROW_BYTES, None)
            };
            // Per layer: N = the new placement's bytes, O = the old one's, B = both, X = else.
            let pattern = WEIGHTS.pattern(&w, &old, &new, rank);
            println!("\nFM_LAYERS {pattern}");
            report(start, mode, r.map(drop));
        }
        other => panic!("unknown fault point {other}"),
    }
}

// ---- the parent side -------------------------------------------------------------------------

/// What a rank reported.
#[derive(Debug)]
struct Outcome {
    rank: usize,
    ok: bool,
    status: i32,
    ms: u64,
    mode: String,
    message: String,
    layers: Option<String>,
}

fn outcome(f: &Finished) -> Outcome {
    outcome_of(f, "FM_RESULT ")
}

fn outcome_of(f: &Finished, prefix: &str) -> Outcome {
    let out = f.output();
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| {
            panic!(
                "rank {} reported no result (hung and killed at the deadline, or crashed):\n{out}",
                f.rank
            )
        });
    let parts: Vec<&str> = line.splitn(5, ' ').collect();
    assert_eq!(parts.len(), 5, "bad result line {line:?}");
    Outcome {
        rank: f.rank,
        ok: parts[0] == "ok",
        status: parts[1].parse().unwrap(),
        ms: parts[2].parse().unwrap(),
        mode: parts[3].to_owned(),
        message: parts[4].to_owned(),
        layers: out
            .lines()
            .find_map(|l| l.strip_prefix("FM_LAYERS "))
            .map(str::to_owned),
    }
}

fn status_name(code: i32) -> String {
    Status::from_code(code).map_or_else(|| code.to_string(), |s| format!("{s:?}"))
}

fn spawn(group: &str, case: &str, phase: &str, mode: Mode, ready: &str) -> Vec<(usize, Child)> {
    spawn_some(0..WORLD, group, case, phase, mode, ready)
}

fn spawn_some(
    which: impl IntoIterator<Item = usize>,
    group: &str,
    case: &str,
    phase: &str,
    mode: Mode,
    ready: &str,
) -> Vec<(usize, Child)> {
    ranks::spawn_ranks(CHILD_TEST, which, |rank| {
        let mut env = vec![
            ("FM_CASE", case.to_owned()),
            ("FM_PHASE", phase.to_owned()),
            ("FM_GROUP", group.to_owned()),
            ("FM_RANK", rank.to_string()),
            ("FM_READY", ready.to_owned()),
            ("EPCOMM_TIMEOUT_S", TIMEOUT_S.to_string()),
            ("RUST_BACKTRACE", "0".to_owned()),
        ];
        if mode == Mode::Region {
            env.push(("EPCOMM_SHM_DIRECT", "0".to_owned()));
        }
        if phase == "fault" && rank == victim_of(case) {
            if let Some(point) = case.split_once(':').map(|(_, p)| p) {
                if case.starts_with("kill") || case.starts_with("rejoin") {
                    env.push(("EPCOMM_FAULT_POINT", point.to_owned()));
                }
            }
        }
        env
    })
}

fn all_output(res: &[Finished]) -> String {
    res.iter()
        .map(Finished::output)
        .collect::<Vec<_>>()
        .join("\n")
}

fn assert_no_leftovers(group: &str, what: &str) {
    let left = shm_leftovers(group);
    assert!(left.is_empty(), "{what}: left in /dev/shm: {left:?}");
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: sending a signal to a child process this test started.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

/// Phase 1 with rank 2 stopped: waits for rank 2 to join, SIGSTOPs it, waits for the survivors,
/// then SIGCONTs it (so it sees the failure and cleans up) and SIGKILLs it if it does not end.
fn run_stalled(kids: Vec<(usize, Child)>, ready: &Path) -> Vec<Finished> {
    let start = Instant::now();
    let mut kids = kids;
    let victim = kids.pop().expect("three ranks");
    assert_eq!(victim.0, VICTIM);
    let pid = victim.1.id();
    while !ready.exists() {
        if start.elapsed() > PHASE_DEADLINE {
            signal(pid, libc::SIGKILL);
            let mut all = kids;
            all.push(victim);
            let res = wait_all(all, Duration::ZERO);
            panic!("rank {VICTIM} never joined:\n{}", all_output(&res));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // Let it enter the barrier loop, then freeze it.
    std::thread::sleep(Duration::from_millis(50));
    signal(pid, libc::SIGSTOP);
    let mut res = wait_all(kids, PHASE_DEADLINE);
    signal(pid, libc::SIGCONT);
    res.extend(wait_all(vec![victim], Duration::from_secs(10)));
    res
}

/// Removes what a group left in /dev/shm when the test fails, so a failure leaves nothing.
struct RemoveOnPanic(String);

impl Drop for RemoveOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for f in shm_leftovers(&self.0) {
                let _ = std::fs::remove_file(format!("/dev/shm/{f}"));
            }
        }
    }
}

/// The rank a case kills: rank 0 for `kill0:` cases, else rank 2.
fn victim_of(case: &str) -> usize {
    if case.starts_with("kill0:") {
        0
    } else {
        VICTIM
    }
}

/// Runs one case: the fault phase, its checks, then a fresh group of the same name.
fn run_case(case: &str, mode: Mode) {
    let victim = victim_of(case);
    let tag: String = case
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let group = ranks::unique("fm", &format!("{tag}-{}", mode.tag()));
    let _cleanup = RemoveOnPanic(group.clone());
    let ready = std::env::temp_dir().join(format!("{group}.ready"));
    let _ = std::fs::remove_file(&ready);
    let kids = spawn(&group, case, "fault", mode, &ready.display().to_string());
    let res = if case == "stall" {
        run_stalled(kids, &ready)
    } else {
        wait_all(kids, PHASE_DEADLINE)
    };
    let _ = std::fs::remove_file(&ready);
    // The new group below runs even when these checks fail (it also removes what the fault
    // left); their failure is reported after it.
    let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let all = all_output(&res);
        let bound = Duration::from_secs(TIMEOUT_S) + MARGIN;

        let killed = case.starts_with("kill");
        let stalled = case == "stall";
        let survivors: Vec<Outcome> = res
            .iter()
            .filter(|f| !((killed || stalled) && f.rank == victim))
            .map(|f| {
                assert!(
                    f.success(),
                    "rank {} of {case}/{mode:?} failed:\n{all}",
                    f.rank
                );
                outcome(f)
            })
            .collect();
        for o in &survivors {
            println!(
                "fault_matrix {case:<24} {mode:?} rank {}: {} after {} ms ({}){}: {}",
                o.rank,
                if o.ok {
                    "ok".to_owned()
                } else {
                    status_name(o.status)
                },
                o.ms,
                o.mode,
                o.layers
                    .as_ref()
                    .map_or(String::new(), |l| format!(", layers {l}")),
                o.message
            );
            assert!(
                Duration::from_millis(o.ms) < bound,
                "rank {} of {case}/{mode:?} took {} ms (bound {bound:?}):\n{all}",
                o.rank,
                o.ms
            );
        }
        let named = format!("rank {victim} of group '{group}'");
        if killed {
            let v = res.iter().find(|f| f.rank == victim).unwrap();
            assert_eq!(
                v.status.signal(),
                Some(libc::SIGKILL),
                "rank {victim} did not die at {case}:\n{all}"
            );
            check_killed(case, victim, &survivors, &named, &all);
        } else if stalled {
            // Resumed, rank 2 sees that the others gave up and ends on its own.
            let v = res.iter().find(|f| f.rank == victim).unwrap();
            assert!(
                v.success(),
                "the resumed rank {victim} did not end by itself:\n{all}"
            );
            let o = outcome(v);
            assert!(!o.ok, "{o:?}");
            println!(
                "fault_matrix {case:<24} {mode:?} rank {victim} (resumed): {}: {}",
                status_name(o.status),
                o.message
            );
            for o in &survivors {
                assert!(!o.ok, "{o:?}");
                assert_eq!(o.status, Status::Timeout as i32, "{o:?}\n{all}");
                assert!(
                    o.message.starts_with(&format!(
                        "timed out after {TIMEOUT_S}.0 s in barrier of group '{group}'"
                    )) && o
                        .message
                        .ends_with(&format!("waiting for rank(s) {victim}")),
                    "{o:?}"
                );
                assert!(
                    o.ms + 100 >= TIMEOUT_S * 1000,
                    "a stalled peer was given up on early: {o:?}"
                );
            }
        } else {
            check_mismatch(case, &survivors, &all);
        }
    }));
    // Checked at the end, so the new group below runs (and shows it removes stale segments).
    let leftovers = shm_leftovers(&group);

    // A new group with the same name works.
    let res = wait_all(spawn(&group, case, "after", mode, "-"), PHASE_DEADLINE);
    if let Err(p) = checked {
        std::panic::resume_unwind(p);
    }
    let all = all_output(&res);
    for f in &res {
        assert!(
            f.success(),
            "after {case}/{mode:?}: rank {} failed:\n{all}",
            f.rank
        );
        let o = outcome(f);
        assert!(o.ok, "after {case}/{mode:?}: {o:?}\n{all}");
        if mode == Mode::Region {
            assert_eq!(o.mode, "region", "after {case}/{mode:?}");
        }
    }
    assert_no_leftovers(&group, &format!("{case}/{mode:?} after the new group"));
    assert!(
        leftovers.is_empty(),
        "{case}/{mode:?}: after the fault, left in /dev/shm: {leftovers:?} (a new group of the same name removed them)"
    );
}

/// Survivors of a killed rank 2: PeerFailure naming it; for EPLB each layer either old or (as
/// the message says) new.
fn check_killed(case: &str, victim: usize, survivors: &[Outcome], named: &str, all: &str) {
    let eplb = case.contains(":eplb:");
    let mut done_layers = Vec::new();
    for o in survivors {
        if o.ok {
            // Only an interruption after the last layer's transfers may look like success.
            assert!(
                case == "kill1:eplb:after_staging",
                "{case}: rank {} succeeded although rank {victim} was killed:\n{all}",
                o.rank
            );
        } else if case.starts_with("kill0:join")
            && o.status == Status::Timeout as i32
            && o.message.contains("waiting for rank 0 to create group")
        {
            // A rank that started waiting after rank 0 created the segment and died cannot
            // tell it from a stale segment of a crashed run: it waits for a new rank 0 and
            // times out, naming rank 0.
        } else {
            assert_eq!(
                o.status,
                Status::PeerFailure as i32,
                "{case}: rank {} returned {} instead of PeerFailure: {}\n{all}",
                o.rank,
                status_name(o.status),
                o.message
            );
            assert!(
                o.message.contains(named) && o.message.contains(" died (pid "),
                "{case}: rank {}'s error does not name the dead {named}: {}\n{all}",
                o.rank,
                o.message
            );
        }
        if !eplb {
            continue;
        }
        let layers = o
            .layers
            .as_deref()
            .expect("an EPLB case reports its layers");
        // Layers the rearrangement finished: all on success; from the message otherwise.
        let done = if o.ok {
            layers.len()
        } else if o
            .message
            .ends_with("(EPLB rearrangement: no layer was changed)")
        {
            0
        } else {
            let l = o
                .message
                .split("(EPLB rearrangement: layers before ")
                .nth(1)
                .and_then(|s| s.split(' ').next())
                .and_then(|s| s.parse::<usize>().ok())
                .unwrap_or_else(|| panic!("{case}: no EPLB progress in {:?}", o.message));
            assert!(
                o.message.ends_with(&format!(
                    "were rearranged; layer {l} and later keep the old placement)"
                )),
                "{}",
                o.message
            );
            l
        };
        for (l, c) in layers.chars().enumerate() {
            let want = if l < done { 'N' } else { 'O' };
            assert!(
                c == want || c == 'B',
                "{case}: rank {} layer {l} is {c:?} (layers {layers}), expected {want:?} since {done} layer(s) were reported done: {}\n{all}",
                o.rank,
                o.message
            );
        }
        if case.ends_with("before_staging") {
            assert_eq!(done, 0, "{case}: {}", o.message);
        }
        done_layers.push(done);
    }
    assert!(
        done_layers.windows(2).all(|w| w[0] == w[1]),
        "{case}: survivors disagree on how many layers were rearranged: {done_layers:?}\n{all}"
    );
}

/// Ranks that disagree on the collective or its sizes: every rank gets an error, none a timeout.
fn check_mismatch(case: &str, outcomes: &[Outcome], all: &str) {
    let why = match case {
        "order" | "order_dispatch" => "every rank must call the same collectives in the same order",
        "sizes" => {
            // Every rank sees the same published sizes and says the same, before data moves.
            for o in outcomes {
                assert_eq!(o.status, Status::InvalidArgument as i32, "{o:?}\n{all}");
                assert!(
                    o.message.starts_with("all_gatherv: ranks of group '")
                        && o.message.ends_with(
                            "' disagree on sum(sizes): rank 0 passes 24 but rank 1 passes 32; every rank must pass the same sum(sizes) (no data was exchanged)"
                        ),
                    "{o:?}\n{all}"
                );
            }
            "disagree on sum(sizes)"
        }
        "config" => "every rank must create the manager with the same backend and configuration",
        other => panic!("unknown case {other}"),
    };
    for o in outcomes {
        assert!(
            !o.ok,
            "{case}: rank {} returned success from a collective the other ranks disagreed on\n{all}",
            o.rank
        );
        assert!(
            [
                Status::InvalidArgument as i32,
                Status::InvalidState as i32,
                Status::PeerFailure as i32
            ]
            .contains(&o.status),
            "{case}: rank {} returned {}: {}\n{all}",
            o.rank,
            status_name(o.status),
            o.message
        );
    }
    assert!(
        outcomes.iter().any(|o| o.message.contains(why)),
        "{case}: no rank explains the disagreement ({why:?})\n{all}"
    );
}

// ---- the matrix ------------------------------------------------------------------------------

#[test]
fn kill_at_join() {
    run_case("kill:join", Mode::Direct);
}

/// Regression: rank 0 (the creator) dies at `join`, after it created the group and claimed its
/// slot. Two outcomes, by timing, neither the documented one:
/// - ranks 1 and 2 had both opened the group: they report PeerFailure naming rank 0 within
///   ~60 ms, but nobody removes the control segment /dev/shm/epcomm.<name> (only rank 0 does,
///   once all joined), so it stays until a new group of the same name replaces it;
/// - rank 2 arrives after rank 0 died: it ignores a group whose creator is gone and waits for a
///   new one, while rank 1 waits for rank 2 to join without checking that the ranks already in
///   (rank 0) are alive: both time out after the full 5 s, rank 1 naming rank 2 (alive) instead
///   of the dead rank 0, and rank 0's segments stay in /dev/shm.
#[test]
fn kill_rank_0_at_join() {
    run_case("kill0:join", Mode::Direct);
}

#[test]
fn kill_at_dispatch_before_counts() {
    run_case("kill:dispatch:before_counts", Mode::Direct);
    run_case("kill:dispatch:before_counts", Mode::Region);
}

#[test]
fn kill_at_dispatch_after_counts() {
    run_case("kill:dispatch:after_counts", Mode::Direct);
    run_case("kill:dispatch:after_counts", Mode::Region);
}

#[test]
fn kill_at_combine() {
    run_case("kill:combine", Mode::Direct);
    run_case("kill:combine", Mode::Region);
}

#[test]
fn kill_at_eplb_before_staging() {
    run_case("kill:eplb:before_staging", Mode::Direct);
    run_case("kill:eplb:before_staging", Mode::Region);
}

#[test]
fn kill_at_eplb_between_batches() {
    // Without migration batching a layer is one execute: rank 2 dies right after layer 0's,
    // so layer 0 is new, 1 and 2 old (tests/eplb_decision.rs covers the batched path).
    run_case("kill:eplb:between_batches", Mode::Direct);
    run_case("kill:eplb:between_batches", Mode::Region);
}

#[test]
fn kill_at_eplb_after_staging() {
    // Three layers: rank 2 dies after layer 0's transfers, so layer 0 is new, 1 and 2 old.
    run_case("kill:eplb:after_staging", Mode::Direct);
    run_case("kill:eplb:after_staging", Mode::Region);
}

/// One layer, killed after its transfers: the survivors complete the rearrangement (their
/// weights are the new placement) and, never having waited on rank 2 again, do not notice its
/// death. Regression: rank 2's region must not stay in /dev/shm (today it stays until a new
/// group of the same name is created).
#[test]
fn kill_after_the_last_eplb_transfer() {
    run_case("kill1:eplb:after_staging", Mode::Direct);
}

#[test]
fn stalled_rank_times_out() {
    run_case("stall", Mode::Direct);
}

#[test]
fn different_collectives_fail_on_every_rank() {
    run_case("order", Mode::Direct);
    run_case("order", Mode::Region);
    run_case("order_dispatch", Mode::Direct);
    run_case("order_dispatch", Mode::Region);
}

#[test]
fn different_configs_fail_on_every_rank() {
    run_case("config", Mode::Direct);
    run_case("config", Mode::Region);
}

#[test]
fn different_sizes_fail_on_every_rank() {
    run_case("sizes", Mode::Direct);
}

/// Regression: staged through the shared regions, the rank whose own view of the sizes is
/// consistent (rank 1) returns success while ranks 0 and 2 fail the same all_gatherv; it only
/// learns of the failure at its next collective.
#[test]
fn different_sizes_fail_on_every_rank_when_staged() {
    run_case("sizes", Mode::Region);
}

/// Regression (ranks as threads, direct reads): a rank whose collective fails returns at once,
/// while peers may still be copying straight from its buffers. Here rank 2 rejects rank 0's
/// 64 MiB contribution (it expects 1 byte) and frees its own 1 MiB input as soon as its call
/// returned; ranks 0 and 1, whose view of the sizes is consistent, are still copying rank 0's
/// 64 MiB and read rank 2's input afterwards — memory that is gone. Run in a child process, so a
/// crash fails this test instead of the test binary. Every rank must return an error, and the
/// process must not crash.
#[test]
fn a_failing_rank_does_not_free_buffers_its_peers_still_read() {
    const BIG: usize = 64 << 20;
    const SMALL: usize = 1 << 20;
    if let Ok(group) = std::env::var("FM_UAF_GROUP") {
        let res = ranks::on_threads(WORLD, move |rank| {
            let mut g = ShmGroup::join(&group, rank, WORLD, GroupOptions::default()).unwrap();
            g.barrier().unwrap();
            assert!(g.direct(), "threads always read each other directly");
            let sizes = if rank == 2 {
                vec![1, 0, SMALL]
            } else {
                vec![BIG, 0, SMALL]
            };
            let input = match rank {
                0 => vec![1u8; BIG],
                1 => Vec::new(),
                _ => vec![3u8; SMALL],
            };
            let mut out = vec![0u8; sizes.iter().sum()];
            let r = g.all_gatherv(&input, &sizes, &mut out);
            // What a caller does after an error: drop (or reuse) its buffers.
            drop(input);
            r.map_err(|e| format!("{:?}: {e}", e.status()))
        });
        for (rank, r) in res.iter().enumerate() {
            println!("\nFM_UAF rank {rank}: {r:?}");
            assert!(r.is_err(), "rank {rank} succeeded");
        }
        return;
    }
    let group = ranks::unique("fm", "uaf");
    let kids = vec![(
        0,
        ranks::spawn_test(
            "a_failing_rank_does_not_free_buffers_its_peers_still_read",
            &[
                ("FM_UAF_GROUP", group.clone()),
                ("EPCOMM_TIMEOUT_S", TIMEOUT_S.to_string()),
                ("RUST_BACKTRACE", "0".to_owned()),
            ],
        ),
    )];
    let res = wait_all(kids, PHASE_DEADLINE);
    let out = res[0].output();
    println!("{out}");
    if !res[0].success() {
        // A crash leaves the ranks' regions; remove them so the failure leaves nothing behind.
        for f in shm_leftovers(&group) {
            let _ = std::fs::remove_file(format!("/dev/shm/{f}"));
        }
    }
    assert!(
        res[0].success(),
        "the process whose rank threads disagreed on sizes did not end cleanly (signal {:?}):\n{out}",
        res[0].status.signal()
    );
    assert_no_leftovers(&group, "threads disagreeing on sizes");
}

/// Buffers larger than the host's memory are an error at creation, naming the sizes, instead
/// of an allocation that the out-of-memory killer ends.
#[test]
fn buffers_larger_than_memory_are_errors() {
    let mut c = moe_cfg(4096);
    c.max_tokens_per_rank = 1 << 30;
    for backend in ["deepep_low_latency", "flashinfer_nvlink_two_sided"] {
        let e = Manager::new(backend, c.clone(), 0, 1).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument, "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("bytes of memory available; lower max_tokens_per_rank"),
            "{msg}"
        );
    }
    // A shared region larger than /dev/shm: an error when the group is created (posix_fallocate
    // reserves the pages, so it is never a SIGBUS later), and nothing is left behind.
    let group = ranks::unique("fm", "huge");
    let huge = GroupOptions {
        initial_capacity: 1 << 50,
        ..GroupOptions::default()
    };
    let e = ShmGroup::join(&group, 0, 1, huge).unwrap_err();
    assert_eq!(e.status(), Status::System, "{e}");
    assert_no_leftovers(&group, "a region larger than /dev/shm");
}

/// Recovery without restarting the survivors: rank 2 dies at `point`, the survivors get their
/// PeerFailure and at once join a new group of the same name in the same process, which a
/// replacement rank 2 (started by the parent as soon as rank 2 is gone) joins too; the new group
/// does a barrier and a checked dispatch/combine.
fn rejoin_case(point: &str) {
    let case = format!("rejoin:{point}");
    let tag: String = point
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let group = ranks::unique("fm", &format!("rejoin_{tag}"));
    let _cleanup = RemoveOnPanic(group.clone());
    let mut kids = spawn(&group, &case, "fault", Mode::Direct, "-");
    let (rank, mut victim) = kids.pop().unwrap();
    assert_eq!(rank, VICTIM);
    let start = Instant::now();
    let died = loop {
        if let Some(s) = victim.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > PHASE_DEADLINE {
            let _ = victim.kill();
            let res = wait_all(kids, Duration::ZERO);
            panic!(
                "rank {VICTIM} did not die at {point}:\n{}",
                all_output(&res)
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    assert_eq!(died.signal(), Some(libc::SIGKILL), "{case}");
    kids.extend(spawn_some(
        [VICTIM],
        &group,
        &case,
        "after",
        Mode::Direct,
        "-",
    ));
    let res = wait_all(kids, PHASE_DEADLINE);
    let all = all_output(&res);
    for f in &res {
        assert!(f.success(), "{case}: rank {} failed:\n{all}", f.rank);
        if f.rank != VICTIM {
            let o = outcome(f);
            assert_eq!(o.status, Status::PeerFailure as i32, "{case}: {o:?}\n{all}");
        }
        let prefix = if f.rank == VICTIM {
            "FM_RESULT "
        } else {
            "FM_REJOIN "
        };
        let o = outcome_of(f, prefix);
        println!(
            "fault_matrix {case:<24} rank {} in the re-formed group: {} after {} ms: {}",
            f.rank,
            if o.ok {
                "ok".to_owned()
            } else {
                status_name(o.status)
            },
            o.ms,
            o.message
        );
        assert!(
            o.ok,
            "{case}: rank {} could not re-form the group: {o:?}\n{all}",
            f.rank
        );
    }
    assert_no_leftovers(&group, &case);
}

#[test]
fn survivors_rejoin_with_a_replacement_rank() {
    rejoin_case("dispatch:before_counts");
    rejoin_case("combine");
}

/// Regression: rank 2 dies while the group is being created. Its replacement starts at once and
/// finds the old control segment (rank 0 is alive and has not noticed the death yet, so it has
/// not removed it) with slot 2 still claimed by the dead pid: its join fails at once with
/// InvalidArgument "rank 2 of group '...' is already taken (by pid <dead pid>); each rank joins
/// once" instead of waiting for the survivors' new group, which then times out without it.
#[test]
fn a_replacement_rank_joins_while_the_survivors_notice_the_death() {
    rejoin_case("join");
}
