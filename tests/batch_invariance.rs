//! Batch invariance: a token's combined output is bit-identical whatever else is in the batch
//! (how many tokens each rank has, their values and routes, where the token sits in its
//! rank's batch), for one backend of every layout epcomm implements, in f32 and bf16. vLLM
//! needs this under `VLLM_BATCH_INVARIANT`, where (0.33 and 0.34) the
//! `allgather_reducescatter` combine runs as an all-to-all plus a fixed-order sum: epcomm's
//! combines sum each token's contributions in a fixed order (by source rank, then by slot of
//! the token's own top-k), never in an order the rest of the batch decides.

mod common;
mod ranks;

use epcomm::group::shm::ShmGroup;
use epcomm::group::GroupOptions;
use epcomm::moe::reference::{unit, ToyExperts};
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::{self, FloatKind};

const WORLD: usize = 4;
const EXPERTS: usize = 16;
const TOP_K: usize = 4;
const HIDDEN: usize = 48;
const MAX_TOKENS: usize = 24;
/// One backend of each layout epcomm implements (REPLICATED, TOKEN_MAJOR, EXPERT_MAJOR,
/// EXPERT_PACKED, RANK_MAJOR).
const BACKENDS: [&str; 5] = [
    "allgather_reducescatter",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "flashinfer_nvlink_two_sided",
];

fn cfg(kind: FloatKind) -> MoeConfig {
    MoeConfig {
        num_experts: EXPERTS,
        top_k: TOP_K,
        hidden: HIDDEN,
        hidden_dtype: kind.dtype(),
        expert_dtype: kind,
        out_dtype: kind,
        max_tokens_per_rank: MAX_TOKENS,
        extra_row_bytes: Vec::new(),
        apply_router_weight_on_input: false,
    }
}

/// The probe token (rank 0's): its row, its experts (one on each rank) and weights.
fn probe() -> (Vec<f32>, Vec<i64>, Vec<f32>) {
    let x = (0..HIDDEN as u64).map(|i| unit(7, i)).collect();
    (x, vec![13, 2, 7, 8], vec![0.4, 0.3, 0.2, 0.1])
}

/// Rank `rank`'s batch in variant `v`: `n` tokens of their own, and on rank 0 the probe at
/// position `at`.
fn batch(v: u64, rank: usize, n: usize, at: usize) -> (Vec<f32>, Vec<i64>, Vec<f32>) {
    let seed = v * 1000 + rank as u64;
    let (mut x, mut ids, mut ws) = (Vec::new(), Vec::new(), Vec::new());
    let (px, pids, pws) = probe();
    for t in 0..n {
        if rank == 0 && t == at {
            x.extend(&px);
            ids.extend(&pids);
            ws.extend(&pws);
            continue;
        }
        x.extend((0..HIDDEN as u64).map(|i| unit(seed, (t * HIDDEN) as u64 + i)));
        let first = ((unit(seed ^ 0x55, t as u64) + 1.0) * 0.5 * EXPERTS as f32) as usize;
        for k in 0..TOP_K {
            // Distinct experts; some tokens route to one rank only, some to all.
            let stride = 1 + (t + v as usize) % 5;
            ids.push(((first + k * stride) % EXPERTS) as i64);
        }
        ws.extend((0..TOP_K as u64).map(|k| 0.5 + 0.5 * unit(seed ^ 0x77, (t * TOP_K) as u64 + k)));
    }
    (x, ids, ws)
}

/// The probe's combined row (its bytes) for every variant.
fn probe_rows(backend: &'static str, kind: FloatKind) -> Vec<Vec<u8>> {
    // (variant, tokens per rank, the probe's position on rank 0)
    let variants: Vec<(u64, [usize; WORLD], usize)> = vec![
        (1, [1, 1, 1, 1], 0),
        (2, [24, 3, 17, 9], 11),
        (3, [5, 24, 0, 24], 4),
        (4, [24, 24, 24, 24], 23),
        (5, [2, 0, 0, 0], 1),
    ];
    let name = ranks::unique("bi", backend);
    let out = ranks::on_threads(WORLD, move |rank| {
        let opts = GroupOptions::default();
        let mut g = ShmGroup::join(&name, rank, WORLD, opts).unwrap();
        let ex = ToyExperts::new(EXPERTS, HIDDEN, 23);
        let mut m = Manager::new(backend, cfg(kind), rank, WORLD).unwrap();
        let mut rows = Vec::new();
        for (v, sizes, at) in &variants {
            let (x, ids, ws) = batch(*v, rank, sizes[rank], *at);
            let xb = num::from_f32(&x, kind);
            let view = m.dispatch(&mut g, &xb, &ids, &ws, &[]).unwrap();
            let y = ex.run_local(&view, kind, rank, WORLD, TOP_K);
            let mut out = vec![0u8; sizes[rank] * HIDDEN * kind.size()];
            m.combine(&mut g, &num::from_f32(&y, kind), &mut out)
                .unwrap();
            if rank == 0 {
                let row = HIDDEN * kind.size();
                rows.push(out[at * row..(at + 1) * row].to_vec());
            }
        }
        rows
    });
    out.into_iter().next().unwrap()
}

#[test]
fn a_tokens_combined_output_does_not_depend_on_the_rest_of_the_batch() {
    for kind in [FloatKind::F32, FloatKind::Bf16] {
        for backend in BACKENDS {
            let rows = probe_rows(backend, kind);
            for (i, r) in rows.iter().enumerate() {
                assert_eq!(r, &rows[0], "{backend} {kind:?}: variant {i} differs");
            }
            // It is the probe's row: the reference's, to rounding.
            let (x, ids, ws) = probe();
            let ex = ToyExperts::new(EXPERTS, HIDDEN, 23);
            let want = ex.reference(&x, &ids, &ws, TOP_K, false);
            let got = num::to_f32(&rows[0], kind);
            let tol = if kind == FloatKind::F32 { 1e-5 } else { 3e-2 };
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= tol * w.abs().max(1.0),
                    "{backend} {kind:?}: {g} vs {w}"
                );
            }
        }
    }
}
