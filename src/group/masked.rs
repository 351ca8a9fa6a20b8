//! A group seen through a rank mask: the survivors' group ([`super::survivors::current`])
//! under the original rank numbering, for callers whose buffers keep the original ranks (the
//! fault-tolerant all2all manager: its layouts index rows by source rank). A masked rank
//! contributes and receives nothing: every per-rank list must be empty at its index (0 bytes,
//! no rows), and the collectives run over the survivors only.

use super::{
    AllToAllv, Group, Identity, Op, P2p, ReduceScatterv, RowExchange, RowReduce, SharedBuf,
};
use crate::error::{Error, Result};

/// The survivors' group under the original numbering ([`MaskedGroup::new`]).
pub struct MaskedGroup<'a> {
    inner: &'a mut dyn Group,
    rank: usize,
    /// Original rank -> survivor rank, `None` when masked.
    to_inner: Vec<Option<usize>>,
    /// Survivor rank -> original rank.
    to_outer: Vec<usize>,
}

impl std::fmt::Debug for MaskedGroup<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MaskedGroup")
            .field("name", &self.inner.name())
            .field("rank", &self.rank)
            .field("mask", &self.mask())
            .finish()
    }
}

impl<'a> MaskedGroup<'a> {
    /// `inner` is the group of the ranks not in `mask` (true = masked), renumbered in order;
    /// `rank` is this rank's original number.
    pub fn new(inner: &'a mut dyn Group, rank: usize, mask: &[bool]) -> Result<MaskedGroup<'a>> {
        let to_outer: Vec<usize> = (0..mask.len()).filter(|&r| !mask[r]).collect();
        let mut to_inner = vec![None; mask.len()];
        to_outer
            .iter()
            .enumerate()
            .for_each(|(i, &r)| to_inner[r] = Some(i));
        if inner.size() != to_outer.len()
            || to_inner.get(rank).copied().flatten() != Some(inner.rank())
        {
            return Err(Error::Internal(format!(
                "the survivors' group has rank {} of {}, but rank {rank} with {} of {} ranks masked expects rank {:?} of {}",
                inner.rank(),
                inner.size(),
                mask.len() - to_outer.len(),
                mask.len(),
                to_inner.get(rank).copied().flatten(),
                to_outer.len()
            )));
        }
        Ok(MaskedGroup {
            inner,
            rank,
            to_inner,
            to_outer,
        })
    }

    /// The mask, one entry per original rank (true = masked).
    pub fn mask(&self) -> Vec<bool> {
        self.to_inner.iter().map(Option::is_none).collect()
    }

    /// Original rank `r`'s survivor number, if it is not masked.
    pub fn inner_rank(&self, r: usize) -> Option<usize> {
        self.to_inner.get(r).copied().flatten()
    }

    /// The survivors' entries of a per-rank list; a masked rank's entry must be empty.
    fn compress<T: Clone>(
        &self,
        op: Op,
        what: &str,
        list: &[T],
        empty: impl Fn(&T) -> bool,
    ) -> Result<Vec<T>> {
        if list.len() != self.to_inner.len() {
            return Err(Error::InvalidArgument(format!(
                "{}: {what} has {} entries; expected one per rank ({})",
                op.name(),
                list.len(),
                self.to_inner.len()
            )));
        }
        if let Some(r) = (0..list.len()).find(|&r| self.to_inner[r].is_none() && !empty(&list[r])) {
            return Err(Error::InvalidArgument(format!(
                "{}: {what}[{r}] is not empty, but rank {r} of group '{}' is masked (it failed earlier); expected nothing for it",
                op.name(),
                self.inner.name()
            )));
        }
        Ok(self.to_outer.iter().map(|&r| list[r].clone()).collect())
    }

    /// The survivors' entries of a pair of per-rank lists (sizes, row lists) whose masked
    /// entries must be empty; an error is this rank's rejection of `op` ([`Self::rejecting`]).
    #[allow(clippy::type_complexity)]
    fn compress_pair<A: Clone, B: Clone>(
        &mut self,
        op: Op,
        (what_a, a, empty_a): (&str, &[A], fn(&A) -> bool),
        (what_b, b, empty_b): (&str, &[B], fn(&B) -> bool),
    ) -> Result<(Vec<A>, Vec<B>)> {
        let both = self
            .compress(op, what_a, a, empty_a)
            .and_then(|a| Ok((a, self.compress(op, what_b, b, empty_b)?)));
        self.rejecting(op, both)
    }

    /// `r`, or its error taken to the peers as this rank's rejection of `op` (they fail at
    /// once instead of waiting for it).
    fn rejecting<T>(&mut self, op: Op, r: Result<T>) -> Result<T> {
        r.map_err(|e| self.inner.reject(op, e))
    }

    /// The survivor number of a peer argument; a masked peer is an error.
    fn peer(&self, op: Op, what: &str, r: usize) -> Result<usize> {
        super::check_rank(what, op, r, self.to_inner.len())?;
        self.to_inner[r].ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{}: {what} is {r}, but rank {r} of group '{}' is masked (it failed earlier); expected a live rank",
                op.name(),
                self.inner.name()
            ))
        })
    }
}

