//! Counts mode, per dispatch, all on the executor's stream:
//! 1. `ep_layout` → this rank's counts row ([`crate::gpu::transport::plan`] module doc) +
//!    device error word;
//! 2. all-gather of the rows;
//! 3. **the one host sync** ([`Executor::read_i32`]): refused on a capturing stream;
//! 4. scans → `ep_pack` (rows, wire ids/weights/source token, extras);
//! 5. one exchange group per buffer ([`counts_plan`]), self rows by a device copy;
//! 6. the layout's unpack kernel.
//!
//! Combine mirrors it with the transposed matrix: `ep_combine_return_*` on the expert rank,
//! the reverse exchange, then `ep_weighted_combine` (expert layouts) or `ep_sum_ranks`.

use super::experts::{payloads, unpack_buckets, unpack_packed, Selected};
use super::{
    pack, return_pairs, sizes, weighted_sum, Ctx, DispatchInput, Executor, Family, GpuDispatch,
    Phase, Pipeline, State, Wire,
};
use crate::error::{Error, Result};
use crate::gpu::kernels::{
    encode_error_word, CombineReturnRankMajorArgs, LayoutArgs, PairRowsArgs, RecvFlagsArgs,
    SumRanksArgs, UnpackRankMajorArgs, UnpackTokenMajorArgs, ERR_HOST_REJECTED,
};
use crate::gpu::nccl::plan::counts_plan;
use crate::gpu::transport::plan::{
    broadcast_plan, combine_counts, counts_row_len, dispatch_shape, recv_offsets,
    row_expert_counts, scan_scratch_elems, DispatchShape, Gathered, ROW_ERROR, ROW_RANK_COUNTS,
};
use crate::moe::layout::WeightsBy;

/// A counts-mode dispatch (steps 1–6 of the module doc).
pub(super) fn dispatch(p: &mut Pipeline, c: &mut Ctx, inp: &DispatchInput) -> Result<GpuDispatch> {
    // The one host sync of counts mode is impossible inside a graph capture.
    c.x.ensure_not_capturing()?;
    // Every buffer of a call with at most max(T, M) tokens on each rank, before the peers
    // wait for this rank (only a peer with more tokens makes a buffer grow later).
    let bound = inp.tokens.max(p.config().max_tokens_per_rank);
    for (name, bytes) in sizes::buffers(p, bound) {
        c.buf(&name, bytes)?;
    }
    let g = gather(p, c, inp)?;
    // Every rank reads the same counts: an error up to here is every rank's.
    let shape = dispatch_shape(p.layout(), &p.geometry(), &g)?;
    p.phase = Phase::Collective;
    let sent = send(p, c, inp, &g)?;
    let o = receive(p, c, inp, &sent, shape.clone())?;
    p.state = Some(State {
        tokens: inp.tokens,
        id_dtype: inp.id_dtype,
        n_recv: sent.n_recv,
        gathered: Some(g),
        shape,
    });
    Ok(o)
}

