//! The fault-tolerant all2all fixture shared by tests/moe_ft.rs and tests/ft_overlap.rs: a
//! deepep_low_latency manager with fault tolerance on (4 ranks, 16 experts, top-4, f32), each
//! rank's tokens per step, and one checked step (dispatch, the toy experts, combine, compared
//! with the f32 reference with the masked ranks' experts left out) as a line a rank process
//! prints and the campaign parses.
#![allow(dead_code)]

use std::time::Duration;

use super::moe_fixture::max_rel_error;
use epcomm::group::{Group, GroupOptions};
use epcomm::moe::reference::{unit, ToyExperts};
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::{self, FloatKind};
use epcomm::Status;

pub const BACKEND: &str = "deepep_low_latency";
pub const WORLD: usize = 4;
pub const EXPERTS: usize = 16;
pub const TOP_K: usize = 4;
pub const HIDDEN: usize = 64;
pub const MAX_TOKENS: usize = 32;
/// Relative tolerance against the f32 reference: both sum the same f32 products, in another
/// order (the reference by k, combine by rank), so a few ulps.
pub const TOL: f32 = 1e-5;
/// The thread tests' timeout (their stalled rank sleeps three times as long).
pub const STALL_TIMEOUT: Duration = Duration::from_millis(1500);

pub fn cfg() -> MoeConfig {
    MoeConfig {
        num_experts: EXPERTS,
        top_k: TOP_K,
        hidden: HIDDEN,
        hidden_dtype: FloatKind::F32.dtype(),
        expert_dtype: FloatKind::F32,
        out_dtype: FloatKind::F32,
        max_tokens_per_rank: MAX_TOKENS,
        extra_row_bytes: Vec::new(),
        apply_router_weight_on_input: false,
    }
}

pub fn experts() -> ToyExperts {
    ToyExperts::new(EXPERTS, HIDDEN, 19)
}

/// A manager with fault tolerance on.
pub fn manager(rank: usize) -> Manager {
    let mut m = Manager::new(BACKEND, cfg(), rank, WORLD).unwrap();
    m.set_fault_tolerance(true).unwrap();
    m
}

/// Rank `rank`'s tokens of step `step`: hidden rows, TOP_K distinct expert ids, weights.
pub fn tokens(step: usize, rank: usize) -> (Vec<f32>, Vec<i64>, Vec<f32>) {
    let t = 4 + (step * 7 + rank * 5) % (MAX_TOKENS - 4);
    let seed = (step * WORLD + rank) as u64;
    let x: Vec<f32> = (0..(t * HIDDEN) as u64).map(|i| unit(seed, i)).collect();
    let mut ids = Vec::with_capacity(t * TOP_K);
    for tok in 0..t {
        let first = ((unit(seed ^ 0x1d, tok as u64) + 1.0) * 0.5 * EXPERTS as f32) as usize;
        // TOP_K distinct experts on consecutive ranks' blocks, so most tokens reach 4 ranks.
        for k in 0..TOP_K {
            ids.push(((first + k * (EXPERTS / WORLD) + k) % EXPERTS) as i64);
        }
    }
    let ws = (0..(t * TOP_K) as u64)
        .map(|i| 0.5 + 0.5 * unit(seed ^ 0x3e, i))
        .collect();
    (x, ids, ws)
}

/// `ids` with the experts of masked ranks (`mask[r] == 1`) replaced by -1.
pub fn masked_ids(ids: &[i64], mask: &[i32]) -> Vec<i64> {
    let per = (EXPERTS / WORLD) as i64;
    ids.iter()
        .map(|&e| {
            if e >= 0 && mask[(e / per) as usize] == 1 {
                -1
            } else {
                e
            }
        })
        .collect()
}

/// What one step gave on one rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub step: usize,
    /// None = OK.
    pub status: Option<Status>,
    pub message: String,
    /// Largest relative difference from the reference (OK steps).
    pub error: f32,
    pub mask: Vec<i32>,
    pub dropped: u64,
    /// The pairs this rank routed to masked experts, counted here.
    pub expected_dropped: u64,
}

impl Step {
    pub fn line(&self) -> String {
        let status = self.status.map_or("OK".to_string(), |s| format!("{s:?}"));
        let mask: Vec<String> = self.mask.iter().map(i32::to_string).collect();
        format!(
            "STEP {} {status} err={:e} mask={} dropped={} expected_dropped={} msg={}",
            self.step,
            self.error,
            mask.join(","),
            self.dropped,
            self.expected_dropped,
            self.message.replace('\n', " ")
        )
    }

    pub fn parse(line: &str) -> Option<Step> {
        // The test harness may print its "test ... " on the same line first.
        let rest = &line[line.find("STEP ")? + 5..];
        let (head, message) = rest.split_once(" msg=")?;
        let f: Vec<&str> = head.split(' ').collect();
        let field = |i: usize, k: &str| f.get(i)?.strip_prefix(k);
        let status = match *f.get(1)? {
            "OK" => None,
            s => Some(
                [Status::PeerFailure, Status::Timeout, Status::InvalidState]
                    .into_iter()
                    .find(|x| format!("{x:?}") == s)
                    .unwrap_or(Status::Internal),
            ),
        };
        Some(Step {
            step: f.first()?.parse().ok()?,
            status,
            message: message.to_string(),
            error: field(2, "err=")?.parse().ok()?,
            mask: field(3, "mask=")?
                .split(',')
                .map(|v| v.parse().unwrap_or(-1))
                .collect(),
            dropped: field(4, "dropped=")?.parse().ok()?,
            expected_dropped: field(5, "expected_dropped=")?.parse().ok()?,
        })
    }
}

/// One dispatch, the toy experts, one combine; the outcome checked against the reference
/// with the experts of the ranks masked during the call left out.
pub fn one_step(m: &mut Manager, g: &mut dyn Group, ex: &ToyExperts, step: usize) -> Step {
    let rank = g.rank();
    let (x, ids, ws) = tokens(step, rank);
    let xb = num::from_f32(&x, FloatKind::F32);
    let fail = |m: &Manager, e: epcomm::Error| Step {
        step,
        status: Some(e.status()),
        message: e.to_string(),
        error: 0.0,
        mask: m.active_mask(),
        dropped: 0,
        expected_dropped: 0,
    };
    let y = match m.dispatch(g, &xb, &ids, &ws, &[]) {
        Ok(v) => ex.run_local(&v, FloatKind::F32, rank, WORLD, TOP_K),
        Err(e) => return fail(m, e),
    };
    let mut out = vec![0u8; x.len() * 4];
    if let Err(e) = m.combine(g, &num::from_f32(&y, FloatKind::F32), &mut out) {
        return fail(m, e);
    }
    let mask = m.active_mask();
    let live = masked_ids(&ids, &mask);
    let want = ex.reference(&x, &live, &ws, TOP_K, false);
    let got = num::to_f32(&out, FloatKind::F32);
    let error = max_rel_error(&got, &want);
    Step {
        step,
        status: None,
        message: String::new(),
        error,
        dropped: m.stats().dropped_pairs,
        expected_dropped: ids.iter().zip(&live).filter(|(a, b)| a != b).count() as u64,
        mask,
    }
}

pub fn opts(timeout: Duration) -> GroupOptions {
    GroupOptions {
        timeout,
        ..GroupOptions::default()
    }
}
