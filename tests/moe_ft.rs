//! Fault-tolerant expert parallelism (deepep_low_latency with fault tolerance on, vLLM's
//! `enable_fault_tolerance`): a rank killed (SIGKILL) or stopped past the timeout (SIGSTOP) at
//! a random moment of a multi-step run fails the call in progress on every survivor, the
//! same step everywhere; from the next call on the survivors run over their own group with
//! that rank masked, and every output equals the single-process f32 reference with the masked
//! rank's experts left out. Every survivor reports the same mask; the stopped rank, once
//! resumed, never completes a call again (it never rejoins); nothing is left in /dev/shm.
//!
//! `ft_campaign_sample` runs a CI-sized sample (`EPCOMM_FT_RUNS`, default 8: kills and stops
//! alternate, the victim and the moment drawn from `EPCOMM_FT_SEED`); `scripts/ft-campaign.sh`
//! runs 100 or more. The thread tests cover the same flow without processes, the refusals
//! and vLLM's query/clean semantics.

#[path = "common/channel.rs"]
mod channel;
mod common;
mod ranks;

use channel::{channel_transports, ChannelTransport};
use common::moe_fixture::max_rel_error;

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use epcomm::group::host::{HostFailure, HostGroup, HostTransport};
use epcomm::group::shm::ShmGroup;
use epcomm::group::Group;
use epcomm::moe::reference::unit;
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::{self, FloatKind};
use epcomm::Status;

use common::ft_fixture::*;

// ---------------------------------------------------------------------------------------
// Thread ranks.

/// Rank 3 stops calling after two steps (a stall, like a rank stuck in a kernel) and comes
/// back after the survivors gave up on it; `group(rank)` makes each rank's group.
fn stalled_rank_run(group: impl Fn(usize) -> Box<dyn Group> + Send + Sync + Clone + 'static) {
    let results = ranks::on_threads(WORLD, move |rank| {
        let mut g = group(rank);
        let mut m = manager(rank);
        let ex = experts();
        let steps = if rank == 3 { 2 } else { 6 };
        let mut out: Vec<Step> = (0..steps)
            .map(|s| one_step(&mut m, g.as_mut(), &ex, s))
            .collect();
        if rank == 3 {
            std::thread::sleep(STALL_TIMEOUT * 3);
            out.extend((2..4).map(|s| one_step(&mut m, g.as_mut(), &ex, s)));
        }
        let fault = m.query_fault();
        m.clean_buffers();
        let after_clean = m.query_fault();
        // vLLM v0.34.0's sentinel replays the dead ranks after clean_buffers (update_mask).
        let replay = [
            m.update_mask(3, true)
                .map_err(|e| (e.status(), e.to_string())),
            m.update_mask(3, false)
                .map_err(|e| (e.status(), e.to_string())),
            m.update_mask(0, true)
                .map_err(|e| (e.status(), e.to_string())),
            m.update_mask(0, false)
                .map_err(|e| (e.status(), e.to_string())),
            m.update_mask(WORLD, true)
                .map_err(|e| (e.status(), e.to_string())),
        ];
        (
            out,
            fault,
            after_clean,
            replay,
            m.query_fault(),
            m.active_mask(),
        )
    });
    for (rank, (steps, fault, fault_after_clean, replay, fault_after_replay, mask)) in
        results.iter().enumerate()
    {
        let ok = |s: &Step| s.status.is_none() && s.error <= TOL;
        assert!(ok(&steps[0]) && ok(&steps[1]), "rank {rank}: {steps:?}");
        if rank == 3 {
            // Never rejoins: every call after the stall fails.
            assert!(steps[2..].iter().all(|s| s.status.is_some()), "{steps:?}");
            continue;
        }
        assert_eq!(
            steps[2].status,
            Some(Status::Timeout),
            "rank {rank}: {steps:?}"
        );
        assert!(
            steps[2].message.contains("waiting for rank(s) 3"),
            "{}",
            steps[2].message
        );
        for s in &steps[3..] {
            assert!(ok(s), "rank {rank} step {}: {s:?}", s.step);
            assert_eq!(s.mask, vec![0, 0, 0, 1]);
            assert_eq!(s.dropped, s.expected_dropped, "rank {rank}: {s:?}");
        }
        assert!(steps[3..].iter().any(|s| s.dropped > 0));
        assert!(
            *fault && !*fault_after_clean,
            "rank {rank}: query_fault before/after clean"
        );
        // Replaying the masked rank changes nothing; a live rank cannot be masked by hand nor a
        // masked one unmasked.
        assert_eq!(replay[0], Ok(()), "rank {rank}");
        assert_eq!(replay[1].as_ref().unwrap_err().0, Status::InvalidState);
        assert_eq!(
            replay[2],
            Err((
                Status::InvalidState,
                "update_mask: rank 0 is live in this group; epcomm masks a rank when the group \
                 loses it (it then leaves the survivors' group), not by hand"
                    .to_owned()
            ))
        );
        assert_eq!(replay[3], Ok(()));
        assert_eq!(replay[4].as_ref().unwrap_err().0, Status::InvalidArgument);
        assert!(!*fault_after_replay, "rank {rank}");
        assert_eq!(mask, &vec![0, 0, 0, 1]);
    }
}