/// Steps 1–3: this rank's counts row, the all-gather, the host sync, the checks.
fn gather(p: &mut Pipeline, c: &mut Ctx, inp: &DispatchInput) -> Result<Gathered> {
    let cfg = p.config();
    let (r, k, e) = (p.world(), cfg.top_k, cfg.num_experts);
    let t = inp.tokens;
    let row_len = counts_row_len(r, e);
    let row = c.buf("counts_row", 4 * row_len)?;
    let all = c.buf("counts_all", 4 * row_len * r)?;
    let err = c.buf("err", 8)?;
    let rank_flag = c.buf("rank_flag", 4 * r * t)?;
    let pair_flag = if p.per_pair() {
        c.buf("pair_flag", 4 * r * t * k)?
    } else {
        0
    };
    // SAFETY: every range was sized above.
    unsafe {
        c.x.fill8(row, 0, 4 * row_len)?;
        c.x.fill8(err, 0, 8)?;
        c.x.upload(row, &(t as i32).to_ne_bytes(), "h_tokens")?;
    }
    c.run(c.k.layout(LayoutArgs {
        topk_ids: inp.topk_ids,
        T: t as i32,
        E: e as i32,
        E_local: (e / r) as i32,
        R: r as i32,
        rank_flag,
        pair_flag,
        rank_counts: row + 4 * ROW_RANK_COUNTS as u64,
        expert_counts: row + 4 * row_expert_counts(r) as u64,
        err,
    }))?;
    // SAFETY: err (8 bytes) into the row's two error slots.
    unsafe { c.x.copy(row + 4 * ROW_ERROR as u64, err, 8) }?;
    p.phase = Phase::Collective;
    // SAFETY: `all` holds R rows.
    unsafe { c.x.all_gather_i32(row, all, row_len) }?;
    let raw = c.x.read_i32(all, row_len * r)?;
    p.phase = Phase::Agreed;
    let g = Gathered::parse(&raw, r, e)?;
    g.check(p.rank())?;
    Ok(g)
}

/// The counts row of a rank that rejected its input (T = 0, the host-made error word), sent
/// through the all-gather its peers are waiting in ([`Pipeline::reject_dispatch`]).
pub(super) fn send_rejection(p: &Pipeline, x: &mut dyn Executor) -> Result<()> {
    let (r, e) = (p.world(), p.config().num_experts);
    let row_len = counts_row_len(r, e);
    let word = encode_error_word(ERR_HOST_REJECTED, 0, 0);
    let row = x.buffer("counts_row", 4 * row_len)?;
    let all = x.buffer("counts_all", 4 * row_len * r)?;
    let mut v = vec![0i32; row_len];
    v[ROW_ERROR] = word as u32 as i32;
    v[ROW_ERROR + 1] = (word >> 32) as u32 as i32;
    // SAFETY: device buffers sized above.
    unsafe {
        x.upload(row, crate::bytes::as_bytes(&v), "h_reject")?;
        x.all_gather_i32(row, all, row_len)?;
    }
    x.read_i32(all, row_len * r).map(|_| ())
}

/// The send side's result: the wire buffers and the sizes the receive side needs.
struct Sent {
    wire: Wire,
    matrix: Vec<i32>,
    n_recv: usize,
    scratch: u64,
}

/// Steps 4–5: flags scanned into send positions, `ep_pack`, the exchange.
/// REPLICATED packs each token once (R = 1, every flag set) and broadcasts.
fn send(p: &Pipeline, c: &mut Ctx, inp: &DispatchInput, g: &Gathered) -> Result<Sent> {
    let cfg = p.config();
    let (r, d, k) = (p.world(), p.rank(), cfg.top_k);
    let el = cfg.num_experts / r;
    let t = inp.tokens;
    let replicated = p.every_token();
    let matrix = if replicated {
        g.replicated_counts()
    } else {
        g.rank_counts.clone()
    };
    let rank_flag = c.buf("rank_flag", 4 * r * t)?;
    let (pack_r, flags) = if replicated {
        let ones = c.buf("ones_t", 4 * t)?;
        // SAFETY: t int32.
        unsafe { c.x.fill32(ones, 1, t) }?;
        (1usize, ones)
    } else {
        (r, rank_flag)
    };
    let n_send: usize = if replicated {
        t
    } else {
        (0..r).map(|x| matrix[d * r + x] as usize).sum()
    };
    let n_recv: usize = (0..r).map(|x| matrix[x * r + d] as usize).sum();
    let scan_n = (pack_r * t).max(r * t * k).max(el * n_recv).max(n_recv * k);
    let scratch = c.buf("scan_scratch", 4 * scan_scratch_elems(scan_n))?;
    let send_pos = c.buf("send_pos", 4 * (pack_r * t + 1))?;
    c.run(c.k.scan(flags, send_pos, pack_r * t, scratch))?;
    let wire = Wire::alloc(c, "", p.widths(), n_send, n_recv)?;
    pack(c, inp, &cfg.extra_row_bytes, pack_r, flags, send_pos, &wire)?;
    let zero = p.opts.zero_size_p2p;
    let items = wire.items(|w| {
        if replicated {
            Ok(broadcast_plan(&g.tokens, d, w, zero))
        } else {
            counts_plan(&matrix, r, d, w, p.opts)
        }
    })?;
    c.exchange(&items)?;
    Ok(Sent {
        wire,
        matrix,
        n_recv,
        scratch,
    })
}

