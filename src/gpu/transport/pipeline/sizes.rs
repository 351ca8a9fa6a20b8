//! The largest size of every buffer the pipeline asks its executor for, when no rank has more
//! than `t` tokens: what [`super::Pipeline::reserve`] allocates at creation (`t` = M) and
//! counts mode makes sure of before its all-gather (`t` = max(T, M)), so a call within the
//! bound allocates nothing once its peers may be waiting for it. Each entry mirrors a
//! `buffer` request of counts.rs / capacity.rs (same name, same formula at the bound);
//! tests/gpu_pipeline_counts_emu.rs checks that random calls then allocate nothing.

use super::{Family, GpuMode, Pipeline};
use crate::gpu::transport::plan::{counts_row_len, scan_scratch_elems};

/// (name, bytes) of every buffer of `p`'s mode and layout for at most `t` tokens per rank.
pub(super) fn buffers(p: &Pipeline, t: usize) -> Vec<(String, usize)> {
    match p.mode {
        GpuMode::Counts => counts(p, t),
        GpuMode::Capacity => capacity(p),
    }
}

/// The row payloads' buffers `{prefix}{i}` of `rows` rows (hidden and extras: wire index 0
/// and 4..).
fn payloads(p: &Pipeline, v: &mut Vec<(String, usize)>, prefix: &str, rows: usize) {
    for (i, w) in p.widths().into_iter().enumerate() {
        if i == 0 || i >= 4 {
            v.push((format!("{prefix}{i}"), rows * w));
        }
    }
}

/// The wire buffers `{prefix}send{i}` / `{prefix}recv{i}`.
fn wire(p: &Pipeline, v: &mut Vec<(String, usize)>, prefix: &str, n_send: usize, n_recv: usize) {
    for (i, w) in p.widths().into_iter().enumerate() {
        v.push((format!("{prefix}send{i}"), n_send * w));
        v.push((format!("{prefix}recv{i}"), n_recv * w));
    }
}

fn counts(p: &Pipeline, t: usize) -> Vec<(String, usize)> {
    let cfg = p.config();
    let (r, k, e, m) = (
        p.world(),
        cfg.top_k,
        cfg.num_experts,
        cfg.max_tokens_per_rank,
    );
    let el = e / r;
    let row_len = counts_row_len(r, e);
    let replicated = p.every_token();
    let pack_r = if replicated { 1 } else { r };
    // Rows this rank sends (a token goes to at most min(R, K) ranks) and receives (each
    // source sends a token at most once), (token, local expert) rows received, and the rows
    // combine moves back (to the sources) and home (from the experts).
    let n_send = if replicated { t } else { t * r.min(k) };
    let n_recv = r * t;
    let pairs_in = n_recv * k.min(el);
    let (n_back, n_home) = match (replicated, p.per_pair()) {
        (true, _) => (n_recv, r * t),
        (false, true) => (pairs_in, t * k),
        (false, false) => (n_recv, t * r.min(k)),
    };
    let scan_n = (pack_r * t).max(r * t * k).max(el * n_recv).max(n_recv * k);
    let mut v: Vec<(String, usize)> = vec![
        ("counts_row".into(), 4 * row_len),
        ("counts_all".into(), 4 * row_len * r),
        ("err".into(), 8),
        ("rank_flag".into(), 4 * r * t),
        ("scan_scratch".into(), 4 * scan_scratch_elems(scan_n)),
        ("send_pos".into(), 4 * (pack_r * t + 1)),
        ("recv_offsets".into(), 4 * (r + 1)),
        ("comb_recv".into(), n_home * p.expert_row_bytes()),
    ];
    if p.per_pair() {
        v.push(("pair_flag".into(), 4 * r * t * k));
    }
    if replicated {
        v.push(("ones_t".into(), 4 * t));
    }
    wire(p, &mut v, "", n_send, n_recv);
    if p.family != Family::Tokens {
        v.push(("comb_send".into(), n_back * p.expert_row_bytes()));
    }
    match p.family {
        Family::Tokens => {
            v.push(("out_ids".into(), 8 * n_recv * k));
            v.push(("out_w".into(), 4 * n_recv * k));
            if !replicated {
                v.push(("out_counts".into(), 4 * el));
            }
        }
        Family::Buckets | Family::Packed => experts(p, &mut v, t, n_recv, pairs_in),
        Family::Regions => {
            v.push(("out_ids".into(), 8 * r * m * k));
            v.push(("out_w".into(), 4 * r * m * k));
            v.push(("out_counts".into(), 4 * r));
            payloads(p, &mut v, "out_rows", r * m);
        }
    }
    v
}

/// EXPERT_MAJOR / EXPERT_PACKED in counts mode: the selection, the outputs, combine's source.
fn experts(p: &Pipeline, v: &mut Vec<(String, usize)>, t: usize, n: usize, nr: usize) {
    let cfg = p.config();
    let (r, k) = (p.world(), cfg.top_k);
    let el = cfg.num_experts / r;
    v.extend([
        ("expert_flag".into(), 4 * el * n),
        ("expert_pos".into(), 4 * (el * n + 1)),
        ("recv_pair_flag".into(), 4 * n * k),
        ("recv_pair_pos".into(), 4 * (n * k + 1)),
        ("pair_pos".into(), 4 * (r * t * k + 1)),
        ("combine_rows".into(), 4 * t * k),
        ("weights_copy".into(), 4 * t * k),
    ]);
    if p.family == Family::Buckets {
        v.push(("out_counts".into(), 4 * el));
        payloads(p, v, "out_rows", el * cfg.max_tokens_per_rank * r);
        return;
    }
    v.extend([
        ("out_offsets".into(), 4 * (el + 1)),
        ("out_w".into(), 4 * nr),
        ("out_src_rank".into(), 4 * nr),
        ("out_src_token".into(), 4 * nr),
    ]);
    payloads(p, v, "out_rows", nr);
}

/// Capacity mode: every size is static (M tokens per rank, padded slabs).
fn capacity(p: &Pipeline) -> Vec<(String, usize)> {
    let cfg = p.config();
    let (r, k, m) = (p.world(), cfg.top_k, cfg.max_tokens_per_rank);
    let el = cfg.num_experts / r;
    let n = r * m;
    let comb = r * m * k * p.expert_row_bytes();
    let mut v: Vec<(String, usize)> = vec![
        ("err".into(), 8),
        ("cap_ones".into(), 4 * n * k),
        ("cap_iota".into(), 4 * (n * k + 1)),
        ("cap_mvals".into(), 4 * r),
        ("cap_offsets".into(), 4 * (r + 1)),
        ("cap_rank_flag".into(), 4 * r * m),
        (
            "scan_scratch_cap".into(),
            4 * scan_scratch_elems(n * k * el.max(1)),
        ),
        ("cap_expert_flag".into(), 4 * el * n),
        ("cap_expert_pos".into(), 4 * (el * n + 1)),
        ("cap_counts".into(), 4 * el),
        ("cap_combine_rows".into(), 4 * m * k),
        ("cap_weights".into(), 4 * m * k),
        ("cap_comb_send".into(), comb),
        ("cap_comb_recv".into(), comb),
    ];
    wire(p, &mut v, "cap_", m, n);
    payloads(p, &mut v, "cap_out_rows", el * m * r);
    v
}