#[test]
fn a_stalled_rank_is_masked_and_the_survivors_go_on() {
    let name = ranks::unique("ft", "stall");
    stalled_rank_run(move |rank| {
        Box::new(ShmGroup::join(&name, rank, WORLD, opts(STALL_TIMEOUT)).unwrap())
    });
}

/// The same over the host-callback transport: the host's transport (channels for the data, a
/// shared-memory group for its all_gather, which is where a peer that stopped calling is found,
/// the same on every rank) reports the stall as TIMEOUT, names the lost rank and shrinks; the
/// manager masks the same way.
#[test]
fn a_stalled_rank_is_masked_over_the_host_transport() {
    let name = ranks::unique("ft", "host");
    let meshes = Arc::new(Mutex::new(HashMap::new()));
    stalled_rank_run(move |rank| {
        let ctl = ShmGroup::join(&name, rank, WORLD, opts(STALL_TIMEOUT)).unwrap();
        let t = HostFt::new(Box::new(ctl), (0..WORLD).collect(), meshes.clone());
        Box::new(HostGroup::new(Box::new(t), "ft-host", rank, WORLD, false).unwrap())
    });
}

/// Channel meshes by the original ranks of their members: each member takes its end.
type Meshes = Arc<Mutex<HashMap<Vec<usize>, Vec<Option<ChannelTransport>>>>>;

/// A host transport: channels for send/recv, a group for all_gather, lost ranks and shrink.
struct HostFt {
    data: ChannelTransport,
    ctl: Box<dyn Group>,
    /// The original rank of each member.
    members: Vec<usize>,
    meshes: Meshes,
    failure: Option<HostFailure>,
}

impl HostFt {
    fn new(ctl: Box<dyn Group>, members: Vec<usize>, meshes: Meshes) -> HostFt {
        let data = {
            let mut all = meshes.lock().unwrap();
            let mesh = all.entry(members.clone()).or_insert_with(|| {
                channel_transports(members.len(), false)
                    .into_iter()
                    .map(Some)
                    .collect()
            });
            mesh[ctl.rank()].take().unwrap()
        };
        HostFt {
            data,
            ctl,
            members,
            meshes,
            failure: None,
        }
    }
}