/// Step 6: the receive offsets on the device, then the layout's unpack.
fn receive(
    p: &Pipeline,
    c: &mut Ctx,
    inp: &DispatchInput,
    sent: &Sent,
    shape: DispatchShape,
) -> Result<GpuDispatch> {
    let r = p.world();
    let offsets = recv_offsets(&sent.matrix, r, p.rank());
    let d_off = c.buf("recv_offsets", 4 * (r + 1))?;
    // SAFETY: r + 1 int32.
    unsafe {
        c.x.upload(d_off, crate::bytes::as_bytes(&offsets), "h_offsets")
    }?;
    let mut o = GpuDispatch::rows(shape, &[sent.wire.recvs[0]]);
    o.extras = sent.wire.recvs[4..].to_vec();
    match p.family {
        Family::Tokens => unpack_tokens(p, c, sent, &mut o)?,
        Family::Buckets | Family::Packed => {
            unpack_experts(p, c, sent, d_off, &mut o)?;
            combine_source(p, c, inp, sent.scratch)?;
        }
        Family::Regions => unpack_rank_major(p, c, sent, d_off, &mut o)?,
    }
    Ok(o)
}

/// REPLICATED and TOKEN_MAJOR: the rows stay in the wire buffer; ids widened to int64 (the
/// non-local ones set to -1 in TOKEN_MAJOR, with their weights zeroed), local counts.
fn unpack_tokens(p: &Pipeline, c: &mut Ctx, sent: &Sent, o: &mut GpuDispatch) -> Result<()> {
    let cfg = p.config();
    let (d, k, e) = (p.rank(), cfg.top_k, cfg.num_experts);
    let el = e / p.world();
    let n_recv = sent.n_recv;
    let [rows, ids, w, _] = sent.wire.recv_meta()?;
    let replicated = p.every_token();
    let out_ids = c.buf("out_ids", 8 * n_recv * k)?;
    let out_w = c.buf("out_w", 4 * n_recv * k)?;
    let (el_u, rank_u) = if replicated {
        (e, 0)
    } else {
        let counts = c.buf("out_counts", 4 * el)?;
        // SAFETY: el int32.
        unsafe { c.x.fill8(counts, 0, 4 * el) }?;
        c.run(c.k.recv_flags(RecvFlagsArgs {
            recv_ids: ids,
            N: n_recv as i32,
            E_local: el as i32,
            rank: d as i32,
            expert_flag: 0,
            pair_flag: 0,
            local_counts: counts,
        }))?;
        o.counts = counts;
        (el, d)
    };
    c.run(c.k.unpack_token_major(UnpackTokenMajorArgs {
        recv_rows: rows,
        recv_ids: ids,
        recv_w: w,
        N: n_recv as i32,
        row_bytes: p.row_bytes() as u64,
        E_local: el_u as i32,
        rank: rank_u as i32,
        out_rows: 0,
        out_ids,
        out_w,
    }))?;
    o.topk_ids = out_ids;
    // REPLICATED is an all-gather: weights arrive unchanged (a masked id keeps its weight, as
    // on the CPU path); TOKEN_MAJOR zeroes the non-local ones.
    o.topk_weights = if replicated { w } else { out_w };
    Ok(())
}

