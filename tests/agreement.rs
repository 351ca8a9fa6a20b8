//! Ranks that disagree, or one rank whose arguments fail its own checks: every rank gets an
//! error before any data moves (the full message checked on every rank), at once (no waiting
//! for the timeout), and the group stays usable: a correct op follows on the same handles.
//! Ranks are threads of this process, over shared memory.

mod common;
mod ranks;

use std::time::{Duration, Instant};

use epcomm::dtype::{Code, DType};
use epcomm::eplb::communicator::EplbCommunicator;
use epcomm::eplb::rearrange::{rearrange, rearrange_typed};
use epcomm::group::shm::ShmGroup;
use epcomm::group::{AllToAllv, Group, GroupOptions, ReduceScatterv, RowExchange, RowReduce};
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::{self, FloatKind};

/// Far above how long any of these calls may take: an error must not wait for it.
const TIMEOUT: Duration = Duration::from_secs(20);
const FAST: Duration = Duration::from_secs(5);

fn join(name: &str, rank: usize, world: usize) -> ShmGroup {
    let opts = GroupOptions {
        timeout: TIMEOUT,
        ..GroupOptions::default()
    };
    ShmGroup::join(name, rank, world, opts).expect("join")
}

/// Runs `f(rank, group)` on `world` thread ranks of a fresh group; returns the results and how
/// long each rank's `f` took.
fn on_group<T: Send + 'static>(
    tag: &str,
    world: usize,
    f: impl Fn(usize, &mut ShmGroup) -> T + Send + Sync + Clone + 'static,
) -> (String, Vec<(T, Duration)>) {
    let name = ranks::unique("ag", tag);
    let n = name.clone();
    let res = ranks::on_threads(world, move |rank| {
        let mut g = join(&n, rank, world);
        let start = Instant::now();
        let r = f(rank, &mut g);
        (r, start.elapsed())
    });
    assert!(ranks::shm_leftovers(&name).is_empty());
    (name, res)
}

fn message(r: &epcomm::Result<()>) -> String {
    match r {
        Ok(()) => "ok".to_owned(),
        Err(e) => format!("{:?}: {e}", e.status()),
    }
}

#[test]
fn broadcast_with_different_roots_fails_on_every_rank_then_works() {
    let (name, res) = on_group("bcast", 2, |rank, g| {
        let mut data = vec![rank as u8 + 1; 16];
        let bad = g.broadcast(rank, &mut data);
        let untouched = data == vec![rank as u8 + 1; 16];
        let mut data = vec![rank as u8 + 1; 16];
        let good = g.broadcast(1, &mut data).map(|()| data);
        (message(&bad), untouched, good.unwrap())
    });
    for (rank, ((bad, untouched, good), took)) in res.into_iter().enumerate() {
        assert_eq!(
            bad,
            format!("InvalidArgument: broadcast: ranks of group '{name}' disagree on root: rank 0 passes 0 but rank 1 passes 1; every rank must pass the same root (no data was exchanged)"),
            "rank {rank}"
        );
        assert!(untouched, "rank {rank}: data moved");
        assert_eq!(good, vec![2u8; 16], "rank {rank}");
        assert!(took < FAST, "rank {rank} took {took:?}");
    }
}