impl HostTransport for HostFt {
    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), String> {
        self.data.send(peer, data)
    }
    fn recv(&mut self, peer: usize, data: &mut [u8]) -> Result<(), String> {
        self.data.recv(peer, data)
    }
    fn all_gather(&mut self, mine: &[u8], out: &mut [u8]) -> Option<Result<(), String>> {
        Some(self.ctl.all_gather(mine, out).map_err(|e| {
            self.failure = match e.status() {
                Status::Timeout => Some(HostFailure::Timeout),
                _ => Some(HostFailure::PeerFailure),
            };
            e.to_string()
        }))
    }
    fn failure_kind(&self) -> Option<HostFailure> {
        self.failure
    }
    fn lost_ranks(&self) -> Option<Result<Vec<usize>, String>> {
        Some(Ok(self.ctl.lost_ranks()))
    }
    fn shrink(&mut self, excluded: &[usize]) -> Option<Result<Box<dyn HostTransport>, String>> {
        let ctl = match self.ctl.shrink(excluded) {
            Ok(g) => g,
            Err(e) => return Some(Err(e.to_string())),
        };
        let members = (0..self.members.len())
            .filter(|r| !excluded.contains(r))
            .map(|r| self.members[r])
            .collect();
        Some(Ok(Box::new(HostFt::new(ctl, members, self.meshes.clone()))))
    }
}

/// Rank 3 stalls between its dispatch and its combine: the survivors' combine fails; a combine
/// tried again (the dispatch was planned with rank 3 alive) fails on every survivor at once,
/// never half-done; the next dispatch/combine works with rank 3 masked.
#[test]
fn a_combine_retried_after_a_loss_fails_alike_then_the_survivors_go_on() {
    let name = ranks::unique("ft", "retry");
    let results = ranks::on_threads(WORLD, move |rank| {
        let mut g = ShmGroup::join(&name, rank, WORLD, opts(STALL_TIMEOUT)).unwrap();
        let mut m = manager(rank);
        let ex = experts();
        let (x, ids, ws) = tokens(0, rank);
        let xb = num::from_f32(&x, FloatKind::F32);
        let y = {
            let v = m.dispatch(&mut g, &xb, &ids, &ws, &[]).unwrap();
            num::from_f32(
                &ex.run_local(&v, FloatKind::F32, rank, WORLD, TOP_K),
                FloatKind::F32,
            )
        };
        if rank == 3 {
            std::thread::sleep(STALL_TIMEOUT * 3);
            return Vec::new();
        }
        let mut out = vec![0u8; x.len() * 4];
        let first = m.combine(&mut g, &y, &mut out).unwrap_err();
        let again = m.combine(&mut g, &y, &mut out).unwrap_err();
        let next = one_step(&mut m, &mut g, &ex, 1);
        vec![
            (first.status(), first.to_string()),
            (again.status(), again.to_string()),
            {
                (
                    next.status.unwrap_or(Status::Ok),
                    format!("{} {:?}", next.error, next.mask),
                )
            },
        ]
    });
    for (rank, r) in results.iter().enumerate().take(3) {
        assert_eq!(r[0].0, Status::Timeout, "rank {rank}: {r:?}");
        assert!(r[0].1.contains("waiting for rank(s) 3"), "{r:?}");
        assert_ne!(r[1].0, Status::Ok, "rank {rank}: {r:?}");
        assert!(
            r[1].1 == "combine: the last dispatch was made before rank(s) 3 were masked, and its rows cannot be combined over the survivors; dispatch again (clean_buffers, then retry the step)"
                || r[1].1.starts_with("combine: rank ") && r[1].1.ends_with(" rejected its input (see that rank's error); no data was exchanged"),
            "rank {rank}: {r:?}"
        );
        assert_eq!(r[2].0, Status::Ok, "rank {rank}: {r:?}");
        assert!(r[2].1.ends_with("[0, 0, 0, 1]"), "rank {rank}: {r:?}");
    }
}

