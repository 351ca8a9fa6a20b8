//! EPLB rearrangement over shared memory: synthetic weights whose bytes encode (expert, layer,
//! tensor, element) end up where the new placement says, on threads and on processes; identical
//! maps move nothing; scale-down and scale-up through a rank mapping; a rank that dies
//! mid-transfer leaves every survivor's weights unchanged.

mod common;
mod ranks;

use std::time::Duration;

use epcomm::eplb::communicator::{self, EplbCommunicator};
use epcomm::eplb::rearrange::rearrange;
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
