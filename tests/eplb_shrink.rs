//! EPLB after a failure and on growth: 4 ranks of 3 slots (8 logical experts, 4 redundant);
//! rank 2 dies, the 3 survivors form a new group and rearrange with the rank mapping
//! [0, 1, -1, 2] to the placement vLLM's policy picks for their 9 slots, sourcing every expert
//! from a surviving replica (the dead rank is not a member and sends nothing). An expert whose
//! only replica was on the dead rank is reported by id: the rearrangement refuses it on every
//! rank before any data moves, or, allowed, leaves its slots with their old bytes and reports
//! it. Scale-up 3 -> 4: the new rank receives its experts, the old ranks keep theirs where the
//! new placement keeps them. Staged and double-buffered, with and without migration batching,
//! on threads; and on 4 real processes, rank 2 SIGKILLed, the survivors shrinking their group
//! (`Group::shrink`) and rearranging over it, and a second death during that rearrangement
//! leaving every other survivor with layer 0 new and layer 1 old.

mod common;
mod ranks;

use std::time::Duration;

use epcomm::eplb::lost_experts;
use epcomm::eplb::rearrange::{
    lost_by_layer, rearrange_into, rearrange_with, LayerView, LostExperts, RearrangeOptions,
    Summary,
};
use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions};
use epcomm::Status;

use common::eplb_fixture::{self, Weights};

const ROW_BYTES: [usize; 2] = [16, 40];
const LAYERS: usize = 2;
const LOGICAL: usize = 8;
const N_LOCAL: usize = 3;

/// 4 ranks x 3 slots: experts 0, 1, 6 and 7 have two replicas on different ranks, and each
/// expert of rank 2 (6, 7, 1) has one elsewhere: losing rank 2 loses no expert.
const REDUNDANT: [i64; 12] = [0, 1, 2, 3, 4, 5, 6, 7, 1, 6, 7, 0];
/// As [`REDUNDANT`] but expert 2's only replica is on rank 2.
const EXPOSED: [i64; 12] = [0, 1, 3, 4, 5, 6, 2, 7, 1, 6, 7, 0];
/// Rank 2 died: survivors 0, 1, 3 become ranks 0, 1, 2.
const MAPPING: [i64; 4] = [0, 1, -1, 2];
/// The old rank of each survivor.
const SURVIVORS: [usize; 3] = [0, 1, 3];

fn opts() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(20),
        ..GroupOptions::default()
    }
}

fn weights(world: usize) -> Weights<'static> {
    Weights {
        world,
        row_bytes: &ROW_BYTES,
    }
}

fn layers(map: &[i64]) -> Vec<Vec<i64>> {
    vec![map.to_vec(); LAYERS]
}

/// vLLM's policy over `world` ranks of [`N_LOCAL`] slots for a skewed load.
fn policy(world: usize, seed: usize) -> Vec<Vec<i64>> {
    let load = eplb_fixture::skewed_load(LAYERS, LOGICAL, seed, 1.0);
    eplb_fixture::rebalanced(&load, world * N_LOCAL, world)
}

/// How a test rearranges.
#[derive(Debug, Clone, Copy)]
struct Mode {
    double_buffered: bool,
    batching: bool,
    lost: LostExperts,
}

const MODES: [Mode; 4] = [
    Mode {
        double_buffered: false,
        batching: false,
        lost: LostExperts::Refuse,
    },
    Mode {
        double_buffered: false,
        batching: true,
        lost: LostExperts::Refuse,
    },
    Mode {
        double_buffered: true,
        batching: false,
        lost: LostExperts::Refuse,
    },
    Mode {
        double_buffered: true,
        batching: true,
        lost: LostExperts::Refuse,
    },
];

/// One rank's weights after the call (the next buffers when double-buffered, the live ones
/// otherwise), whether the live weights stayed as they were, and the outcome.
type Outcome = (Vec<Vec<Vec<u8>>>, bool, epcomm::Result<Summary>);

