//! Row-exchange helpers shared by the transports: argument checks, packing, unpacking and
//! weighted accumulation.

use super::{chunk_starts, grown, AllToAllv, Group, Op, RowExchange, RowReduce};
use crate::bytes;
use crate::error::{Error, Result};
use crate::num::{self, FloatKind};

/// exchange_rows by packing, all_to_allv and unpacking (any transport). Rows are packed
/// straight into the transport's framed chunks ([`Group::all_to_allv_framed`]) in buffers kept
/// per thread, and this rank's rows to itself are copied in place, never exchanged.
pub(crate) fn exchange_packed<G: Group + ?Sized>(g: &mut G, r: RowExchange<'_>) -> Result<()> {
    let me = g.rank();
    // A rejected argument is the peers' error too: they wait in the same all_to_allv.
    let checked = check_exchange(g.size(), &r).and_then(|()| {
        check_own_rows(
            "exchange_rows",
            me,
            r.row_bytes,
            r.give[me].len(),
            r.take[me].len(),
        )
    });
    if let Err(e) = checked {
        return Err(g.reject(Op::AllToAllv, e));
    }
    swap_packed(
        g,
        r.src,
        r.row_bytes,
        r.give,
        r.take,
        "exchange_rows",
        |recv, rs, lead| {
            unpack(recv, r.row_bytes, r.take, me, r.dst, rs, lead);
            Ok(())
        },
    )?;
    copy_own_rows(r.src, r.row_bytes, &r.give[me], &r.take[me], r.dst, false);
    Ok(())
}

/// exchange_rows' rows of a rank to itself: rows `give` of `src` to rows `take` of `dst` (as
/// many of each), with streaming stores (then a fence) when `streaming`.
pub(crate) fn copy_own_rows(
    src: &[u8],
    row_bytes: usize,
    give: &[u32],
    take: &[u32],
    dst: &mut [u8],
    streaming: bool,
) {
    for (&s, &d) in give.iter().zip(take) {
        let (s, d) = (s as usize * row_bytes, d as usize * row_bytes);
        let (to, from) = (&mut dst[d..d + row_bytes], &src[s..s + row_bytes]);
        if streaming {
            crate::copy::copy_streaming(to, from);
        } else {
            to.copy_from_slice(from);
        }
    }
    if streaming {
        crate::copy::streaming_fence();
    }
}

/// reduce_rows by packing, all_to_allv and a blocked weighted accumulation (any transport):
/// packed as [`exchange_packed`] packs; every row is summed where it is (own rows in `src`,
/// peers' in the received chunks).
pub(crate) fn reduce_packed<G: Group + ?Sized>(g: &mut G, r: RowReduce<'_>) -> Result<()> {
    let row_bytes = r.row_elems * r.kind.size();
    let me = g.rank();
    let checked = check_reduce(g.size(), &r).and_then(|rows| {
        check_own_rows(
            "reduce_rows",
            me,
            row_bytes,
            r.give[me].len(),
            r.take[me].len(),
        )?;
        Ok(rows)
    });
    let out_rows = match checked {
        Ok(n) => n,
        Err(e) => return Err(g.reject(Op::AllToAllv, e)),
    };
    swap_packed(
        g,
        r.src,
        row_bytes,
        r.give,
        r.take,
        "reduce_rows",
        |recv, rs, lead| {
            let by_row = ByRow::new(r.take, out_rows);
            // Every row is read where it is: this rank's own in `src`, each peer's in its
            // received chunk (rows in list order), so no row is copied before it is summed.
            with_iota(r.take.iter().map(Vec::len).max().unwrap_or(0), |iota| {
                let in_place: Vec<Option<(&[u8], &[u32])>> = (0..r.take.len())
                    .map(|p| {
                        if p == me {
                            return Some((r.src, r.give[me].as_slice()));
                        }
                        let n = r.take[p].len();
                        let at = rs[p] + lead;
                        Some((&recv[at..at + n * row_bytes], &iota[..n]))
                    })
                    .collect();
                reduce_blocked(
                    r.kind,
                    r.row_elems,
                    &by_row,
                    r.out,
                    r.out_kind,
                    &in_place,
                    |_, _, _| {
                        Err(Error::Internal(
                            "reduce_rows: every row of a packed reduction is read in place".into(),
                        ))
                    },
                )
            })
        },
    )
}