#[test]
fn fault_tolerance_is_refused_for_the_backends_vllm_refuses() {
    let mut m = Manager::new("deepep_high_throughput", cfg(), 0, WORLD).unwrap();
    let e = m.set_fault_tolerance(true).unwrap_err();
    // vllm/v1/worker/sentinel/gpu_worker_sentinel.py, WorkerSentinel.__init__
    assert_eq!(
        e.to_string(),
        "Fault tolerance requires an FT-capable all2all backend (one of ['deepep_low_latency', 'nixl_ep']), but got 'deepep_high_throughput'."
    );
    assert_eq!(e.exception(), "ValueError");
    let mut m = Manager::new("nixl_ep", cfg(), 0, WORLD).unwrap();
    m.set_fault_tolerance(true).unwrap();
    assert!(m.fault_tolerance());
    assert_eq!(m.active_mask(), vec![0; WORLD]);
    assert!(!m.query_fault());
}

#[test]
fn ranks_that_disagree_on_fault_tolerance_fail_alike() {
    let name = ranks::unique("ft", "differ");
    let results = ranks::on_threads(2, move |rank| {
        let mut g = ShmGroup::join(&name, rank, 2, opts(Duration::from_secs(10))).unwrap();
        let mut m = Manager::new(BACKEND, cfg(), rank, 2).unwrap();
        m.set_fault_tolerance(rank == 0).unwrap();
        let (x, ids, ws) = tokens(0, rank);
        let xb = num::from_f32(&x, FloatKind::F32);
        m.dispatch(&mut g, &xb, &ids, &ws, &[])
            .map(drop)
            .unwrap_err()
            .to_string()
    });
    assert_eq!(
        results,
        vec![
            "dispatch: rank 1 has fault tolerance = off but rank 0 has on; every rank must create the manager with the same backend and configuration",
            "dispatch: rank 0 has fault tolerance = on but rank 1 has off; every rank must create the manager with the same backend and configuration",
        ]
    );
}

