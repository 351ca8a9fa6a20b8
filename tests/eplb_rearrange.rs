//! EPLB rearrangement over shared memory: synthetic weights whose bytes encode (expert, layer,
//! tensor, element) end up where the new placement says, on threads and on processes; identical
//! maps move nothing; scale-down and scale-up through a rank mapping; a rank that dies
//! mid-transfer leaves every survivor's weights unchanged.
//!
//! Double-buffered (`rearrange_into`): the next buffers end byte-identical to what the staged
//! path leaves in the live weights, on 2 and 4 ranks, random placements with empty slots, rank
//! mappings, migration batching on and off, while the live weights stay untouched; a rank
//! killed before a layer's transfer leaves every survivor reporting the same valid layers;
//! bad next buffers fail every rank before any data moves.

mod common;
mod ranks;

use std::time::Duration;

use epcomm::eplb::communicator::{self, EplbCommunicator};
use epcomm::eplb::rearrange::{
    check_next_buffers, rearrange, rearrange_into, rearrange_with, LayerView, RearrangeOptions,
};
use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions};
use epcomm::select::eplb::DeviceKind;
use epcomm::Status;

use common::eplb_fixture::{self, Weights};

const ROW_BYTES: [usize; 2] = [16, 40];
const LAYERS: usize = 3;
const LOGICAL: usize = 8;

fn opts() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(20),
        ..GroupOptions::default()
    }
}

/// This rank's tensors for a placement: weights[l][t] = rows of its slots.
fn tensors(map: &[Vec<i64>], rank: usize, world: usize) -> Vec<Vec<Vec<u8>>> {
    let w = Weights {
        world,
        row_bytes: &ROW_BYTES,
    };
    w.all(map, rank)
}

fn initial(physical: usize) -> Vec<Vec<i64>> {
    eplb_fixture::modulo_placement(LAYERS, physical, LOGICAL)
}

fn balanced(physical: usize, world: usize, seed: u64) -> Vec<Vec<i64>> {
    let load = eplb_fixture::skewed_load(LAYERS, LOGICAL, seed as usize, 0.0);
    eplb_fixture::rebalanced(&load, physical, world)
}

fn comm() -> Box<dyn EplbCommunicator> {
    eplb_fixture::gloo_cpu().unwrap()
}

/// Runs a rearrangement on `world` threads; returns every rank's weights afterwards.
fn run(
    world: usize,
    old: Vec<Vec<i64>>,
    new: Vec<Vec<i64>>,
    mapping: Option<Vec<i64>>,
    old_world: usize,
) -> Vec<(Vec<Vec<Vec<u8>>>, usize)> {
    let name = ranks::unique("e", "r");
    ranks::on_threads(world, move |r| {
        let mut g = ShmGroup::join(&name, r, world, opts()).unwrap();
        // Ranks that were not in the old group start with empty slots.
        let mut w = if r < old_world || mapping.is_none() {
            let holder = match &mapping {
                Some(m) if m.len() < world => m.iter().position(|&x| x == r as i64),
                _ => Some(r),
            };
            match holder {
                Some(h) => tensors(&old, h, old_world),
                None => tensors(&vec![vec![-1; old[0].len()]; LAYERS], 0, old_world),
            }
        } else {
            tensors(&vec![vec![-1; old[0].len()]; LAYERS], 0, old_world)
        };
        let mut c = comm();
        let sent = {
            let mut views = eplb_fixture::views(&mut w);
            rearrange(
                &mut g,
                c.as_mut(),
                &old,
                &new,
                &mut views,
                &ROW_BYTES,
                mapping.as_deref(),
            )
            .unwrap()
            .rows_sent
        };
        (w, sent)
    })
}

#[test]
fn weights_follow_the_new_placement() {
    for world in [2, 4] {
        let physical = 12;
        let old = initial(physical);
        let new = balanced(physical, world, world as u64);
        assert_ne!(old, new);
        let res = run(world, old, new.clone(), None, world);
        for (r, (w, _)) in res.iter().enumerate() {
            assert_eq!(w, &tensors(&new, r, world), "rank {r} of {world}");
        }
    }
}

#[test]
fn identical_maps_move_nothing() {
    let old = balanced(12, 2, 1);
    let res = run(2, old.clone(), old.clone(), None, 2);
    for (r, (w, sent)) in res.iter().enumerate() {
        assert_eq!(*sent, 0);
        assert_eq!(w, &tensors(&old, r, 2));
    }
}

