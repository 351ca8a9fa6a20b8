//! Row-exchange helpers shared by the transports: argument checks, packing, unpacking and
//! weighted accumulation.

use super::{Group, Op};
use crate::error::{Error, Result};
use crate::num::{self, FloatKind};

/// exchange_rows by packing, all_to_allv and unpacking (any transport).
pub(crate) fn exchange_packed<G: Group + ?Sized>(
    g: &mut G,
    src: &[u8],
    row_bytes: usize,
    give: &[Vec<u32>],
    dst: &mut [u8],
    take: &[Vec<u32>],
) -> Result<()> {
    check_exchange(g.rank(), g.size(), src, row_bytes, give, dst, take)?;
    let (send, send_sizes) = pack(src, row_bytes, give);
    let recv_sizes: Vec<usize> = take.iter().map(|t| t.len() * row_bytes).collect();
    let mut recv = vec![0u8; recv_sizes.iter().sum()];
    g.all_to_allv(&send, &send_sizes, &mut recv, &recv_sizes)
        .map_err(|e| rename_mismatch(e, "exchange_rows"))?;
    unpack(&recv, row_bytes, take, dst);
    Ok(())
}

/// reduce_rows by packing, all_to_allv and a weighted accumulation (any transport).
pub(crate) fn reduce_packed<G: Group + ?Sized>(
    g: &mut G,
    src: &[u8],
    kind: FloatKind,
    row_elems: usize,
    give: &[Vec<u32>],
    acc: &mut [f32],
    take: &[Vec<(u32, f32)>],
) -> Result<()> {
    let row_bytes = row_elems * kind.size();
    check_reduce(
        g.rank(),
        g.size(),
        src,
        row_bytes,
        row_elems,
        give,
        acc,
        take,
    )?;
    let (send, send_sizes) = pack(src, row_bytes, give);
    let recv_sizes: Vec<usize> = take.iter().map(|t| t.len() * row_bytes).collect();
    let mut recv = vec![0u8; recv_sizes.iter().sum()];
    g.all_to_allv(&send, &send_sizes, &mut recv, &recv_sizes)
        .map_err(|e| rename_mismatch(e, "reduce_rows"))?;
    accumulate_packed(&recv, kind, row_elems, take, acc);
    Ok(())
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
    let idx: Vec<u32> = buf
        .chunks_exact(4)
        .map(|c| u32::from_ne_bytes(c.try_into().unwrap()))
        .collect();
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

pub(crate) fn check_exchange(
    _rank: usize,
    world: usize,
    src: &[u8],
    row_bytes: usize,
    give: &[Vec<u32>],
    dst: &[u8],
    take: &[Vec<u32>],
) -> Result<()> {
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

#[allow(clippy::too_many_arguments)]
pub(crate) fn check_reduce(
    _rank: usize,
    world: usize,
    src: &[u8],
    row_bytes: usize,
    row_elems: usize,
    give: &[Vec<u32>],
    acc: &[f32],
    take: &[Vec<(u32, f32)>],
) -> Result<()> {
    let op = "reduce_rows";
    check_lists("give", give, world, op)?;
    check_lists("take", take, world, op)?;
    if row_bytes == 0 || row_elems == 0 {
        return Ok(());
    }
    let (src_rows, acc_rows) = (src.len() / row_bytes, acc.len() / row_elems);
    for (p, list) in give.iter().enumerate() {
        for (i, &r) in list.iter().enumerate() {
            check_index(op, "give", p, i, r as usize, src_rows)?;
        }
    }
    for (p, list) in take.iter().enumerate() {
        for (i, &(r, _)) in list.iter().enumerate() {
            check_index(op, "take", p, i, r as usize, acc_rows)?;
        }
    }
    Ok(())
}

/// Packs rows `give[p]` of `src` for every peer, in peer order; returns the bytes per peer.
pub(crate) fn pack(src: &[u8], row_bytes: usize, give: &[Vec<u32>]) -> (Vec<u8>, Vec<usize>) {
    let sizes: Vec<usize> = give.iter().map(|g| g.len() * row_bytes).collect();
    let mut out = Vec::with_capacity(sizes.iter().sum());
    for list in give {
        for &r in list {
            let r = r as usize;
            out.extend_from_slice(&src[r * row_bytes..(r + 1) * row_bytes]);
        }
    }
    (out, sizes)
}

/// Writes packed rows (peer order) to rows `take[p]` of `dst`.
pub(crate) fn unpack(packed: &[u8], row_bytes: usize, take: &[Vec<u32>], dst: &mut [u8]) {
    let mut off = 0;
    for list in take {
        for &r in list {
            let r = r as usize;
            dst[r * row_bytes..(r + 1) * row_bytes].copy_from_slice(&packed[off..off + row_bytes]);
            off += row_bytes;
        }
    }
}

/// Adds one row (elements of `kind`) times `w` to `acc_row`.
pub(crate) fn add_row(acc_row: &mut [f32], row: &[u8], kind: FloatKind, w: f32) {
    if w == 1.0 {
        num::accumulate(acc_row, row, kind);
    } else {
        num::accumulate_scaled(acc_row, row, kind, w);
    }
}

/// Adds packed rows (peer order), each times its weight, to rows `take[p][i].0` of `acc`.
pub(crate) fn accumulate_packed(
    packed: &[u8],
    kind: FloatKind,
    row_elems: usize,
    take: &[Vec<(u32, f32)>],
    acc: &mut [f32],
) {
    let row_bytes = row_elems * kind.size();
    let mut off = 0;
    for list in take {
        for &(r, w) in list {
            let r = r as usize;
            add_row(
                &mut acc[r * row_elems..(r + 1) * row_elems],
                &packed[off..off + row_bytes],
                kind,
                w,
            );
            off += row_bytes;
        }
    }
}
