//! Toy experts with real weights and the single-process f32 reference, for the demo, the
//! benchmarks and the tests: expert e computes `y = a_e ⊙ x + b_e` (per-expert weight and bias
//! vectors), and a token's MoE output is `Σ_k w_k · f_{e_k}(x)`.

use super::layout::{self, WeightsBy};
use super::DispatchView;
use crate::num::{self, FloatKind};

/// Per-expert elementwise affine maps.
#[derive(Debug, Clone, PartialEq)]
pub struct ToyExperts {
    pub hidden: usize,
    pub num_experts: usize,
    scale: Vec<f32>,
    bias: Vec<f32>,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A deterministic value in [-1, 1) from a seed and an index.
pub fn unit(seed: u64, i: u64) -> f32 {
    (splitmix(seed ^ splitmix(i)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

impl ToyExperts {
    pub fn new(num_experts: usize, hidden: usize, seed: u64) -> ToyExperts {
        let n = num_experts * hidden;
        ToyExperts {
            hidden,
            num_experts,
            scale: (0..n as u64)
                .map(|i| 1.0 + 0.5 * unit(seed ^ 0xa, i))
                .collect(),
            bias: (0..n as u64).map(|i| 0.1 * unit(seed ^ 0xb, i)).collect(),
        }
    }

    /// `y += w * f_e(x)`.
    fn apply_add(&self, e: usize, x: &[f32], w: f32, y: &mut [f32]) {
        let (a, b) = (
            &self.scale[e * self.hidden..(e + 1) * self.hidden],
            &self.bias[e * self.hidden..(e + 1) * self.hidden],
        );
        for i in 0..self.hidden {
            y[i] += w * (a[i] * x[i] + b[i]);
        }
    }

    /// The f32 MoE output of tokens `x` (`[T, hidden]`): `Σ_k w_k f_{e_k}(x)`, or with the
    /// weight applied on the input (top-1), `f_e(w x)`.
    pub fn reference(
        &self,
        x: &[f32],
        ids: &[i64],
        weights: &[f32],
        k: usize,
        weights_on_input: bool,
    ) -> Vec<f32> {
        let h = self.hidden;
        let t = x.len() / h;
        let mut out = vec![0f32; t * h];
        let mut scaled = vec![0f32; h];
        for tok in 0..t {
            let xr = &x[tok * h..(tok + 1) * h];
            for j in 0..k {
                let e = ids[tok * k + j];
                if e < 0 {
                    continue;
                }
                let w = weights[tok * k + j];
                if weights_on_input {
                    scaled.iter_mut().zip(xr).for_each(|(s, v)| *s = v * w);
                    self.apply_add(e as usize, &scaled, 1.0, &mut out[tok * h..(tok + 1) * h]);
                } else {
                    self.apply_add(e as usize, xr, w, &mut out[tok * h..(tok + 1) * h]);
                }
            }
        }
        out
    }

    /// Runs this rank's experts on a dispatch result the way the layout's contract says
    /// (docs/design.md, section 3) and returns the combine input as f32 (rows of the dispatch
    /// buffer).
    pub fn run_local(
        &self,
        view: &DispatchView<'_>,
        hidden_kind: FloatKind,
        rank: usize,
        world: usize,
        k: usize,
    ) -> Vec<f32> {
        let h = self.hidden;
        let el = self.num_experts / world;
        let first = rank * el;
        let x = num::to_f32(view.hidden, hidden_kind);
        let rows = x.len() / h;
        let mut y = vec![0f32; rows * h];
        let Some(c) = layout::contract(view.layout) else {
            return y;
        };
        let row = |r: usize| &x[r * h..(r + 1) * h];
        match c.weights_by {
            WeightsBy::Holder => {
                let owned = |e: i64| e >= first as i64 && e < (first + el) as i64;
                for r in 0..rows {
                    let (ids, ws) = (
                        &view.topk_ids[r * k..(r + 1) * k],
                        &view.topk_weights[r * k..(r + 1) * k],
                    );
                    let (xr, yr) = (row(r), &mut y[r * h..(r + 1) * h]);
                    for (&e, &w) in ids.iter().zip(ws) {
                        if e >= 0 && owned(e) {
                            self.apply_add(e as usize, xr, w, yr);
                        }
                    }
                }
            }
            WeightsBy::Source => {
                let bucket = rows / el.max(1);
                for j in 0..el {
                    let at = c.expert_rows(j, bucket, view.counts, view.expert_offsets);
                    for r in at.unwrap_or_default() {
                        self.apply_add(first + j, row(r), 1.0, &mut y[r * h..(r + 1) * h]);
                    }
                }
            }
        }
        y
    }
}