#[test]
fn reduce_scatterv_with_different_dtypes_fails_on_every_rank_then_works() {
    // float32 x 4 on rank 0, bfloat16 x 8 on rank 1: the same bytes, different sums.
    let (name, res) = on_group("rsv", 2, |rank, g| {
        let (kind, elems) = if rank == 0 {
            (FloatKind::F32, 4)
        } else {
            (FloatKind::Bf16, 8)
        };
        let input = num::from_f32(&vec![1.0; 2 * elems], kind);
        let mut out = vec![0u8; elems * kind.size()];
        let bad = g.reduce_scatterv(ReduceScatterv {
            input: &input,
            rows: &[1, 1],
            row_elems: elems,
            kind,
            output: &mut out,
        });
        let input = num::from_f32(&[1.0; 8], FloatKind::F32);
        let mut out = vec![0u8; 16];
        let good = g
            .reduce_scatterv(ReduceScatterv {
                input: &input,
                rows: &[1, 1],
                row_elems: 4,
                kind: FloatKind::F32,
                output: &mut out,
            })
            .map(|()| num::to_f32(&out, FloatKind::F32));
        (message(&bad), good.unwrap())
    });
    for (rank, ((bad, good), took)) in res.into_iter().enumerate() {
        assert_eq!(
            bad,
            format!("InvalidArgument: reduce_scatterv: ranks of group '{name}' disagree on dtype: rank 0 passes float32 but rank 1 passes bfloat16; every rank must pass the same dtype (no data was exchanged)"),
            "rank {rank}"
        );
        assert_eq!(good, vec![2.0; 4], "rank {rank}");
        assert!(took < FAST, "rank {rank} took {took:?}");
    }
}

#[test]
fn a_rank_that_rejects_its_arguments_fails_its_peers_at_once() {
    let (name, res) = on_group("reject", 3, |rank, g| {
        // Rank 1 passes an input of the wrong length.
        let input = vec![rank as u8; if rank == 1 { 4 } else { 8 }];
        let mut out = vec![0u8; 24];
        let bad = g.all_gatherv(&input, &[8, 8, 8], &mut out);
        let input = vec![rank as u8; 8];
        let good = g.all_gatherv(&input, &[8, 8, 8], &mut out).map(|()| out);
        (message(&bad), good.unwrap())
    });
    for (rank, ((bad, good), took)) in res.into_iter().enumerate() {
        let want = if rank == 1 {
            "InvalidArgument: all_gatherv: input has 4 bytes; expected 8 (sizes[1])".to_owned()
        } else {
            format!("InvalidArgument: all_gatherv: rank 1 of group '{name}' rejected its arguments (see that rank's error); no data was exchanged")
        };
        assert_eq!(bad, want, "rank {rank}");
        let expect: Vec<u8> = (0..3u8).flat_map(|r| [r; 8]).collect();
        assert_eq!(good, expect, "rank {rank}");
        assert!(
            took < FAST,
            "rank {rank} took {took:?} (waited for the timeout?)"
        );
    }
}

#[test]
fn all_gather_of_2_pow_63_bytes_is_an_argument_error_on_every_rank() {
    use epcomm::ffi::group::{
        epcomm_group, epcomm_group_all_gather, epcomm_group_create_shm, epcomm_group_destroy,
    };
    let name = ranks::unique("ag", "huge");
    let c_name = std::ffi::CString::new(name.clone()).unwrap();
    let res = ranks::on_threads(2, move |rank| {
        let mut g: *mut epcomm_group = std::ptr::null_mut();
        // SAFETY: valid name and out pointer; null options = defaults.
        let rc = unsafe {
            epcomm_group_create_shm(c_name.as_ptr(), rank as i32, 2, std::ptr::null(), &mut g)
        };
        assert_eq!(rc, 0);
        let input = [rank as u8; 8];
        let mut out = [0u8; 16];
        let bytes = if rank == 0 { 1usize << 63 } else { 8 };
        let start = Instant::now();
        // SAFETY: rank 1's buffers fit; rank 0's size is rejected before any access.
        let rc = unsafe {
            epcomm_group_all_gather(g, input.as_ptr().cast(), bytes, out.as_mut_ptr().cast())
        };
        // SAFETY: a NUL-terminated string owned by this thread, copied at once.
        let msg =
            unsafe { std::ffi::CStr::from_ptr(epcomm::ffi::error::epcomm_last_error_message()) }
                .to_string_lossy()
                .into_owned();
        let took = start.elapsed();
        // SAFETY: as above, a valid size on both ranks.
        let good = unsafe {
            epcomm_group_all_gather(g, input.as_ptr().cast(), 8, out.as_mut_ptr().cast())
        };
        // SAFETY: the handle is live.
        unsafe { epcomm_group_destroy(g) };
        (rc, msg, took, good, out)
    });
    for (rank, (rc, msg, took, good, out)) in res.into_iter().enumerate() {
        assert_eq!(
            rc,
            epcomm::Status::InvalidArgument as i32,
            "rank {rank}: {msg}"
        );
        let want = if rank == 0 {
            format!(
                "all_gather: bytes is 9223372036854775808; expected at most {} (world_size 2 times bytes must fit in the largest buffer, {} bytes)",
                isize::MAX as usize / 2,
                isize::MAX
            )
        } else {
            format!("all_gatherv: rank 0 of group '{name}' rejected its arguments (see that rank's error); no data was exchanged")
        };
        assert_eq!(msg, want, "rank {rank}");
        assert!(took < FAST, "rank {rank} took {took:?}");
        assert_eq!(good, 0, "rank {rank}");
        assert_eq!(out, [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]);
    }
    assert!(ranks::shm_leftovers(&name).is_empty());
}