/// Ranks that call different collectives (rank 1 combines while the others dispatch again)
/// fail alike with INVALID_STATE, with and without fault tolerance; nothing is masked (a
/// caller's mistake is not a lost rank) and the group serves on once the calls match again.
#[test]
fn ranks_that_call_different_collectives_fail_alike_and_nothing_is_masked() {
    for ft in [true, false] {
        let name = ranks::unique("ft", "order");
        let group = name.clone();
        let results = ranks::on_threads(WORLD, move |rank| {
            let mut g = ShmGroup::join(&name, rank, WORLD, opts(Duration::from_secs(10))).unwrap();
            let mut m = Manager::new(BACKEND, cfg(), rank, WORLD).unwrap();
            m.set_fault_tolerance(ft).unwrap();
            let ex = experts();
            let first = one_step(&mut m, &mut g, &ex, 0);
            let (x, ids, ws) = tokens(1, rank);
            let xb = num::from_f32(&x, FloatKind::F32);
            let second = if rank == 1 {
                let y = vec![0u8; m.combine_rows().unwrap() * HIDDEN * 4];
                let mut out = vec![0u8; tokens(0, rank).0.len() * 4];
                m.combine(&mut g, &y, &mut out)
            } else {
                m.dispatch(&mut g, &xb, &ids, &ws, &[]).map(drop)
            }
            .map_err(|e| (e.status(), e.to_string()));
            let mask = m.active_mask();
            let third = one_step(&mut m, &mut g, &ex, 2);
            (first, second, mask, third)
        });
        let want = format!("ranks of group '{group}' called different collectives: rank 0 calls dispatch but rank 1 calls combine; every rank must call the same collectives in the same order (no data was exchanged)");
        for (rank, (first, second, mask, third)) in results.into_iter().enumerate() {
            assert!(first.status.is_none() && first.error <= TOL, "{first:?}");
            assert_eq!(
                second,
                Err((Status::InvalidState, want.clone())),
                "rank {rank}, ft {ft}"
            );
            assert_eq!(mask, vec![0; WORLD], "rank {rank}, ft {ft}");
            assert!(third.status.is_none() && third.error <= TOL, "{third:?}");
            assert_eq!(third.mask, vec![0; WORLD]);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Processes: the campaign.

const STEPS: usize = 30;
/// The ranks' timeout: long enough that a loaded CI machine never makes a healthy rank late;
/// a stop lasts until the survivors finished.
const TIMEOUT: Duration = Duration::from_millis(2000);

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} unset"))
}

/// A rank of a campaign run (this binary run again): join, report readiness, run the steps
/// with a short pause between them, print each outcome at once (a killed rank leaves what it
/// did). Not a test of its own: without FT_GROUP it returns.
#[test]
fn ft_rank_process() {
    let Ok(name) = std::env::var("FT_GROUP") else {
        return;
    };
    let rank: usize = env("FT_RANK").parse().unwrap();
    let mut g = ShmGroup::join(&name, rank, WORLD, opts(TIMEOUT)).unwrap();
    let mut m = manager(rank);
    let ex = experts();
    std::fs::write(format!("{}.{rank}", env("FT_READY")), b"ready").unwrap();
    let mut stdout = std::io::stdout();
    for step in 0..STEPS {
        let s = one_step(&mut m, &mut g, &ex, step);
        writeln!(stdout, "{}", s.line()).unwrap();
        stdout.flush().unwrap();
        std::thread::sleep(Duration::from_millis(4));
    }
    println!("DONE");
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    Kill,
    Stop,
}

/// What one run showed; `Err` names the rule it broke.
fn run_once(run: usize, seed: u64) -> Result<&'static str, String> {
    let fault = if run.is_multiple_of(2) {
        Fault::Kill
    } else {
        Fault::Stop
    };
    let mut rng = seed ^ (run as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut draw = |n: u64| {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 33) % n
    };
    let victim = draw(WORLD as u64) as usize;
    let delay = Duration::from_millis(draw(300));
    let name = format!("ftc{}r{run}", std::process::id());
    let ready = ranks::Ready::new(&name, WORLD);
    let children = ranks::spawn_ranks("ft_rank_process", 0..WORLD, |r| {
        vec![
            ("FT_GROUP", name.clone()),
            ("FT_RANK", r.to_string()),
            ("FT_READY", ready.path()),
        ]
    });
    let pids: Vec<u32> = children.iter().map(|(_, c)| c.id()).collect();
    ready.wait(Duration::from_secs(20));
    std::thread::sleep(delay);
    let sig = match fault {
        Fault::Kill => libc::SIGKILL,
        Fault::Stop => libc::SIGSTOP,
    };
    // SAFETY: a child of this process.
    unsafe { libc::kill(pids[victim] as libc::pid_t, sig) };
    // The survivors first; then the stopped rank is resumed (well past the timeout: the
    // survivors masked it and finished) and must find itself left out.
    let (v, others): (Vec<_>, Vec<_>) = children.into_iter().partition(|(r, _)| *r == victim);
    let mut done = ranks::wait_all(others, Duration::from_secs(60));
    if fault == Fault::Stop {
        // SAFETY: as above.
        unsafe { libc::kill(pids[victim] as libc::pid_t, libc::SIGCONT) };
    }
    done.extend(ranks::wait_all(v, Duration::from_secs(30)));
    done.sort_by_key(|f| f.rank);
    drop(ready);
    let leftovers = ranks::shm_leftovers(&name);
    let describe = || {
        let all: Vec<String> = done.iter().map(ranks::Finished::output).collect();
        format!(
            "run {run} ({fault:?} rank {victim} after {delay:?}):\n{}",
            all.join("\n")
        )
    };
    if !leftovers.is_empty() {
        return Err(format!("left in /dev/shm: {leftovers:?}; {}", describe()));
    }
    check_run(&done, victim, fault).map_err(|e| format!("{e}; {}", describe()))
}

