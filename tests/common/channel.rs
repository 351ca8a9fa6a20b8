//! A host transport over in-process channels, what a runtime's own send/recv would be, and a
//! runner that drives one `HostGroup` per thread. Included by path (`#[path]`) so a test binary
//! that needs only this does not pull in the rest of `common`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::Duration;

use epcomm::group::host::{HostGroup, HostTransport};

/// How long a receive waits before it is an error (a test bug, not a library hang).
pub const RECV_TIMEOUT: Duration = Duration::from_secs(30);

pub struct ChannelTransport {
    pub rank: usize,
    /// A sender to every rank and a receiver from every rank (by rank).
    pub to: Vec<Sender<Vec<u8>>>,
    pub from: Vec<Receiver<Vec<u8>>>,
    /// Offer the host's own all_gather (built here from the channels) as well.
    pub with_all_gather: bool,
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
}

/// One connected transport per rank.
pub fn channel_transports(world: usize, with_all_gather: bool) -> Vec<ChannelTransport> {
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
    let handles: Vec<_> = channel_transports(world, with_all_gather)
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
