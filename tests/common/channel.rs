//! A host transport over in-process channels, what a runtime's own send/recv would be, and a
//! runner that drives one `HostGroup` per thread. Included by path (`#[path]`) so a test binary
//! that needs only this does not pull in the rest of `common`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Duration;

use epcomm::group::host::{HostGroup, HostTransport};
use epcomm::group::{AllToAllv, Group, ReduceScatterv};
use epcomm::num::FloatKind;

/// How long a receive waits before it is an error (a test bug, not a library hang).
pub const RECV_TIMEOUT: Duration = Duration::from_secs(30);

pub struct ChannelTransport {
    pub rank: usize,
    /// A sender to every rank and a receiver from every rank (by rank).
    pub to: Vec<Sender<Vec<u8>>>,
    pub from: Vec<Receiver<Vec<u8>>>,
    /// Offer the host's own all_gather (built here from the channels) as well.
    pub with_all_gather: bool,
    /// Offer the host's own all_to_allv (built here from the channels) as well.
    pub with_all_to_allv: bool,
}

impl HostTransport for ChannelTransport {
    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), String> {
        self.to[peer].send(data.to_vec()).map_err(|e| e.to_string())
    }
    fn recv(&mut self, peer: usize, data: &mut [u8]) -> Result<(), String> {
        let m = self.from[peer]
            .recv_timeout(RECV_TIMEOUT)
            .map_err(|e| format!("{e} (rank {} from {peer})", self.rank))?;
        if m.len() != data.len() {
            return Err(format!("got {} bytes, expected {}", m.len(), data.len()));
        }
        data.copy_from_slice(&m);
        Ok(())
    }
    fn all_gather(&mut self, mine: &[u8], out: &mut [u8]) -> Option<Result<(), String>> {
        if !self.with_all_gather {
            return None;
        }
        let world = self.to.len();
        // Unbounded channels: send to everyone first, then receive from everyone.
        let me = self.rank;
        let sent = (0..world)
            .filter(|&p| p != me)
            .try_for_each(|p| self.send(p, mine));
        Some(sent.and_then(|()| {
            let n = mine.len();
            for p in 0..world {
                let dst = &mut out[p * n..(p + 1) * n];
                if p == self.rank {
                    dst.copy_from_slice(mine);
                } else {
                    self.recv(p, dst)?;
                }
            }
            Ok(())
        }))
    }
    fn all_to_allv(&mut self, a: AllToAllv<'_>) -> Option<Result<(), String>> {
        let (send, send_sizes, recv, recv_sizes) = (a.send, a.send_sizes, a.recv, a.recv_sizes);
        if !self.with_all_to_allv {
            return None;
        }
        let me = self.rank;
        let starts = |sizes: &[usize]| -> Vec<usize> {
            sizes
                .iter()
                .scan(0, |a, &n| {
                    let s = *a;
                    *a += n;
                    Some(s)
                })
                .collect()
        };
        let (ss, rs) = (starts(send_sizes), starts(recv_sizes));
        let sent = (0..send_sizes.len())
            .filter(|&p| p != me)
            .try_for_each(|p| self.send(p, &send[ss[p]..ss[p] + send_sizes[p]]));
        Some(sent.and_then(|()| {
            for p in 0..recv_sizes.len() {
                let dst = &mut recv[rs[p]..rs[p] + recv_sizes[p]];
                if p == me {
                    if send_sizes[me] != recv_sizes[me] {
                        return Err("self sizes differ".into());
                    }
                    dst.copy_from_slice(&send[ss[me]..ss[me] + send_sizes[me]]);
                } else {
                    self.recv(p, dst)?;
                }
            }
            Ok(())
        }))
    }
}

/// An all_to_allv of `chunk` bytes to and from every rank (`send` holds one chunk per rank).
pub fn all_to_allv_even(g: &mut dyn Group, send: &[u8], chunk: usize) -> epcomm::Result<Vec<u8>> {
    let sizes = vec![chunk; g.size()];
    let mut out = vec![0; send.len()];
    g.all_to_allv(AllToAllv {
        send,
        send_sizes: &sizes,
        recv: &mut out,
        recv_sizes: &sizes,
    })
    .map(|()| out)
}

/// A reduce_scatterv on rank `r` of `world`: every rank gives one row of two float32 per rank
/// (element i of its input is i + r) and gets back its row of the sum.
pub fn reduce_scatterv_step(g: &mut dyn Group, r: usize, world: usize) -> epcomm::Result<Vec<u8>> {
    let input: Vec<u8> = (0..2 * world)
        .flat_map(|i| ((i + r) as f32).to_ne_bytes())
        .collect();
    let mut out = vec![0; 8];
    g.reduce_scatterv(ReduceScatterv {
        input: &input,
        rows: &vec![1; world],
        row_elems: 2,
        kind: FloatKind::F32,
        output: &mut out,
    })
    .map(|()| out)
}