/// The packed exchange both row primitives make: rows `give[p]` of `src` packed into peer p's
/// framed chunk (own rows left out), the transport's framed all_to_allv, then `use_recv` with
/// the received bytes, each peer's chunk start and the frame's leading room. Buffers are the
/// thread's kept ones; a size disagreement is worded as `op`'s.
fn swap_packed<G: Group + ?Sized, R, T>(
    g: &mut G,
    src: &[u8],
    row_bytes: usize,
    give: &[Vec<u32>],
    take: &[Vec<R>],
    op: &'static str,
    use_recv: impl FnOnce(&[u8], &[usize], usize) -> Result<T>,
) -> Result<T> {
    let me = g.rank();
    let send_sizes = peer_bytes(give, me, row_bytes);
    let recv_sizes = peer_bytes(take, me, row_bytes);
    let pack_rows = |send: &mut [u8], ss: &[usize], lead: usize| {
        pack(src, row_bytes, give, me, send, ss, lead);
    };
    swap_chunks(g, (&send_sizes, &recv_sizes), op, pack_rows, use_recv)
}

/// A framed all_to_allv of chunks the caller packs: `pack` fills each peer's chunk (payload
/// `sizes.0[p]` bytes at the chunk start it is given plus the frame's leading room), then
/// `use_recv` reads the received chunks (`sizes.1[p]` bytes each) in place. Buffers are the
/// thread's kept ones; a size disagreement is worded as `op`'s.
pub(crate) fn swap_chunks<G: Group + ?Sized, T>(
    g: &mut G,
    (send_sizes, recv_sizes): (&[usize], &[usize]),
    op: &'static str,
    pack: impl FnOnce(&mut [u8], &[usize], usize),
    use_recv: impl FnOnce(&[u8], &[usize], usize) -> Result<T>,
) -> Result<T> {
    let room = g.chunk_frame();
    with_packed(|send, recv| {
        let (ss, rs) = (
            chunk_starts(send_sizes, room),
            chunk_starts(recv_sizes, room),
        );
        let send = grown(send, ss[ss.len() - 1]);
        let recv = grown(recv, rs[rs.len() - 1]);
        pack(send, &ss, room.0);
        g.all_to_allv_framed(AllToAllv {
            send,
            send_sizes,
            recv,
            recv_sizes,
        })
        .map_err(|e| rename_mismatch(e, op))?;
        use_recv(recv, &rs, room.0)
    })
}

/// A rank's rows to itself are copied in place: it must take from itself as many rows as it
/// gives itself.
fn check_own_rows(op: &str, me: usize, row_bytes: usize, gives: usize, takes: usize) -> Result<()> {
    if gives == takes {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "{op}: rank {me} sends {} bytes to itself but expects {}; no data was exchanged",
        gives * row_bytes,
        takes * row_bytes
    )))
}

/// Bytes of the rows each peer gets (`lists[p]`), none for this rank (its rows stay in place).
fn peer_bytes<T>(lists: &[Vec<T>], me: usize, row_bytes: usize) -> Vec<usize> {
    (lists.iter().enumerate())
        .map(|(p, l)| if p == me { 0 } else { l.len() * row_bytes })
        .collect()
}