/// The rules of one run (see the module's doc).
fn check_run(
    done: &[ranks::Finished],
    victim: usize,
    fault: Fault,
) -> Result<&'static str, String> {
    let steps =
        |f: &ranks::Finished| -> Vec<Step> { f.stdout.lines().filter_map(Step::parse).collect() };
    let survivors: Vec<&ranks::Finished> = done.iter().filter(|f| f.rank != victim).collect();
    let mut outcomes = BTreeMap::new();
    for f in &survivors {
        let s = steps(f);
        if !f.success() || !f.stdout.contains("DONE") || s.len() != STEPS {
            return Err(format!(
                "survivor {} did not finish its {STEPS} steps",
                f.rank
            ));
        }
        for st in &s {
            if st.status.is_none() && (st.error > TOL || st.dropped != st.expected_dropped) {
                return Err(format!(
                    "survivor {} step {}: wrong output {st:?}",
                    f.rank, st.step
                ));
            }
        }
        let key: Vec<(usize, Option<Status>)> = s.iter().map(|x| (x.step, x.status)).collect();
        outcomes.insert(f.rank, (key, s.last().map(|x| x.mask.clone())));
    }
    let first = outcomes.values().next().cloned().unwrap_or_default();
    if outcomes.values().any(|o| *o != first) {
        return Err(format!("survivors disagree: {outcomes:?}"));
    }
    let failed: Vec<usize> = first
        .0
        .iter()
        .filter(|(_, s)| s.is_some())
        .map(|x| x.0)
        .collect();
    let mut want = vec![0; WORLD];
    if failed.is_empty() {
        // The signal came after the victim's last call.
        return Ok("no failure seen");
    }
    want[victim] = 1;
    if first.1 != Some(want) || failed.len() != 1 {
        return Err(format!("mask {:?} / failing steps {failed:?}", first.1));
    }
    // The stopped rank, resumed, never completes a call at or after the survivors' failure.
    if fault == Fault::Stop {
        let v = done.iter().find(|f| f.rank == victim).unwrap();
        if steps(v)
            .iter()
            .any(|s| s.step >= failed[0] && s.status.is_none())
        {
            return Err("the stopped rank completed a call after it was masked".into());
        }
    }
    Ok("masked")
}