/// One connected transport per rank.
pub fn channel_transports(world: usize, with_all_gather: bool) -> Vec<ChannelTransport> {
    channel_transports_with(world, with_all_gather, false)
}

/// One connected transport per rank, offering the host's all_gather and all_to_allv or not.
pub fn channel_transports_with(
    world: usize,
    with_all_gather: bool,
    with_all_to_allv: bool,
) -> Vec<ChannelTransport> {
    let mut to: Vec<Vec<Sender<Vec<u8>>>> = (0..world).map(|_| Vec::new()).collect();
    let mut from: HashMap<(usize, usize), Receiver<Vec<u8>>> = HashMap::new();
    for (src, row) in to.iter_mut().enumerate() {
        for dst in 0..world {
            let (tx, rx) = channel();
            row.push(tx);
            from.insert((src, dst), rx);
        }
    }
    to.into_iter()
        .enumerate()
        .map(|(r, to)| ChannelTransport {
            rank: r,
            to,
            from: (0..world)
                .filter_map(|src| from.remove(&(src, r)))
                .collect(),
            with_all_gather,
            with_all_to_allv,
        })
        .collect()
}

/// Runs `f(rank, group)` on one thread per rank over channel transports; the results in rank
/// order. A panicking rank fails the test.
pub fn on_host_group<T: Send + 'static>(
    world: usize,
    with_all_gather: bool,
    f: impl Fn(usize, &mut HostGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    on_host_group_with(world, with_all_gather, false, f)
}

/// [`on_host_group`] whose transports offer the host's all_to_allv too, or not.
pub fn on_host_group_with<T: Send + 'static>(
    world: usize,
    with_all_gather: bool,
    with_all_to_allv: bool,
    f: impl Fn(usize, &mut HostGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    on_transports(
        channel_transports_with(world, with_all_gather, with_all_to_allv),
        f,
    )
}

/// `f(rank, group)` on one thread per rank, each over a host group "host" made from that
/// rank's transport (e.g. a channel transport wrapped by a test's lying or counting one);
/// every rank's result in rank order.
pub fn on_transports<X: HostTransport + Send + 'static, T: Send + 'static>(
    transports: Vec<X>,
    f: impl Fn(usize, &mut HostGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let world = transports.len();
    let handles: Vec<_> = transports
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let f = f.clone();
            std::thread::spawn(move || {
                let mut g = HostGroup::new(Box::new(t), "host", rank, world, false)
                    .expect("a host group over channels");
                f(rank, &mut g)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// How [`A2avLiar`]'s all_to_allv lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lie {
    None,
    /// One byte of the frame of peer 0's chunk flipped (its op number; payloads are not
    /// checksummed, docs/design.md).
    Garble,
    /// Peer 0's chunk left as epcomm handed it over.
    Unwritten,
    /// The call returns an error.
    Fails,
    /// The first 4 payload bytes of peer 0's chunk (after its 40-byte frame head) set to 0xff:
    /// in a dispatch's rows, the token of the first routing entry (the frame still checks).
    Routing,
}

/// A channel transport whose all_to_allv number `at` (counting from 0) lies as told.
pub struct A2avLiar {
    pub inner: ChannelTransport,
    pub lie: Lie,
    /// The all_to_allv call (counting from 0) that lies.
    pub at: usize,
    pub calls: usize,
}

impl HostTransport for A2avLiar {
    fn send(&mut self, peer: usize, data: &[u8]) -> Result<(), String> {
        self.inner.send(peer, data)
    }
    fn recv(&mut self, peer: usize, data: &mut [u8]) -> Result<(), String> {
        self.inner.recv(peer, data)
    }
    fn all_gather(&mut self, mine: &[u8], out: &mut [u8]) -> Option<Result<(), String>> {
        self.inner.all_gather(mine, out)
    }
    fn all_to_allv(&mut self, a: AllToAllv<'_>) -> Option<Result<(), String>> {
        let lie = if self.calls == self.at {
            self.lie
        } else {
            Lie::None
        };
        self.calls += 1;
        let (recv, recv_sizes) = (a.recv, a.recv_sizes);
        let before = recv[..recv_sizes[0]].to_vec();
        let got = self.inner.all_to_allv(AllToAllv {
            recv: &mut *recv,
            ..a
        })?;
        Some(got.and_then(|()| match lie {
            Lie::None => Ok(()),
            Lie::Garble => {
                recv[8] ^= 0x10;
                Ok(())
            }
            Lie::Unwritten => {
                recv[..recv_sizes[0]].copy_from_slice(&before);
                Ok(())
            }
            Lie::Fails => Err("connection reset by the test".into()),
            Lie::Routing => {
                recv[40..44].fill(0xff);
                Ok(())
            }
        }))
    }
}
