//! A group driven by the host's own transport (torch.distributed, MPI, ...): the host supplies
//! blocking point-to-point send/recv (and optionally all_gather and barrier), and epcomm builds
//! every primitive from them.
//!
//! Pairwise exchanges follow a round-robin tournament: in each round every rank has at most one
//! partner, and the lower rank of a pair sends first while the higher one receives first. That
//! is deadlock-free even when the host's send blocks until the matching receive is posted.

use super::{check_len, check_p2p, check_rank, check_reduce_scatterv, check_sizes, Group, Op, P2p};
use crate::error::{Error, Result};
use crate::num::{self, FloatKind};

/// What a host transport provides. Calls are blocking; an `Err` carries the host's reason.
pub trait HostTransport: Send {
    /// Sends `data` to `peer` (returns once the buffer may be reused).
    fn send(&mut self, peer: usize, data: &[u8]) -> std::result::Result<(), String>;
    /// Receives exactly `data.len()` bytes from `peer`.
    fn recv(&mut self, peer: usize, data: &mut [u8]) -> std::result::Result<(), String>;
    /// Gathers `mine` from every rank into `out` (rank order). `None` = not provided.
    fn all_gather(
        &mut self,
        _mine: &[u8],
        _out: &mut [u8],
    ) -> Option<std::result::Result<(), String>> {
        None
    }
    /// A barrier. `None` = not provided.
    fn barrier(&mut self) -> Option<std::result::Result<(), String>> {
        None
    }
}

/// A group over a host transport.
pub struct HostGroup {
    transport: Box<dyn HostTransport>,
    name: String,
    rank: usize,
    world: usize,
    elastic: bool,
    broken: Option<String>,
}

impl std::fmt::Debug for HostGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostGroup")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

/// The partner of `rank` in round `round` of a round-robin tournament over `world` ranks, or
/// `None` when it sits the round out (odd world sizes).
pub fn tournament_partner(rank: usize, world: usize, round: usize) -> Option<usize> {
    let m = world + world % 2; // even number of players (one dummy when odd)
    let k = m - 1;
    let partner = if rank == m - 1 {
        (0..k).find(|&i| (2 * i) % k == round % k)?
    } else {
        let j = (round + k - rank % k) % k;
        if j == rank {
            m - 1
        } else {
            j
        }
    };
    (partner < world).then_some(partner)
}

impl HostGroup {
    pub fn new(
        transport: Box<dyn HostTransport>,
        name: &str,
        rank: usize,
        world: usize,
        elastic: bool,
    ) -> Result<HostGroup> {
        if world == 0 {
            return Err(Error::InvalidArgument(
                "world_size is 0; expected at least 1".into(),
            ));
        }
        if rank >= world {
            return Err(Error::InvalidArgument(format!(
                "rank is {rank}; expected 0 <= rank < world_size ({world})"
            )));
        }
        crate::log::set_thread_rank(Some(rank));
        Ok(HostGroup {
            transport,
            name: name.to_owned(),
            rank,
            world,
            elastic,
            broken: None,
        })
    }

    fn host_err(&self, op: Op, what: &str, why: String) -> Error {
        Error::Runtime(format!(
            "host transport {what} failed during {} of group '{}' on rank {}: {why}",
            op.name(),
            self.name,
            self.rank
        ))
    }

    fn send(&mut self, op: Op, peer: usize, data: &[u8]) -> Result<()> {
        self.transport
            .send(peer, data)
            .map_err(|e| self.host_err(op, &format!("send to rank {peer}"), e))
    }

    fn recv(&mut self, op: Op, peer: usize, data: &mut [u8]) -> Result<()> {
        self.transport
            .recv(peer, data)
            .map_err(|e| self.host_err(op, &format!("recv from rank {peer}"), e))
    }

    /// Sends `out` to and receives `inp` from `peer`, lower rank first.
    fn exchange(&mut self, op: Op, peer: usize, out: &[u8], inp: &mut [u8]) -> Result<()> {
        if self.rank < peer {
            self.send(op, peer, out)?;
            self.recv(op, peer, inp)
        } else {
            self.recv(op, peer, inp)?;
            self.send(op, peer, out)
        }
    }

    /// Sends, in issue order, every message of `ops` addressed to `p`.
    fn send_all_to(&mut self, ops: &[P2p<'_>], p: usize) -> Result<()> {
        for o in ops {
            if let P2p::Send { peer, data } = o {
                if *peer == p {
                    self.send(Op::SendRecv, p, data)?;
                }
            }
        }
        Ok(())
    }

    /// Runs `f(partner)` for each round of the tournament.
    fn rounds(&mut self, mut f: impl FnMut(&mut Self, usize) -> Result<()>) -> Result<()> {
        let rounds = self.world + self.world % 2 - 1;
        for round in 0..rounds {
            if let Some(p) = tournament_partner(self.rank, self.world, round) {
                f(self, p)?;
            }
        }
        Ok(())
    }

    fn guarded<T>(&mut self, op: Op, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if let Some(why) = &self.broken {
            return Err(Error::InvalidState(format!(
                "{}: group '{}' is unusable after an earlier failure ({why}); destroy it and create a new one",
                op.name(),
                self.name
            )));
        }
        f(self).inspect_err(|e| {
            if !matches!(e, Error::InvalidArgument(_)) {
                self.broken = Some(e.to_string());
            }
        })
    }
}

fn u64s(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_ne_bytes()).collect()
}