/// Runs one rearrangement on a fresh group of `world` threads; `start(r)` is rank r's weights.
fn run(
    world: usize,
    old: Vec<Vec<i64>>,
    new: Vec<Vec<i64>>,
    mapping: Vec<i64>,
    mode: Mode,
    start: impl Fn(usize) -> Vec<Vec<Vec<u8>>> + Send + Sync + Clone + 'static,
) -> Vec<Outcome> {
    let name = ranks::unique("e", "shrink");
    ranks::on_threads(world, move |r| {
        let mut g = ShmGroup::join(&name, r, world, opts()).unwrap();
        let mut c = eplb_fixture::gloo_cpu().unwrap();
        let options = RearrangeOptions {
            rank_mapping: Some(&mapping),
            migration_batching: mode.batching,
            lost: mode.lost,
            ..RearrangeOptions::default()
        };
        let mut live = start(r);
        let before = live.clone();
        if !mode.double_buffered {
            let mut views = eplb_fixture::views(&mut live);
            let res = rearrange_with(
                &mut g,
                c.as_mut(),
                &old,
                &new,
                &mut views,
                &ROW_BYTES,
                &options,
            );
            let unchanged = live == before;
            return (live, unchanged, res);
        }
        let mut next: Vec<Vec<Vec<u8>>> = live
            .iter()
            .map(|l| l.iter().map(|t| vec![0x5A; t.len()]).collect())
            .collect();
        let view: Vec<LayerView<'_>> = live
            .iter()
            .map(|l| l.iter().map(Vec::as_slice).collect())
            .collect();
        let out = {
            let mut nv = eplb_fixture::views(&mut next);
            rearrange_into(
                &mut g,
                c.as_mut(),
                &old,
                &new,
                &view,
                &mut nv,
                &ROW_BYTES,
                &options,
            )
        };
        let valid = if out.result.is_ok() { LAYERS } else { 0 };
        assert_eq!(out.next_valid, valid, "rank {r}");
        (next, live == before, out.result)
    })
}

/// Survivor r's weights before the rearrangement: those of its old rank under `old`.
fn survivor_start(old: [i64; 12]) -> impl Fn(usize) -> Vec<Vec<Vec<u8>>> + Send + Sync + Clone {
    move |r| weights(4).all(&layers(&old), SURVIVORS[r])
}

#[test]
fn lost_experts_names_experts_without_a_surviving_replica() {
    assert_eq!(
        lost_experts(&REDUNDANT, N_LOCAL, &MAPPING).unwrap(),
        Vec::<i64>::new()
    );
    assert_eq!(lost_experts(&EXPOSED, N_LOCAL, &MAPPING).unwrap(), vec![2]);
    // Ranks 2 and 3 gone: 2 (rank 2 only) and 7 (ranks 2 and 3).
    assert_eq!(
        lost_experts(&EXPOSED, N_LOCAL, &[0, 1, -1, -1]).unwrap(),
        vec![2, 7]
    );
    assert_eq!(
        lost_experts(&EXPOSED, N_LOCAL, &[0, 1, -1]).unwrap_err().to_string(),
        "the old placement has 12 slots; expected one block of 3 slots per entry of the rank mapping (3 entries)"
    );
}

/// What a rearrangement would leave unwritten, counted before the call (C callers size their
/// output with it); maps of different sizes are left to the rearrangement's own check.
#[test]
fn lost_by_layer_counts_before_the_call() {
    let options = RearrangeOptions {
        rank_mapping: Some(&MAPPING),
        ..RearrangeOptions::default()
    };
    let new = policy(3, 4);
    let lost = lost_by_layer(3, &layers(&EXPOSED), &new, &options).unwrap();
    assert_eq!(lost, vec![vec![2]; LAYERS]);
    let lost = lost_by_layer(3, &layers(&REDUNDANT), &new, &options).unwrap();
    assert_eq!(lost, vec![Vec::<i64>::new(); LAYERS]);
    let none = RearrangeOptions::default();
    let lost = lost_by_layer(2, &[vec![0, 1, 2, 3]], &[vec![5, 6]], &none).unwrap();
    assert_eq!(lost, vec![Vec::<i64>::new()]);
}