// ---- MoE managers that disagree on dtypes ---------------------------------------------------

fn moe_cfg(hidden: usize, dtype: DType) -> MoeConfig {
    MoeConfig {
        num_experts: 4,
        top_k: 1,
        hidden,
        hidden_dtype: dtype,
        expert_dtype: FloatKind::F32,
        out_dtype: FloatKind::F32,
        max_tokens_per_rank: 4,
        extra_row_bytes: vec![],
        apply_router_weight_on_input: false,
    }
}

/// Dispatch with rank 1's manager configured as `(hidden, dtype)` and rank 0's as float32 x 8:
/// rank r gets `want[r]` (`{name}` = the group); then managers configured alike dispatch.
fn dispatch_disagreement(tag: &str, hidden: usize, dtype: DType, want: [&str; 2]) {
    let f32_ = FloatKind::F32.dtype();
    let (name, res) = on_group(tag, 2, move |rank, g| {
        let (h, d) = if rank == 1 {
            (hidden, dtype)
        } else {
            (8, f32_)
        };
        let mut m = Manager::new("deepep_high_throughput", moe_cfg(h, d), rank, 2).unwrap();
        let x = vec![0u8; 2 * 32];
        let bad = m.dispatch(g, &x, &[0, 3], &[1.0, 1.0], &[]).map(drop);
        let mut m = Manager::new("deepep_high_throughput", moe_cfg(8, f32_), rank, 2).unwrap();
        let good = m.dispatch(g, &x, &[0, 3], &[1.0, 1.0], &[]).map(drop);
        (message(&bad), message(&good))
    });
    for (rank, ((bad, good), took)) in res.into_iter().enumerate() {
        assert_eq!(bad, want[rank].replace("{name}", &name), "rank {rank}");
        assert_eq!(good, "ok", "rank {rank}");
        assert!(took < FAST, "rank {rank} took {took:?}");
    }
}

#[test]
fn managers_with_different_hidden_dtypes_fail_dispatch_on_every_rank() {
    // float32 x 8 against int32 x 8 (same row bytes) and bfloat16 x 16 (same row bytes).
    dispatch_disagreement(
        "moe-int",
        8,
        DType::new(Code::Int, 32),
        [
            "InvalidArgument: dispatch: rank 1 has hidden dtype = torch.int32 but rank 0 has torch.float32; every rank must create the manager with the same backend and configuration",
            "InvalidArgument: dispatch: rank 0 has hidden dtype = torch.float32 but rank 1 has torch.int32; every rank must create the manager with the same backend and configuration",
        ],
    );
    dispatch_disagreement(
        "moe-bf16",
        16,
        FloatKind::Bf16.dtype(),
        [
            "InvalidArgument: dispatch: rank 1 has hidden dtype = torch.bfloat16 but rank 0 has torch.float32; every rank must create the manager with the same backend and configuration",
            "InvalidArgument: dispatch: rank 0 has hidden dtype = torch.float32 but rank 1 has torch.bfloat16; every rank must create the manager with the same backend and configuration",
        ],
    );
}