// A wrapper: most methods forward to the survivors' group after renumbering; the one-line
// forwards are kept as they are (a forwarding macro would hide which methods renumber).
impl Group for MaskedGroup<'_> {
    /// The survivors' group's name and elasticity; this rank and size under the original
    /// numbering.
    fn identity(&self) -> Identity<'_> {
        Identity {
            rank: self.rank,
            size: self.to_inner.len(),
            ..self.inner.identity()
        }
    }
    fn barrier(&mut self) -> Result<()> {
        self.inner.barrier()
    }

    fn all_gatherv(&mut self, input: &[u8], sizes: &[usize], output: &mut [u8]) -> Result<()> {
        // Masked ranks add 0 bytes, so the output keeps the original layout.
        let sizes = self.compress(Op::AllGatherv, "sizes", sizes, |&s| s == 0);
        let sizes = self.rejecting(Op::AllGatherv, sizes)?;
        self.inner.all_gatherv(input, &sizes, output)
    }

    fn reduce_scatterv(&mut self, r: ReduceScatterv<'_>) -> Result<()> {
        let rows = self.compress(Op::ReduceScatterv, "rows", r.rows, |&s| s == 0);
        let rows = self.rejecting(Op::ReduceScatterv, rows)?;
        self.inner
            .reduce_scatterv(ReduceScatterv { rows: &rows, ..r })
    }

    fn all_to_allv(&mut self, a: AllToAllv<'_>) -> Result<()> {
        let zero = |s: &usize| *s == 0;
        let (s, r) = self.compress_pair(
            Op::AllToAllv,
            ("send_sizes", a.send_sizes, zero),
            ("recv_sizes", a.recv_sizes, zero),
        )?;
        self.inner.all_to_allv(AllToAllv {
            send_sizes: &s,
            recv_sizes: &r,
            ..a
        })
    }

    fn send_recv(&mut self, ops: &mut [P2p<'_>]) -> Result<()> {
        let peers: Result<Vec<usize>> = (ops.iter().enumerate())
            .map(|(i, op)| {
                let peer = match op {
                    P2p::Send { peer, .. } | P2p::Recv { peer, .. } => *peer,
                };
                self.peer(Op::SendRecv, &format!("ops[{i}].peer"), peer)
            })
            .collect();
        let peers = self.rejecting(Op::SendRecv, peers)?;
        let mut mapped: Vec<P2p<'_>> = (ops.iter_mut().zip(peers))
            .map(|(op, peer)| match op {
                P2p::Send { data, .. } => P2p::Send { peer, data },
                P2p::Recv { data, .. } => P2p::Recv { peer, data },
            })
            .collect();
        self.inner.send_recv(&mut mapped)
    }

    fn broadcast(&mut self, root: usize, data: &mut [u8]) -> Result<()> {
        let root = self.peer(Op::Broadcast, "root", root);
        let root = self.rejecting(Op::Broadcast, root)?;
        self.inner.broadcast(root, data)
    }

    fn reject(&mut self, op: Op, e: Error) -> Error {
        self.inner.reject(op, e)
    }

    fn open_call(&mut self) {
        self.inner.open_call()
    }

    fn close_call(&mut self, outcome: Result<()>) -> Result<()> {
        self.inner.close_call(outcome)
    }

    fn alloc_shared(&mut self, len: usize) -> Result<Option<SharedBuf>> {
        self.inner.alloc_shared(len)
    }

    fn owns_shared(&self, buf: &SharedBuf) -> bool {
        self.inner.owns_shared(buf)
    }

    /// The survivors' objects in their original places; a masked rank's bytes are zero.
    fn all_gather(&mut self, mine: &[u8], out: &mut [u8]) -> Result<()> {
        let n = mine.len();
        super::check_len(
            "output",
            Op::AllGatherv,
            out.len(),
            n * self.size(),
            "one object per rank",
        )?;
        let mut live = vec![0u8; n * self.to_outer.len()];
        self.inner.all_gather(mine, &mut live)?;
        out.fill(0);
        for (chunk, &r) in live.chunks_exact(n.max(1)).zip(&self.to_outer) {
            out[r * n..(r + 1) * n].copy_from_slice(chunk);
        }
        Ok(())
    }

    fn exchange_rows(&mut self, r: RowExchange<'_>) -> Result<()> {
        let (give, take) = self.compress_pair(
            Op::ExchangeRows,
            ("give", r.give, Vec::is_empty),
            ("take", r.take, Vec::is_empty),
        )?;
        let (give, take) = (&give, &take);
        self.inner.exchange_rows(RowExchange { give, take, ..r })
    }

    fn reduce_rows(&mut self, r: RowReduce<'_>) -> Result<()> {
        let (give, take) = self.compress_pair(
            Op::ReduceRows,
            ("give", r.give, Vec::is_empty),
            ("take", r.take, Vec::is_empty),
        )?;
        let (give, take) = (&give, &take);
        self.inner.reduce_rows(RowReduce { give, take, ..r })
    }

    /// The inner group's lost ranks, renumbered: `to_outer` is increasing, so they stay sorted.
    fn lost_ranks(&self) -> Vec<usize> {
        (self.inner.lost_ranks().into_iter())
            .filter_map(|i| self.to_outer.get(i).copied())
            .collect()
    }
}
