//! Payload movement: reading a rank's published op (metadata words and payload, every word
//! checked), copying from a region or straight from a peer's memory (direct mode), and
//! summing sources.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::layout::{align64, OpHead, OP_HEADER_BYTES};
use super::segment::{copy_from_process, copy_scattered_from_process, Segment};
use super::ShmGroup;
// Where ops.rs looks for it; it is the windows' rule (window.rs).
pub(super) use super::window::exchange_streams;
use crate::bytes;
use crate::error::{Error, Result};
use crate::group::{rows, Op};
use crate::num::{self, FloatKind};

impl ShmGroup {
    /// Records the buffers of op `n` (direct mode) where thread ranks of this process read them.
    pub(super) fn note_table(&self, n: u64, payload: &[&[u8]]) {
        let mut t = self.tables[self.rank]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        t.0 = n;
        t.1.clear();
        t.1.extend(payload.iter().map(|b| (b.as_ptr() as u64, b.len())));
    }

    /// The buffers thread rank `p` of this process recorded for op `n`.
    fn local_table(&self, p: usize, n: u64) -> Option<Vec<(u64, usize)>> {
        let t = self.tables[p].lock().unwrap_or_else(|e| e.into_inner());
        (t.0 == n).then(|| t.1.clone())
    }

    /// Rank p's published metadata words and payload for the current op (p may be this rank).
    /// Every word read from the segment is checked against the segment's size and against what
    /// a rank may publish for this op, so a segment another process altered is an error naming
    /// the rank, never an allocation of its choosing, a panic or a fault.
    pub(super) fn parts(&self, p: usize) -> Result<(Vec<u64>, Payload<'_>)> {
        let seg = self.published_segment(p)?;
        let bad = |what: String| {
            Error::PeerFailure(format!(
                "the shared-memory region of rank {p} of group '{}' (memfd {}) holds an invalid op header: {what}; another process may have written to it (seen from rank {})",
                self.name,
                seg.name().trim_start_matches('/'),
                self.rank
            ))
        };
        let mut raw = [0u8; OpHead::BYTES];
        seg.read(0, &mut raw);
        let head = OpHead::decode(&raw);
        self.check_head(p, seg.len(), &head).map_err(bad)?;
        let meta_len = head.meta_len as usize;
        let mut meta_bytes = vec![0u8; meta_len * 8];
        seg.read(OP_HEADER_BYTES, &mut meta_bytes);
        let meta: Vec<u64> = bytes::to_vec(&meta_bytes);
        let payload_off = align64(OP_HEADER_BYTES + meta_len * 8);
        let payload_len = usize::try_from(head.payload_len).unwrap_or(usize::MAX);
        let payload = if self.direct {
            self.direct_payload(p, seg, &head, payload_off, payload_len)
        } else {
            region_payload(seg, payload_off, payload_len)
        }
        .map_err(bad)?;
        check_meta(Op::from_code(head.kind), &meta, payload_len, self.world).map_err(bad)?;
        Ok((meta, payload))
    }

    /// Rank `p`'s payload and the `count` source rows (of `row_bytes`) it gives this rank, as
    /// published with [`rows::index_table`] for `op`.
    pub(super) fn rows_from(
        &self,
        op: Op,
        p: usize,
        row_bytes: usize,
        count: usize,
    ) -> Result<(Payload<'_>, Vec<u32>)> {
        let (meta, payload) = self.parts(p)?;
        let idx = rows::read_index_list(op, &meta, p, self.rank, row_bytes, count, |o, b| {
            payload.copy_to(o, b)
        })?;
        Ok((payload, idx))
    }

    /// The segment rank `p` published the current op in.
    fn published_segment(&self, p: usize) -> Result<&Segment> {
        if p == self.rank {
            return Ok(&self.data);
        }
        match self.peers[p].as_ref() {
            Some((_, seg)) => Ok(seg),
            None => Err(Error::Internal(format!(
                "the region of rank {p} of group '{}' is not mapped on rank {}",
                self.name, self.rank
            ))),
        }
    }