/// EXPERT_MAJOR and EXPERT_PACKED: (local expert, row) flags and positions, then the
/// buckets or the packed rows.
fn unpack_experts(
    p: &Pipeline,
    c: &mut Ctx,
    sent: &Sent,
    d_off: u64,
    o: &mut GpuDispatch,
) -> Result<()> {
    let cfg = p.config();
    let (n, k) = (sent.n_recv, cfg.top_k);
    let rpflag = c.buf("recv_pair_flag", 4 * n * k)?;
    let rppos = c.buf("recv_pair_pos", 4 * (n * k + 1))?;
    let names = ["expert_flag", "expert_pos"];
    let sel = Selected::flag(p, c, &sent.wire, (n, d_off), sent.scratch, names, rpflag)?;
    c.run(c.k.scan(rpflag, rppos, n * k, sent.scratch))?;
    if p.family == Family::Buckets {
        let el = cfg.num_experts / p.world();
        let cap = cfg.max_tokens_per_rank * p.world();
        let counts = c.buf("out_counts", 4 * el)?;
        let err = c.buf("err", 8)?;
        let outs = sent.wire.outputs(c, "out_rows", el * cap)?;
        unpack_buckets(p, c, &sel, &outs, counts, err)?;
        (o.hidden, o.extras) = payloads(&outs);
        o.counts = counts;
        return Ok(());
    }
    unpack_packed(c, &sent.wire, &sel, o)
}

/// The source side of combine (expert layouts): where each (t, k) result will land, and the
/// weights combine applies.
fn combine_source(p: &Pipeline, c: &mut Ctx, inp: &DispatchInput, scratch: u64) -> Result<()> {
    let cfg = p.config();
    let (r, k, e) = (p.world(), cfg.top_k, cfg.num_experts);
    let t = inp.tokens;
    let pair_flag = c.buf("pair_flag", 4 * r * t * k)?;
    let ppos = c.buf("pair_pos", 4 * (r * t * k + 1))?;
    let crow = c.buf("combine_rows", 4 * t * k)?;
    let wcopy = c.buf("weights_copy", 4 * t * k)?;
    c.run(c.k.scan(pair_flag, ppos, r * t * k, scratch))?;
    let rows = PairRowsArgs {
        topk_ids: inp.topk_ids,
        T: t as i32,
        E: e as i32,
        E_local: (e / r) as i32,
        pair_pos: ppos,
        rows: crow,
    };
    c.run(c.k.pair_rows(false, rows))?;
    if t * k > 0 {
        // SAFETY: t*k f32 in both.
        unsafe { c.x.copy(wcopy, inp.topk_weights, 4 * t * k) }?;
    }
    Ok(())
}

// unpack_experts and unpack_rank_major take the same arguments: receive's per-layout steps.
/// RANK_MAJOR: regions of M rows per source rank, ids and weights unchanged, recv counts.
fn unpack_rank_major(
    p: &Pipeline,
    c: &mut Ctx,
    sent: &Sent,
    d_off: u64,
    o: &mut GpuDispatch,
) -> Result<()> {
    let cfg = p.config();
    let (r, k, m) = (p.world(), cfg.top_k, cfg.max_tokens_per_rank);
    let [_, ids, w, _] = sent.wire.recv_meta()?;
    let out_ids = c.buf("out_ids", 8 * r * m * k)?;
    let out_w = c.buf("out_w", 4 * r * m * k)?;
    let counts = c.buf("out_counts", 4 * r)?;
    let err = c.buf("err", 8)?;
    let outs = sent.wire.outputs(c, "out_rows", r * m)?;
    for &(recv_rows, wb, out_rows) in &outs {
        c.run(c.k.unpack_rank_major(UnpackRankMajorArgs {
            recv_rows,
            recv_ids: ids,
            recv_w: w,
            recv_offsets: d_off,
            R: r as i32,
            M: m as i32,
            row_bytes: wb as u64,
            out_rows,
            out_ids,
            out_w,
            recv_counts: counts,
            err,
        }))?;
    }
    (o.hidden, o.extras) = payloads(&outs);
    o.topk_ids = out_ids;
    o.topk_weights = out_w;
    o.counts = counts;
    Ok(())
}

