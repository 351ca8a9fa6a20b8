//! Capacity mode ([`super::GpuMode::Capacity`], EXPERT_MAJOR only): no host sync, every size
//! static (M tokens per rank, whatever T is), all allocated when the manager is created
//! ([`super::Pipeline::reserve`]): a dispatch+combine can be captured in a CUDA graph at any
//! T ≤ M, and a later call at another T never moves a buffer a captured graph uses. (The
//! first call still compiles the kernels: capture after one uncaptured call.)
//!
//! Every rank sends a padded slab of M rows (ids -1, weights 0 past T) to every rank; the
//! receiver selects its rows into buckets on the device; combine returns M·K rows per peer at
//! fixed positions (the "iota" pair positions). Bad ids and full buckets land in the device
//! error word, read by `GpuManager::check_device_error`.

use super::experts::{payloads, unpack_buckets, Selected};
use super::{
    pack, return_pairs, weighted_sum, Ctx, DispatchInput, GpuDispatch, Phase, Pipeline, State, Wire,
};
use crate::error::Result;
use crate::gpu::kernels::{LayoutArgs, PairRowsArgs};
use crate::gpu::nccl::plan::counts_plan;
use crate::gpu::transport::plan::{broadcast_plan, scan_scratch_elems, DispatchShape};

/// The static arrays of one configuration: pair positions 0, 1, 2, … (iota), the receive
/// offsets 0, M, 2M, …, scan scratch, the error word.
struct Statics {
    err: u64,
    rank_flag: u64,
    ones: u64,
    iota: u64,
    d_off: u64,
    scratch: u64,
}

fn statics(p: &Pipeline, c: &mut Ctx) -> Result<Statics> {
    let cfg = p.config();
    let (r, k, m) = (p.world(), cfg.top_k, cfg.max_tokens_per_rank);
    let el = cfg.num_experts / r;
    let n = r * m;
    let err = c.buf("err", 8)?;
    let ones = c.buf("cap_ones", 4 * n * k)?;
    let iota = c.buf("cap_iota", 4 * (n * k + 1))?;
    let mvals = c.buf("cap_mvals", 4 * r)?;
    let d_off = c.buf("cap_offsets", 4 * (r + 1))?;
    // The validation launch's rank flags (unused afterwards). Sized by M, not T: a graph
    // captured at a smaller T keeps writing this buffer when replayed.
    let rank_flag = c.buf("cap_rank_flag", 4 * r * m)?;
    let scratch = c.buf(
        "scan_scratch_cap",
        4 * scan_scratch_elems(n * k * el.max(1)),
    )?;
    // SAFETY: every range was sized above.
    unsafe {
        c.x.fill8(err, 0, 8)?;
        c.x.fill32(ones, 1, n * k)?;
        c.x.fill32(mvals, m as u32, r)?;
    }
    c.run(c.k.scan(ones, iota, n * k, scratch))?;
    c.run(c.k.scan(mvals, d_off, r, scratch))?;
    Ok(Statics {
        err,
        rank_flag,
        ones,
        iota,
        d_off,
        scratch,
    })
}

/// A capacity-mode dispatch: validation into the error word, padded slabs, the broadcast,
/// the buckets, the source side of combine.
pub(super) fn dispatch(p: &mut Pipeline, c: &mut Ctx, inp: &DispatchInput) -> Result<GpuDispatch> {
    // The CPU manager's check and wording (T > M on this rank).
    p.cpu.check_tokens(inp.tokens)?;
    // The peers wait for this rank's slabs from here on.
    p.phase = Phase::Collective;
    let cfg = p.config();
    let (r, e) = (p.world(), cfg.num_experts);
    let el = e / r;
    let (t, m) = (inp.tokens, cfg.max_tokens_per_rank);
    let s = statics(p, c)?;
    // Validation only (bad ids → error word; read it with check_device_error).
    c.run(c.k.layout(LayoutArgs {
        topk_ids: inp.topk_ids,
        T: t as i32,
        E: e as i32,
        E_local: el as i32,
        R: r as i32,
        rank_flag: s.rank_flag,
        pair_flag: 0,
        rank_counts: 0,
        expert_counts: 0,
        err: s.err,
    }))?;
    let wire = send(p, c, inp, &s)?;
    let (hidden, extras, counts) = receive(p, c, &wire, &s)?;
    combine_source(p, c, &wire, &s)?;
    let cap = m * r;
    let geo = p.geometry().layout_geometry();
    let sh = p.contract().shapes(&geo, cfg.hidden, el * cap);
    // The received rows are only on the device (counts).
    let shape = DispatchShape::new(p.layout(), usize::MAX, el * cap, sh);
    p.state = Some(State {
        tokens: t,
        id_dtype: inp.id_dtype,
        n_recv: r * m,
        gathered: None,
        shape: shape.clone(),
    });
    let mut o = GpuDispatch::rows(shape, &[hidden]);
    o.extras = extras;
    o.counts = counts;
    Ok(o)
}