#[test]
fn ft_campaign_sample() {
    let runs: usize = std::env::var("EPCOMM_FT_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let seed: u64 = std::env::var("EPCOMM_FT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed);
    let mut tally: BTreeMap<String, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    let start = Instant::now();
    for run in 0..runs {
        match run_once(run, seed) {
            Ok(what) => *tally.entry(what.to_string()).or_default() += 1,
            Err(e) => failures.push(e),
        }
    }
    println!(
        "ft campaign: {runs} runs (seed {seed}) in {:.1} s: {tally:?}, {} violations",
        start.elapsed().as_secs_f64(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

// ---------------------------------------------------------------------------------------
// Masking, then shrink + EPLB scale-down: full expert coverage again.

/// Logical experts of the scale-down test; 4 slots per rank.
const LOGICAL: usize = 12;
const SLOTS: usize = 4;
/// The placement on 4 ranks: every expert rank 3 holds (9, 10, 11, 0) has a replica elsewhere.
const OLD_MAP: [i64; 16] = [0, 1, 2, 9, 3, 4, 5, 10, 6, 7, 8, 11, 9, 10, 11, 0];
/// Old rank -> rank of the survivors' group (rank 3 is gone).
const SCALE_DOWN: [i64; 4] = [0, 1, 2, -1];

/// Logical expert e's weights, one row: H scales then H biases (f32).
fn expert_row(e: usize) -> Vec<u8> {
    let mut v: Vec<f32> = (0..HIDDEN as u64)
        .map(|i| 1.0 + 0.5 * unit(e as u64, i))
        .collect();
    v.extend((0..HIDDEN as u64).map(|i| 0.1 * unit(e as u64 + 100, i)));
    num::from_f32(&v, FloatKind::F32)
}

/// y += w (a ⊙ x + b) with the weights of one expert row.
fn apply_row(row: &[f32], x: &[f32], w: f32, y: &mut [f32]) {
    for i in 0..HIDDEN {
        y[i] += w * (row[i] * x[i] + row[HIDDEN + i]);
    }
}

/// Tokens with 2 distinct logical experts each, routed to the physical slot `slot_of` picks.
fn logical_tokens(step: usize, rank: usize) -> (Vec<f32>, Vec<usize>, Vec<f32>) {
    let t = 6 + (step + rank) % 5;
    let seed = 1000 + (step * WORLD + rank) as u64;
    let x = (0..(t * HIDDEN) as u64).map(|i| unit(seed, i)).collect();
    let mut ids = Vec::new();
    for tok in 0..t {
        let e = ((unit(seed ^ 7, tok as u64) + 1.0) * 0.5 * LOGICAL as f32) as usize % LOGICAL;
        ids.extend([e, (e + 5) % LOGICAL]);
    }
    let ws = (0..(t * 2) as u64)
        .map(|i| 0.5 + 0.25 * unit(seed ^ 9, i))
        .collect();
    (x, ids, ws)
}

/// One MoE step with `map` (physical -> logical) and this rank's slot weights `held` (one
/// expert row per slot): logical ids go to the replica `slot_of(logical, token)` picks, the
/// experts that arrive run with the weights the slots hold, combine; the largest error against
/// the logical reference over the pairs whose slot is on a live rank, and the pairs dropped.
fn placed_step(
    m: &mut Manager,
    g: &mut dyn Group,
    held: &[Vec<u8>],
    slot_of: &dyn Fn(usize, usize) -> usize,
    step: usize,
    rank: usize,
) -> epcomm::Result<(f32, u64)> {
    let (x, logical, ws) = logical_tokens(step, rank);
    let phys: Vec<i64> = logical
        .iter()
        .enumerate()
        .map(|(i, &e)| slot_of(e, i / 2) as i64)
        .collect();
    let xb = num::from_f32(&x, FloatKind::F32);
    let v = m.dispatch(g, &xb, &phys, &ws, &[])?;
    let rows = num::to_f32(v.hidden, FloatKind::F32);
    let bucket = rows.len() / HIDDEN / SLOTS;
    let mut y = vec![0f32; rows.len()];
    for (j, slot) in held.iter().enumerate().take(SLOTS) {
        let w = num::to_f32(slot, FloatKind::F32);
        for r in j * bucket..j * bucket + v.counts[j] as usize {
            let (xr, yr) = (
                &rows[r * HIDDEN..(r + 1) * HIDDEN],
                &mut y[r * HIDDEN..(r + 1) * HIDDEN],
            );
            apply_row(&w, xr, 1.0, yr);
        }
    }
    let mut out = vec![0u8; x.len() * 4];
    m.combine(g, &num::from_f32(&y, FloatKind::F32), &mut out)?;
    let mask = m.active_mask();
    let mut want = vec![0f32; x.len()];
    for (i, (&e, &p)) in logical.iter().zip(&phys).enumerate() {
        if mask[p as usize / SLOTS] == 0 {
            let tok = i / 2;
            let row = num::to_f32(&expert_row(e), FloatKind::F32);
            let (xr, yr) = (
                &x[tok * HIDDEN..(tok + 1) * HIDDEN],
                &mut want[tok * HIDDEN..(tok + 1) * HIDDEN],
            );
            apply_row(&row, xr, ws[i], yr);
        }
    }
    let got = num::to_f32(&out, FloatKind::F32);
    let err = max_rel_error(&got, &want);
    Ok((err, m.stats().dropped_pairs))
}

fn placed_manager(rank: usize, world: usize) -> Manager {
    let cfg = MoeConfig {
        num_experts: world * SLOTS,
        top_k: 2,
        ..cfg()
    };
    let mut m = Manager::new(BACKEND, cfg, rank, world).unwrap();
    m.set_fault_tolerance(true).unwrap();
    m
}

/// Rank 3 stalls; the survivors serve with its slots masked (pairs routed there are
/// dropped), then shrink, move the experts with EPLB onto the 3-rank group by the rank
/// mapping (vLLM's elastic scale-down, with the dead rank sending nothing), and serve again
/// with every logical expert covered: outputs equal the reference of the new placement, no
/// pair dropped.
#[test]
fn shrink_and_eplb_scale_down_restore_full_coverage() {
    let name = ranks::unique("ft", "scale");
    let results = ranks::on_threads(WORLD, move |rank| {
        let mut g = ShmGroup::join(&name, rank, WORLD, opts(STALL_TIMEOUT)).unwrap();
        let mut m = placed_manager(rank, WORLD);
        let mut held: Vec<Vec<u8>> = OLD_MAP[rank * SLOTS..(rank + 1) * SLOTS]
            .iter()
            .map(|&e| expert_row(e as usize))
            .collect();
        // Rank 3's replica for even tokens of the experts it holds, so masking drops pairs.
        let old_slot = |e: usize, tok: usize| {
            let all: Vec<usize> = (0..16).filter(|&s| OLD_MAP[s] == e as i64).collect();
            *all.get(tok % 2).unwrap_or(&all[0])
        };
        let mut log = Vec::new();
        let steps = if rank == 3 { 1 } else { 4 };
        for s in 0..steps {
            log.push(placed_step(&mut m, &mut g, &held, &old_slot, s, rank));
        }
        if rank == 3 {
            std::thread::sleep(STALL_TIMEOUT * 3);
            return (log, Vec::new());
        }
        // Shrink and scale down with EPLB: the survivors' new placement covers every expert.
        let lost = g.lost_ranks();
        assert_eq!(lost, vec![3]);
        let mut s = g.shrink(&lost).unwrap();
        let new_map: Vec<i64> = (0..LOGICAL as i64).collect();
        let mut c = common::eplb_fixture::gloo_cpu().unwrap();
        let summary = {
            // One tensor per layer: a row of 2 x HIDDEN f32 per slot.
            let mut w = vec![vec![held.concat()]];
            let mut views = common::eplb_fixture::views(&mut w);
            let options = epcomm::eplb::rearrange::RearrangeOptions {
                rank_mapping: Some(&SCALE_DOWN),
                ..Default::default()
            };
            let r = epcomm::eplb::rearrange::rearrange_with(
                s.as_mut(),
                c.as_mut(),
                &[OLD_MAP.to_vec()],
                std::slice::from_ref(&new_map),
                &mut views,
                &[2 * HIDDEN * 4],
                &options,
            );
            drop(views);
            held = w[0][0].chunks(2 * HIDDEN * 4).map(<[u8]>::to_vec).collect();
            r.unwrap()
        };
        assert!(summary.lost_experts.iter().all(Vec::is_empty));
        let me = s.rank();
        let mut m2 = placed_manager(me, 3);
        let new_slot = |e: usize, _tok: usize| e;
        let mut after = Vec::new();
        for step in 4..8 {
            after.push(placed_step(
                &mut m2,
                s.as_mut(),
                &held,
                &new_slot,
                step,
                rank,
            ));
        }
        (log, after)
    });
    for (rank, (before, after)) in results.iter().enumerate().take(3) {
        let ok: Vec<&(f32, u64)> = before.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert!(before[0].is_ok(), "rank {rank}: {before:?}");
        assert_eq!(before[1].as_ref().unwrap_err().status(), Status::Timeout);
        assert!(ok.iter().all(|(e, _)| *e <= TOL), "rank {rank}: {before:?}");
        assert!(
            ok[1..].iter().any(|(_, d)| *d > 0),
            "rank {rank}: nothing dropped: {before:?}"
        );
        for r in after {
            let (err, dropped) = r.as_ref().unwrap();
            assert!(*err <= TOL && *dropped == 0, "rank {rank}: {after:?}");
        }
    }
}
