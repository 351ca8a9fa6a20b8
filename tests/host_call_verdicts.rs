//! Inside one dispatch or combine over a host transport, the ops leave their verdicts to the
//! next op's header or to the call's close (`Group::open_call`): a host all_to_allv that
//! fails, garbles a chunk or leaves one unwritten, on one rank at any of the call's exchanges (the routing, the
//! rows there, the rows back) still fails that call on every rank, with the same status, the
//! liar naming what it got and every other rank naming the liar; never OK with wrong data,
//! and the group is unusable on every rank afterwards. Ranks are threads over in-process
//! channels with bounded receives (a bug fails the test, never hangs it).

#[path = "common/channel.rs"]
mod channel;
#[path = "common/host_step.rs"]
mod host_step;

use channel::{channel_transports_with, on_transports, A2avLiar, Lie};
use epcomm::group::host::HostGroup;
use epcomm::Status;
use host_step::Step;

/// Tokens per rank: 64 carry 1.5 KiB of routing, more than a header holds; it travels with the
/// rows, so a dispatch makes one exchange and combine one: two all_to_allv per step.
const TOKENS: usize = 64;

/// Each rank's outcome of the second of three steps (dispatch, the expert side, combine) over
/// transports where rank `liar`'s all_to_allv number `at` lies as `lie` (the first step is
/// honest: its sums are what the second must give if it returns OK), and the status of the
/// third step.
fn outcomes(world: usize, liar: usize, lie: Lie, at: usize) -> Vec<(epcomm::Result<()>, Status)> {
    let transports = channel_transports_with(world, true, true)
        .into_iter()
        .enumerate()
        .map(|(r, inner)| A2avLiar {
            inner,
            lie: if r == liar { lie } else { Lie::None },
            at,
            calls: 0,
        })
        .collect();
    on_transports(transports, move |rank, g: &mut HostGroup| {
        let mut s = Step::new(rank, world, TOKENS);
        let honest = s.run(g, |v| v).expect("the honest first step");
        let got =
            (s.run(g, |v| v)).map(|out| assert_eq!(out, honest, "rank {rank}: OK with other sums"));
        let next = s.run(g, |v| v).map_or_else(|e| e.status(), |_| Status::Ok);
        (got, next)
    })
}

fn assert_every_rank_fails(world: usize, liar: usize, lie: Lie, at: usize) {
    let case = format!("world {world}, {lie:?} at all_to_allv #{at}");
    // The liar's exchange: the second step's rows there (2) or back (3), counting from 0 (each
    // step's dispatch sends its routing with its rows). Op numbers: the first step's dispatch
    // makes ops 1-3 (header, rows, verdict), its combine 4-5 (the rows with combine's header
    // riding in theirs, verdict); the second's dispatch starts at 6.
    let (call, op) = match at {
        2 => ("dispatch", 7),
        _ => ("combine", 9),
    };
    for (r, (got, next)) in outcomes(world, liar, lie, at).into_iter().enumerate() {
        let e = got.expect_err(&format!("{case}: rank {r} returned OK"));
        assert_eq!(e.status(), Status::Runtime, "{case}: rank {r}: {e}");
        let msg = e.to_string();
        if r == liar {
            let says = match lie {
                Lie::Fails => format!("host transport all_to_allv failed during {call} of group 'host' on rank {r}: connection reset by the test"),
                Lie::Routing => format!("dispatch: the routing rank 0 sent with its rows is bad (token 4294967295 of its {TOKENS}); the host transport garbled the bytes"),
                Lie::Garble | Lie::Unwritten | Lie::None => format!("host transport all_to_allv (rank 0's chunk) delivered a bad message during {call} of group 'host' on rank {r}: "),
            };
            assert!(msg.contains(&says), "{case}: rank {r}: {msg}");
        } else {
            assert_eq!(
                msg,
                format!("{call}: rank {liar} of group 'host' failed op #{op} (runtime error; see rank {liar}'s error), so it fails on every rank (rank {r} too); the group is unusable"),
                "{case}: rank {r}"
            );
        }
        assert_eq!(next, Status::InvalidState, "{case}: rank {r}");
    }
}

#[test]
fn a_failed_exchange_inside_a_call_fails_it_on_every_rank() {
    for world in [2, 3] {
        for at in [2, 3] {
            assert_every_rank_fails(world, world - 1, Lie::Fails, at);
        }
    }
}

#[test]
fn a_bad_chunk_inside_a_call_fails_it_on_every_rank() {
    for world in [2, 4] {
        for at in [2, 3] {
            assert_every_rank_fails(world, 1, Lie::Garble, at);
            assert_every_rank_fails(world, 0, Lie::Unwritten, at);
        }
    }
}

/// A dispatch whose rows arrive with a routing entry the receiver cannot place (the frame
/// checks; the entry's token is out of range): every rank fails that dispatch, none panics.
#[test]
fn a_bad_routing_entry_fails_the_dispatch_on_every_rank() {
    for world in [2, 3] {
        assert_every_rank_fails(world, 1, Lie::Routing, 2);
    }
}

/// The control of the cases above: an honest transport gives every rank OK with the first
/// step's sums (asserted inside `outcomes`), and the third step OK too.
#[test]
fn an_honest_transport_passes() {
    for (r, (got, next)) in outcomes(3, 0, Lie::None, 0).into_iter().enumerate() {
        got.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(next, Status::Ok, "rank {r}");
    }
}