// ---- EPLB rearrangements that disagree ------------------------------------------------------

const SLOTS: usize = 4; // 2 ranks x 2 local experts

fn eplb_comm() -> Box<dyn EplbCommunicator> {
    common::eplb_fixture::gloo_cpu().unwrap()
}

/// Rank `rank`'s weights for `layers` layers of `map`: one tensor, 8-byte rows = the expert id.
fn weights(map: &[i64], layers: usize, rank: usize) -> Vec<Vec<u8>> {
    (0..layers)
        .map(|_| {
            map[rank * 2..rank * 2 + 2]
                .iter()
                .flat_map(|&e| [e as u8; 8])
                .collect()
        })
        .collect()
}

/// A rearrangement where rank 1 passes (`layers1`, `new1`, `dtype1`) and rank 0 (1 layer,
/// [1,0,3,2], float32); both must fail with `want` and keep their weights, then a rearrangement
/// with matching arguments succeeds.
fn eplb_disagreement(tag: &str, layers1: usize, new1: [i64; SLOTS], dtype1: DType, want: &str) {
    let old = [0i64, 1, 2, 3];
    let (name, res) = on_group(tag, 2, move |rank, g| {
        let (layers, new, dtype) = if rank == 1 {
            (layers1, new1, dtype1)
        } else {
            (1, [1, 0, 3, 2], FloatKind::F32.dtype())
        };
        let olds = vec![old.to_vec(); layers];
        let news = vec![new.to_vec(); layers];
        let mut w = weights(&old, layers, rank);
        let mut c = eplb_comm();
        let bad = {
            let mut views: Vec<Vec<&mut [u8]>> = w.iter_mut().map(|l| vec![&mut l[..]]).collect();
            rearrange_typed(
                g,
                c.as_mut(),
                &olds,
                &news,
                &mut views,
                &[8],
                None,
                &[dtype],
            )
            .map(drop)
        };
        let kept = w == weights(&old, layers, rank);
        let mut w = weights(&old, 1, rank);
        let new = [1i64, 0, 3, 2];
        let good = {
            let mut views: Vec<Vec<&mut [u8]>> = w.iter_mut().map(|l| vec![&mut l[..]]).collect();
            rearrange(
                g,
                c.as_mut(),
                &[old.to_vec()],
                &[new.to_vec()],
                &mut views,
                &[8],
                None,
            )
            .map(drop)
        };
        let moved = w == weights(&new, 1, rank);
        (message(&bad), kept, message(&good), moved)
    });
    for (rank, ((bad, kept, good, moved), took)) in res.into_iter().enumerate() {
        assert_eq!(bad, want.replace("{name}", &name), "rank {rank}");
        assert!(kept, "rank {rank}: weights changed");
        assert_eq!(good, "ok", "rank {rank}");
        assert!(
            moved,
            "rank {rank}: the good rearrangement did not move the weights"
        );
        assert!(took < FAST, "rank {rank} took {took:?}");
    }
}

#[test]
fn eplb_with_different_weight_dtypes_fails_on_every_rank() {
    eplb_disagreement(
        "eplb-dtype",
        1,
        [1, 0, 3, 2],
        DType::new(Code::Int, 32),
        "InvalidArgument: rearrange: ranks disagree on the weight dtypes: rank 0 and rank 1 pass different ones; every rank must pass the same (EPLB rearrangement: no layer was changed)",
    );
}

#[test]
fn eplb_with_different_layer_counts_fails_on_every_rank() {
    eplb_disagreement(
        "eplb-layers",
        2,
        [1, 0, 3, 2],
        FloatKind::F32.dtype(),
        "InvalidArgument: rearrange: ranks disagree on the number of layers: rank 0 passes 1 but rank 1 passes 2; every rank must pass the same (EPLB rearrangement: no layer was changed)",
    );
}