// The same arguments as capacity::combine: the two modes' combine, chosen by the pipeline.
/// A counts-mode combine: the layout's return rows, the reverse exchange, the reduction.
pub(super) fn combine(
    p: &Pipeline,
    c: &mut Ctx,
    st: &State,
    expert_output: u64,
    out: u64,
) -> Result<()> {
    let (r, d) = (p.world(), p.rank());
    let erb = p.expert_row_bytes();
    let g = st
        .gathered
        .as_ref()
        .ok_or_else(|| Error::Internal("counts-mode state without counts".into()))?;
    let cm = combine_counts(p.layout(), g);
    let n_back: usize = (0..r).map(|x| cm[d * r + x] as usize).sum();
    let n_home: usize = (0..r).map(|x| cm[x * r + d] as usize).sum();
    let recv = c.buf("comb_recv", n_home * erb)?;
    let send = return_rows(p, c, st, expert_output, n_back)?;
    let plan = counts_plan(&cm, r, d, erb, p.opts)?;
    c.exchange(&[(plan, send, recv)])?;
    reduce(p, c, st.tokens, recv, out)
}

/// The expert rank's side of combine: the rows to send home, grouped by source rank.
fn return_rows(
    p: &Pipeline,
    c: &mut Ctx,
    st: &State,
    expert_output: u64,
    n_back: usize,
) -> Result<u64> {
    let cfg = p.config();
    let r = p.world();
    let erb = p.expert_row_bytes();
    match p.family {
        Family::Tokens => Ok(expert_output),
        Family::Regions => {
            let send = c.buf("comb_send", n_back * erb)?;
            let d_off = c.buf("recv_offsets", 4 * (r + 1))?;
            let m = cfg.max_tokens_per_rank as i32;
            c.run(c.k.combine_return_rank_major(CombineReturnRankMajorArgs {
                y: expert_output,
                row_bytes: erb as u64,
                recv_offsets: d_off,
                R: r as i32,
                M: m,
                send_rows: send,
            }))?;
            Ok(send)
        }
        Family::Buckets | Family::Packed => {
            let send = c.buf("comb_send", n_back * erb)?;
            let ids = c.buf("recv1", 0)?;
            let epos = c.buf("expert_pos", 0)?;
            let rppos = c.buf("recv_pair_pos", 0)?;
            let cap = if p.family == Family::Buckets {
                cfg.max_tokens_per_rank * r
            } else {
                0
            };
            return_pairs(p, c, st, expert_output, [ids, epos, rppos], cap, send)?;
            Ok(send)
        }
    }
}

/// The source rank's side of combine: `[T, hidden]` from the rows that came home.
fn reduce(p: &Pipeline, c: &mut Ctx, t: usize, recv: u64, out: u64) -> Result<()> {
    let (r, h) = (p.world() as i32, p.config().hidden as i32);
    let t = t as i32;
    let sum = |rank_flag, send_pos| SumRanksArgs {
        y: recv,
        rank_flag,
        send_pos,
        T: t,
        R: r,
        H: h,
        out,
    };
    match p.contract().weights_by {
        // Holder-weighted rows: a plain sum per token (REPLICATED: every rank's row of every
        // token, no flags).
        WeightsBy::Holder if p.every_token() => c.run(c.k.sum_ranks(sum(0, 0))),
        WeightsBy::Holder => {
            let flag = c.buf("rank_flag", 0)?;
            let pos = c.buf("send_pos", 0)?;
            c.run(c.k.sum_ranks(sum(flag, pos)))
        }
        WeightsBy::Source => {
            let crow = c.buf("combine_rows", 0)?;
            let w = c.buf("weights_copy", 0)?;
            weighted_sum(c, p, t as usize, recv, crow, w, out)
        }
    }
}
