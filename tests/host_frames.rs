//! A host transport that delivers wrong bytes on one rank (a short or garbled receive, a
//! message from another peer or from an earlier op, an all_gather part left unwritten) fails
//! the op on every rank with the same status, never OK with wrong data on the honest ranks;
//! so does one failed receive on an honest rank inside a broadcast. Ranks are threads over
//! in-process channels; every receive is bounded (a bug fails the test, never hangs it). On
//! 0dfc3b5 the honest ranks returned OK (with wrong data where the liar's bytes reached
//! them).

#[path = "common/channel.rs"]
mod channel;

use channel::{all_to_allv_even, channel_transports, on_transports, reduce_scatterv_step};
use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Duration;

use epcomm::group::host::{HostGroup, HostTransport};
use epcomm::group::{Group, P2p};
use epcomm::Status;

const RECV_TIMEOUT: Duration = Duration::from_secs(20);

/// How the liar's transport lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lie {
    /// Honest.
    None,
    /// The receive writes only the first half of the message.
    Short,
    /// The receive writes garbage over the whole buffer.
    Garbage,
    /// The receive delivers the last message that came from another peer.
    WrongPeer,
    /// The receive delivers the previous message from the same peer again (an earlier op's).
    Stale,
    /// The all_gather leaves the part of one peer unwritten.
    UnwrittenPart,
    /// The receive fails (the host reports an error; an honest transport's failure).
    Fails,
}

/// A transport over channels that lies once, at its `at`-th receive (or all_gather).
struct Liar {
    rank: usize,
    to: Vec<Sender<Vec<u8>>>,
    from: Vec<Receiver<Vec<u8>>>,
    with_all_gather: bool,
    lie: Lie,
    at: usize,
    recvs: usize,
    gathers: usize,
    /// The last message received from each peer, and from whom the last one came.
    last: HashMap<usize, Vec<u8>>,
    last_peer: Option<usize>,
}

impl Liar {
    fn take(&mut self, peer: usize) -> Result<Vec<u8>, String> {
        self.from[peer]
            .recv_timeout(RECV_TIMEOUT)
            .map_err(|e| format!("{e} (rank {} from {peer})", self.rank))
    }

    fn honest_recv(&mut self, peer: usize, data: &mut [u8]) -> Result<(), String> {
        let m = self.take(peer)?;
        if m.len() != data.len() {
            return Err(format!("got {} bytes, expected {}", m.len(), data.len()));
        }
        data.copy_from_slice(&m);
        Ok(())
    }
}

impl HostTransport for Liar {
    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), String> {
        self.to[peer].send(data.to_vec()).map_err(|e| e.to_string())
    }

    fn recv(&mut self, peer: usize, data: &mut [u8]) -> Result<(), String> {
        let n = self.recvs;
        self.recvs += 1;
        let m = self.take(peer)?;
        let lie = if n == self.at { self.lie } else { Lie::None };
        let previous = self.last.insert(peer, m.clone());
        // The last message from another peer: the one just before when it came from another.
        let other_peer = self
            .last_peer
            .filter(|&q| q != peer)
            .or_else(|| self.last.keys().copied().filter(|&q| q != peer).min());
        let other = other_peer.and_then(|q| self.last.get(&q).cloned());
        self.last_peer = Some(peer);
        let fill = |data: &mut [u8], src: &[u8]| {
            let k = src.len().min(data.len());
            data[..k].copy_from_slice(&src[..k]);
        };
        match lie {
            Lie::None | Lie::UnwrittenPart => {
                if m.len() != data.len() {
                    return Err(format!("got {} bytes, expected {}", m.len(), data.len()));
                }
                data.copy_from_slice(&m);
            }
            Lie::Short => {
                let half = data.len() / 2;
                data[..half].copy_from_slice(&m[..half]);
            }
            Lie::Garbage => {
                for (i, b) in data.iter_mut().enumerate() {
                    *b = (i as u8).wrapping_mul(37) ^ 0xA5;
                }
            }
            Lie::WrongPeer => fill(data, &other.expect("a message from another peer first")),
            Lie::Stale => fill(data, &previous.expect("an earlier message from this peer")),
            Lie::Fails => return Err("connection reset by the test".into()),
        }
        Ok(())
    }

    fn all_gather(&mut self, mine: &[u8], out: &mut [u8]) -> Option<Result<(), String>> {
        if !self.with_all_gather {
            return None;
        }
        let n = self.gathers;
        self.gathers += 1;
        let world = self.to.len();
        let me = self.rank;
        let sent = (0..world)
            .filter(|&p| p != me)
            .try_for_each(|p| self.send(p, mine));
        Some(sent.and_then(|()| {
            let k = mine.len();
            for p in 0..world {
                let dst = &mut out[p * k..(p + 1) * k];
                if p == me {
                    dst.copy_from_slice(mine);
                } else {
                    let mut part = vec![0u8; k];
                    self.honest_recv(p, &mut part)?;
                    let unwritten =
                        self.lie == Lie::UnwrittenPart && n == self.at && p == (me + 1) % world;
                    if !unwritten {
                        dst.copy_from_slice(&part);
                    }
                }
            }
            Ok(())
        }))
    }
}