#[test]
fn survivors_take_the_new_placement_from_surviving_replicas() {
    let new = policy(3, 4);
    assert_eq!(new[0].len(), 9);
    for l in &new {
        for e in 0..LOGICAL as i64 {
            assert!(l.contains(&e), "the policy places every expert: {l:?}");
        }
    }
    for mode in MODES {
        let res = run(
            3,
            layers(&REDUNDANT),
            new.clone(),
            MAPPING.to_vec(),
            mode,
            survivor_start(REDUNDANT),
        );
        for (r, (w, live_kept, summary)) in res.into_iter().enumerate() {
            let summary = summary.unwrap();
            assert_eq!(w, weights(3).all(&new, r), "rank {r}, {mode:?}");
            assert_eq!(summary.lost_experts, vec![Vec::<i64>::new(); LAYERS]);
            // Double-buffered, the live weights are only read.
            assert!(live_kept || !mode.double_buffered, "rank {r}, {mode:?}");
        }
    }
}

/// The lost-expert choice is part of what every rank must agree on.
#[test]
fn ranks_that_disagree_on_lost_experts_fail_alike() {
    let new = policy(3, 4);
    let name = ranks::unique("e", "disagree");
    let (old, n) = (layers(&REDUNDANT), new.clone());
    let res = ranks::on_threads(3, move |r| {
        let mut g = ShmGroup::join(&name, r, 3, opts()).unwrap();
        let mut c = eplb_fixture::gloo_cpu().unwrap();
        let lost = if r == 0 {
            LostExperts::LeaveUnwritten
        } else {
            LostExperts::Refuse
        };
        let options = RearrangeOptions {
            rank_mapping: Some(&MAPPING),
            lost,
            ..RearrangeOptions::default()
        };
        let mut w = weights(4).all(&old, SURVIVORS[r]);
        let before = w.clone();
        let mut views = eplb_fixture::views(&mut w);
        let e = rearrange_with(
            &mut g,
            c.as_mut(),
            &old,
            &n,
            &mut views,
            &ROW_BYTES,
            &options,
        )
        .unwrap_err();
        drop(views);
        (e.to_string(), w == before)
    });
    for (r, (e, kept)) in res.into_iter().enumerate() {
        assert_eq!(
            e,
            "rearrange: ranks disagree on leaving lost experts unwritten: rank 0 turns it on but rank 1 turns it off; every rank must pass the same (EPLB rearrangement: no layer was changed)",
            "rank {r}"
        );
        assert!(kept, "rank {r}");
    }
}

/// Mappings the docs call invalid fail every survivor alike before any data moves, in every
/// mode (on 0dfc3b5 the Rust API returned OK for some of them).
#[test]
fn invalid_rank_mappings_fail_every_survivor_alike() {
    let new = policy(3, 4);
    let dup = "rank_mapping[0] and rank_mapping[1] are both 0; every surviving rank needs a rank of its own";
    let none = "rank_mapping removes all of its 4 ranks (every entry is -1); expected at least one surviving rank (an entry >= 0)";
    let gap = "rank_mapping gives new rank 2 to no surviving rank; expected the new ranks 0 to 2 (the new EP size 3) to be taken by one surviving rank each";
    for (mapping, want) in [
        (vec![0, 0, -1, 1], dup),
        (vec![-1, -1, -1, -1], none),
        (vec![0, 1, -1, -1], gap),
    ] {
        for mode in MODES {
            let res = run(
                3,
                layers(&REDUNDANT),
                new.clone(),
                mapping.clone(),
                mode,
                survivor_start(REDUNDANT),
            );
            for (r, (_, live_kept, summary)) in res.into_iter().enumerate() {
                let e = summary.unwrap_err();
                assert_eq!(e.to_string(), want, "{mapping:?}, rank {r}, {mode:?}");
                assert_eq!(e.status(), Status::InvalidArgument);
                assert!(live_kept, "{mapping:?}, rank {r}: no data moved");
            }
        }
        // epcomm_eplb_lost_experts checks the mapping the same way (with as many new ranks as
        // survivors: two survivors of four are a valid mapping there).
        let lost = lost_experts(&REDUNDANT, N_LOCAL, &mapping);
        match lost {
            Err(e) => assert_eq!(e.to_string(), want),
            Ok(_) => assert_eq!(want, gap),
        }
    }
}

const REFUSAL: &str = "rearrange: layer 0 needs logical experts [2], which have no replica on a surviving rank (rank_mapping removes ranks [2]); their weights are gone: allow lost experts to rearrange the others and leave their slots unwritten (the call reports them; load their weights there afterwards), or choose a new placement without them";

