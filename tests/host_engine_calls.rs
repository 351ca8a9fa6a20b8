//! The host engine calls of one dispatch + combine over a host-callback group, counted with an
//! instrumented transport (docs/design.md, "Host callbacks", states them): a regression that adds
//! round trips fails here. Every rank also checks its combined rows.

#[path = "common/channel.rs"]
mod channel;
#[path = "common/host_step.rs"]
mod host_step;

use std::sync::{Arc, Mutex};

use channel::{channel_transports_with, ChannelTransport};
use epcomm::group::host::{HostGroup, HostTransport};
use epcomm::group::AllToAllv;
use host_step::{Step, HIDDEN};

/// Calls of each kind: send, recv, all_gather, all_to_allv.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Calls {
    send: usize,
    recv: usize,
    all_gather: usize,
    all_to_allv: usize,
}

struct Counting {
    inner: ChannelTransport,
    calls: Arc<Mutex<Calls>>,
}

impl Counting {
    fn count(&self, f: impl FnOnce(&mut Calls)) {
        f(&mut self.calls.lock().unwrap());
    }
}

impl HostTransport for Counting {
    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), String> {
        self.count(|c| c.send += 1);
        self.inner.send(peer, data)
    }
    fn recv(&mut self, peer: usize, data: &mut [u8]) -> Result<(), String> {
        self.count(|c| c.recv += 1);
        self.inner.recv(peer, data)
    }
    fn all_gather(&mut self, mine: &[u8], out: &mut [u8]) -> Option<Result<(), String>> {
        let got = self.inner.all_gather(mine, out);
        if got.is_some() {
            self.count(|c| c.all_gather += 1);
        }
        got
    }
    fn all_to_allv(&mut self, a: AllToAllv<'_>) -> Option<Result<(), String>> {
        let got = self.inner.all_to_allv(a);
        if got.is_some() {
            self.count(|c| c.all_to_allv += 1);
        }
        got
    }
}

/// Each rank's calls during its second dispatch + combine (the first warms up), after checking
/// the combined rows of both.
fn calls(world: usize, all_gather: bool, all_to_allv: bool, tokens: usize) -> Vec<Calls> {
    let handles: Vec<_> = channel_transports_with(world, all_gather, all_to_allv)
        .into_iter()
        .enumerate()
        .map(|(rank, inner)| {
            std::thread::spawn(move || {
                let calls = Arc::new(Mutex::new(Calls::default()));
                let t = Counting {
                    inner,
                    calls: calls.clone(),
                };
                let mut g = HostGroup::new(Box::new(t), "host", rank, world, false).unwrap();
                let mut step = Step::new(rank, world, tokens);
                let mut before = Calls::default();
                for it in 0..2 {
                    if it == 1 {
                        before = *calls.lock().unwrap();
                    }
                    // The expert side: every row doubled.
                    let out = step.run(&mut g, |v| 2.0 * v).unwrap();
                    for (i, v) in out.iter().enumerate() {
                        let want = 2.0 * step.x[i] * step.holders(i / HIDDEN);
                        assert_eq!(*v, want, "rank {rank} element {i}");
                    }
                }
                let after = *calls.lock().unwrap();
                Calls {
                    send: after.send - before.send,
                    recv: after.recv - before.recv,
                    all_gather: after.all_gather - before.all_gather,
                    all_to_allv: after.all_to_allv - before.all_to_allv,
                }
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

fn assert_every_rank(world: usize, got: Vec<Calls>, want: Calls) {
    for (r, c) in got.into_iter().enumerate() {
        assert_eq!(c, want, "world {world}, rank {r}");
    }
}

/// With the host's all_gather and all_to_allv, at any world size and token count (1 token per
/// rank; 64, 6 KiB of routing per rank): 5 all_gathers (dispatch: its header with each rank's
/// row count per destination, the rows' header, the verdict; combine: the rows' header with
/// combine's own riding in it, the verdict) and 2 all_to_allv (the rows, dispatch's with their
/// routing in front).
#[test]
fn dispatch_and_combine_with_all_to_allv() {
    for world in [2, 4] {
        let want = Calls {
            send: 0,
            recv: 0,
            all_gather: 5,
            all_to_allv: 2,
        };
        assert_every_rank(world, calls(world, true, true, 1), want);
        assert_every_rank(world, calls(world, true, true, 64), want);
    }
}

/// A host with all_gather but no all_to_allv (as before the callback): the data moves in
/// send/recv pairs of a round-robin tournament, world - 1 rounds per exchange.
#[test]
fn dispatch_and_combine_without_all_to_allv() {
    for world in [2, 4] {
        let p2p = 2 * (world - 1);
        let want = Calls {
            send: p2p,
            recv: p2p,
            all_gather: 5,
            all_to_allv: 0,
        };
        assert_every_rank(world, calls(world, true, false, 64), want);
    }
}