/// One transport per rank; rank `liar` lies as told.
fn transports(world: usize, with_all_gather: bool, liar: usize, lie: Lie, at: usize) -> Vec<Liar> {
    channel_transports(world, with_all_gather)
        .into_iter()
        .map(|t| Liar {
            lie: if t.rank == liar { lie } else { Lie::None },
            rank: t.rank,
            to: t.to,
            from: t.from,
            with_all_gather: t.with_all_gather,
            at,
            recvs: 0,
            gathers: 0,
            last: HashMap::new(),
            last_peer: None,
        })
        .collect()
}

/// The ops the cases run (after one honest warm-up op, so every lie has earlier messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Coll {
    Barrier,
    Broadcast,
    AllGather,
    AllGatherv,
    AllToAllv,
    ReduceScatterv,
    SendRecv,
}

const COLLS: [Coll; 7] = [
    Coll::Barrier,
    Coll::Broadcast,
    Coll::AllGather,
    Coll::AllGatherv,
    Coll::AllToAllv,
    Coll::ReduceScatterv,
    Coll::SendRecv,
];

/// all_gather's bytes per rank: more than an op header carries inline. all_gatherv's 8 bytes
/// travel in the op header.
const BIG: usize = 264;

/// Runs `coll` on rank `r`; Ok carries the bytes it produced.
fn run(g: &mut HostGroup, coll: Coll, r: usize, world: usize) -> epcomm::Result<Vec<u8>> {
    let mine = vec![r as u8 + 1; 8];
    match coll {
        Coll::Barrier => g.barrier().map(|()| Vec::new()),
        Coll::Broadcast => {
            let mut d = if r == 0 { vec![9; 8] } else { vec![0; 8] };
            g.broadcast(0, &mut d).map(|()| d)
        }
        Coll::AllGather => {
            // More than the 256 bytes an op header carries: its own data step.
            let mine = vec![r as u8 + 1; BIG];
            let mut out = vec![0; BIG * world];
            g.all_gather(&mine, &mut out).map(|()| out)
        }
        Coll::AllGatherv => {
            let mut out = vec![0; 8 * world];
            g.all_gatherv(&mine, &vec![8; world], &mut out)
                .map(|()| out)
        }
        Coll::AllToAllv => {
            let send = vec![r as u8 + 1; 8 * world];
            all_to_allv_even(g, &send, 8)
        }
        Coll::ReduceScatterv => reduce_scatterv_step(g, r, world),
        Coll::SendRecv => {
            // A ring: send to the next rank, receive from the previous one.
            let mut got = vec![0u8; 8];
            let mut ops = [
                P2p::Send {
                    peer: (r + 1) % world,
                    data: &mine,
                },
                P2p::Recv {
                    peer: (r + world - 1) % world,
                    data: &mut got,
                },
            ];
            g.send_recv(&mut ops).map(|()| got)
        }
    }
}

/// Every rank's outcome of `coll` (after a warm-up all_to_allv) and of a barrier after it.
fn outcomes(
    world: usize,
    with_all_gather: bool,
    liar: usize,
    lie: Lie,
    at: usize,
    coll: Coll,
) -> Vec<(epcomm::Result<Vec<u8>>, epcomm::Result<()>)> {
    on_transports(
        transports(world, with_all_gather, liar, lie, at),
        move |r, g| {
            run(g, Coll::AllToAllv, r, world).expect("the honest warm-up");
            let got = run(g, coll, r, world);
            (got, g.barrier())
        },
    )
}

/// The receives a rank makes before `coll`'s data moves (in the op after the warm-up),
/// counting the warm-up's: the `at` that makes a lie hit the data (or, for a barrier, the op
/// header).
fn first_data_recv(world: usize, with_all_gather: bool, coll: Coll) -> usize {
    let gather = if with_all_gather { 0 } else { world - 1 };
    // The warm-up all_to_allv: header (the size lists' fingerprints in it), data, verdict.
    let warm_up = gather + (world - 1) + gather;
    match coll {
        // No data: the op header's first receive.
        Coll::Barrier => warm_up,
        Coll::AllToAllv => warm_up + gather,
        Coll::SendRecv => warm_up + gather + world - 1,
        // The data is in the op header.
        Coll::AllGatherv => warm_up,
        Coll::Broadcast | Coll::AllGather | Coll::ReduceScatterv => warm_up + gather,
    }
}