#[test]
fn an_expert_lost_with_the_dead_rank_is_refused_on_every_rank() {
    let new = policy(3, 4);
    for mode in MODES {
        let res = run(
            3,
            layers(&EXPOSED),
            new.clone(),
            MAPPING.to_vec(),
            mode,
            survivor_start(EXPOSED),
        );
        for (r, (_, live_kept, summary)) in res.into_iter().enumerate() {
            let e = summary.unwrap_err();
            assert_eq!(e.to_string(), REFUSAL, "rank {r}, {mode:?}");
            assert_eq!(e.status(), Status::InvalidArgument);
            assert_eq!(e.exception(), "ValueError");
            assert!(live_kept, "rank {r}: no data moved");
        }
    }
}

#[test]
fn allowed_lost_experts_keep_their_old_bytes_and_are_reported() {
    let new = policy(3, 4);
    // EXPOSED without rank 2's block, in both layers.
    let old_survivors = layers(&[0, 1, 3, 4, 5, 6, 6, 7, 0]);
    for mut mode in MODES {
        mode.lost = LostExperts::LeaveUnwritten;
        let res = run(
            3,
            layers(&EXPOSED),
            new.clone(),
            MAPPING.to_vec(),
            mode,
            survivor_start(EXPOSED),
        );
        for (r, (w, _, summary)) in res.into_iter().enumerate() {
            assert_eq!(summary.unwrap().lost_experts, vec![vec![2i64]; LAYERS]);
            // The new placement, except expert 2's slots: those keep the old slot's bytes.
            let want: Vec<Vec<i64>> = (0..LAYERS)
                .map(|l| {
                    let (n, o) = (&new[l], &old_survivors[l]);
                    (0..9)
                        .map(|s| if n[s] == 2 { o[s] } else { n[s] })
                        .collect()
                })
                .collect();
            assert_eq!(w, weights(3).all(&want, r), "rank {r}, {mode:?}");
        }
    }
}

#[test]
fn a_grown_group_fills_the_new_rank() {
    let old = policy(3, 2);
    let new = policy(4, 6);
    let empty = layers(&[-1; 12]);
    for mode in MODES {
        let (o, e) = (old.clone(), empty.clone());
        let start = move |r: usize| {
            if r < 3 {
                weights(3).all(&o, r)
            } else {
                weights(4).all(&e, 0)
            }
        };
        let res = run(4, old.clone(), new.clone(), vec![0, 1, 2], mode, start);
        for (r, (w, _, summary)) in res.into_iter().enumerate() {
            let summary = summary.unwrap();
            assert_eq!(w, weights(4).all(&new, r), "rank {r}, {mode:?}");
            if r == 3 {
                // Every slot of the new rank arrives from an old rank (or duplicates one).
                assert_eq!(summary.rows_received, LAYERS * N_LOCAL, "{mode:?}");
                assert_eq!(summary.rows_copied_locally, 0);
                assert_eq!(summary.rows_sent, 0);
                continue;
            }
            // An old rank writes only the slots whose expert changes; the others keep theirs.
            let slots = r * N_LOCAL..(r + 1) * N_LOCAL;
            let changed: usize = (0..LAYERS)
                .map(|l| slots.clone().filter(|&s| old[l][s] != new[l][s]).count())
                .sum();
            let written = summary.rows_received + summary.rows_copied_locally;
            assert_eq!(written, changed, "rank {r}, {mode:?}");
        }
    }
}

// ---- real processes: rank 2 is SIGKILLed, the survivors shrink and rearrange -----------------

/// The new placement of the process test, for the survivors' 9 slots.
fn after_kill() -> Vec<Vec<i64>> {
    policy(3, 4)
}

