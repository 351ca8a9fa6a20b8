//! The collectives: the [`Group`] trait over the protocol.

use super::payload::{exchange_streams, reduce_into, Payload};
use super::window::window_view;
use super::{SharedBuf, ShmGroup};
use crate::error::{Error, Result};
use crate::group::agree;
use crate::group::rows;
use crate::group::{
    check_len, check_p2p, check_sizes, AllToAllv, Group, Identity, Op, P2p, ReduceScatterv,
    RowExchange, RowReduce,
};

impl Group for ShmGroup {
    fn survivors_slot(&mut self) -> Option<&mut Option<crate::group::survivors::Survivors>> {
        Some(&mut self.survivors)
    }

    // Each transport reads its own fields (the protocol code uses them directly).
    fn identity(&self) -> Identity<'_> {
        Identity {
            rank: self.rank,
            size: self.world,
            name: &self.name,
            elastic: self.opts.elastic,
        }
    }

    fn barrier(&mut self) -> Result<()> {
        self.run_agreed(Op::Barrier, Ok(()), &[], &[], &[], |_| Ok(()))
    }

    fn reject(&mut self, op: Op, e: Error) -> Error {
        self.reject_op(op, e)
    }

    fn all_gatherv(&mut self, input: &[u8], sizes: &[usize], output: &mut [u8]) -> Result<()> {
        let op = Op::AllGatherv;
        self.check_usable(op)?;
        let me = self.rank;
        let (local, params) =
            agree::all_gatherv_args(me, self.world, input.len(), sizes, output.len());
        self.run_agreed(op, local, &params, &[], &[input], |g| {
            let mut off = 0;
            for (p, &len) in sizes.iter().enumerate() {
                let dst = &mut output[off..off + len];
                if p == me {
                    dst.copy_from_slice(input);
                } else {
                    let (_, data) = g.parts(p)?;
                    if data.len() != len {
                        return Err(Error::InvalidArgument(format!(
                            "all_gatherv: rank {p} contributed {} bytes but sizes[{p}] on rank {me} is {len} (ranks disagree on sizes)",
                            data.len()
                        )));
                    }
                    data.copy_to(0, dst)?;
                }
                off += len;
            }
            Ok(())
        })
    }

    fn reduce_scatterv(&mut self, r: ReduceScatterv<'_>) -> Result<()> {
        let op = Op::ReduceScatterv;
        self.check_usable(op)?;
        let me = self.rank;
        let (local, params) = agree::reduce_scatterv_args(me, self.world, &r);
        let (input, kind, output) = (r.input, r.kind, r.output);
        let (row_bytes, first_row) = *local.as_ref().unwrap_or(&(0, 0));
        self.run_agreed(op, local.map(drop), &params, &[], &[input], |g| {
            let mut sources: Vec<Payload<'_>> = Vec::with_capacity(g.world);
            for p in 0..g.world {
                if p == me {
                    sources.push(Payload::Region(input));
                } else {
                    let (_, data) = g.parts(p)?;
                    if data.len() != input.len() {
                        return Err(Error::InvalidArgument(format!(
                            "reduce_scatterv: rank {p} contributed {} bytes but rank {me} expects {} (ranks disagree on rows or row size)",
                            data.len(),
                            input.len()
                        )));
                    }
                    sources.push(data);
                }
            }
            let start = first_row * row_bytes;
            reduce_into(&sources, start, kind, output)
        })
    }

    fn all_to_allv(&mut self, a: AllToAllv<'_>) -> Result<()> {
        let (send, send_sizes, recv, recv_sizes) = (a.send, a.send_sizes, a.recv, a.recv_sizes);
        let op = Op::AllToAllv;
        self.check_usable(op)?;
        let local = (|| {
            let send_total = check_sizes("send_sizes", op, send_sizes, self.world)?;
            let recv_total = check_sizes("recv_sizes", op, recv_sizes, self.world)?;
            check_len("send", op, send.len(), send_total, "sum(send_sizes)")?;
            check_len("recv", op, recv.len(), recv_total, "sum(recv_sizes)")
        })();
        let me = self.rank;
        let world = self.world;
        let meta: Vec<u64> = send_sizes
            .iter()
            .chain(recv_sizes)
            .map(|&s| s as u64)
            .collect();
        let check = |g: &Self| {
            let sizes: Vec<Vec<u64>> = (0..world)
                .map(|p| g.parts(p).map(|(m, _)| m))
                .collect::<Result<_>>()?;
            let sent = |r: usize, p: usize| sizes[r][p];
            let expected = |p: usize, r: usize| sizes[p][world + r];
            agree::check_size_matrix(world, &sent, &expected)
        };
        self.run_checked(op, local, &[], &meta, &[send], check, |g| {
            let mut off = 0;
            for (p, &len) in recv_sizes.iter().enumerate() {
                let dst = &mut recv[off..off + len];
                off += len;
                let (their_sizes, data) = g.parts(p)?;
                let start: usize = their_sizes[..me].iter().map(|&s| s as usize).sum();
                data.copy_to(start, dst)?;
            }
            Ok(())
        })
    }

    fn send_recv(&mut self, ops: &mut [P2p<'_>]) -> Result<()> {
        let op = Op::SendRecv;
        self.check_usable(op)?;
        let (me, world) = (self.rank, self.world);
        let local = check_p2p(ops, me, world);
        let meta = agree::p2p_words(ops);
        // The sends (payload, issue order) and the receive buffers, borrowed apart.
        let mut sends: Vec<&[u8]> = Vec::new();
        let mut recvs: Vec<(usize, &mut [u8])> = Vec::new();
        for o in ops.iter_mut() {
            match o {
                P2p::Send { data, .. } => sends.push(data),
                P2p::Recv { peer, data } => recvs.push((*peer, &mut **data)),
            }
        }
        let check = |g: &Self| {
            let lists: Vec<Vec<u64>> = (0..world)
                .map(|p| g.parts(p).map(|(m, _)| m))
                .collect::<Result<_>>()?;
            agree::check_messages(&lists)
        };
        self.run_checked(op, local, &[], &meta, &sends, check, |g| {
            // Each source's published op is read once: its payload and, in order, the offsets
            // of its sends to this rank.
            let mut from: Vec<Option<(Payload<'_>, std::vec::IntoIter<usize>)>> =
                (0..world).map(|_| None).collect();
            for (p, data) in recvs {
                let (payload, offsets) = match &mut from[p] {
                    Some(source) => source,
                    slot => {
                        let (meta, payload) = g.parts(p)?;
                        slot.insert((payload, sends_to(&meta, me).into_iter()))
                    }
                };
                let off = offsets.next().ok_or_else(|| {
                    Error::Internal(format!(
                        "send_recv: a send of rank {p} to rank {me} vanished after the check"
                    ))
                })?;
                payload.copy_to(off, data)?;
            }
            Ok(())
        })
    }

    fn exchange_rows(&mut self, r: RowExchange<'_>) -> Result<()> {
        let op = Op::ExchangeRows;
        self.check_usable(op)?;
        if !self.direct {
            return rows::exchange_packed(self, r);
        }
        if let Err(e) = rows::check_exchange(self.world, &r) {
            return Err(self.reject_op(op, e));
        }
        let (src, row_bytes, give, dst, take) = (r.src, r.row_bytes, r.give, r.dst, r.take);
        let (mut meta, index_bytes) = rows::index_table(src.len(), row_bytes, give);
        // A destination in a window is written by its sources; others pull from each source.
        let window = self.offer_dst(dst, row_bytes, take);
        let into_window = window.is_some();
        meta.extend(window.unwrap_or_default());
        let params = [agree::number("row_bytes", row_bytes)];
        let me = self.rank;
        let check = |g: &Self| g.check_windows(row_bytes);
        self.run_checked(
            op,
            Ok(()),
            &params,
            &meta,
            &[src, &index_bytes],
            check,
            |g| {
                g.push_rows(src, row_bytes, give)?;
                if into_window {
                    // This rank's own rows: a plain copy (the counts were checked alike), with
                    // streaming stores when the call stores many rows, as the sources'.
                    let streaming = exchange_streams(give, row_bytes);
                    rows::copy_own_rows(src, row_bytes, &give[me], &take[me], dst, streaming);
                    return Ok(());
                }
                for (p, take_p) in take.iter().enumerate() {
                    let (payload, src_idx) = g.rows_from(op, p, row_bytes, take_p.len())?;
                    let ranges: Vec<(usize, usize, usize)> = src_idx
                        .iter()
                        .zip(take_p)
                        .map(|(&s, &d)| (s as usize * row_bytes, d as usize * row_bytes, row_bytes))
                        .collect();
                    payload.copy_scattered(dst, &ranges)?;
                }
                Ok(())
            },
        )
    }

    fn reduce_rows(&mut self, r: RowReduce<'_>) -> Result<()> {
        let op = Op::ReduceRows;
        self.check_usable(op)?;
        if !self.direct {
            return rows::reduce_packed(self, r);
        }
        let out_rows = match rows::check_reduce(self.world, &r) {
            Ok(n) => n,
            Err(e) => return Err(self.reject_op(op, e)),
        };
        let RowReduce {
            src,
            kind,
            row_elems,
            give,
            out,
            out_kind,
            take,
        } = r;
        let row_bytes = row_elems * kind.size();
        let me = self.rank;
        // A source in a window is read by its destinations with plain loads.
        let (mut meta, index_bytes) = rows::index_table(src.len(), row_bytes, give);
        meta.extend(self.offer_src(src, give).unwrap_or_default());
        let params = [
            agree::dtype("row dtype", kind),
            agree::number("row_elems", row_elems),
            agree::dtype("output dtype", out_kind),
        ];
        self.run_agreed(op, Ok(()), &params, &meta, &[src, &index_bytes], |g| {
            let sources = g.reduce_sources(op, row_bytes, give, take)?;
            let cache = g.peer_windows.borrow(); // own rows and peers' windows: in place
            let in_place: Vec<Option<(&[u8], &[u32])>> = sources
                .iter()
                .enumerate()
                .map(|(p, s)| match s {
                    Source::Own => Some((src, give[me].as_slice())),
                    Source::Window((w, idx)) => {
                        window_view(&cache, p, w).map(|v| (v, idx.as_slice()))
                    }
                    Source::Payload(_) => None,
                })
                .collect();
            let by_row = rows::ByRow::new(take, out_rows);
            let mut ranges = Vec::new();
            rows::reduce_blocked(
                kind,
                row_elems,
                &by_row,
                out,
                out_kind,
                &in_place,
                |peer: usize, positions: &[u32], scratch: &mut [u8]| match &sources[peer] {
                    Source::Own => Err(Error::Internal(
                        "reduce_rows: this rank's own rows are read in place".into(),
                    )),
                    Source::Window((w, idx)) => g.with_window(peer, w, |seg| {
                        for (i, &pos) in positions.iter().enumerate() {
                            let at = w.off + idx[pos as usize] as usize * row_bytes;
                            seg.read(at, &mut scratch[i * row_bytes..(i + 1) * row_bytes]);
                        }
                        Ok(())
                    }),
                    Source::Payload((payload, idx)) => {
                        ranges.clear();
                        ranges.extend(positions.iter().enumerate().map(|(i, &pos)| {
                            (
                                idx[pos as usize] as usize * row_bytes,
                                i * row_bytes,
                                row_bytes,
                            )
                        }));
                        payload.copy_scattered(scratch, &ranges)
                    }
                },
            )
        })
    }

    fn alloc_shared(&mut self, len: usize) -> Result<Option<SharedBuf>> {
        // Windows serve the direct-mode row paths; the region mode stages everything.
        if !self.direct {
            return Ok(None);
        }
        self.alloc_window(len).map(Some)
    }

    fn owns_shared(&self, buf: &SharedBuf) -> bool {
        self.owns_window(buf)
    }

    fn lost_ranks(&self) -> Vec<usize> {
        self.lost()
    }

    fn shrink(&mut self, excluded: &[usize]) -> Result<Box<dyn Group>> {
        Ok(Box::new(self.shrunk(excluded)?))
    }

    fn shrink_lost(&mut self) -> Result<Option<crate::group::Shrunk>> {
        Ok(self
            .survivors()?
            .map(|(out, g)| (out, Box::new(g) as Box<dyn Group>)))
    }

    fn broadcast(&mut self, root: usize, data: &mut [u8]) -> Result<()> {
        let op = Op::Broadcast;
        self.check_usable(op)?;
        let (local, params) = agree::broadcast_args(self.world, root, data.len());
        let me = self.rank;
        let mine: Vec<u8> = if me == root {
            data.to_vec()
        } else {
            Vec::new()
        };
        self.run_agreed(op, local, &params, &[root as u64], &[&mine], |g| {
            if me == root {
                return Ok(());
            }
            let (_, payload) = g.parts(root)?;
            if payload.len() != data.len() {
                return Err(Error::InvalidArgument(format!(
                    "broadcast: root {root} sent {} bytes but rank {me} expects {}",
                    payload.len(),
                    data.len()
                )));
            }
            payload.copy_to(0, data)
        })
    }
}

/// The payload offsets of the sends to `dst`, in issue order, in a rank's
/// [`agree::p2p_words`] `meta` (checked by `check_meta`: the lengths sum to the payload).
fn sends_to(meta: &[u64], dst: usize) -> Vec<usize> {
    let n = meta.first().map_or(0, |&n| n as usize);
    let sends = meta.get(2..2 + 2 * n).unwrap_or(&[]);
    let mut off = 0usize;
    let mut out = Vec::new();
    for pair in sends.chunks_exact(2) {
        if pair[0] as usize == dst {
            out.push(off);
        }
        off = off.saturating_add(pair[1] as usize);
    }
    out
}

impl ShmGroup {
    /// Where this rank reads each peer's rows of a reduce_rows: in place (its own; a peer's
    /// window) or from the peer's published payload; the row counts checked.
    fn reduce_sources(
        &self,
        op: Op,
        row_bytes: usize,
        give: &[Vec<u32>],
        take: &[Vec<(u32, f32)>],
    ) -> Result<Vec<Source<'_>>> {
        let me = self.rank;
        let mut sources = Vec::with_capacity(self.world);
        for (p, take_p) in take.iter().enumerate() {
            sources.push(if p == me {
                if give[me].len() != take_p.len() {
                    return Err(Error::InvalidArgument(format!(
                        "reduce_rows: rank {me} gives {} rows to rank {me} but rank {me} expects {}",
                        give[me].len(),
                        take_p.len()
                    )));
                }
                Source::Own
            } else if let Some(w) = self.source_window(p, row_bytes, take_p.len())? {
                Source::Window(w)
            } else {
                Source::Payload(self.rows_from(op, p, row_bytes, take_p.len())?)
            });
        }
        Ok(sources)
    }
}

/// Where a reduce_rows destination reads one peer's rows.
enum Source<'a> {
    /// This rank's own source.
    Own,
    /// The peer's window, and the rows of it this rank gets.
    Window((super::window::WinMeta, Vec<u32>)),
    /// The peer's published payload (direct reads), and the rows of it this rank gets.
    Payload((Payload<'a>, Vec<u32>)),
}
