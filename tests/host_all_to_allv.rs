//! The host's all_to_allv callback carries the data of all_to_allv, exchange_rows,
//! reduce_scatterv and all_gatherv; what it delivers is checked like every host message: a
//! chunk it garbles or leaves unwritten on one rank, or a call that fails on one rank, fails
//! the op on every rank with the same status (never OK with wrong data), and the group is then
//! unusable everywhere. Honest, the results are those of the send/recv path.

#[path = "common/channel.rs"]
mod channel;

use channel::{
    all_to_allv_even, channel_transports_with, on_transports, reduce_scatterv_step,
    A2avLiar as Liar, Lie,
};
use epcomm::group::host::HostGroup;
use epcomm::group::{Group, RowExchange};
use epcomm::Status;

#[derive(Debug, Clone, Copy)]
enum Coll {
    AllToAllv,
    ExchangeRows,
    ReduceScatterv,
    AllGatherv,
}

const COLLS: [Coll; 4] = [
    Coll::AllToAllv,
    Coll::ExchangeRows,
    Coll::ReduceScatterv,
    Coll::AllGatherv,
];

/// Runs `coll` on rank `r` (data from every rank to every rank); Ok carries its bytes.
fn run(g: &mut HostGroup, coll: Coll, r: usize, world: usize) -> epcomm::Result<Vec<u8>> {
    match coll {
        Coll::AllToAllv => {
            let send: Vec<u8> = (0..world).flat_map(|p| [(10 * r + p) as u8; 16]).collect();
            all_to_allv_even(g, &send, 16)
        }
        Coll::ExchangeRows => {
            // Rank r gives row p of its 8-byte rows to peer p, which puts it at row r.
            let src: Vec<u8> = (0..world).flat_map(|p| [(10 * r + p) as u8; 8]).collect();
            let give: Vec<Vec<u32>> = (0..world as u32).map(|p| vec![p]).collect();
            let take: Vec<Vec<u32>> = (0..world as u32).map(|p| vec![p]).collect();
            let mut dst = vec![0; 8 * world];
            g.exchange_rows(RowExchange {
                src: &src,
                row_bytes: 8,
                give: &give,
                dst: &mut dst,
                take: &take,
            })
            .map(|()| dst)
        }
        Coll::ReduceScatterv => reduce_scatterv_step(g, r, world),
        Coll::AllGatherv => {
            // More than an op header carries inline: through the host's all_to_allv.
            let mut out = vec![0; 300 * world];
            g.all_gatherv(&[r as u8 + 1; 300], &vec![300; world], &mut out)
                .map(|()| out)
        }
    }
}

fn want(coll: Coll, r: usize, world: usize) -> Vec<u8> {
    match coll {
        Coll::AllToAllv => (0..world).flat_map(|p| [(10 * p + r) as u8; 16]).collect(),
        Coll::ExchangeRows => (0..world).flat_map(|p| [(10 * p + r) as u8; 8]).collect(),
        Coll::ReduceScatterv => (0..2)
            .flat_map(|e| {
                let i = 2 * r + e;
                let s: f32 = (0..world).map(|p| (i + p) as f32).sum();
                s.to_ne_bytes()
            })
            .collect(),
        Coll::AllGatherv => (0..world).flat_map(|p| [p as u8 + 1; 300]).collect(),
    }
}

type Outcome = (epcomm::Result<Vec<u8>>, epcomm::Result<()>);

/// Every rank's outcome of `coll` (after an honest warm-up all_to_allv) and of a barrier.
fn outcomes(world: usize, liar: usize, lie: Lie, coll: Coll) -> Vec<Outcome> {
    let liars = channel_transports_with(world, true, true)
        .into_iter()
        .enumerate()
        .map(|(r, inner)| Liar {
            inner,
            lie: if r == liar { lie } else { Lie::None },
            at: 1,
            calls: 0,
        })
        .collect();
    on_transports(liars, move |r, g| {
        run(g, Coll::AllToAllv, r, world).expect("the honest warm-up");
        let got = run(g, coll, r, world);
        (got, g.barrier())
    })
}

#[test]
fn honest_all_to_allv_gives_the_send_recv_results() {
    for world in [1, 2, 3, 4] {
        for coll in COLLS {
            for (r, (got, next)) in outcomes(world, 0, Lie::None, coll).into_iter().enumerate() {
                assert_eq!(got.unwrap(), want(coll, r, world), "{coll:?} world {world}");
                next.unwrap();
            }
        }
    }
}

#[test]
fn a_lying_or_failing_all_to_allv_fails_every_rank() {
    for world in [2, 3] {
        let liar = world - 1;
        for lie in [Lie::Garble, Lie::Unwritten, Lie::Fails] {
            for coll in COLLS {
                let what = format!("world {world}, {lie:?}, {coll:?}");
                let out = outcomes(world, liar, lie, coll);
                for (r, (got, next)) in out.iter().enumerate() {
                    let e = match got {
                        Ok(b) => panic!("{what}: rank {r} returned OK with {b:?}"),
                        Err(e) => e,
                    };
                    assert_eq!(e.status(), Status::Runtime, "{what}: rank {r}: {e}");
                    let msg = e.to_string();
                    if r == liar {
                        let says = match lie {
                            Lie::Fails => "host transport all_to_allv failed",
                            Lie::Garble | Lie::Unwritten => {
                                "host transport all_to_allv (rank 0's chunk) delivered a bad message"
                            }
                            Lie::None | Lie::Routing => unreachable!(),
                        };
                        assert!(msg.contains(says), "{what}: rank {r}: {msg}");
                    } else {
                        assert!(
                            msg.contains(&format!("rank {liar} of group 'host' failed op #2")),
                            "{what}: rank {r}: {msg}"
                        );
                    }
                    let next = next.as_ref().expect_err("the group is unusable");
                    assert_eq!(next.status(), Status::InvalidState, "{what}: rank {r}");
                }
            }
        }
    }
}