#[test]
fn eplb_with_different_new_maps_fails_on_every_rank_with_its_layer_report() {
    eplb_disagreement(
        "eplb-maps",
        1,
        [2, 3, 0, 1],
        FloatKind::F32.dtype(),
        "InvalidArgument: rearrange: ranks disagree on the new placement: rank 0 and rank 1 pass different ones; every rank must pass the same (EPLB rearrangement: no layer was changed)",
    );
}

#[test]
fn a_rank_with_bad_row_lists_fails_its_peers_at_once_in_both_modes() {
    for direct in [true, false] {
        let name = ranks::unique("ag", if direct { "rows-d" } else { "rows-r" });
        let n = name.clone();
        let res = ranks::on_threads(2, move |rank| {
            let opts = GroupOptions {
                timeout: TIMEOUT,
                direct_reads: direct,
                ..GroupOptions::default()
            };
            let mut g = ShmGroup::join(&n, rank, 2, opts).expect("join");
            let src = vec![rank as u8 + 1; 2 * 4];
            let mut dst = vec![0u8; 2 * 4];
            // Rank 1 gives row 5 of its 2 rows.
            let give = if rank == 1 {
                vec![vec![5], vec![]]
            } else {
                vec![vec![], vec![0]]
            };
            let take = if rank == 1 {
                vec![vec![0], vec![]]
            } else {
                vec![vec![], vec![0]]
            };
            let start = Instant::now();
            let bad = g.exchange_rows(RowExchange {
                src: &src,
                row_bytes: 4,
                give: &give,
                dst: &mut dst,
                take: &take,
            });
            let took = start.elapsed();
            let give = vec![vec![0], vec![1]];
            let take = vec![vec![0], vec![1]];
            let good = g
                .exchange_rows(RowExchange {
                    src: &src,
                    row_bytes: 4,
                    give: &give,
                    dst: &mut dst,
                    take: &take,
                })
                .map(|()| dst);
            (message(&bad), took, good.unwrap(), g.direct())
        });
        for (rank, (bad, took, good, mode)) in res.into_iter().enumerate() {
            assert_eq!(mode, direct, "rank {rank}");
            if rank == 0 {
                assert_eq!(
                    bad,
                    format!("InvalidArgument: exchange_rows: rank 1 of group '{name}' rejected its arguments (see that rank's error); no data was exchanged"),
                    "rank {rank} (direct {direct})"
                );
            } else {
                assert_eq!(
                    bad,
                    "InvalidArgument: exchange_rows: give[0][0] = 5 is out of range; the buffer has 2 rows",
                    "rank {rank}"
                );
            }
            assert!(took < FAST, "rank {rank} took {took:?}");
            assert_eq!(good, [[1u8; 4], [2; 4]].concat(), "rank {rank}");
        }
    }
}

/// With direct reads, exchange_rows and reduce_rows agree on their row shape in the op header:
/// a disagreement names the argument as the caller passes it (`row_bytes`, `row_elems`).
#[test]
fn direct_row_ops_with_different_row_shapes_name_the_argument() {
    let (name, res) = on_group("rowshape", 2, |rank, g| {
        assert!(g.direct());
        let row_bytes = 4 * (rank + 1);
        let src = vec![1u8; row_bytes];
        let mut dst = vec![0u8; row_bytes];
        // Rank 0's row 0 to itself; rank 1's row to rank 0 is not asked for: the shapes differ
        // first.
        let (give, take) = (vec![vec![0u32], vec![]], vec![vec![0u32], vec![]]);
        let rows = g.exchange_rows(RowExchange {
            src: &src,
            row_bytes,
            give: &give,
            dst: &mut dst,
            take: &take,
        });
        let src = num::from_f32(&vec![1.0; rank + 1], FloatKind::F32);
        let mut out = vec![0u8; 4 * (rank + 1)];
        // Every rank's row 0 to rank 0, which adds them to its row 0.
        let give = vec![vec![0u32], vec![]];
        let take = if rank == 0 {
            vec![vec![(0u32, 1.0f32)], vec![(0, 1.0)]]
        } else {
            vec![vec![], vec![]]
        };
        let reduced = g.reduce_rows(RowReduce {
            src: &src,
            kind: FloatKind::F32,
            row_elems: rank + 1,
            give: &give,
            out: &mut out,
            out_kind: FloatKind::F32,
            take: &take,
        });
        (message(&rows), message(&reduced))
    });
    for (rank, ((rows, reduced), took)) in res.into_iter().enumerate() {
        assert_eq!(
            rows,
            format!("InvalidArgument: exchange_rows: ranks of group '{name}' disagree on row_bytes: rank 0 passes 4 but rank 1 passes 8; every rank must pass the same row_bytes (no data was exchanged)"),
            "rank {rank}"
        );
        assert_eq!(
            reduced,
            format!("InvalidArgument: reduce_rows: ranks of group '{name}' disagree on row_elems: rank 0 passes 1 but rank 1 passes 2; every rank must pass the same row_elems (no data was exchanged)"),
            "rank {rank}"
        );
        assert!(took < FAST, "rank {rank} took {took:?}");
    }
}