#[test]
fn scale_down_and_scale_up() {
    // Scale-down 4 -> 2: ranks 1 and 3 leave; the old group of 4 runs the move.
    let old = initial(16);
    let new = balanced(8, 2, 9);
    let res = run(4, old.clone(), new.clone(), Some(vec![0, -1, 1, -1]), 4);
    assert_eq!(res[0].0, tensors(&new, 0, 2));
    assert_eq!(res[2].0, tensors(&new, 1, 2));
    // Scale-up 2 -> 4: new ranks 2 and 3 start empty; the new group of 4 runs the move.
    let old = initial(8);
    let new = balanced(16, 4, 3);
    let res = run(4, old.clone(), new.clone(), Some(vec![0, 1]), 2);
    for (r, (w, _)) in res.iter().enumerate() {
        assert_eq!(w, &tensors(&new, r, 4), "rank {r}");
    }
}

#[test]
fn communicators_follow_the_factory() {
    // Host tensors: torch_gloo and torch_nccl (vLLM runs it on the CPU group) work.
    assert_eq!(
        communicator::create(
            Some("torch_nccl"),
            false,
            DeviceKind::Cpu,
            &[],
            false,
            false
        )
        .unwrap()
        .kind()
        .name(),
        "torch_nccl"
    );
    let e = communicator::create(Some("pynccl"), false, DeviceKind::Cpu, &[], false, false)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "EPLB communicator 'pynccl' supports only cuda-like devices (got cpu)."
    );
    let e =
        communicator::create(Some("nixl"), false, DeviceKind::Cuda, &[], false, false).unwrap_err();
    assert_eq!(
        e.to_string(),
        "EPLB communicator 'nixl' requested but NIXL is unavailable."
    );
    let e = communicator::create(Some("pynccl"), false, DeviceKind::Cuda, &[], true, false)
        .unwrap_err();
    assert_eq!(e.to_string(), "Failed to initialize PyNcclEplbCommunicator (epcomm's NCCL transport is not implemented yet).");
    let e = communicator::create(
        Some("torch_nccl"),
        false,
        DeviceKind::Cuda,
        &[],
        true,
        false,
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::NotImplemented);
    assert_eq!(
        communicator::create(None, false, DeviceKind::Cpu, &[], false, false)
            .unwrap()
            .kind()
            .name(),
        "torch_gloo"
    );
}

#[test]
fn a_rank_dying_mid_transfer_leaves_survivors_unchanged() {
    if let Ok(group) = std::env::var("EPCOMM_EPLB_CHILD") {
        let rank: usize = std::env::var("EPCOMM_EPLB_RANK").unwrap().parse().unwrap();
        let old = initial(12);
        let new = balanced(12, 3, 4);
        let mut g = ShmGroup::join(&group, rank, 3, opts()).unwrap();
        g.barrier().unwrap();
        if rank == 2 {
            std::thread::sleep(Duration::from_millis(100));
            std::process::abort();
        }
        let mut w = tensors(&old, rank, 3);
        let before = w.clone();
        let mut c = comm();
        let r = {
            let mut views = eplb_fixture::views(&mut w);
            rearrange(&mut g, c.as_mut(), &old, &new, &mut views, &ROW_BYTES, None)
        };
        let e = r.unwrap_err();
        assert_eq!(e.status(), Status::PeerFailure, "{e}");
        assert!(e.to_string().contains("rank 2 of group"), "{e}");
        assert!(
            e.to_string()
                .ends_with("(EPLB rearrangement: no layer was changed)"),
            "{e}"
        );
        assert!(w == before, "weights changed on rank {rank}");
        return;
    }
    let group = ranks::unique("e", "kill");
    let kids = ranks::spawn_ranks(
        "a_rank_dying_mid_transfer_leaves_survivors_unchanged",
        0..3,
        |r| {
            vec![
                ("EPCOMM_EPLB_CHILD", group.clone()),
                ("EPCOMM_EPLB_RANK", r.to_string()),
            ]
        },
    );
    for k in ranks::wait_all(kids, Duration::from_secs(60)) {
        if k.rank != 2 {
            assert!(k.success(), "rank {}: {}{}", k.rank, k.stdout, k.stderr);
        }
    }
}