/// Every rank fails with the same status; the liar names the bad message, the others the
/// rank that failed; the next op finds the group unusable on every rank.
fn assert_every_rank_fails(
    what: &str,
    liar: usize,
    out: Vec<(epcomm::Result<Vec<u8>>, epcomm::Result<()>)>,
    liar_says: &str,
) {
    let statuses: Vec<_> = out
        .iter()
        .map(|(r, _)| r.as_ref().map_err(|e| e.status()).err())
        .collect();
    for (r, (got, next)) in out.iter().enumerate() {
        let e = match got {
            Ok(bytes) => {
                panic!("{what}: rank {r} returned OK with {bytes:?}; statuses {statuses:?}")
            }
            Err(e) => e,
        };
        assert_eq!(e.status(), Status::Runtime, "{what}: rank {r}: {e}");
        let msg = e.to_string();
        if r == liar {
            assert!(msg.contains(liar_says), "{what}: rank {r}: {msg}");
        } else {
            assert!(
                msg.contains(&format!("rank {liar} of group 'host' failed op #2 (runtime error; see rank {liar}'s error), so it fails on every rank (rank {r} too); the group is unusable")),
                "{what}: rank {r}: {msg}"
            );
        }
        let next = next.as_ref().expect_err("the group is unusable");
        assert_eq!(
            next.status(),
            Status::InvalidState,
            "{what}: rank {r}: {next}"
        );
    }
}

#[test]
fn a_lying_receive_fails_every_rank() {
    for world in [3, 4] {
        let liar = world - 1;
        for with_all_gather in [false, true] {
            for lie in [Lie::Short, Lie::Garbage, Lie::WrongPeer, Lie::Stale] {
                for coll in COLLS {
                    if with_all_gather
                        && matches!(coll, Coll::Barrier | Coll::AllGather | Coll::AllGatherv)
                    {
                        continue; // no receive to lie in: all through the host's all_gather
                    }
                    let at = first_data_recv(world, with_all_gather, coll);
                    let what =
                        format!("world {world}, all_gather {with_all_gather}, {lie:?}, {coll:?}");
                    let out = outcomes(world, with_all_gather, liar, lie, at, coll);
                    assert_every_rank_fails(&what, liar, out, "delivered a bad message");
                }
            }
        }
    }
}

#[test]
fn an_all_gather_part_left_unwritten_fails_every_rank() {
    for world in [3, 4] {
        let liar = 1;
        for coll in COLLS {
            // The op header gather (the warm-up took 2: header with the size lists'
            // fingerprints, verdict).
            let out = outcomes(world, true, liar, Lie::UnwrittenPart, 2, coll);
            if coll == Coll::SendRecv {
                // A rank that cannot read the headers does not know the lengths of the message
                // lists: it fails at once, and its peers fail on the message they get from it
                // instead (no OK anywhere; the status is the host's).
                for (r, (got, next)) in out.iter().enumerate() {
                    assert!(got.is_err() && next.is_err(), "world {world}, rank {r}");
                }
                continue;
            }
            assert_every_rank_fails(
                &format!("world {world}, {coll:?}, header"),
                liar,
                out,
                &format!("host transport all_gather (rank 2's part) delivered a bad message during {} of group 'host' on rank 1: it is not an epcomm message (the bytes are garbled, or were never written); a host transport must deliver every message whole, once, in order, from the rank that sent it", name(coll)),
            );
        }
        // all_gather's data goes through the host's all_gather: its second one.
        let out = outcomes(world, true, liar, Lie::UnwrittenPart, 3, Coll::AllGather);
        assert_every_rank_fails(
            &format!("world {world}, all_gather data"),
            liar,
            out,
            "host transport all_gather (rank 2's part) delivered a bad message during all_gatherv",
        );
    }
}

fn name(coll: Coll) -> &'static str {
    match coll {
        Coll::Barrier => "barrier",
        Coll::Broadcast => "broadcast",
        Coll::AllGather | Coll::AllGatherv => "all_gatherv",
        Coll::AllToAllv => "all_to_allv",
        Coll::ReduceScatterv => "reduce_scatterv",
        Coll::SendRecv => "send_recv",
    }
}