    /// Checks rank `p`'s op header against its slot, this rank's op and mode, and the size of
    /// its segment (`seg_len` bytes).
    fn check_head(
        &self,
        p: usize,
        seg_len: usize,
        head: &OpHead,
    ) -> std::result::Result<(), String> {
        let (kind, n, direct, meta_len) = (head.kind, head.n, head.direct, head.meta_len);
        let expected = self.slot(p).op_kind.load(Ordering::Acquire);
        if kind != expected {
            return Err(format!(
                "operation code {kind}, but the rank's slot says {expected}"
            ));
        }
        // The op this rank published last is the one being read.
        let current = self.slot(self.rank).published.load(Ordering::Acquire);
        if n != current {
            return Err(format!("op #{n}, expected op #{current}"));
        }
        if direct != u32::from(self.direct) {
            return Err(format!(
                "mode word {direct}, expected {}",
                u32::from(self.direct)
            ));
        }
        let room = seg_len - OP_HEADER_BYTES;
        if meta_len > (room / 8) as u64 {
            return Err(format!(
                "{meta_len} metadata words, more than the {seg_len} bytes of the region hold"
            ));
        }
        Ok(())
    }

    /// Rank `p`'s payload in direct mode: the table of its buffers at `payload_off` of `seg`
    /// (or, for a thread rank of this process, as its owner recorded it), `payload_len` bytes
    /// in all.
    fn direct_payload(
        &self,
        p: usize,
        seg: &Segment,
        head: &OpHead,
        payload_off: usize,
        payload_len: usize,
    ) -> std::result::Result<Payload<'static>, String> {
        let (n, pieces) = (head.n, head.pieces);
        let left = seg.len().saturating_sub(payload_off);
        if pieces > (left / 16) as u64 {
            return Err(format!(
                "{pieces} buffer addresses, more than the {} bytes of the region hold",
                seg.len()
            ));
        }
        let pid = self.slot(p).pid.load(Ordering::Acquire);
        let local = pid == self.pid;
        let table: Vec<(u64, usize)> = if local {
            // A thread rank's buffers are followed only as its owner recorded them in this
            // process's memory: a forged address must not fault this process.
            self.local_table(p, n).ok_or_else(|| {
                format!("no buffers of op #{n} were published by rank {p} in this process")
            })?
        } else {
            let mut raw = vec![0u8; pieces as usize * 16];
            seg.read(payload_off, &mut raw);
            bytes::words::<[u64; 2]>(&raw)
                .map(|[addr, len]| (addr, usize::try_from(len).unwrap_or(usize::MAX)))
                .collect()
        };
        let total = table.iter().try_fold(0usize, |acc, &(addr, len)| {
            addr.checked_add(len as u64)?;
            acc.checked_add(len)
        });
        if total != Some(payload_len) {
            return Err(format!(
                "buffers of {total:?} bytes in all, but a payload of {payload_len} bytes"
            ));
        }
        Ok(Payload::Direct(Direct {
            rank: p,
            pid,
            local,
            pieces: table,
            len: payload_len,
        }))
    }
}

/// The payload of `payload_len` bytes at `payload_off` of region `seg` (region mode).
fn region_payload(
    seg: &Segment,
    payload_off: usize,
    payload_len: usize,
) -> std::result::Result<Payload<'_>, String> {
    let left = seg.len().saturating_sub(payload_off);
    if payload_len > left {
        return Err(format!(
            "a payload of {payload_len} bytes at offset {payload_off}, past the end of the region ({} bytes)",
            seg.len()
        ));
    }
    Ok(Payload::Region(seg.view(payload_off, payload_len)))
}

