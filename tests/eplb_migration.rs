//! vLLM v0.33.0's migration scheduler (`vllm/distributed/eplb/migration_scheduler.py`) as
//! epcomm implements it (`epcomm::eplb::migration`), and the rearrangement's batched path.
//!
//! Ported from vLLM v0.33.0's `tests/distributed/test_eplb_migration_scheduler.py`: every case
//! that tests the scheduler (same inputs, same expected batches and flows; vLLM's
//! `_placements_for_transfers` helper is ported as is), its two `EPLBConfig` cases, and its two
//! `move_to_buffer` cases as rearrangements over shared memory that record what each
//! communicator execute moved. That file cannot run unmodified against epcomm: it imports
//! vLLM's `rebalance_execute.move_to_buffer`/`move_from_buffer` (vLLM's own per-rank torch code
//! driving a mock communicator, with NIXL's `set_transfer_context`), which epcomm has no
//! counterpart of — its rearrangement is one collective call — so a shim would have to
//! reimplement vLLM's code rather than call epcomm's.
//!
//! Beyond vLLM's cases: batches vLLM's own scheduler computed for random maps (embedded below,
//! with the generator that made the maps), vLLM v0.33.0's unmodified `migration_scheduler.py`
//! run against epcomm's Python wrapper on 3000 random layers (needs numpy and vLLM's sdist; a
//! SKIPPED line without them), property tests (each rank in at most one flow per
//! batch; every needed copy delivered once; the same sources as the transfer plan), more than 64
//! ranks, and the batched rearrangement on 2 and 4 ranks, byte-identical to the unbatched one.

mod common;
mod ranks;

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use epcomm::eplb::communicator::EplbCommunicator;
use epcomm::eplb::migration::{
    schedule_migration_batches, schedule_migration_batches_for_layers, Batches, MigrationFlow,
};
use epcomm::eplb::rearrange::{rearrange_with, RearrangeOptions, Summary};
use epcomm::eplb::transfer::plan_layer;
use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions, P2p};
use epcomm::select::config::{parse_eplb_config_json, EplbConfig};
use epcomm::select::eplb::Communicator;
use epcomm::Status;

use common::eplb_fixture::{self, Weights};
use common::python::numpy_or_skip;
use common::skip::{required, skipped};
use common::{cdylib, manifest_dir, run_with_timeout};

// ---- helpers ported from vLLM's test file ----------------------------------------------------

fn endpoints(flows: &[MigrationFlow]) -> Vec<(usize, usize)> {
    flows.iter().map(|f| (f.src_rank, f.dst_rank)).collect()
}

fn assert_no_endpoint_conflict(batch: &[MigrationFlow]) {
    let mut seen = BTreeSet::new();
    for f in batch {
        assert!(
            !seen.contains(&f.src_rank),
            "rank {} twice in {batch:?}",
            f.src_rank
        );
        assert!(
            !seen.contains(&f.dst_rank),
            "rank {} twice in {batch:?}",
            f.dst_rank
        );
        seen.extend([f.src_rank, f.dst_rank]);
    }
}

fn flatten_transfers(batches: &Batches) -> Vec<(usize, usize, i64)> {
    batches
        .iter()
        .flatten()
        .flat_map(|f| f.expert_ids.iter().map(|&e| (f.src_rank, f.dst_rank, e)))
        .collect()
}

/// vLLM's `_placements_for_transfers`: old and new maps in which each (src, dst, expert) is the
/// only copy of `expert`, on `src` before and on `dst` after.
fn placements_for_transfers(
    num_ranks: usize,
    transfers: &[(usize, usize, i64)],
) -> (usize, Vec<i64>, Vec<i64>) {
    let (mut old_counts, mut new_counts) = (vec![0; num_ranks], vec![0; num_ranks]);
    for &(s, d, _) in transfers {
        old_counts[s] += 1;
        new_counts[d] += 1;
    }
    let n = old_counts
        .iter()
        .chain(&new_counts)
        .copied()
        .max()
        .unwrap_or(0)
        .max(1);
    let (mut old, mut new) = (vec![-1; num_ranks * n], vec![-1; num_ranks * n]);
    let (mut old_counts, mut new_counts) = (vec![0; num_ranks], vec![0; num_ranks]);
    for &(s, d, e) in transfers {
        old[s * n + old_counts[s]] = e;
        new[d * n + new_counts[d]] = e;
        old_counts[s] += 1;
        new_counts[d] += 1;
    }
    (n, old, new)
}

fn flow(src_rank: usize, dst_rank: usize, expert_ids: &[i64]) -> MigrationFlow {
    MigrationFlow {
        src_rank,
        dst_rank,
        expert_ids: expert_ids.to_vec(),
    }
}

