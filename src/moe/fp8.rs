//! FP8 dispatch: hidden rows quantised to float8 e4m3fn with one f32 scale per 128 elements,
//! the format of DeepEP's low-latency dispatch with `use_fp8=True` (csrc/kernels/internode_ll.cu
//! in deepseek-ai/DeepEP, `calculate_fp8_scales` in csrc/kernels/utils.cuh), which vLLM's
//! DeepEP low-latency prepare/finalize consumes as `(x_fp8, x_scales)`
//! (vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_ll.py).
//!
//! Per token and 128-element block along hidden: `amax = max(1e-4, max |x|)`; then either
//! `scale = 448 / amax`, `scale_inv = amax * (1/448)` or, with power-of-two scales (DeepEP's
//! `round_scale`, vLLM's UE8M0 dispatch), `scale_inv = 2^ceil(log2(amax * (1/448)))`,
//! `scale = 2^-that`. Each element is stored as `e4m3fn(x * scale)` (round to nearest even,
//! saturating) and the block's `scale_inv` as f32; `x ≈ e4m3 × scale_inv`.
//!
//! Accuracy: |x·scale| ≤ 448, where an e4m3 ulp is at most 32, so the stored value is within
//! 16 units, i.e. |dequantised − x| ≤ 16·scale_inv ≤ amax/28 per element; more precisely
//! ≤ max(|x|·2^-4, scale_inv·2^-10) (half an ulp with 3 mantissa bits, or half the subnormal
//! step 2^-9), up to the f32 rounding of the products.

use crate::error::{Error, Result};
use crate::num::{self, FloatKind};

/// Elements per scale (DeepEP's `kNumPerChannels`).
pub const BLOCK: usize = 128;
/// Largest finite e4m3fn value.
const AMAX: f32 = 448.0;
const AMAX_INV: f32 = 1.0 / 448.0;
/// Floor of a block's amax (DeepEP's `kFP8Margin`): an all-zero block gets a finite scale.
const MARGIN: f32 = 1e-4;

/// How the scales are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scales {
    /// `amax / 448` exactly (DeepEP `round_scale=False`).
    Exact,
    /// Rounded up to a power of two (DeepEP `round_scale=True`, the UE8M0 scales), still
    /// delivered as f32.
    Ue8m0,
}

impl Scales {
    /// Its word in the dispatch header (0 means bf16 dispatch).
    pub(crate) fn word(self) -> u64 {
        match self {
            Scales::Exact => 1,
            Scales::Ue8m0 => 2,
        }
    }

    /// What a header word means, for mismatch messages.
    pub(crate) fn describe(word: u64) -> &'static str {
        match word {
            0 => "off",
            1 => "e4m3 (f32 scales)",
            2 => "e4m3 (ue8m0 scales)",
            _ => "unknown",
        }
    }
}

/// `(scale, scale_inv)` of a block whose largest magnitude is `amax` (before the margin).
pub fn block_scale(amax: f32, scales: Scales) -> (f32, f32) {
    let amax = amax.max(MARGIN);
    match scales {
        Scales::Exact => (AMAX / amax, amax * AMAX_INV),
        Scales::Ue8m0 => {
            let e = log2_ceil(amax * AMAX_INV);
            (pow2(-e), pow2(e))
        }
    }
}

/// ceil(log2(x)) of a positive normal f32 (DeepEP's `fast_log2_ceil`).
fn log2_ceil(x: f32) -> i32 {
    let b = x.to_bits();
    ((b >> 23) & 0xff) as i32 - 127 + i32::from(b & 0x7f_ffff != 0)
}

/// 2^e for -126 ≤ e ≤ 127 (DeepEP's `fast_pow2`).
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Bytes of the scales of one row of `hidden` elements.
pub fn scale_row_bytes(hidden: usize) -> usize {
    hidden / BLOCK * 4
}

/// Checks that rows of `hidden` elements can be quantised (vLLM's assertion message).
pub fn check_hidden(hidden: usize) -> Result<()> {
    if !hidden.is_multiple_of(BLOCK) {
        return Err(Error::InvalidArgument(format!(
            "DeepEP kernels quantize the inputs in blocks of shape 128 (hidden_size {hidden} is not a multiple of 128)"
        )));
    }
    Ok(())
}

/// Quantises one block of f32 values into `q` and returns its `scale_inv`; `Err(j)` names the
/// first non-finite element.
#[inline(always)]
fn quantize_block(x: &[f32], q: &mut [u8], scales: Scales) -> std::result::Result<f32, usize> {
    // |x| orders as its bits, and infinities and NaNs have the largest: one integer max
    // (which vectorizes, unlike f32::max) finds the amax and any non-finite value.
    let top = x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    if top >= 0x7f80_0000 {
        return Err(x.iter().position(|v| !v.is_finite()).unwrap_or(0));
    }
    let amax = f32::from_bits(top);
    let (scale, scale_inv) = block_scale(amax, scales);
    for (d, v) in q.iter_mut().zip(x) {
        *d = num::f32_to_e4m3fn(v * scale);
    }
    Ok(scale_inv)
}

