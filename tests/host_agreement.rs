//! Host-callback groups agree before any data moves: a rank's rejected arguments, parameters
//! the ranks pass differently, mismatched size lists and ranks calling different collectives
//! are the same error on every rank at once (not a hang until the host's timeout, not wrong
//! data), and the group stays usable. Each case runs with and without the host's own
//! all_gather.

#[path = "common/channel.rs"]
mod channel;

use std::time::{Duration, Instant};

use channel::{on_host_group_with, RECV_TIMEOUT};
use epcomm::group::{AllToAllv, Group, P2p, ReduceScatterv, RowExchange};
use epcomm::num::FloatKind;

/// A rejection must reach the peers long before a receive would time out.
const AT_ONCE: Duration = Duration::from_secs(5);

fn msg(r: epcomm::Result<()>) -> String {
    r.expect_err("expected an error").to_string()
}

/// Runs the case over the host transports: send/recv only, with all_gather, with all_gather
/// and all_to_allv.
fn both<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize, &mut epcomm::group::host::HostGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<Vec<T>> {
    [(false, false), (true, false), (true, true)]
        .into_iter()
        .map(|(ag, a2a)| on_host_group_with(world, ag, a2a, f.clone()))
        .collect()
}

#[test]
fn broadcast_with_different_roots_fails_on_every_rank_then_works() {
    for out in both(2, |rank, g| {
        let mut data = [rank as u8; 4];
        let e = msg(g.broadcast(rank, &mut data));
        let mut good = [if rank == 0 { 7u8 } else { 0 }; 4];
        g.broadcast(0, &mut good).unwrap();
        (e, data, good)
    }) {
        for (rank, (e, data, good)) in out.into_iter().enumerate() {
            assert_eq!(e, "broadcast: ranks of group 'host' disagree on root: rank 0 passes 0 but rank 1 passes 1; every rank must pass the same root (no data was exchanged)");
            assert_eq!(data, [rank as u8; 4], "nothing moved");
            assert_eq!(good, [7; 4]);
        }
    }
}

#[test]
fn reduce_scatterv_with_different_dtypes_fails_on_every_rank_then_works() {
    for out in both(2, |rank, g| {
        // Same bytes per row on both ranks: 2 float32 or 4 bfloat16.
        let (kind, elems) = if rank == 0 {
            (FloatKind::F32, 2)
        } else {
            (FloatKind::Bf16, 4)
        };
        let e = msg(g.reduce_scatterv(ReduceScatterv {
            input: &[0; 16],
            rows: &[1, 1],
            row_elems: elems,
            kind,
            output: &mut [0; 8],
        }));
        let input: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .flat_map(|x| (x * (rank + 1) as f32).to_ne_bytes())
            .collect();
        let mut out = [0u8; 8];
        g.reduce_scatterv(ReduceScatterv {
            input: &input,
            rows: &[1, 1],
            row_elems: 2,
            kind: FloatKind::F32,
            output: &mut out,
        })
        .unwrap();
        (e, epcomm::bytes::to_vec::<f32>(&out))
    }) {
        assert_eq!(out[0].0, "reduce_scatterv: ranks of group 'host' disagree on dtype: rank 0 passes float32 but rank 1 passes bfloat16; every rank must pass the same dtype (no data was exchanged)");
        assert_eq!(out[1].0, out[0].0);
        assert_eq!(out[0].1, [3.0, 6.0]);
        assert_eq!(out[1].1, [9.0, 12.0]);
    }
}

#[test]
fn a_rank_that_rejects_its_arguments_fails_its_peers_at_once() {
    for out in both(3, |rank, g| {
        let t = Instant::now();
        let sizes: &[usize] = if rank == 1 { &[1, 1] } else { &[1, 1, 1] };
        let e = msg(g.all_gatherv(&[rank as u8], sizes, &mut [0; 3]));
        let took = t.elapsed();
        let mut all = [0u8; 3];
        g.all_gatherv(&[rank as u8 + 10], &[1, 1, 1], &mut all)
            .unwrap();
        (e, took, all)
    }) {
        for (rank, (e, took, all)) in out.into_iter().enumerate() {
            let want = if rank == 1 {
                "all_gatherv: sizes has 2 entries; expected one per rank (3)"
            } else {
                "all_gatherv: rank 1 of group 'host' rejected its arguments (see that rank's error); no data was exchanged"
            };
            assert_eq!(e, want, "rank {rank}");
            assert!(
                took < AT_ONCE,
                "rank {rank} waited {took:?} (receive timeout {RECV_TIMEOUT:?})"
            );
            assert_eq!(all, [10, 11, 12]);
        }
    }
}

