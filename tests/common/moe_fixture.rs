//! The MoE check shared by the fault matrix and the fault campaign: one dispatch, the toy
//! experts where the rows land, one combine, compared with the single-process f32 reference.

use epcomm::group::Group;
use epcomm::moe::reference::ToyExperts;
use epcomm::moe::Manager;
use epcomm::num::{self, FloatKind};

/// One rank's tokens: hidden rows (f32), top-k ids and weights.
pub struct Tokens {
    pub x: Vec<f32>,
    pub ids: Vec<i64>,
    pub ws: Vec<f32>,
}

/// Dispatches `t` through `m` on rank `rank` of `world`, runs `experts` (top-k `top_k`) on
/// what arrived, combines, and returns the largest difference from the reference, relative to
/// the reference value (or to 1 where that is smaller).
pub fn round_trip_error(
    m: &mut Manager,
    g: &mut dyn Group,
    experts: &ToyExperts,
    t: &Tokens,
    (rank, world, top_k): (usize, usize, usize),
) -> epcomm::Result<f32> {
    let xb = num::from_f32(&t.x, FloatKind::F32);
    let v = m.dispatch(g, &xb, &t.ids, &t.ws, &[])?;
    let y = experts.run_local(&v, FloatKind::F32, rank, world, top_k);
    let y = num::from_f32(&y, FloatKind::F32);
    let mut out = vec![0u8; t.x.len() * 4];
    m.combine(g, &y, &mut out)?;
    let got = num::to_f32(&out, FloatKind::F32);
    let want = experts.reference(&t.x, &t.ids, &t.ws, top_k, false);
    Ok(max_rel_error(&got, &want))
}

/// The largest difference of `got` from `want`, relative to the reference value (or to 1
/// where that is smaller).
pub fn max_rel_error(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
        .fold(0f32, f32::max)
}