/// The full messages of one case: a message from another peer, on rank 0 of 3.
#[test]
fn a_message_from_the_wrong_peer_is_named() {
    // all_to_allv over the host's all_gather: rank 0's data receives come from ranks 1 and 2
    // (one per round); the second delivers the first one's bytes again.
    let at = first_data_recv(3, true, Coll::AllToAllv) + 1;
    let out = outcomes(3, true, 0, Lie::WrongPeer, at, Coll::AllToAllv);
    let msgs: Vec<String> = out
        .iter()
        .map(|(r, _)| r.as_ref().expect_err("every rank fails").to_string())
        .collect();
    let first = epcomm::group::host::tournament_partner(0, 3, 0).unwrap_or(1);
    let second = 3 - first;
    assert_eq!(msgs[0], format!("host transport recv from rank {second} delivered a bad message during all_to_allv of group 'host' on rank 0: it was sent by rank {first}; expected rank {second}; a host transport must deliver every message whole, once, in order, from the rank that sent it"));
    for r in [1, 2] {
        assert_eq!(msgs[r], format!("all_to_allv: rank 0 of group 'host' failed op #2 (runtime error; see rank 0's error), so it fails on every rank (rank {r} too); the group is unusable"));
    }
}

/// One honest receive failure inside a broadcast: every rank fails with the host's status, the
/// root and the other receivers included.
#[test]
fn a_failed_receive_inside_a_broadcast_fails_every_rank() {
    for world in [3, 4] {
        for with_all_gather in [false, true] {
            let at = first_data_recv(world, with_all_gather, Coll::Broadcast);
            let out = outcomes(world, with_all_gather, 2, Lie::Fails, at, Coll::Broadcast);
            assert_every_rank_fails(
                &format!("world {world}, all_gather {with_all_gather}"),
                2,
                out,
                "host transport recv from rank 0 failed during broadcast of group 'host' on rank 2: connection reset by the test",
            );
        }
    }
}

/// The same transports without a lie: every op gives the right bytes (the framing is
/// invisible to honest hosts).
#[test]
fn honest_transports_are_unchanged() {
    for world in [3, 4] {
        for with_all_gather in [false, true] {
            for coll in COLLS {
                let out = outcomes(world, with_all_gather, 0, Lie::None, 0, coll);
                for (r, (got, next)) in out.into_iter().enumerate() {
                    let got = got.unwrap_or_else(|e| panic!("{coll:?} rank {r}: {e}"));
                    next.unwrap();
                    let want: Vec<u8> = match coll {
                        Coll::Barrier => Vec::new(),
                        Coll::Broadcast => vec![9; 8],
                        Coll::AllGather => (0..world).flat_map(|p| [p as u8 + 1; BIG]).collect(),
                        Coll::AllGatherv => (0..world).flat_map(|p| [p as u8 + 1; 8]).collect(),
                        Coll::AllToAllv => (0..world).flat_map(|p| [p as u8 + 1; 8]).collect(),
                        Coll::ReduceScatterv => (0..2)
                            .flat_map(|e| {
                                let i = 2 * r + e;
                                let s: f32 = (0..world).map(|p| (i + p) as f32).sum();
                                s.to_ne_bytes()
                            })
                            .collect(),
                        Coll::SendRecv => vec![((r + world - 1) % world) as u8 + 1; 8],
                    };
                    assert_eq!(got, want, "{coll:?} world {world} rank {r}");
                }
            }
        }
    }
}

/// The full messages of each lie in a broadcast over the host's all_gather (3 ranks; rank 2's
/// receive from the root lies): the liar names what is wrong, the others name the liar.
#[test]
fn each_lie_is_named_on_the_rank_that_sees_it() {
    let tail = "; a host transport must deliver every message whole, once, in order, from the rank that sent it";
    for (lie, why) in [
        (Lie::Short, "its end was never written (a short receive)"),
        (
            Lie::Garbage,
            "it is not an epcomm message (the bytes are garbled, or were never written)",
        ),
        (
            Lie::Stale,
            "it is all_to_allv's data message; expected broadcast's data message",
        ),
    ] {
        let at = first_data_recv(3, true, Coll::Broadcast);
        let out = outcomes(3, true, 2, lie, at, Coll::Broadcast);
        let msgs: Vec<String> = out
            .iter()
            .map(|(r, _)| r.as_ref().expect_err("every rank fails").to_string())
            .collect();
        assert_eq!(
            msgs[2],
            format!("host transport recv from rank 0 delivered a bad message during broadcast of group 'host' on rank 2: {why}{tail}"),
            "{lie:?}"
        );
        for r in [0, 1] {
            assert_eq!(msgs[r], format!("broadcast: rank 2 of group 'host' failed op #2 (runtime error; see rank 2's error), so it fails on every rank (rank {r} too); the group is unusable"), "{lie:?}");
        }
    }
}