/// A rank process of [`a_killed_rank_s_experts_move_onto_the_shrunk_group`]. Does nothing
/// unless started by it (`ES_GROUP` set).
#[test]
fn eplb_shrink_rank() {
    let (Ok(group), Ok(rank)) = (std::env::var("ES_GROUP"), std::env::var("ES_RANK")) else {
        return;
    };
    let rank: usize = rank.parse().unwrap();
    let mut g = ShmGroup::join(&group, rank, 4, opts()).expect("join");
    g.barrier().expect("first barrier");
    if rank == 2 {
        // SAFETY: signals this process; nothing after it runs.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let mut failure = None;
    for _ in 0..100 {
        if let Err(e) = g.barrier() {
            failure = Some(e);
            break;
        }
    }
    let e = failure.expect("a barrier fails once rank 2 is dead");
    assert_eq!(e.status(), Status::PeerFailure, "{e}");
    let lost = g.lost_ranks();
    assert_eq!(lost, vec![2]);
    let mut s = Group::shrink(&mut g, &lost).expect("shrink");
    let me = s.rank();
    assert_eq!((SURVIVORS[me], s.size()), (rank, 3));
    let (old, new) = (layers(&REDUNDANT), after_kill());
    let mut w = weights(4).all(&old, rank);
    let mut c = eplb_fixture::gloo_cpu().unwrap();
    let options = RearrangeOptions {
        rank_mapping: Some(&MAPPING),
        ..RearrangeOptions::default()
    };
    let result = {
        let mut views = eplb_fixture::views(&mut w);
        rearrange_with(
            s.as_mut(),
            c.as_mut(),
            &old,
            &new,
            &mut views,
            &ROW_BYTES,
            &options,
        )
    };
    if std::env::var("ES_CASE").as_deref() == Ok("second") {
        // Survivor 1 died after layer 0's transfers (EPCOMM_FAULT_POINT): layer 0 holds the
        // new placement, layer 1 the old bytes, on every other survivor.
        let e = result.expect_err("survivor 1 died");
        assert_eq!(e.status(), Status::PeerFailure, "{e}");
        let tail = "(EPLB rearrangement: layers before 1 were rearranged; layer 1 and later keep the old placement)";
        assert!(e.to_string().ends_with(tail), "{e}");
        assert_eq!(w[0], weights(3).layer(&new[0], 0, me), "survivor {me}");
        assert_eq!(w[1], weights(4).layer(&old[1], 1, rank), "survivor {me}");
        let (new1, old0) = (
            weights(3).layer(&new[1], 1, me),
            weights(4).layer(&old[0], 0, rank),
        );
        assert_ne!(new1, w[1], "layer 1 would change on survivor {me}");
        assert_ne!(old0, w[0], "layer 0 changed on survivor {me}");
        println!("ES|interrupted|{me}");
        return;
    }
    let summary = result.expect("rearrange on the shrunk group");
    assert_eq!(w, weights(3).all(&new, me), "survivor {me}");
    assert_eq!(summary.lost_experts, vec![Vec::<i64>::new(); LAYERS]);
    s.barrier().expect("a barrier of the shrunk group");
    println!("ES|ok|{me}|{}", summary.rows_received);
}

/// Runs the rank processes of `case`; the old ranks in `killed` must end by SIGKILL, the others
/// print `ES|{line}|{new rank}`.
fn run_kill_case(case: &str, killed: &[usize], line: &str) {
    use std::os::unix::process::ExitStatusExt;
    let group = ranks::unique("e", "kill");
    let env = |r: usize| {
        let mut env = vec![
            ("ES_GROUP", group.clone()),
            ("ES_RANK", r.to_string()),
            ("ES_CASE", case.to_owned()),
        ];
        if case == "second" && r == 1 {
            env.push(("EPCOMM_FAULT_POINT", "eplb:after_staging".to_owned()));
        }
        env
    };
    let kids = ranks::spawn_ranks("eplb_shrink_rank", 0..4, env);
    let done = ranks::wait_all(kids, Duration::from_secs(60));
    let all: Vec<String> = done.iter().map(ranks::Finished::output).collect();
    let all = all.join("\n");
    for f in &done {
        if killed.contains(&f.rank) {
            assert_eq!(f.status.signal(), Some(libc::SIGKILL), "{all}");
        } else {
            assert!(f.success(), "{all}");
            let me = SURVIVORS.iter().position(|&o| o == f.rank).unwrap();
            assert!(f.stdout.contains(&format!("ES|{line}|{me}")), "{all}");
        }
    }
}

#[test]
fn a_killed_rank_s_experts_move_onto_the_shrunk_group() {
    run_kill_case("first", &[2], "ok");
}

/// A second failure, during the rearrangement over the shrunk group, keeps its guarantee: the
/// layers before the failed one hold the new placement, the others the old bytes, alike on
/// every survivor.
#[test]
fn a_second_death_interrupts_the_shrunk_rearrangement_between_layers() {
    run_kill_case("second", &[1, 2], "interrupted");
}
