//! One rank's MoE step over a host group for the host-transport tests: a
//! deepep_high_throughput manager with f32 rows 8 wide, top-2 of 2 experts per rank, token t
//! routed to experts t and t + 3 (mod E), so one or two ranks hold it. Included by path.
#![allow(dead_code)]

use epcomm::group::Group;
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::FloatKind;

pub const HIDDEN: usize = 8;
pub const K: usize = 2;

pub struct Step {
    pub m: Manager,
    /// This rank's tokens' rows, ids and weights.
    pub x: Vec<f32>,
    pub ids: Vec<i64>,
    pub w: Vec<f32>,
}

impl Step {
    pub fn new(rank: usize, world: usize, tokens: usize) -> Step {
        let experts = 2 * world;
        let cfg = MoeConfig {
            num_experts: experts,
            top_k: K,
            hidden: HIDDEN,
            hidden_dtype: FloatKind::F32.dtype(),
            expert_dtype: FloatKind::F32,
            out_dtype: FloatKind::F32,
            max_tokens_per_rank: tokens,
            extra_row_bytes: vec![],
            apply_router_weight_on_input: false,
        };
        Step {
            m: Manager::new("deepep_high_throughput", cfg, rank, world).unwrap(),
            x: (0..tokens * HIDDEN)
                .map(|i| (rank * 1000 + i) as f32)
                .collect(),
            ids: (0..tokens)
                .flat_map(|t| [(t % experts) as i64, ((t + 3) % experts) as i64])
                .collect(),
            w: vec![0.5; tokens * K],
        }
    }

    /// Dispatch, `expert` on every element of the dispatched rows, combine: the combined rows.
    pub fn run(
        &mut self,
        g: &mut dyn Group,
        expert: impl Fn(f32) -> f32,
    ) -> epcomm::Result<Vec<f32>> {
        let x = epcomm::bytes::as_bytes(&self.x);
        let d = self.m.dispatch(g, x, &self.ids, &self.w, &[])?;
        let y: Vec<f32> = (epcomm::bytes::to_vec::<f32>(d.hidden).into_iter())
            .map(expert)
            .collect();
        let mut out = vec![0u8; self.x.len() * 4];
        self.m.combine(g, epcomm::bytes::as_bytes(&y), &mut out)?;
        Ok(epcomm::bytes::to_vec(&out))
    }

    /// How many ranks hold token t's experts (weights 0.5 each: the combined row is the
    /// expert's output of x times this).
    pub fn holders(&self, t: usize) -> f32 {
        let p = &self.ids[t * K..(t + 1) * K];
        if p[0] / 2 == p[1] / 2 {
            1.0
        } else {
            2.0
        }
    }
}
