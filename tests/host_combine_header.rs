//! Combine's header rides in the header of its rows' exchange on a host-callback group
//! (`Group::ride`: one engine call fewer, counted by tests/host_engine_calls.rs). What the
//! separate header gave must still hold: a rank whose combine input is rejected, and ranks in
//! different calls, fail every rank alike before any data moves, with the manager's messages,
//! and the group goes on.

#[path = "common/channel.rs"]
mod channel;
#[path = "common/host_step.rs"]
mod host_step;

use channel::{channel_transports_with, on_transports};
use epcomm::group::host::HostGroup;
use epcomm::Status;
use host_step::{Step, HIDDEN};

const TOKENS: usize = 4;

/// The step's combined rows as the expert side `v -> 2v` makes them: the expert's output of
/// token t's row times the number of ranks that hold it ([`Step::holders`]).
fn expected(s: &Step) -> Vec<f32> {
    (0..TOKENS * HIDDEN)
        .map(|i| 2.0 * s.x[i] * s.holders(i / HIDDEN))
        .collect()
}

/// Dispatch everywhere, then combine with a wrong-sized expert output on rank `bad`: every
/// rank's outcome, then a whole step on every rank (checked against the expected rows).
fn rejected_combine(world: usize, bad: usize) -> Vec<(Status, String)> {
    let transports = channel_transports_with(world, true, true);
    on_transports(transports, move |rank, g: &mut HostGroup| {
        let mut s = Step::new(rank, world, TOKENS);
        let x = epcomm::bytes::as_bytes(&s.x).to_vec();
        let rows = {
            let d = s.m.dispatch(g, &x, &s.ids, &s.w, &[]).expect("dispatch");
            d.hidden.len()
        };
        let y = vec![0u8; if rank == bad { rows + 4 } else { rows }];
        let mut out = vec![0u8; TOKENS * HIDDEN * 4];
        let e = s.m.combine(g, &y, &mut out).expect_err("combine must fail");
        let got = s.run(g, |v| 2.0 * v).expect("the next step");
        assert_eq!(
            got,
            expected(&s),
            "rank {rank}: the step after the rejection"
        );
        (e.status(), e.to_string())
    })
}

#[test]
fn a_rejected_combine_fails_every_rank_and_the_group_goes_on() {
    for (world, bad) in [(2, 0), (2, 1), (3, 1), (4, 3)] {
        for (r, (status, msg)) in rejected_combine(world, bad).into_iter().enumerate() {
            assert_eq!(
                status,
                Status::InvalidArgument,
                "world {world}, rank {r}: {msg}"
            );
            if r == bad {
                assert!(
                    msg.starts_with("expert_output has "),
                    "world {world}, rank {r}: {msg}"
                );
            } else {
                assert_eq!(
                    msg,
                    format!("combine: rank {bad} rejected its input (see that rank's error); no data was exchanged"),
                    "world {world}, rank {r}"
                );
            }
        }
    }
}

/// After a dispatch everywhere, rank 0 dispatches again while the others combine: the
/// manager's error on every rank, the same text (combine's header rides in an all_to_allv op,
/// dispatch's in an all_gather: the headers are checked before the ops are compared).
#[test]
fn dispatch_against_combine_is_the_same_error_on_every_rank() {
    for world in [2, 3] {
        let transports = channel_transports_with(world, true, true);
        let got = on_transports(transports, move |rank, g: &mut HostGroup| {
            let mut s = Step::new(rank, world, TOKENS);
            let x = epcomm::bytes::as_bytes(&s.x).to_vec();
            let rows = {
                let d = s.m.dispatch(g, &x, &s.ids, &s.w, &[]).expect("dispatch");
                d.hidden.len()
            };
            let e = if rank == 0 {
                s.m.dispatch(g, &x, &s.ids, &s.w, &[]).map(|_| ())
            } else {
                let mut out = vec![0u8; TOKENS * HIDDEN * 4];
                s.m.combine(g, &vec![0u8; rows], &mut out)
            }
            .expect_err("different calls must fail");
            (e.status(), e.to_string())
        });
        for (r, (status, msg)) in got.into_iter().enumerate() {
            assert_eq!(
                status,
                Status::InvalidState,
                "world {world}, rank {r}: {msg}"
            );
            assert_eq!(
                msg,
                "ranks of group 'host' called different collectives: rank 0 calls dispatch but rank 1 calls combine; every rank must call the same collectives in the same order (no data was exchanged)",
                "world {world}, rank {r}"
            );
        }
    }
}