/// Checks the metadata words a rank published for `op` against its payload of `payload_len`
/// bytes, so the collectives can index and sum them without overflow or out-of-range access.
fn check_meta(
    op: Option<Op>,
    meta: &[u64],
    payload_len: usize,
    world: usize,
) -> std::result::Result<(), String> {
    pub(super) fn sum(mut words: impl Iterator<Item = u64>) -> Option<u64> {
        words.try_fold(0u64, |a, w| a.checked_add(w))
    }
    let total = payload_len as u64;
    match op {
        None => Err("an unknown operation".into()),
        Some(Op::AllToAllv) => {
            // send_sizes then recv_sizes, one per rank each.
            if meta.len() != 2 * world {
                return Err(format!("{} size words for {world} ranks", meta.len()));
            }
            match sum(meta[..world].iter().copied()) {
                Some(s) if s == total => Ok(()),
                s => Err(format!(
                    "send sizes summing to {s:?}, but a payload of {total} bytes"
                )),
            }
        }
        Some(Op::SendRecv) => {
            // group::agree::p2p_words: [sends, receives, (peer, bytes) per send, per receive].
            let words = |c: &[u64]| c[0].checked_add(c[1])?.checked_mul(2)?.checked_add(2);
            if meta.len() < 2 || words(meta) != Some(meta.len() as u64) {
                return Err(format!(
                    "{} message words that are not [sends, receives, pairs]",
                    meta.len()
                ));
            }
            if let Some(pair) = meta[2..]
                .chunks_exact(2)
                .find(|pair| pair[0] >= world as u64)
            {
                return Err(format!("a message to or from rank {} of {world}", pair[0]));
            }
            let sends = &meta[2..2 + 2 * meta[0] as usize];
            match sum(sends.chunks_exact(2).map(|pair| pair[1])) {
                Some(s) if s == total => Ok(()),
                s => Err(format!(
                    "messages of {s:?} bytes in all, but a payload of {total} bytes"
                )),
            }
        }
        Some(Op::ExchangeRows | Op::ReduceRows) => {
            // The index table, then (windows) the window section, checked by its parser.
            if meta.len() < 2 + 2 * world {
                return Err(format!("{} row-index words for {world} ranks", meta.len()));
            }
            super::window::parse(meta, world)?;
            let src = meta[1];
            let index_bytes = total
                .checked_sub(src)
                .ok_or_else(|| format!("a source of {src} bytes in a payload of {total} bytes"))?;
            for (r, pair) in meta[2..2 + 2 * world].chunks_exact(2).enumerate() {
                let end = pair[0].checked_add(pair[1]).and_then(|x| x.checked_mul(4));
                if end.is_none_or(|e| e > index_bytes) {
                    return Err(format!(
                        "row list for rank {r} at {} with {} rows, past the {index_bytes} bytes of row indices",
                        pair[0], pair[1]
                    ));
                }
            }
            Ok(())
        }
        Some(Op::Broadcast) => match meta.len() {
            1 => Ok(()),
            k => Err(format!("{k} root words (expected 1)")),
        },
        Some(Op::Join | Op::Barrier | Op::AllGatherv | Op::ReduceScatterv | Op::Leave) => Ok(()),
    }
}

/// Buffer tables of the thread ranks of one process, per group session: rank r's entry holds
/// (op, (address, length) of each buffer). Private memory, so no other process can forge it.
pub(super) type LocalTables = Vec<Mutex<(u64, Vec<(u64, usize)>)>>;

pub(super) fn local_tables(session: u64, world: usize) -> Arc<LocalTables> {
    static ALL: OnceLock<Mutex<HashMap<u64, Weak<LocalTables>>>> = OnceLock::new();
    let mut all = ALL
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(t) = all.get(&session).and_then(Weak::upgrade) {
        return t;
    }
    all.retain(|_, w| w.strong_count() > 0);
    let t: Arc<LocalTables> = Arc::new((0..world).map(|_| Mutex::new((0, Vec::new()))).collect());
    all.insert(session, Arc::downgrade(&t));
    t
}

/// A read of `len` bytes at `offset` of a payload (or buffer) of `size` bytes: the ranks'
/// published sizes disagree with what this read needs.
fn out_of_payload(offset: usize, len: usize, size: usize) -> Error {
    Error::InvalidArgument(format!(
        "a read of {len} bytes at offset {offset} goes past the end of a rank's published data ({size} bytes); the ranks disagree on sizes"
    ))
}

/// A rank's contribution to the current op: bytes in its shared region, or (direct mode)
/// ranges of its own memory to copy from.
pub(super) enum Payload<'a> {
    Region(&'a [u8]),
    Direct(Direct),
}

/// A rank's buffers as it published them for direct reads.
pub(super) struct Direct {
    rank: usize,
    pid: u32,
    /// A thread rank of this process: plain copies.
    local: bool,
    /// (address, length) of each buffer, in payload order.
    pieces: Vec<(u64, usize)>,
    len: usize,
}