fn from_u64s(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

impl Group for HostGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.world
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn elastic(&self) -> bool {
        self.elastic
    }

    fn barrier(&mut self) -> Result<()> {
        self.guarded(Op::Barrier, |g| match g.transport.barrier() {
            Some(r) => r.map_err(|e| g.host_err(Op::Barrier, "barrier", e)),
            None => {
                let mut out = vec![0u8; g.world];
                g.all_gather(&[1], &mut out)
            }
        })
    }

    fn all_gatherv(&mut self, input: &[u8], sizes: &[usize], output: &mut [u8]) -> Result<()> {
        let op = Op::AllGatherv;
        let total = check_sizes("sizes", op, sizes, self.world)?;
        let me = self.rank;
        check_len("input", op, input.len(), sizes[me], &format!("sizes[{me}]"))?;
        check_len("output", op, output.len(), total, "sum(sizes)")?;
        let offsets: Vec<usize> = sizes
            .iter()
            .scan(0, |acc, &s| {
                let o = *acc;
                *acc += s;
                Some(o)
            })
            .collect();
        output[offsets[me]..offsets[me] + sizes[me]].copy_from_slice(input);
        self.guarded(op, |g| {
            g.rounds(|g, p| {
                let dst = &mut output[offsets[p]..offsets[p] + sizes[p]];
                g.exchange(op, p, input, dst)
            })
        })
    }

    fn reduce_scatterv(
        &mut self,
        input: &[u8],
        rows: &[usize],
        row_elems: usize,
        kind: FloatKind,
        output: &mut [u8],
    ) -> Result<()> {
        let me = self.rank;
        let (row_bytes, _) = check_reduce_scatterv(
            me,
            self.world,
            input.len(),
            rows,
            row_elems,
            kind,
            output.len(),
        )?;
        let slice = |r: usize| {
            let start: usize = rows[..r].iter().sum::<usize>() * row_bytes;
            start..start + rows[r] * row_bytes
        };
        // Every rank's contribution to this rank's slice, then a sum in rank order.
        let mut parts = vec![Vec::new(); self.world];
        self.guarded(Op::ReduceScatterv, |g| {
            g.rounds(|g, p| {
                let mut theirs = vec![0u8; rows[me] * row_bytes];
                g.exchange(Op::ReduceScatterv, p, &input[slice(p)], &mut theirs)?;
                parts[p] = theirs;
                Ok(())
            })
        })?;
        parts[me] = input[slice(me)].to_vec();
        let mut acc = vec![0f32; rows[me] * row_elems];
        for part in &parts {
            num::accumulate(&mut acc, part, kind);
        }
        num::store(&acc, output, kind);
        Ok(())
    }

    fn all_to_allv(
        &mut self,
        send: &[u8],
        send_sizes: &[usize],
        recv: &mut [u8],
        recv_sizes: &[usize],
    ) -> Result<()> {
        let op = Op::AllToAllv;
        let st = check_sizes("send_sizes", op, send_sizes, self.world)?;
        let rt = check_sizes("recv_sizes", op, recv_sizes, self.world)?;
        check_len("send", op, send.len(), st, "sum(send_sizes)")?;
        check_len("recv", op, recv.len(), rt, "sum(recv_sizes)")?;
        let off = |sizes: &[usize], r: usize| -> std::ops::Range<usize> {
            let s: usize = sizes[..r].iter().sum();
            s..s + sizes[r]
        };
        let me = self.rank;
        if send_sizes[me] != recv_sizes[me] {
            return Err(Error::InvalidArgument(format!(
                "all_to_allv: rank {me} sends {} bytes to itself but expects {}",
                send_sizes[me], recv_sizes[me]
            )));
        }
        recv[off(recv_sizes, me)].copy_from_slice(&send[off(send_sizes, me)]);
        self.guarded(op, |g| {
            g.rounds(|g, p| {
                // Sizes first, so a disagreement is an error and never a hang or corruption.
                let mut theirs = [0u8; 8];
                g.exchange(op, p, &(send_sizes[p] as u64).to_ne_bytes(), &mut theirs)?;
                let theirs = u64::from_ne_bytes(theirs) as usize;
                if theirs != recv_sizes[p] {
                    return Err(Error::InvalidArgument(format!(
                        "all_to_allv: rank {p} sends {theirs} bytes to rank {me} but recv_sizes[{p}] on rank {me} is {}",
                        recv_sizes[p]
                    )));
                }
                g.exchange(op, p, &send[off(send_sizes, p)], &mut recv[off(recv_sizes, p)])
            })
        })
    }

    fn send_recv(&mut self, ops: &mut [P2p<'_>]) -> Result<()> {
        let op = Op::SendRecv;
        check_p2p(ops, self.rank, self.world)?;
        let me = self.rank;
        // Self-sends pair with self-receives in order.
        let self_sends: Vec<Vec<u8>> = ops
            .iter()
            .filter_map(|o| match o {
                P2p::Send { peer, data } if *peer == me => Some(data.to_vec()),
                _ => None,
            })
            .collect();
        let mut k = 0;
        for o in ops.iter_mut() {
            if let P2p::Recv { peer, data } = o {
                if *peer == me {
                    let src = self_sends.get(k).ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "send_recv: rank {me} posted receive #{k} from itself but only {} send(s) to itself",
                            self_sends.len()
                        ))
                    })?;
                    if src.len() != data.len() {
                        return Err(Error::InvalidArgument(format!(
                            "send_recv: receive #{k} on rank {me} from rank {me} has {} bytes but the matching send has {} bytes",
                            data.len(),
                            src.len()
                        )));
                    }
                    data.copy_from_slice(src);
                    k += 1;
                }
            }
        }
        self.guarded(op, |g| {
            g.rounds(|g, p| {
                // Exchange the list of message sizes, then the messages, lower rank first.
                let out_sizes: Vec<u64> = ops
                    .iter()
                    .filter_map(|o| match o {
                        P2p::Send { peer, data } if *peer == p => Some(data.len() as u64),
                        _ => None,
                    })
                    .collect();
                let in_sizes: Vec<u64> = ops
                    .iter()
                    .filter_map(|o| match o {
                        P2p::Recv { peer, data } if *peer == p => Some(data.len() as u64),
                        _ => None,
                    })
                    .collect();
                let mut theirs_n = [0u8; 8];
                g.exchange(op, p, &(out_sizes.len() as u64).to_ne_bytes(), &mut theirs_n)?;
                let theirs_n = u64::from_ne_bytes(theirs_n) as usize;
                let mut theirs = vec![0u8; theirs_n * 8];
                g.exchange(op, p, &u64s(&out_sizes), &mut theirs)?;
                let theirs = from_u64s(&theirs);
                if theirs != in_sizes {
                    return Err(Error::InvalidArgument(format!(
                        "send_recv: rank {p} sends messages of {theirs:?} bytes to rank {me}, but rank {me} posted receives of {in_sizes:?} bytes"
                    )));
                }
                if me < p {
                    g.send_all_to(ops, p)?;
                }
                for o in ops.iter_mut() {
                    if let P2p::Recv { peer, data } = o {
                        if *peer == p {
                            g.recv(op, p, data)?;
                        }
                    }
                }
                if me > p {
                    g.send_all_to(ops, p)?;
                }
                Ok(())
            })
        })
    }

    fn broadcast(&mut self, root: usize, data: &mut [u8]) -> Result<()> {
        let op = Op::Broadcast;
        check_rank("root", op, root, self.world)?;
        let me = self.rank;
        self.guarded(op, |g| {
            if me == root {
                for p in (0..g.world).filter(|&p| p != root) {
                    g.send(op, p, data)?;
                }
                Ok(())
            } else {
                g.recv(op, root, data)
            }
        })
    }

    fn all_gather(&mut self, mine: &[u8], out: &mut [u8]) -> Result<()> {
        let op = Op::AllGatherv;
        check_len(
            "out",
            op,
            out.len(),
            mine.len() * self.world,
            "world_size * len(mine)",
        )?;
        let provided = self.guarded(op, |g| {
            g.transport
                .all_gather(mine, out)
                .map(|r| r.map_err(|e| g.host_err(op, "all_gather", e)))
                .transpose()
        })?;
        match provided {
            Some(()) => Ok(()),
            None => {
                let sizes = vec![mine.len(); self.world];
                self.all_gatherv(mine, &sizes, out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::tournament_partner;

    #[test]
    fn tournament_is_a_perfect_schedule() {
        for world in 1..=9 {
            let rounds = world + world % 2 - 1;
            let mut met = vec![vec![0; world]; world];
            for round in 0..rounds {
                for (r, row) in met.iter_mut().enumerate() {
                    if let Some(p) = tournament_partner(r, world, round) {
                        assert_ne!(p, r);
                        assert_eq!(tournament_partner(p, world, round), Some(r));
                        row[p] += 1;
                    }
                }
            }
            for (r, row) in met.iter().enumerate() {
                for (p, &n) in row.iter().enumerate() {
                    assert_eq!(
                        n,
                        usize::from(r != p),
                        "world {world}: {r} met {p} {n} times"
                    );
                }
            }
        }
    }
}