/// Quantises `rows` of `hidden` elements of `kind` into `q` (one byte per element) and
/// `scales_out` (`hidden/128` native-endian f32 per row). Non-finite inputs are refused: with
/// DeepEP's formula an infinity makes its block's scale 0 and every element NaN, and a NaN is
/// skipped by the amax, so neither survives the trip; the error names the first one.
pub fn quantize(
    src: &[u8],
    kind: FloatKind,
    hidden: usize,
    scales: Scales,
    q: &mut Vec<u8>,
    scales_out: &mut Vec<u8>,
) -> Result<()> {
    let rows = src.len() / (hidden * kind.size()).max(1);
    q.resize(rows * hidden, 0);
    scales_out.resize(rows * scale_row_bytes(hidden), 0);
    let mut vals = vec![0.0f32; hidden];
    let row_bytes = hidden * kind.size();
    let sb = scale_row_bytes(hidden);
    for (t, row) in src.chunks_exact(row_bytes).enumerate() {
        let qrow = &mut q[t * hidden..(t + 1) * hidden];
        let srow = &mut scales_out[t * sb..(t + 1) * sb];
        let r = Row {
            src: row,
            kind,
            vals: &mut vals,
            q: qrow,
            scales_out: srow,
            scales,
        };
        quantize_row_dispatch(r).map_err(|j| non_finite(t, j, vals[j]))?;
    }
    Ok(())
}

/// One row's quantisation: `src` (elements of `kind`) through `vals` into `q` and its block
/// scales `scales_out`.
struct Row<'a> {
    src: &'a [u8],
    kind: FloatKind,
    vals: &'a mut [f32],
    q: &'a mut [u8],
    scales_out: &'a mut [u8],
    scales: Scales,
}

/// One row: decoded to f32, then block by block; `Err(j)`: element j is not finite.
#[inline(always)]
fn quantize_row(r: Row<'_>) -> std::result::Result<(), usize> {
    decode_row(r.src, r.kind, r.vals);
    let blocks = r.vals.chunks_exact(BLOCK).zip(r.q.chunks_exact_mut(BLOCK));
    for (b, ((x, qb), s)) in blocks.zip(r.scales_out.chunks_exact_mut(4)).enumerate() {
        let inv = quantize_block(x, qb, r.scales).map_err(|j| b * BLOCK + j)?;
        s.copy_from_slice(&inv.to_ne_bytes());
    }
    Ok(())
}

/// [`quantize_row`] compiled for AVX2 where the CPU has it (the loops are written to
/// vectorize; the baseline x86-64 target gives them SSE2 only), else as built.
fn quantize_row_dispatch(r: Row<'_>) -> std::result::Result<(), usize> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked at run time).
        return unsafe { quantize_row_avx2(r) };
    }
    quantize_row(r)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_row_avx2(r: Row<'_>) -> std::result::Result<(), usize> {
    quantize_row(r)
}

/// One row to f32, exactly (signed zeros kept, so -0.0 becomes e4m3 `0x80` as on the GPU).
#[inline(always)]
fn decode_row(row: &[u8], kind: FloatKind, out: &mut [f32]) {
    match kind {
        FloatKind::F32 => row
            .chunks_exact(4)
            .zip(out)
            .for_each(|(c, o)| *o = f32::from_ne_bytes([c[0], c[1], c[2], c[3]])),
        FloatKind::Bf16 => row
            .chunks_exact(2)
            .zip(out)
            .for_each(|(c, o)| *o = num::bf16_to_f32(u16::from_ne_bytes([c[0], c[1]]))),
        FloatKind::F16 => row
            .chunks_exact(2)
            .zip(out)
            .for_each(|(c, o)| *o = num::f16_to_f32(u16::from_ne_bytes([c[0], c[1]]))),
    }
}

fn non_finite(token: usize, j: usize, v: f32) -> Error {
    Error::InvalidArgument(format!(
        "hidden_states[{token}, {j}] is {v}: FP8 dispatch quantises finite values only (an infinity or NaN would turn its 128-element block into NaN)"
    ))
}

/// Dequantises rows (`q` e4m3fn bytes, `scales` native-endian f32, `hidden/128` per row) to f32.
pub fn dequantize(q: &[u8], scales: &[u8], hidden: usize) -> Vec<f32> {
    let per_row = hidden / BLOCK;
    let inv: Vec<f32> = scales
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    q.iter()
        .enumerate()
        .map(|(i, &b)| {
            let (row, col) = (i / hidden, i % hidden);
            num::e4m3fn_to_f32(b) * inv[row * per_row + col / BLOCK]
        })
        .collect()
}