fn schedule(n_local: usize, old: &[i64], new: &[i64]) -> Batches {
    schedule_migration_batches(n_local, old, new).unwrap()
}

/// Batches as text: flows `src>dst:e1,e2` separated by spaces, batches by ` | `.
fn text(batches: &Batches) -> String {
    let flow = |f: &MigrationFlow| {
        let ids: Vec<String> = f.expert_ids.iter().map(i64::to_string).collect();
        format!("{}>{}:{}", f.src_rank, f.dst_rank, ids.join(","))
    };
    let b: Vec<String> = batches
        .iter()
        .map(|b| b.iter().map(flow).collect::<Vec<_>>().join(" "))
        .collect();
    b.join(" | ")
}

// ---- vLLM's cases --------------------------------------------------------------------------

#[test]
fn test_migration_batching_is_disabled_by_default_and_can_be_enabled() {
    assert!(!EplbConfig::default().enable_migration_batching);
    let c = parse_eplb_config_json(r#"{"enable_migration_batching": true}"#).unwrap();
    assert!(c.enable_migration_batching);
}

#[test]
fn test_migration_batching_only_applies_to_async_eplb() {
    let enabled = |json: &str| {
        parse_eplb_config_json(json)
            .unwrap()
            .migration_batching_enabled()
    };
    assert!(!enabled(r#"{"use_async": true}"#));
    assert!(enabled(
        r#"{"use_async": true, "enable_migration_batching": true}"#
    ));
    assert!(!enabled(
        r#"{"use_async": true, "enable_migration_batching": false}"#
    ));
    assert!(!enabled(
        r#"{"use_async": false, "enable_migration_batching": true}"#
    ));
}

#[test]
fn test_schedule_migration_batches_is_deterministic() {
    let transfers = [
        (1, 3, 0),
        (2, 4, 1),
        (0, 1, 2),
        (0, 2, 3),
        (0, 3, 4),
        (0, 4, 5),
    ];
    let (n, old, new) = placements_for_transfers(5, &transfers);
    let batches = schedule(n, &old, &new);
    let ends: Vec<_> = batches.iter().map(|b| endpoints(b)).collect();
    assert_eq!(
        ends,
        vec![
            vec![(1, 3), (2, 4)],
            vec![(0, 1)],
            vec![(0, 2)],
            vec![(0, 3)],
            vec![(0, 4)],
        ]
    );
    for b in &batches {
        assert_no_endpoint_conflict(b);
    }
}

#[test]
fn test_schedule_migration_batches_coalesces_rank_pair() {
    let (n, old, new) = placements_for_transfers(4, &[(0, 1, 0), (0, 1, 1), (2, 3, 2)]);
    assert_eq!(
        schedule(n, &old, &new),
        vec![vec![flow(0, 1, &[0, 1]), flow(2, 3, &[2])]]
    );
}

/// vLLM draws these with `np.random.default_rng(42)`: for expert_id in range(80),
/// `rng.integers(0, 8, size=2)`, kept when src != dst (73 of them; numpy 2.4.6).
const RANDOM_TRANSFERS: [(usize, usize, i64); 73] = [
    (0, 6, 0),
    (5, 3, 1),
    (3, 6, 2),
    (0, 5, 3),
    (1, 0, 4),
    (4, 7, 5),
    (5, 6, 6),
    (5, 6, 7),
    (4, 1, 8),
    (6, 3, 9),
    (4, 2, 10),
    (1, 7, 11),
    (6, 5, 12),
    (3, 6, 13),
    (4, 3, 14),
    (3, 1, 15),
    (0, 4, 16),
    (7, 0, 17),
    (2, 5, 19),
    (1, 6, 20),
    (5, 2, 21),
    (0, 7, 22),
    (3, 7, 23),
    (5, 6, 24),
    (6, 1, 25),
    (2, 3, 26),
    (3, 0, 27),
    (4, 1, 28),
    (7, 5, 30),
    (2, 7, 31),
    (3, 2, 32),
    (7, 2, 33),
    (0, 3, 34),
    (6, 1, 35),
    (3, 1, 36),
    (5, 3, 37),
    (2, 1, 38),
    (4, 5, 39),
    (7, 3, 40),
    (1, 6, 41),
    (0, 2, 43),
    (3, 6, 45),
    (6, 3, 46),
    (7, 2, 47),
    (1, 5, 48),
    (5, 1, 49),
    (6, 1, 50),
    (6, 0, 51),
    (6, 5, 53),
    (3, 5, 54),
    (2, 6, 55),
    (4, 3, 56),
    (0, 1, 58),
    (1, 0, 59),
    (3, 5, 60),
    (5, 3, 61),
    (6, 4, 62),
    (0, 6, 63),
    (4, 5, 64),
    (0, 4, 66),
    (6, 2, 67),
    (4, 0, 68),
    (2, 3, 69),
    (7, 1, 70),
    (2, 3, 71),
    (7, 6, 72),
    (0, 1, 73),
    (6, 0, 74),
    (6, 2, 75),
    (7, 2, 76),
    (3, 5, 77),
    (1, 4, 78),
    (4, 6, 79),
];

#[test]
fn test_schedule_migration_batches_covers_random_instructions() {
    let (n, old, new) = placements_for_transfers(8, &RANDOM_TRANSFERS);
    let batches = schedule(n, &old, &new);
    let scheduled = flatten_transfers(&batches);
    assert_eq!(scheduled.len(), RANDOM_TRANSFERS.len());
    let set: BTreeSet<_> = scheduled.into_iter().collect();
    assert_eq!(set, RANDOM_TRANSFERS.iter().copied().collect());
    for b in &batches {
        assert_no_endpoint_conflict(b);
    }
    // Beyond vLLM's assertions: the very batches vLLM v0.33.0's scheduler makes of them.
    assert_eq!(n, 13);
    assert_eq!(text(&batches), RANDOM_CASE_BATCHES);
}

#[test]
fn test_schedule_migration_batches_excludes_local_copies() {
    // Old: rank 0 [0, 1], rank 1 [1, 2]. New: rank 1 needs expert 0.
    assert_eq!(
        schedule(2, &[0, 1, 1, 2], &[0, 1, 0, 2]),
        vec![vec![flow(0, 1, &[0])]]
    );
}

#[test]
fn test_schedule_migration_batches_requires_matching_shapes() {
    let e = schedule_migration_batches(1, &[0, 1], &[0]).unwrap_err();
    assert_eq!(e.status(), Status::Assertion);
    assert_eq!(e.exception(), "AssertionError");
    assert_eq!(
        e.to_string(),
        "old_indices.shape == new_indices.shape ((2,) != (1,))"
    );
}

#[test]
fn test_schedule_migration_batches_balances_replicas() {
    // Rank 0 and rank 1 hold expert 0; ranks 2, 3, and 4 need it.
    let batches = schedule(1, &[0, 0, 1, 1, 1], &[0, 0, 0, 0, 0]);
    let set: BTreeSet<_> = flatten_transfers(&batches).into_iter().collect();
    assert_eq!(set, BTreeSet::from([(0, 2, 0), (0, 4, 0), (1, 3, 0)]));
}

#[test]
fn test_schedule_migration_batches_for_layers_matches_individual_calls() {
    let old = vec![vec![0, 1, 2, 3], vec![3, 2, 1, 0]];
    let new = vec![vec![1, 2, 3, 0], vec![0, 3, 2, 1]];
    assert_eq!(
        schedule_migration_batches_for_layers(1, &old, &new).unwrap(),
        vec![schedule(1, &old[0], &new[0]), schedule(1, &old[1], &new[1])]
    );
    let e = schedule_migration_batches_for_layers(1, &old, &new[..1]).unwrap_err();
    assert_eq!(e.status(), Status::Assertion);
}

// ---- vLLM's scheduler on random maps ---------------------------------------------------------

/// splitmix64, the generator of the maps below (the same few lines in Python made them).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// `slots` slots: -1 with probability `empty`%, else an expert below `logical`.
    fn map(&mut self, slots: usize, logical: u64, empty: u64) -> Vec<i64> {
        (0..slots)
            .map(|_| {
                if self.below(100) < empty {
                    -1
                } else {
                    self.below(logical) as i64
                }
            })
            .collect()
    }
}

/// (seed, ranks, slots per rank, logical experts, % empty slots, vLLM's batches). The maps are
/// `old = rng.map(..)` then `new = rng.map(..)` with `Rng(seed)`; the batches are what vLLM
/// v0.33.0's `schedule_migration_batches` (its unmodified module, numpy 2.4.6) returned for them.
/// Empty slots, replicas, experts nobody holds (case 8: skipped) and 70 ranks are all there.
const GOLDEN: [(u64, usize, usize, u64, u64, &str); 8] = [
    (1, 2, 3, 4, 10, "0>1:0 | 1>0:1,2"),
    (2, 4, 2, 6, 0, "0>2:0 | 2>3:1,2 0>1:2 | 1>0:5"),
    (3, 4, 4, 8, 20, "2>0:0 1>3:2 | 2>1:0 0>3:6 | 1>2:3 | 3>2:4"),
    (4, 8, 2, 10, 10, "7>1:1 0>2:2 6>5:3 | 6>0:3 1>4:5 | 0>4:4 2>6:9"),
    (5, 8, 3, 12, 0, "5>3:1,10 1>4:3 7>2:7 | 4>5:2 7>1:9 2>6:10 | 7>4:7 5>0:9 2>1:10 | 5>4:9 1>6:11 3>7:11"),
    (6, 16, 2, 24, 15, "5>14:4 7>0:5 13>10:5 4>6:7 9>12:7 3>15:9 1>2:12 | 4>8:7 9>14:7 12>0:11 10>7:20 | 8>3:13 10>12:20 | 8>1:16 | 8>4:16"),
    (7, 70, 1, 40, 10, "7>15:0 9>25:0 54>64:0 1>14:3 0>26:4 19>3:7 24>33:7 35>36:7 67>49:7 18>55:8 32>39:10 48>68:10 41>8:11 38>43:12 28>51:19 22>50:20 62>20:20 46>31:21 16>27:32 58>57:32 5>44:36 53>60:37 | 1>37:3 29>7:6 19>53:7 41>16:11 38>46:12 14>35:15 22>9:20 60>18:23 6>24:24 26>10:26 55>30:29 43>12:30 8>65:31 15>4:32 45>32:37 25>34:38 | 41>45:11 11>19:15 26>52:26 10>28:29 30>0:34 25>47:38 65>48:38 | 41>61:11 25>69:38 65>58:38 | 41>67:11"),
    (8, 5, 3, 7, 30, "1>2:0 | 1>3:0 | 1>4:0"),
];

/// vLLM's batches for its random-instructions case (num_local_experts = 13).
const RANDOM_CASE_BATCHES: &str = "0>6:0,63 5>3:1,37,61 4>7:5 2>1:38 | 3>6:2,13,45 0>5:3 4>1:8,28 2>7:31 | 1>0:4,59 5>6:6,7,24 4>2:10 3>7:23 | 6>3:9,46 1>7:11 0>4:16,66 2>5:19 | 6>5:12,53 4>3:14,56 7>0:17 | 3>1:15,36 5>2:21 0>7:22 6>4:62 | 1>6:20,41 2>3:26,69,71 7>5:30 4>0:68 | 6>1:25,35,50 3>0:27 7>2:33,47,76 4>5:39,64 | 3>2:32 1>5:48 6>0:51,74 | 0>3:34 5>1:49 2>6:55 | 7>3:40 0>2:43 1>4:78 | 3>5:54,60,77 0>1:58,73 6>2:67,75 | 7>1:70 4>6:79 | 7>6:72";

#[test]
fn random_maps_give_vllms_batches() {
    for (seed, ranks, n_local, logical, empty, want) in GOLDEN {
        let mut rng = Rng(seed);
        let old = rng.map(ranks * n_local, logical, empty);
        let new = rng.map(ranks * n_local, logical, empty);
        assert_eq!(text(&schedule(n_local, &old, &new)), want, "case {seed}");
    }
}

/// Per rank, the experts of its block without -1.
fn blocks(map: &[i64], n_local: usize) -> Vec<BTreeSet<i64>> {
    map.chunks(n_local)
        .map(|b| b.iter().copied().filter(|&e| e != -1).collect())
        .collect()
}

/// Every (expert, rank) the new map adds to a rank, for experts some rank holds in the old map.
fn needed(old: &[i64], new: &[i64], n_local: usize) -> Vec<(i64, usize)> {
    let (o, n) = (blocks(old, n_local), blocks(new, n_local));
    let held: BTreeSet<i64> = o.iter().flatten().copied().collect();
    let mut v: Vec<(i64, usize)> = Vec::new();
    for (r, (o, n)) in o.iter().zip(&n).enumerate() {
        v.extend(
            n.difference(o)
                .filter(|e| held.contains(e))
                .map(|&e| (e, r)),
        );
    }
    v.sort_unstable();
    v
}

#[test]
fn batches_are_conflict_free_and_deliver_each_copy_once() {
    let mut rng = Rng(2026);
    for case in 0..400 {
        let ranks = 1 + rng.below(if case % 10 == 0 { 140 } else { 12 }) as usize;
        let n_local = 1 + rng.below(4) as usize;
        let logical = 1 + rng.below((ranks * n_local) as u64 + 2);
        let empty = rng.below(40);
        let old = rng.map(ranks * n_local, logical, empty);
        let new = rng.map(ranks * n_local, logical, empty);
        let batches = schedule(n_local, &old, &new);
        let o = blocks(&old, n_local);
        let mut delivered: Vec<(i64, usize)> = Vec::new();
        for b in &batches {
            assert!(!b.is_empty());
            assert_no_endpoint_conflict(b);
            for f in b {
                assert!(!f.expert_ids.is_empty() && f.src_rank != f.dst_rank);
                assert!(f.expert_ids.windows(2).all(|w| w[0] < w[1]), "{f:?}");
                for &e in &f.expert_ids {
                    assert!(
                        o[f.src_rank].contains(&e),
                        "case {case}: {f:?} sends what it lacks"
                    );
                    delivered.push((e, f.dst_rank));
                }
            }
        }
        delivered.sort_unstable();
        assert_eq!(delivered, needed(&old, &new, n_local), "case {case}");
    }
}

/// Maps whose new placement needs only experts the old one holds (the rearrangement refuses
/// others): `old` with empty slots, `new` drawn from the experts of `old`.
fn held_maps(rng: &mut Rng, ranks: usize, n_local: usize) -> (Vec<i64>, Vec<i64>) {
    let logical = 1 + rng.below((ranks * n_local) as u64 + 1);
    let mut old = rng.map(ranks * n_local, logical, 20);
    if old.iter().all(|&e| e == -1) {
        old[0] = 0;
    }
    let held: Vec<i64> = old.iter().copied().filter(|&e| e != -1).collect();
    let new = (0..ranks * n_local)
        .map(|_| held[rng.below(held.len() as u64) as usize])
        .collect();
    (old, new)
}

#[test]
fn batches_use_the_transfer_plans_sources() {
    // vLLM: "Batching changes transfer order, not which existing replica supplies a copy".
    // The plan (`plan_layer`) is epcomm's unbatched path, with vLLM's unbatched pairing.
    let mut rng = Rng(7);
    for case in 0..300 {
        let ranks = 1 + rng.below(9) as usize;
        let n_local = 1 + rng.below(4) as usize;
        let (old, new) = held_maps(&mut rng, ranks, n_local);
        let flows = flatten_transfers(&schedule(n_local, &old, &new));
        for r in 0..ranks {
            let plan = plan_layer(&old, &new, n_local, r).unwrap();
            let mut sends: Vec<(i64, usize)> = plan.sends.iter().map(|s| (s.0, s.2)).collect();
            let mut recvs: Vec<(i64, usize)> = plan.recvs.iter().map(|s| (s.0, s.2)).collect();
            sends.sort_unstable();
            recvs.sort_unstable();
            let mut by_flows_s: Vec<_> = flows
                .iter()
                .filter(|f| f.0 == r)
                .map(|f| (f.2, f.1))
                .collect();
            let mut by_flows_r: Vec<_> = flows
                .iter()
                .filter(|f| f.1 == r)
                .map(|f| (f.2, f.0))
                .collect();
            by_flows_s.sort_unstable();
            by_flows_r.sort_unstable();
            assert_eq!(sends, by_flows_s, "case {case} rank {r}: sends");
            assert_eq!(recvs, by_flows_r, "case {case} rank {r}: receives");
        }
    }
}

// ---- the batched rearrangement ---------------------------------------------------------------

/// One op of an execute as the communicator saw it: (send?, peer, first byte of the row after
/// the execute), which names the expert (see `expert_byte`).
type Seen = (bool, usize, u8);

/// The `torch_gloo` communicator, recording every execute's ops.
#[derive(Debug)]
struct Recorder {
    inner: Box<dyn EplbCommunicator>,
    executes: Vec<Vec<Seen>>,
}

impl EplbCommunicator for Recorder {
    fn kind(&self) -> Communicator {
        self.inner.kind()
    }

    fn execute(&mut self, g: &mut dyn Group, ops: &mut [P2p<'_>]) -> epcomm::Result<()> {
        self.inner.execute(g, ops)?;
        let seen = ops.iter().map(|o| match o {
            P2p::Send { peer, data } => (true, *peer, data[0]),
            P2p::Recv { peer, data } => (false, *peer, data[0]),
        });
        self.executes.push(seen.collect());
        Ok(())
    }
}

/// What one rank ended with: its weights, the summary, what each execute moved.
type RankResult = (Vec<Vec<Vec<u8>>>, Summary, Vec<Vec<Seen>>);

/// Rearranges `old` into `new` on `world` threads over shared memory; `batching(rank)` is the
/// rank's migration_batching option.
fn run(
    world: usize,
    old: Vec<Vec<i64>>,
    new: Vec<Vec<i64>>,
    row_bytes: &'static [usize],
    batching: fn(usize) -> bool,
) -> Vec<epcomm::Result<RankResult>> {
    let name = ranks::unique("e", "mig");
    ranks::on_threads(world, move |r| {
        let opts = GroupOptions {
            timeout: Duration::from_secs(20),
            ..GroupOptions::default()
        };
        let mut g = ShmGroup::join(&name, r, world, opts).unwrap();
        let mut w = Weights { world, row_bytes }.all(&old, r);
        let mut c = Recorder {
            inner: eplb_fixture::gloo_cpu().unwrap(),
            executes: Vec::new(),
        };
        let options = RearrangeOptions {
            migration_batching: batching(r),
            ..RearrangeOptions::default()
        };
        let summary = {
            let mut views = eplb_fixture::views(&mut w);
            rearrange_with(&mut g, &mut c, &old, &new, &mut views, row_bytes, &options)
        }?;
        Ok((w, summary, c.executes))
    })
}

/// The first byte of expert `e`'s row in layer 0, tensor 0 of the fixture's weights.
fn expert_byte(e: i64) -> u8 {
    Weights {
        world: 1,
        row_bytes: &[1],
    }
    .row(e, 0, 0)[0]
}

#[test]
fn batched_rearrangement_equals_unbatched_and_the_new_placement() {
    const ROW_BYTES: &[usize] = &[16, 40];
    let mut rng = Rng(16);
    for world in [2, 4] {
        for round in 0..3 {
            let n_local = 1 + rng.below(4) as usize;
            let (old, new): (Vec<_>, Vec<_>) =
                (0..4).map(|_| held_maps(&mut rng, world, n_local)).unzip();
            let plain = run(world, old.clone(), new.clone(), ROW_BYTES, |_| false);
            let batched = run(world, old.clone(), new.clone(), ROW_BYTES, |_| true);
            for (r, (p, b)) in plain.into_iter().zip(batched).enumerate() {
                let (p, b) = (p.unwrap(), b.unwrap());
                let what = format!("world {world} round {round} rank {r}");
                let reference = Weights {
                    world,
                    row_bytes: ROW_BYTES,
                }
                .all(&new, r);
                assert!(
                    b.0 == reference,
                    "{what}: batched weights differ from the new placement"
                );
                assert!(p.0 == b.0, "{what}: batched and unbatched weights differ");
                assert_eq!((p.1.executes, p.2.len()), (4, 4), "{what}");
                let layers: usize = old
                    .iter()
                    .zip(&new)
                    .map(|(o, n)| schedule(n_local, o, n).len())
                    .sum();
                assert_eq!((b.1.executes, b.2.len()), (layers, layers), "{what}");
                assert_eq!(
                    (p.1.rows_sent, p.1.rows_received, p.1.layers_changed),
                    (b.1.rows_sent, b.1.rows_received, b.1.layers_changed),
                    "{what}"
                );
                for ops in &b.2 {
                    let peers: BTreeSet<usize> = ops.iter().map(|o| o.1).collect();
                    assert!(peers.len() <= 1, "{what}: one execute talks to {peers:?}");
                }
            }
        }
    }
}

#[test]
fn test_move_to_buffer_uses_multiple_batches() {
    // vLLM runs rank 0 of four with a mock communicator: two executes, one send of expert 0
    // to rank 3 and one receive of expert 1 from rank 1. Here all four ranks run; vLLM's
    // `use_precomputed` variant is the for_layers test above (epcomm schedules in the call).
    let (old, new) = (vec![vec![0, 1, 2, 3]], vec![vec![1, 2, 3, 0]]);
    let res = run(4, old, new.clone(), &[8], |_| true);
    let (b0, b1) = (expert_byte(0), expert_byte(1));
    let (b2, b3) = (expert_byte(2), expert_byte(3));
    let want: [Vec<Vec<Seen>>; 4] = [
        vec![vec![(true, 3, b0)], vec![(false, 1, b1)]],
        vec![vec![(false, 2, b2)], vec![(true, 0, b1)]],
        vec![vec![(true, 1, b2)], vec![(false, 3, b3)]],
        vec![vec![(false, 0, b0)], vec![(true, 2, b3)]],
    ];
    for (r, (res, want)) in res.into_iter().zip(want).enumerate() {
        let (w, summary, executes) = res.unwrap();
        assert_eq!(executes, want, "rank {r}");
        assert_eq!(summary.executes, 2);
        let reference = Weights {
            world: 4,
            row_bytes: &[8],
        };
        assert_eq!(w, reference.all(&new, r), "rank {r}");
    }
}

#[test]
fn test_move_to_buffer_uses_primary_duplicate_destination() {
    // Rank 0 (slots [0, 1] -> [2, 2]) receives expert 2 once, from rank 1, and both its slots
    // hold it afterwards.
    let (old, new) = (vec![vec![0, 1, 2, 3]], vec![vec![2, 2, 0, 3]]);
    let res = run(2, old, new.clone(), &[8], |_| true);
    let (b0, b2) = (expert_byte(0), expert_byte(2));
    let want = [
        vec![vec![(true, 1, b0)], vec![(false, 1, b2)]],
        vec![vec![(false, 0, b0)], vec![(true, 0, b2)]],
    ];
    for (r, (res, want)) in res.into_iter().zip(want).enumerate() {
        let (w, summary, executes) = res.unwrap();
        assert_eq!(executes, want, "rank {r}");
        assert_eq!(summary.rows_received, if r == 0 { 2 } else { 1 });
        let reference = Weights {
            world: 2,
            row_bytes: &[8],
        };
        assert_eq!(w, reference.all(&new, r), "rank {r}");
    }
}

#[test]
fn ranks_must_agree_on_batching() {
    let (old, new) = (vec![vec![0, 1, 2, 3]], vec![vec![1, 2, 3, 0]]);
    let res = run(2, old, new, &[8], |r| r == 0);
    for r in res {
        let e = r.unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument);
        assert_eq!(
            e.to_string(),
            "rearrange: ranks disagree on migration batching: rank 0 turns it on but rank 1 turns it off; every rank must pass the same (EPLB rearrangement: no layer was changed)"
        );
    }
}

#[test]
fn an_expert_nobody_holds_is_refused_when_batching() {
    // vLLM's scheduler skips expert 4 (no rank holds it); epcomm's rearrangement refuses the
    // layer on the rank that needs it, with or without batching, and nothing changes.
    assert_eq!(schedule(2, &[0, 1, 2, 3], &[0, 1, 2, 4]), Batches::new());
    let res = run(
        2,
        vec![vec![0, 1, 2, 3]],
        vec![vec![0, 1, 2, 4]],
        &[8],
        |_| true,
    );
    let msgs: Vec<String> = res
        .into_iter()
        .map(|r| r.unwrap_err().to_string())
        .collect();
    assert_eq!(
        msgs,
        [
            "rearrange: rank 1 rejected its arguments (see that rank's error) (EPLB rearrangement: no layer was changed)",
            "expert 4 is needed on rank 1 but no rank holds it in the old placement",
        ]
    );
}

/// Rearranges on `world` threads with a rank mapping; `start[r]` is rank r's weights before.
fn run_mapped(
    start: Vec<Vec<Vec<Vec<u8>>>>,
    old: Vec<Vec<i64>>,
    new: Vec<Vec<i64>>,
    mapping: Vec<i64>,
    migration_batching: bool,
) -> Vec<Vec<Vec<Vec<u8>>>> {
    let (world, name) = (start.len(), ranks::unique("e", "migmap"));
    ranks::on_threads(world, move |r| {
        let opts = GroupOptions {
            timeout: Duration::from_secs(20),
            ..GroupOptions::default()
        };
        let mut g = ShmGroup::join(&name, r, world, opts).unwrap();
        let mut w = start[r].clone();
        let mut c = eplb_fixture::gloo_cpu().unwrap();
        let options = RearrangeOptions {
            rank_mapping: Some(&mapping),
            migration_batching,
            ..RearrangeOptions::default()
        };
        let mut views = eplb_fixture::views(&mut w);
        rearrange_with(
            &mut g,
            c.as_mut(),
            &old,
            &new,
            &mut views,
            &[16, 40],
            &options,
        )
        .unwrap();
        drop(views);
        w
    })
}

#[test]
fn batched_scale_down_and_scale_up() {
    const ROW_BYTES: &[usize] = &[16, 40];
    let at = |world| Weights {
        world,
        row_bytes: ROW_BYTES,
    };
    let load = eplb_fixture::skewed_load(3, 8, 9, 0.0);
    // Scale-down 4 -> 2: ranks 1 and 3 leave; the old group of 4 moves.
    let old = eplb_fixture::modulo_placement(3, 16, 8);
    let new = eplb_fixture::rebalanced(&load, 8, 2);
    let start: Vec<_> = (0..4).map(|r| at(4).all(&old, r)).collect();
    let mapping = vec![0, -1, 1, -1];
    let plain = run_mapped(
        start.clone(),
        old.clone(),
        new.clone(),
        mapping.clone(),
        false,
    );
    let batched = run_mapped(start, old, new.clone(), mapping, true);
    assert!(
        batched == plain,
        "scale-down: batched and unbatched weights differ"
    );
    assert!(batched[0] == at(2).all(&new, 0) && batched[2] == at(2).all(&new, 1));
    // Scale-up 2 -> 4: new ranks 2 and 3 start empty; the new group of 4 moves.
    let old = eplb_fixture::modulo_placement(3, 8, 8);
    let new = eplb_fixture::rebalanced(&load, 16, 4);
    let empty = at(2).all(&[vec![-1; 8], vec![-1; 8], vec![-1; 8]], 0);
    let start: Vec<_> = (0..4)
        .map(|r| {
            if r < 2 {
                at(2).all(&old, r)
            } else {
                empty.clone()
            }
        })
        .collect();
    let plain = run_mapped(start.clone(), old.clone(), new.clone(), vec![0, 1], false);
    let batched = run_mapped(start, old, new.clone(), vec![0, 1], true);
    assert!(
        batched == plain,
        "scale-up: batched and unbatched weights differ"
    );
    for (r, w) in batched.iter().enumerate() {
        assert!(*w == at(4).all(&new, r), "scale-up: rank {r}");
    }
}

// ---- vLLM's own scheduler against epcomm's, through Python -----------------------------------

const VLLM_VERSION: &str = "0.34.0";
const SCHEDULER: &str = "vllm/distributed/eplb/migration_scheduler.py";
/// The SHA-256 of `SCHEDULER` in vLLM 0.34.0's sdist (byte for byte 0.33.0's).
const SCHEDULER_SHA256: &str = "c7ce0aef974a83bdc000cb2bbbcbe8e689db8aaa64327ed9066a622f91eaef21";

/// Loads vLLM's module from its file, draws random layers (empty slots, replicas, experts
/// nobody holds, up to 150 ranks) and compares its batches with epcomm's.
const DIFFERENTIAL: &str = r#"
import hashlib, importlib.util, sys
import numpy as np
from epcomm import eplb_algo
path, want_sha = sys.argv[1], sys.argv[2]
assert hashlib.sha256(open(path, "rb").read()).hexdigest() == want_sha, "not v0.33.0's file"
spec = importlib.util.spec_from_file_location("migration_scheduler", path)
ms = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ms)
rng = np.random.default_rng(16)
cases = batches = 0
for case in range(3000):
    ranks = int(rng.integers(1, 150 if case % 20 == 0 else 12))
    n_local = int(rng.integers(1, 5))
    logical = int(rng.integers(1, ranks * n_local + 3))
    empty = float(rng.random() * 0.4)
    def draw():
        m = rng.integers(0, logical, size=ranks * n_local)
        m[rng.random(ranks * n_local) < empty] = -1
        return m.astype(np.int64)
    old, new = draw(), draw()
    theirs = [[(f.src_rank, f.dst_rank, f.expert_ids) for f in b]
              for b in ms.schedule_migration_batches(n_local, old, new)]
    ours = eplb_algo.schedule_migration_batches(n_local, old, new)
    assert ours == theirs, (case, n_local, old.tolist(), new.tolist(), ours, theirs)
    cases += 1
    batches += len(ours)
print(f"{cases} layers agree ({batches} batches)")
"#;

#[test]
fn vllms_scheduler_agrees_on_random_layers() {
    const TEST: &str = "vllms_scheduler_agrees_on_random_layers";
    let Some(python) = numpy_or_skip(TEST) else {
        return;
    };
    let tree = match common::python::vllm_sdist(&python.exe, VLLM_VERSION) {
        Ok(tree) => tree,
        Err(why) => {
            assert!(
                !required("EPCOMM_REQUIRE_VLLM_SRC"),
                "EPCOMM_REQUIRE_VLLM_SRC is set but {why}"
            );
            skipped(TEST, &why);
            return;
        }
    };
    let mut cmd = Command::new(&python.exe);
    cmd.arg("-c")
        .arg(DIFFERENTIAL)
        .arg(tree.join(SCHEDULER))
        .arg(SCHEDULER_SHA256)
        .env("PYTHONPATH", manifest_dir().join("python"))
        .env("EPCOMM_LIBRARY", cdylib())
        .env("PYTHONDONTWRITEBYTECODE", "1");
    let out = run_with_timeout(cmd, Duration::from_secs(300));
    let what = format!("vLLM {VLLM_VERSION}'s {SCHEDULER} against epcomm");
    assert!(out.success(), "{}", out.describe(&what));
    assert!(
        out.stdout.starts_with("3000 layers agree"),
        "{}",
        out.describe(&what)
    );
    println!("{what}: {}", out.stdout.trim());
}