/// Padded slabs of M rows (ids -1, weights 0 past T), packed and broadcast.
fn send(p: &Pipeline, c: &mut Ctx, inp: &DispatchInput, s: &Statics) -> Result<Wire> {
    let cfg = p.config();
    let (r, d, k, m) = (p.world(), p.rank(), cfg.top_k, cfg.max_tokens_per_rank);
    let wire = Wire::alloc(c, "cap_", p.widths(), m, r * m)?;
    // Padding rows: ids -1 (0xff bytes), weights 0.
    // SAFETY: m*k int32/f32.
    unsafe {
        c.x.fill8(wire.sends[1], 0xff, 4 * m * k)?;
        c.x.fill8(wire.sends[2], 0, 4 * m * k)?;
    }
    pack(c, inp, &cfg.extra_row_bytes, 1, s.ones, s.iota, &wire)?;
    let rows_per = vec![m; r];
    let zero = p.opts.zero_size_p2p;
    let items = wire.items(|w| Ok(broadcast_plan(&rows_per, d, w, zero)))?;
    c.exchange(&items)?;
    Ok(wire)
}

/// The device-side selection into buckets: (hidden, extras, counts).
fn receive(p: &Pipeline, c: &mut Ctx, wire: &Wire, s: &Statics) -> Result<(u64, Vec<u64>, u64)> {
    let cfg = p.config();
    let (r, m) = (p.world(), cfg.max_tokens_per_rank);
    let el = cfg.num_experts / r;
    let names = ["cap_expert_flag", "cap_expert_pos"];
    let sel = Selected::flag(p, c, wire, (r * m, s.d_off), s.scratch, names, 0)?;
    let counts = c.buf("cap_counts", 4 * el)?;
    let outs = wire.outputs(c, "cap_out_rows", el * m * r)?;
    unpack_buckets(p, c, &sel, &outs, counts, s.err)?;
    let (hidden, extras) = payloads(&outs);
    Ok((hidden, extras, counts))
}

/// The source side of combine: row of (t, k) = owner·M·K + t·K + k (fixed slabs), and the
/// padded weights.
fn combine_source(p: &Pipeline, c: &mut Ctx, wire: &Wire, s: &Statics) -> Result<()> {
    let cfg = p.config();
    let (k, e, m) = (cfg.top_k, cfg.num_experts, cfg.max_tokens_per_rank);
    let el = e / p.world();
    let crow = c.buf("cap_combine_rows", 4 * m * k)?;
    let wcopy = c.buf("cap_weights", 4 * m * k)?;
    let rows = PairRowsArgs {
        topk_ids: wire.sends[1],
        T: m as i32,
        E: e as i32,
        E_local: el as i32,
        pair_pos: s.iota,
        rows: crow,
    };
    c.run(c.k.pair_rows(true, rows))?;
    // SAFETY: the padded weights slab (m*k f32).
    unsafe { c.x.copy(wcopy, wire.sends[2], 4 * m * k) }
}

/// A capacity-mode combine: M·K rows per peer back to their fixed slots, the weighted sum.
pub(super) fn combine(
    p: &Pipeline,
    c: &mut Ctx,
    st: &State,
    expert_output: u64,
    out: u64,
) -> Result<()> {
    let cfg = p.config();
    let (r, d, k, m) = (p.world(), p.rank(), cfg.top_k, cfg.max_tokens_per_rank);
    let erb = p.expert_row_bytes();
    let send = c.buf("cap_comb_send", r * m * k * erb)?;
    let recv = c.buf("cap_comb_recv", r * m * k * erb)?;
    let ids = c.buf("cap_recv1", 0)?;
    let epos = c.buf("cap_expert_pos", 0)?;
    let iota = c.buf("cap_iota", 0)?;
    let crow = c.buf("cap_combine_rows", 0)?;
    let w = c.buf("cap_weights", 0)?;
    return_pairs(p, c, st, expert_output, [ids, epos, iota], m * r, send)?;
    let cm = vec![(m * k) as i32; r * r];
    let plan = counts_plan(&cm, r, d, erb, p.opts)?;
    c.exchange(&[(plan, send, recv)])?;
    weighted_sum(c, p, st.tokens, recv, crow, w, out)
}