#[test]
fn weights_follow_the_new_placement_across_processes() {
    if let Ok(group) = std::env::var("EPCOMM_EPLB_MOVE_CHILD") {
        let rank: usize = std::env::var("EPCOMM_EPLB_RANK").unwrap().parse().unwrap();
        let world: usize = std::env::var("EPCOMM_EPLB_WORLD").unwrap().parse().unwrap();
        let physical = 16;
        let old = initial(physical);
        let new = balanced(physical, world, 11);
        let mut g = ShmGroup::join(&group, rank, world, opts()).unwrap();
        let mut w = tensors(&old, rank, world);
        let mut c = comm();
        {
            let mut views = eplb_fixture::views(&mut w);
            rearrange(&mut g, c.as_mut(), &old, &new, &mut views, &ROW_BYTES, None).unwrap();
        }
        assert!(w == tensors(&new, rank, world), "rank {rank} of {world}");
        return;
    }
    for world in [2, 4] {
        let group = ranks::unique("e", "proc");
        let kids = ranks::spawn_ranks(
            "weights_follow_the_new_placement_across_processes",
            0..world,
            |r| {
                vec![
                    ("EPCOMM_EPLB_MOVE_CHILD", group.clone()),
                    ("EPCOMM_EPLB_RANK", r.to_string()),
                    ("EPCOMM_EPLB_WORLD", world.to_string()),
                ]
            },
        );
        for k in ranks::wait_all(kids, Duration::from_secs(60)) {
            let r = k.rank;
            assert!(k.success(), "rank {r} of {world}: {}{}", k.stdout, k.stderr);
        }
    }
}

/// A rank's tensors of every layer: weights[l][t].
type Tensors = Vec<Vec<Vec<u8>>>;

/// A small deterministic generator (xorshift64*), so a failing seed can be replayed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }

    fn shuffle(&mut self, v: &mut [i64]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }

    /// An old map holding every logical expert at least once, shuffled.
    fn old_map(&mut self, physical: usize) -> Vec<i64> {
        let mut m: Vec<i64> = (0..physical)
            .map(|i| {
                if i < LOGICAL {
                    i as i64
                } else {
                    self.below(LOGICAL) as i64
                }
            })
            .collect();
        self.shuffle(&mut m);
        m
    }

    /// A new map of random experts, about one slot in eight empty.
    fn new_map(&mut self, physical: usize) -> Vec<i64> {
        (0..physical)
            .map(|_| match self.below(8) {
                0 => -1,
                _ => self.below(LOGICAL) as i64,
            })
            .collect()
    }
}

/// Rank `r`'s starting weights as [`run`] builds them (ranks new in a scale-up start empty).
fn start(
    r: usize,
    old: &[Vec<i64>],
    mapping: Option<&[i64]>,
    world: usize,
    old_world: usize,
) -> Vec<Vec<Vec<u8>>> {
    let empty = || tensors(&vec![vec![-1; old[0].len()]; old.len()], 0, old_world);
    let holder = match mapping {
        None => Some(r),
        Some(_) if r >= old_world => None,
        Some(m) if m.len() < world => m.iter().position(|&x| x == r as i64),
        Some(_) => Some(r),
    };
    holder.map_or_else(empty, |h| tensors(old, h, old_world))
}

/// Garbage next buffers of the live tensors' sizes: every byte must be written.
fn garbage(live: &[Vec<Vec<u8>>]) -> Vec<Vec<Vec<u8>>> {
    live.iter()
        .map(|l| l.iter().map(|t| vec![0xA5; t.len()]).collect())
        .collect()
}

fn read_only(w: &[Vec<Vec<u8>>]) -> Vec<LayerView<'_>> {
    w.iter()
        .map(|l| l.iter().map(Vec::as_slice).collect())
        .collect()
}