/// Send and receive sizes that do not pair up (all_to_allv, send_recv): every rank checks every
/// rank's sizes before any data moves, so every rank gets the same error naming the pair, no
/// buffer is written, and the group stays usable.
#[test]
fn mismatched_sizes_fail_on_every_rank_before_data_moves_then_work() {
    let (_, res) = on_group("sizes", 2, |rank, g| {
        let (send_sizes, recv_sizes): (&[usize], &[usize]) = if rank == 0 {
            (&[1, 2], &[1, 1])
        } else {
            (&[1, 1], &[3, 1])
        };
        let send = vec![rank as u8 + 1; send_sizes.iter().sum()];
        let mut recv = vec![0u8; recv_sizes.iter().sum()];
        let a2a = message(&g.all_to_allv(AllToAllv {
            send: &send,
            send_sizes,
            recv: &mut recv,
            recv_sizes,
        }));
        let a2a_untouched = recv.iter().all(|&b| b == 0);
        let data = [5u8; 4];
        let mut buf = [0u8; 8];
        let p2p = message(&if rank == 0 {
            g.send_recv(&mut [epcomm::group::P2p::Send {
                peer: 1,
                data: &data,
            }])
        } else {
            g.send_recv(&mut [epcomm::group::P2p::Recv {
                peer: 0,
                data: &mut buf,
            }])
        });
        // A send to itself that no receive matches.
        let own = message(&g.send_recv(&mut [epcomm::group::P2p::Send {
            peer: rank,
            data: &data,
        }]));
        let mut got = [0u8; 2];
        let good = message(&g.all_to_allv(AllToAllv {
            send: &[rank as u8 * 2, rank as u8 * 2 + 1],
            send_sizes: &[1, 1],
            recv: &mut got,
            recv_sizes: &[1, 1],
        }));
        (a2a, a2a_untouched, p2p, buf, own, good, got)
    });
    for (rank, ((a2a, untouched, p2p, buf, own, good, got), took)) in res.into_iter().enumerate() {
        assert_eq!(a2a, "InvalidArgument: all_to_allv: rank 0 sends 2 bytes to rank 1 but recv_sizes[0] on rank 1 is 3; no data was exchanged", "rank {rank}");
        assert!(untouched, "rank {rank} received data");
        assert_eq!(p2p, "InvalidArgument: send_recv: rank 0 sends messages of [4] bytes to rank 1, but rank 1 posted receives of [8] bytes; no data was exchanged", "rank {rank}");
        assert_eq!(buf, [0; 8]);
        // Both ranks' own checks find it (each rank's own error; the group stays usable).
        assert_eq!(own, format!("InvalidArgument: send_recv: rank {rank} sends itself messages of [4] bytes but posts receives from itself of [] bytes"));
        assert_eq!(good, "ok", "rank {rank}");
        assert_eq!(got, [rank as u8, 2 + rank as u8]);
        assert!(took < FAST, "rank {rank} took {took:?}");
    }
}
