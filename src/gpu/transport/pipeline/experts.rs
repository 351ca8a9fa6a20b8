//! The expert layouts' receive side, shared by both modes: the (local expert, row) flags of
//! the received rows scanned into positions ([`Selected`]), and the unpack kernels that read
//! them (`ep_unpack_expert_major` into buckets, `ep_unpack_expert_packed` into exact rows).

use super::{Ctx, GpuDispatch, Pipeline, Wire};
use crate::error::Result;
use crate::gpu::kernels::{RecvFlagsArgs, UnpackExpertMajorArgs, UnpackExpertPackedArgs};

/// What the expert layouts' receive side selects from: the wire's ids, weights, source tokens
/// and receive offsets of `n` rows, the (local expert, row) flags and their scanned positions,
/// and this rank's place (world, rank, local experts).
pub(super) struct Selected {
    ids: u64,
    w: u64,
    src: u64,
    offsets: u64,
    n: usize,
    eflag: u64,
    epos: u64,
    world: usize,
    rank: usize,
    local_experts: usize,
}

impl Selected {
    /// Flags the (local expert, row) pairs of the `n` rows received on `wire` (receive offsets
    /// `offsets`) into buffer `names[0]` and scans them into positions in `names[1]`;
    /// `pair_flag` (0 = none) gets the (row, k) flags of the same launch.
    pub(super) fn flag(
        p: &Pipeline,
        c: &mut Ctx,
        wire: &Wire,
        (n, offsets): (usize, u64),
        scratch: u64,
        names: [&str; 2],
        pair_flag: u64,
    ) -> Result<Selected> {
        let (world, rank) = (p.world(), p.rank());
        let local_experts = p.config().num_experts / world;
        let [_, ids, w, src] = wire.recv_meta()?;
        let eflag = c.buf(names[0], 4 * local_experts * n)?;
        let epos = c.buf(names[1], 4 * (local_experts * n + 1))?;
        c.run(c.k.recv_flags(RecvFlagsArgs {
            recv_ids: ids,
            N: n as i32,
            E_local: local_experts as i32,
            rank: rank as i32,
            expert_flag: eflag,
            pair_flag,
            local_counts: 0,
        }))?;
        c.run(c.k.scan(eflag, epos, local_experts * n, scratch))?;
        Ok(Selected {
            ids,
            w,
            src,
            offsets,
            n,
            eflag,
            epos,
            world,
            rank,
            local_experts,
        })
    }
}

/// The arguments both expert unpack kernels take first (`ep_unpack_expert`'s, in unpack.cu),
/// from a [`Selected`] and one row payload, followed by the kernel's own.
macro_rules! expert_unpack_args {
    ($args:ident, $sel:expr, ($recv_rows:expr, $row_bytes:expr), { $($own:tt)* }) => {
        $args {
            recv_rows: $recv_rows,
            recv_ids: $sel.ids,
            recv_w: $sel.w,
            recv_src: $sel.src,
            recv_offsets: $sel.offsets,
            N: $sel.n as i32,
            R: $sel.world as i32,
            row_bytes: $row_bytes as u64,
            E_local: $sel.local_experts as i32,
            rank: $sel.rank as i32,
            expert_flag: $sel.eflag,
            expert_pos: $sel.epos,
            $($own)*
        }
    };
}

/// EXPERT_MAJOR's buckets of M·R rows per local expert (both modes): one
/// `ep_unpack_expert_major` per row payload `outs` (received rows, row bytes, buckets).
pub(super) fn unpack_buckets(
    p: &Pipeline,
    c: &mut Ctx,
    sel: &Selected,
    outs: &[(u64, usize, u64)],
    counts: u64,
    err: u64,
) -> Result<()> {
    let capacity = (p.config().max_tokens_per_rank * sel.world) as i32;
    for &(recv_rows, wb, out_rows) in outs {
        c.run(c.k.unpack_expert_major(expert_unpack_args!(
            UnpackExpertMajorArgs,
            sel,
            (recv_rows, wb),
            {
                capacity,
                out_rows,
                counts,
                out_w: 0,
                out_src_rank: 0,
                out_src_token: 0,
                err,
            }
        )))?;
    }
    Ok(())
}

/// EXPERT_PACKED (counts mode): exact rows grouped by expert, offsets, per-row weight and
/// source.
pub(super) fn unpack_packed(
    c: &mut Ctx,
    wire: &Wire,
    sel: &Selected,
    o: &mut GpuDispatch,
) -> Result<()> {
    let nr = o.shape.received_rows;
    let offs = c.buf("out_offsets", 4 * (sel.local_experts + 1))?;
    let out_w = c.buf("out_w", 4 * nr)?;
    let sr = c.buf("out_src_rank", 4 * nr)?;
    let st = c.buf("out_src_token", 4 * nr)?;
    let outs = wire.outputs(c, "out_rows", nr)?;
    for &(recv_rows, wb, out_rows) in &outs {
        c.run(c.k.unpack_expert_packed(expert_unpack_args!(
            UnpackExpertPackedArgs,
            sel,
            (recv_rows, wb),
            {
                out_rows,
                expert_offsets: offs,
                out_w,
                out_src_rank: sr,
                out_src_token: st,
            }
        )))?;
    }
    (o.hidden, o.extras) = payloads(&outs);
    o.expert_offsets = offs;
    o.topk_weights = out_w;
    o.src_rank = sr;
    o.src_token = st;
    Ok(())
}

/// The unpacked row payloads as the dispatch's outputs: (hidden, extras).
pub(super) fn payloads(outs: &[(u64, usize, u64)]) -> (u64, Vec<u64>) {
    let mut it = outs.iter().map(|o| o.2);
    (it.next().unwrap_or(0), it.collect())
}