/// On `world` threads: the staged path's result and the double-buffered path's next buffers
/// from the same start; asserts the live weights stay as they were.
fn staged_and_double_buffered(
    world: usize,
    old: Vec<Vec<i64>>,
    new: Vec<Vec<i64>>,
    mapping: Option<Vec<i64>>,
    old_world: usize,
    batching: bool,
) -> Vec<(Tensors, Tensors)> {
    let name = ranks::unique("e", "db");
    ranks::on_threads(world, move |r| {
        let mut g = ShmGroup::join(&name, r, world, opts()).unwrap();
        let live = start(r, &old, mapping.as_deref(), world, old_world);
        let options = RearrangeOptions {
            rank_mapping: mapping.as_deref(),
            dtypes: &[],
            migration_batching: batching,
            ..RearrangeOptions::default()
        };
        let mut c = comm();
        let mut staged = live.clone();
        let s = rearrange_with(
            &mut g,
            c.as_mut(),
            &old,
            &new,
            &mut eplb_fixture::views(&mut staged),
            &ROW_BYTES,
            &options,
        )
        .unwrap();
        let mut next = garbage(&live);
        let into = rearrange_into(
            &mut g,
            c.as_mut(),
            &old,
            &new,
            &read_only(&live),
            &mut eplb_fixture::views(&mut next),
            &ROW_BYTES,
            &options,
        );
        assert_eq!(into.next_valid, LAYERS, "rank {r}");
        assert_eq!(into.result.unwrap(), s, "rank {r}: the summaries differ");
        assert!(
            live == start(r, &old, mapping.as_deref(), world, old_world),
            "rank {r}: live changed"
        );
        (staged, next)
    })
}

#[test]
fn double_buffered_matches_the_staged_path_on_random_placements() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for world in [2, 4] {
        for batching in [false, true] {
            for _ in 0..3 {
                let physical = 12;
                let old: Vec<Vec<i64>> = (0..LAYERS).map(|_| rng.old_map(physical)).collect();
                let new: Vec<Vec<i64>> = (0..LAYERS).map(|_| rng.new_map(physical)).collect();
                let res = staged_and_double_buffered(world, old, new, None, world, batching);
                for (r, (staged, next)) in res.iter().enumerate() {
                    assert!(staged == next, "rank {r} of {world}, batching {batching}");
                }
            }
        }
    }
}

#[test]
fn double_buffered_matches_the_staged_path_across_rank_mappings() {
    let mut rng = Rng(7);
    for batching in [false, true] {
        // Scale-down 4 -> 2 (ranks 1 and 3 leave), then scale-up 2 -> 4.
        let old: Vec<Vec<i64>> = (0..LAYERS).map(|_| rng.old_map(16)).collect();
        let new: Vec<Vec<i64>> = (0..LAYERS).map(|_| rng.old_map(8)).collect();
        let res =
            staged_and_double_buffered(4, old, new.clone(), Some(vec![0, -1, 1, -1]), 4, batching);
        assert_eq!(res[0].1, tensors(&new, 0, 2));
        assert_eq!(res[2].1, tensors(&new, 1, 2));
        for (r, (staged, next)) in res.iter().enumerate() {
            assert!(staged == next, "scale-down rank {r}, batching {batching}");
        }
        let old: Vec<Vec<i64>> = (0..LAYERS).map(|_| rng.old_map(8)).collect();
        let new: Vec<Vec<i64>> = (0..LAYERS).map(|_| rng.new_map(16)).collect();
        let res = staged_and_double_buffered(4, old, new, Some(vec![0, 1]), 2, batching);
        for (r, (staged, next)) in res.iter().enumerate() {
            assert!(staged == next, "scale-up rank {r}, batching {batching}");
        }
    }
}

#[test]
fn bad_next_buffers_fail_every_rank_before_any_data_moves() {
    let old = initial(12);
    let new = balanced(12, 2, 5);
    let name = ranks::unique("e", "dbbad");
    let res = ranks::on_threads(2, move |r| {
        let mut g = ShmGroup::join(&name, r, 2, opts()).unwrap();
        let live = tensors(&old, r, 2);
        let mut next = garbage(&live);
        if r == 1 {
            next[2][1].pop();
        }
        let before = next.clone();
        let mut c = comm();
        let out = rearrange_into(
            &mut g,
            c.as_mut(),
            &old,
            &new,
            &read_only(&live),
            &mut eplb_fixture::views(&mut next),
            &ROW_BYTES,
            &RearrangeOptions::default(),
        );
        assert!(next == before, "rank {r}: next written");
        assert!(live == tensors(&old, r, 2), "rank {r}: live changed");
        (out.next_valid, out.result.unwrap_err())
    });
    let (v0, e0) = &res[0];
    let (v1, e1) = &res[1];
    assert_eq!((*v0, *v1), (0, 0));
    assert_eq!(e0.status(), Status::InvalidArgument);
    assert_eq!(e0.to_string(), "rearrange: rank 1 rejected its arguments (see that rank's error) (EPLB rearrangement: no layer was changed)");
    assert_eq!(e1.to_string(), "next_weights layer 2 tensor 1 has 239 bytes; expected 240 (the size of live layer 2 tensor 1)");
}