#[test]
fn all_to_allv_with_mismatched_sizes_fails_on_every_rank_then_works() {
    for out in both(2, |rank, g| {
        // Rank 0 sends 2 bytes to rank 1, which expects 3.
        let (send_sizes, recv_sizes): (&[usize], &[usize]) = if rank == 0 {
            (&[1, 2], &[1, 1])
        } else {
            (&[1, 1], &[3, 1])
        };
        let send = vec![rank as u8; send_sizes.iter().sum()];
        let mut recv = vec![0u8; recv_sizes.iter().sum()];
        let e = msg(g.all_to_allv(AllToAllv {
            send: &send,
            send_sizes,
            recv: &mut recv,
            recv_sizes,
        }));
        let untouched = recv.iter().all(|&b| b == 0);
        let mut got = [0u8; 2];
        g.all_to_allv(AllToAllv {
            send: &[rank as u8 * 2, rank as u8 * 2 + 1],
            send_sizes: &[1, 1],
            recv: &mut got,
            recv_sizes: &[1, 1],
        })
        .unwrap();
        (e, untouched, got)
    }) {
        for (rank, (e, untouched, got)) in out.into_iter().enumerate() {
            assert_eq!(e, "all_to_allv: rank 0 sends 2 bytes to rank 1 but recv_sizes[0] on rank 1 is 3; no data was exchanged");
            assert!(untouched, "rank {rank} received data");
            assert_eq!(got, [rank as u8, 2 + rank as u8]);
        }
    }
}

#[test]
fn send_recv_with_mismatched_messages_fails_on_every_rank_then_works() {
    for out in both(2, |rank, g| {
        let data = [5u8; 4];
        let mut buf = [0u8; 8];
        let e = msg(if rank == 0 {
            g.send_recv(&mut [P2p::Send {
                peer: 1,
                data: &data,
            }])
        } else {
            g.send_recv(&mut [P2p::Recv {
                peer: 0,
                data: &mut buf,
            }])
        });
        let mut got = [0u8; 4];
        let mine = [rank as u8 + 1; 4];
        g.send_recv(&mut [
            P2p::Send {
                peer: 1 - rank,
                data: &mine,
            },
            P2p::Recv {
                peer: 1 - rank,
                data: &mut got,
            },
        ])
        .unwrap();
        (e, buf, got)
    }) {
        for (rank, (e, buf, got)) in out.into_iter().enumerate() {
            assert_eq!(e, "send_recv: rank 0 sends messages of [4] bytes to rank 1, but rank 1 posted receives of [8] bytes; no data was exchanged");
            assert_eq!(buf, [0; 8]);
            assert_eq!(got, [2 - rank as u8; 4]);
        }
    }
}

#[test]
fn ranks_calling_different_collectives_fail_on_every_rank_then_work() {
    for out in both(2, |rank, g| {
        let e = if rank == 0 {
            msg(g.barrier())
        } else {
            msg(g.broadcast(0, &mut [0; 4]))
        };
        g.barrier().unwrap();
        e
    }) {
        let tail = "ranks of group 'host' called different collectives: rank 0 calls barrier but rank 1 calls broadcast; every rank must call the same collectives in the same order (no data was exchanged)";
        assert_eq!(out[0], format!("barrier: {tail}"));
        assert_eq!(out[1], format!("broadcast: {tail}"));
    }
}

#[test]
fn a_rank_with_bad_row_lists_fails_its_peers_at_once() {
    for out in both(2, |rank, g| {
        let t = Instant::now();
        // Rank 1 names row 9 of a 2-row source.
        let give = if rank == 1 {
            vec![vec![9], vec![]]
        } else {
            vec![vec![], vec![0]]
        };
        let take = if rank == 1 {
            vec![vec![0], vec![]]
        } else {
            vec![vec![], vec![]]
        };
        let e = msg(g.exchange_rows(RowExchange {
            src: &[1; 8],
            row_bytes: 4,
            give: &give,
            dst: &mut [0; 4],
            take: &take,
        }));
        (e, t.elapsed())
    }) {
        assert_eq!(out[0].0, "exchange_rows: rank 1 of group 'host' rejected its arguments (see that rank's error); no data was exchanged");
        assert!(out[1].0.starts_with("exchange_rows: "), "{}", out[1].0);
        assert!(out.iter().all(|(_, t)| *t < AT_ONCE));
    }
}