impl Payload<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            Payload::Region(b) => b.len(),
            Payload::Direct(d) => d.len,
        }
    }

    /// Copies `dst.len()` bytes starting at byte `offset` of the payload into `dst`.
    pub(super) fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        match self {
            Payload::Region(b) => {
                let src = offset
                    .checked_add(dst.len())
                    .and_then(|end| b.get(offset..end))
                    .ok_or_else(|| out_of_payload(offset, dst.len(), b.len()))?;
                dst.copy_from_slice(src);
                Ok(())
            }
            Payload::Direct(d) => d.copy_to(offset, dst),
        }
    }

    /// Copies ranges (payload offset, offset in `dst`, length) of the payload into `dst`; each
    /// range lies within one published buffer.
    pub(super) fn copy_scattered(
        &self,
        dst: &mut [u8],
        ranges: &[(usize, usize, usize)],
    ) -> Result<()> {
        match self {
            Payload::Region(b) => {
                for &(src, off, len) in ranges {
                    let from = src
                        .checked_add(len)
                        .and_then(|end| b.get(src..end))
                        .ok_or_else(|| out_of_payload(src, len, b.len()))?;
                    let size = dst.len();
                    let to = off
                        .checked_add(len)
                        .and_then(|end| dst.get_mut(off..end))
                        .ok_or_else(|| out_of_payload(off, len, size))?;
                    to.copy_from_slice(from);
                }
                Ok(())
            }
            Payload::Direct(d) => d.copy_scattered(dst, ranges),
        }
    }
}

impl Direct {
    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        if offset
            .checked_add(dst.len())
            .is_none_or(|end| end > self.len)
        {
            return Err(out_of_payload(offset, dst.len(), self.len));
        }
        let (mut piece_start, mut done) = (0usize, 0usize);
        for &(addr, plen) in &self.pieces {
            let want = offset + done;
            if done == dst.len() {
                break;
            }
            if want < piece_start + plen {
                let within = want - piece_start;
                let n = (plen - within).min(dst.len() - done);
                copy_from_process(
                    self.pid,
                    self.local,
                    addr + within as u64,
                    &mut dst[done..done + n],
                )
                .map_err(|e| self.read_failed(e))?;
                done += n;
            }
            piece_start += plen;
        }
        Ok(())
    }

    fn copy_scattered(&self, dst: &mut [u8], ranges: &[(usize, usize, usize)]) -> Result<()> {
        let mut remote = Vec::with_capacity(ranges.len());
        for &(src, off, len) in ranges {
            let mut start = 0usize;
            let addr = self.pieces.iter().find_map(|&(addr, plen)| {
                let hit = src >= start && src.saturating_add(len) <= start + plen;
                let a = addr + (src - start.min(src)) as u64;
                start += plen;
                hit.then_some(a)
            });
            let addr = addr.ok_or_else(|| out_of_payload(src, len, self.len))?;
            if off.checked_add(len).is_none_or(|end| end > dst.len()) {
                return Err(out_of_payload(off, len, dst.len()));
            }
            remote.push((addr, off, len));
        }
        copy_scattered_from_process(self.pid, self.local, dst, &remote)
            .map_err(|e| self.read_failed(e))
    }

    /// A failed read straight from the rank's memory.
    fn read_failed(&self, e: std::io::Error) -> Error {
        let (rank, pid) = (self.rank, self.pid);
        Error::PeerFailure(format!(
            "cannot read the data of rank {rank} (pid {pid}) directly: {e}"
        ))
    }
}

/// Sums `out.len()` bytes (elements of `kind`) starting at byte `start` of every source, in
/// source order, accumulating in f32, and stores the result in `out`. Works in cache-sized
/// chunks; direct sources are copied chunk by chunk into a small buffer first.
pub(super) fn reduce_into(
    sources: &[Payload<'_>],
    start: usize,
    kind: FloatKind,
    out: &mut [u8],
) -> Result<()> {
    const CHUNK: usize = 8192; // elements
    let es = kind.size();
    let elems = out.len() / es;
    let mut acc = vec![0f32; CHUNK.min(elems)];
    let mut scratch = vec![0u8; CHUNK.min(elems) * es];
    let mut e0 = 0;
    while e0 < elems {
        let n = CHUNK.min(elems - e0);
        let acc = &mut acc[..n];
        acc.fill(0.0);
        let (b0, b1) = (start + e0 * es, start + (e0 + n) * es);
        for src in sources {
            match src {
                Payload::Region(b) => num::accumulate(acc, &b[b0..b1], kind),
                Payload::Direct(d) => {
                    let tmp = &mut scratch[..n * es];
                    d.copy_to(b0, tmp)?;
                    num::accumulate(acc, tmp, kind);
                }
            }
        }
        num::store(acc, &mut out[e0 * es..(e0 + n) * es], kind);
        e0 += n;
    }
    Ok(())
}