thread_local! {
    /// The packed send and receive buffers of [`exchange_packed`] and [`reduce_packed`], kept
    /// per thread and only grown: a fresh allocation per call above malloc's mmap threshold
    /// would page-fault on every page of every call.
    static PACKED: std::cell::RefCell<(Vec<u8>, Vec<u8>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs `f` with this thread's kept packing buffers (taken out meanwhile, so a nested call
/// gets fresh ones instead of a borrow error).
fn with_packed<T>(f: impl FnOnce(&mut Vec<u8>, &mut Vec<u8>) -> T) -> T {
    let (mut send, mut recv) = PACKED.with(|b| std::mem::take(&mut *b.borrow_mut()));
    let out = f(&mut send, &mut recv);
    PACKED.with(|b| *b.borrow_mut() = (send, recv));
    out
}

thread_local! {
    /// 0, 1, 2, ...: the row list of a received chunk, whose rows are in list order.
    static IOTA: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` with `0..n` as u32s (kept per thread and only grown, as [`with_packed`]'s buffers).
fn with_iota<T>(n: usize, f: impl FnOnce(&[u32]) -> T) -> T {
    let mut iota = IOTA.with(|b| std::mem::take(&mut *b.borrow_mut()));
    if iota.len() < n {
        iota = (0..n as u32).collect();
    }
    let out = f(&iota[..n]);
    IOTA.with(|b| *b.borrow_mut() = iota);
    out
}

/// Every output row's contributions in the canonical order (peer, then position in that
/// peer's list): a compressed sparse row table.
pub(crate) struct ByRow {
    offsets: Vec<usize>,
    /// (peer, position in take[peer], weight)
    entries: Vec<(u32, u32, f32)>,
}

impl ByRow {
    pub(crate) fn new(take: &[Vec<(u32, f32)>], out_rows: usize) -> ByRow {
        let mut offsets = vec![0usize; out_rows + 1];
        for list in take {
            for &(r, _) in list {
                offsets[r as usize + 1] += 1;
            }
        }
        for i in 0..out_rows {
            offsets[i + 1] += offsets[i];
        }
        let mut fill = offsets.clone();
        let mut entries = vec![(0u32, 0u32, 0f32); offsets[out_rows]];
        for (p, list) in take.iter().enumerate() {
            for (pos, &(r, w)) in list.iter().enumerate() {
                entries[fill[r as usize]] = (p as u32, pos as u32, w);
                fill[r as usize] += 1;
            }
        }
        ByRow { offsets, entries }
    }
}

/// The blocked reduction shared by every transport: for each block of output rows, `fetch`
/// copies the needed rows of each peer (given as positions in that peer's list, into
/// consecutive rows of the scratch buffer), and each output row is summed in f32 in canonical
/// order in one pass ([`num::sum_rows`]) and stored as `out_kind`.
/// `in_place[p]` = (peer p's source rows, the rows it gives this rank) where this rank can
/// read them in place (its own rows; a peer's shared-memory window): those are never fetched.
pub(crate) fn reduce_blocked(
    kind: FloatKind,
    row_elems: usize,
    by_row: &ByRow,
    out: &mut [u8],
    out_kind: FloatKind,
    in_place: &[Option<(&[u8], &[u32])>],
    mut fetch: impl FnMut(usize, &[u32], &mut [u8]) -> Result<()>,
) -> Result<()> {
    let out_rows = by_row.offsets.len() - 1;
    if row_elems == 0 || out_rows == 0 {
        return Ok(());
    }
    // Blocks of about 256 KiB / (4 bytes x row) output rows: one read per peer per block into
    // a cache-resident scratch. The scratch is kept per thread: above malloc's mmap threshold
    // a fresh allocation would page-fault on every call.
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let block = ((256 << 10) / (row_elems * 4)).clamp(1, out_rows);
    let mut scratch = SCRATCH.with(|b| std::mem::take(&mut *b.borrow_mut()));
    let plan = Reduction {
        kind,
        row_bytes: row_elems * kind.size(),
        out_kind,
        out_row_bytes: row_elems * out_kind.size(),
        in_place,
        // An output much larger than the caches is written past them (see
        // num::store_streaming); a small one stays cached for the caller's next read.
        streaming: out_rows * row_elems * out_kind.size() >= crate::copy::STREAMING_MIN_BYTES,
    };
    let result = reduce_blocks(&plan, by_row, out, &mut fetch, block, &mut scratch);
    SCRATCH.with(|b| *b.borrow_mut() = scratch);
    result
}

/// What stays the same over all blocks of one reduction.
struct Reduction<'a> {
    kind: FloatKind,
    row_bytes: usize,
    out_kind: FloatKind,
    out_row_bytes: usize,
    /// Per peer, (its source rows, the rows it gives this rank) where they are read in place.
    in_place: &'a [Option<(&'a [u8], &'a [u32])>],
    streaming: bool,
}

/// Per-block bookkeeping, kept across blocks so steady state allocates nothing.
#[derive(Default)]
struct Fetched {
    /// Entry i of the block landed at scratch row `slots[i]`.
    slots: Vec<usize>,
    positions: Vec<u32>,
    which: Vec<usize>,
}

fn reduce_blocks(
    plan: &Reduction<'_>,
    by_row: &ByRow,
    out: &mut [u8],
    fetch: &mut impl FnMut(usize, &[u32], &mut [u8]) -> Result<()>,
    block: usize,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let out_rows = by_row.offsets.len() - 1;
    let mut fetched = Fetched::default();
    let peers = by_row
        .entries
        .iter()
        .map(|e| e.0 as usize + 1)
        .max()
        .unwrap_or(0);
    for b0 in (0..out_rows).step_by(block) {
        let b1 = (b0 + block).min(out_rows);
        let (e0, e1) = (by_row.offsets[b0], by_row.offsets[b1]);
        let entries = &by_row.entries[e0..e1];
        fetch_block(plan, entries, peers, fetch, scratch, &mut fetched)?;
        let rows = BlockRows {
            entries,
            slots: &fetched.slots,
            scratch,
        };
        for r in b0..b1 {
            let entries_r = by_row.offsets[r] - e0..by_row.offsets[r + 1] - e0;
            sum_row(plan, r, entries_r, &rows, out);
        }
    }
    if plan.streaming {
        crate::copy::streaming_fence();
    }
    Ok(())
}

/// Fetches the rows of one block's `entries` from every peer but this rank: one fetch per
/// peer, into consecutive rows of `scratch`.
fn fetch_block(
    plan: &Reduction<'_>,
    entries: &[(u32, u32, f32)],
    peers: usize,
    fetch: &mut impl FnMut(usize, &[u32], &mut [u8]) -> Result<()>,
    scratch: &mut Vec<u8>,
    fetched: &mut Fetched,
) -> Result<()> {
    let row_bytes = plan.row_bytes;
    let Fetched {
        slots,
        positions,
        which,
    } = fetched;
    scratch.resize(entries.len() * row_bytes, 0);
    slots.clear();
    slots.resize(entries.len(), 0);
    let mut next = 0usize;
    for peer in 0..peers {
        if plan.in_place.get(peer).is_some_and(Option::is_some) {
            continue;
        }
        positions.clear();
        which.clear();
        for (i, e) in entries.iter().enumerate() {
            if e.0 as usize == peer {
                positions.push(e.1);
                which.push(i);
            }
        }
        if positions.is_empty() {
            continue;
        }
        let n = positions.len();
        fetch(
            peer,
            positions,
            &mut scratch[next * row_bytes..(next + n) * row_bytes],
        )?;
        for (k, &i) in which.iter().enumerate() {
            slots[i] = next + k;
        }
        next += n;
    }
    Ok(())
}

/// One block's contributions (peer, position, weight) and where `fetch_block` put their rows.
struct BlockRows<'b> {
    entries: &'b [(u32, u32, f32)],
    slots: &'b [usize],
    scratch: &'b [u8],
}

/// Output row `r` from its contributions `entries[entries_r]`, summed in one pass
/// ([`num::sum_rows`]: in f32, in canonical order, the partial sums in registers).
fn sum_row(
    plan: &Reduction<'_>,
    r: usize,
    entries_r: std::ops::Range<usize>,
    block: &BlockRows<'_>,
    out: &mut [u8],
) {
    let BlockRows {
        entries,
        slots,
        scratch,
    } = *block;
    let row_bytes = plan.row_bytes;
    let row_of = |i: usize| -> (&[u8], f32) {
        let (peer, pos, w) = entries[i];
        let row = match plan.in_place.get(peer as usize) {
            // Rows readable where they are (this rank's own, a peer's window).
            Some(Some((src, gives))) => {
                let sr = gives[pos as usize] as usize;
                &src[sr * row_bytes..(sr + 1) * row_bytes]
            }
            _ => &scratch[slots[i] * row_bytes..(slots[i] + 1) * row_bytes],
        };
        (row, w)
    };
    let dst = &mut out[r * plan.out_row_bytes..(r + 1) * plan.out_row_bytes];
    // Up to MAX_INLINE contributions (top-k, ranks) on the stack: no allocation per row.
    const MAX_INLINE: usize = 32;
    if entries_r.len() <= MAX_INLINE {
        let mut rows: [(&[u8], f32); MAX_INLINE] = [(&[], 0.0); MAX_INLINE];
        for (slot, i) in rows.iter_mut().zip(entries_r.clone()) {
            *slot = row_of(i);
        }
        let rows = &rows[..entries_r.len()];
        num::sum_rows(rows, plan.kind, dst, plan.out_kind, plan.streaming);
    } else {
        let rows: Vec<(&[u8], f32)> = entries_r.map(row_of).collect();
        num::sum_rows(&rows, plan.kind, dst, plan.out_kind, plan.streaming);
    }
}

fn rename_mismatch(e: Error, op: &str) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(m.replacen("all_to_allv", op, 1)),
        other => other,
    }
}

/// The metadata and index payload a rank publishes for a direct row exchange:
/// meta = [row_bytes, src_len, (offset, count) per peer]; payload = the row indices (u32).
pub(crate) fn index_table(
    src_len: usize,
    row_bytes: usize,
    give: &[Vec<u32>],
) -> (Vec<u64>, Vec<u8>) {
    let mut meta = vec![row_bytes as u64, src_len as u64];
    let mut bytes = Vec::new();
    let mut off = 0u64;
    for list in give {
        meta.extend([off, list.len() as u64]);
        off += list.len() as u64;
        bytes.extend(list.iter().flat_map(|i| i.to_ne_bytes()));
    }
    (meta, bytes)
}

/// Reads the row indices peer `p` gives to rank `me` (published by [`index_table`]), checking
/// that the peer agrees on the row size and the row count.
pub(crate) fn read_index_list(
    op: Op,
    meta: &[u64],
    p: usize,
    me: usize,
    row_bytes: usize,
    expected: usize,
    copy: impl Fn(usize, &mut [u8]) -> Result<()>,
) -> Result<Vec<u32>> {
    let name = op.name();
    if meta.first().copied() != Some(row_bytes as u64) {
        return Err(Error::InvalidArgument(format!(
            "{name}: rank {p} uses rows of {} bytes but rank {me} uses {row_bytes}",
            meta.first().copied().unwrap_or(0)
        )));
    }
    let src_len = meta[1] as usize;
    let (off, count) = (meta[2 + 2 * me] as usize, meta[3 + 2 * me] as usize);
    if count != expected {
        return Err(Error::InvalidArgument(format!(
            "{name}: rank {p} gives {count} rows to rank {me} but rank {me} expects {expected}"
        )));
    }
    let mut buf = vec![0u8; count * 4];
    copy(src_len + off * 4, &mut buf)?;
    let idx: Vec<u32> = bytes::to_vec(&buf);
    let rows = src_len.checked_div(row_bytes).unwrap_or(0);
    if let Some(bad) = idx.iter().find(|&&i| i as usize >= rows) {
        return Err(Error::InvalidArgument(format!(
            "{name}: rank {p} gives row {bad} of a buffer with {rows} rows"
        )));
    }
    Ok(idx)
}

fn check_lists<T>(what: &str, lists: &[Vec<T>], world: usize, op: &str) -> Result<()> {
    if lists.len() != world {
        return Err(Error::InvalidArgument(format!(
            "{op}: {what} has {} lists; expected one per rank ({world})",
            lists.len()
        )));
    }
    Ok(())
}

fn check_index(op: &str, what: &str, p: usize, i: usize, idx: usize, rows: usize) -> Result<()> {
    if idx >= rows {
        return Err(Error::InvalidArgument(format!(
            "{op}: {what}[{p}][{i}] = {idx} is out of range; the buffer has {rows} rows"
        )));
    }
    Ok(())
}

/// Checks exchange_rows arguments.
pub(crate) fn check_exchange(world: usize, r: &RowExchange<'_>) -> Result<()> {
    let (src, row_bytes, give, dst, take) = (r.src, r.row_bytes, r.give, &*r.dst, r.take);
    let op = "exchange_rows";
    check_lists("give", give, world, op)?;
    check_lists("take", take, world, op)?;
    if row_bytes == 0 {
        return Ok(());
    }
    let (src_rows, dst_rows) = (src.len() / row_bytes, dst.len() / row_bytes);
    for (p, list) in give.iter().enumerate() {
        for (i, &r) in list.iter().enumerate() {
            check_index(op, "give", p, i, r as usize, src_rows)?;
        }
    }
    for (p, list) in take.iter().enumerate() {
        for (i, &r) in list.iter().enumerate() {
            check_index(op, "take", p, i, r as usize, dst_rows)?;
        }
    }
    Ok(())
}

/// Checks reduce_rows arguments; returns the number of output rows.
pub(crate) fn check_reduce(world: usize, r: &RowReduce<'_>) -> Result<usize> {
    let (src, row_elems, give, out, out_kind, take) =
        (r.src, r.row_elems, r.give, &*r.out, r.out_kind, r.take);
    let row_bytes = row_elems * r.kind.size();
    let op = "reduce_rows";
    check_lists("give", give, world, op)?;
    check_lists("take", take, world, op)?;
    if row_bytes == 0 || row_elems == 0 {
        return Ok(0);
    }
    let out_row = row_elems * out_kind.size();
    if !out.len().is_multiple_of(out_row) {
        return Err(Error::InvalidArgument(format!(
            "{op}: output has {} bytes; expected whole rows of {row_elems} {} elements",
            out.len(),
            out_kind.name()
        )));
    }
    let (src_rows, out_rows) = (src.len() / row_bytes, out.len() / out_row);
    for (p, list) in give.iter().enumerate() {
        for (i, &r) in list.iter().enumerate() {
            check_index(op, "give", p, i, r as usize, src_rows)?;
        }
    }
    for (p, list) in take.iter().enumerate() {
        for (i, &(r, _)) in list.iter().enumerate() {
            check_index(op, "take", p, i, r as usize, out_rows)?;
        }
    }
    Ok(out_rows)
}

/// Packs rows `give[p]` of `src` for every peer but this rank into chunk p of `out` (it starts
/// at `starts[p]`, its payload `before` bytes later).
fn pack(
    src: &[u8],
    row_bytes: usize,
    give: &[Vec<u32>],
    me: usize,
    out: &mut [u8],
    starts: &[usize],
    before: usize,
) {
    for (p, list) in give.iter().enumerate().filter(|&(p, _)| p != me) {
        let mut at = starts[p] + before;
        for &r in list {
            let r = r as usize;
            out[at..at + row_bytes].copy_from_slice(&src[r * row_bytes..(r + 1) * row_bytes]);
            at += row_bytes;
        }
    }
}

/// Writes the rows of chunk p of `packed` (laid out as [`pack`] lays them out) to rows
/// `take[p]` of `dst`, for every peer but this rank.
fn unpack(
    packed: &[u8],
    row_bytes: usize,
    take: &[Vec<u32>],
    me: usize,
    dst: &mut [u8],
    starts: &[usize],
    before: usize,
) {
    for (p, list) in take.iter().enumerate().filter(|&(p, _)| p != me) {
        let mut at = starts[p] + before;
        for &r in list {
            let r = r as usize;
            dst[r * row_bytes..(r + 1) * row_bytes].copy_from_slice(&packed[at..at + row_bytes]);
            at += row_bytes;
        }
    }
}