#[test]
fn next_buffers_that_alias_the_live_weights_are_named() {
    let live = vec![vec![(1000, 100), (2000, 50)], vec![(3000, 100), (4000, 50)]];
    let ok = vec![vec![(5000, 100), (6000, 50)], vec![(7000, 100), (8000, 50)]];
    assert!(check_next_buffers(&live, &ok).is_ok());
    let mut bad = ok.clone();
    bad[1][0] = (3050, 100);
    assert_eq!(
        check_next_buffers(&live, &bad).unwrap_err().to_string(),
        "next_weights layer 1 tensor 0 overlaps live layer 1 tensor 0; the next weights must be buffers of their own"
    );
    bad[1][0] = (1999, 100);
    assert_eq!(
        check_next_buffers(&live, &bad).unwrap_err().to_string(),
        "next_weights layer 1 tensor 0 overlaps live layer 0 tensor 1; the next weights must be buffers of their own"
    );
    bad[1][0] = (6040, 100);
    assert_eq!(
        check_next_buffers(&live, &bad).unwrap_err().to_string(),
        "next_weights layer 1 tensor 0 overlaps next_weights layer 0 tensor 1; every next tensor must be a buffer of its own"
    );
    // Adjacent is not overlapping.
    bad[1][0] = (2050, 100);
    assert!(check_next_buffers(&live, &bad).is_ok());
    let e = check_next_buffers(&live, &ok[..1]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "next_weights has 1 layers; expected 2 (one per layer of the live weights)"
    );
    let e = check_next_buffers(&live, &[ok[0].clone(), vec![(7000, 100)]]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "next_weights layer 1 has 1 tensors; expected 2 (as the live weights)"
    );
}

#[test]
fn an_interrupted_double_buffered_run_reports_the_same_valid_layers() {
    if let Ok(group) = std::env::var("EPCOMM_EPLB_DB_CHILD") {
        let rank: usize = std::env::var("EPCOMM_EPLB_RANK").unwrap().parse().unwrap();
        let old = initial(12);
        let new = balanced(12, 3, 4);
        if rank == 2 {
            assert!(epcomm::fault::set_hook(eplb_fixture::kill_before_layer_1));
        }
        let mut g = ShmGroup::join(&group, rank, 3, opts()).unwrap();
        let live = tensors(&old, rank, 3);
        let mut next = garbage(&live);
        let mut c = comm();
        let out = rearrange_into(
            &mut g,
            c.as_mut(),
            &old,
            &new,
            &read_only(&live),
            &mut eplb_fixture::views(&mut next),
            &ROW_BYTES,
            &RearrangeOptions::default(),
        );
        let e = out.result.unwrap_err();
        assert_eq!(out.next_valid, 1, "rank {rank}: {e}");
        assert_eq!(e.status(), Status::PeerFailure, "{e}");
        assert!(e.to_string().contains("rank 2 of group"), "{e}");
        assert!(
            e.to_string().ends_with("(EPLB rearrangement: layers before 1 were rearranged; layer 1 and later keep the old placement)"),
            "{e}"
        );
        assert!(live == tensors(&old, rank, 3), "rank {rank}: live changed");
        assert!(
            next[0] == tensors(&new, rank, 3)[0],
            "rank {rank}: layer 0's next is not the new placement"
        );
        assert!(
            next[2] == garbage(&live)[2],
            "rank {rank}: layer 2's next was written"
        );
        return;
    }
    let group = ranks::unique("e", "dbkill");
    let kids = ranks::spawn_ranks(
        "an_interrupted_double_buffered_run_reports_the_same_valid_layers",
        0..3,
        |r| {
            vec![
                ("EPCOMM_EPLB_DB_CHILD", group.clone()),
                ("EPCOMM_EPLB_RANK", r.to_string()),
            ]
        },
    );
    for k in ranks::wait_all(kids, Duration::from_secs(60)) {
        if k.rank != 2 {
            assert!(k.success(), "rank {}: {}{}", k.rank, k.stdout, k.stderr);
        }
    }
}
