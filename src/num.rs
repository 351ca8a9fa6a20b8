//! Floating-point element kinds that collectives reduce (f32, bf16, f16), with conversions to
//! and from f32. Reductions always accumulate in f32.

use crate::dtype::{Code, DType};

/// A float element type a reduction can sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FloatKind {
    F32,
    Bf16,
    F16,
}

impl FloatKind {
    pub fn from_dtype(d: DType) -> Option<FloatKind> {
        match (d.code(), d.bits, d.lanes) {
            (Some(Code::Float), 32, 1) => Some(FloatKind::F32),
            (Some(Code::Bfloat), 16, 1) => Some(FloatKind::Bf16),
            (Some(Code::Float), 16, 1) => Some(FloatKind::F16),
            _ => None,
        }
    }

    pub fn dtype(self) -> DType {
        match self {
            FloatKind::F32 => DType::F32,
            FloatKind::Bf16 => DType::BF16,
            FloatKind::F16 => DType::F16,
        }
    }

    pub fn size(self) -> usize {
        match self {
            FloatKind::F32 => 4,
            FloatKind::Bf16 | FloatKind::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FloatKind::F32 => "float32",
            FloatKind::Bf16 => "bfloat16",
            FloatKind::F16 => "float16",
        }
    }
}

/// bf16 bits → f32 (exact).
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 → bf16 bits, round to nearest even; NaN stays NaN. Integer-only and branch-free, so the
/// store loops vectorize.
#[inline]
pub fn f32_to_bf16(f: f32) -> u16 {
    let bits = f.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let nan = (bits >> 16) | 0x0040;
    let is_nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    (if is_nan { nan } else { rounded }) as u16
}

/// IEEE binary16 bits → f32 (exact).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let mant = (h & 0x3ff) as u32;
    let bits = match (exp, mant) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: value = m * 2^-24.
            let v = m as f32 * f32::from_bits(0x3380_0000); // 2^-24
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// f32 → IEEE binary16 bits, round to nearest even, overflow to infinity.
#[inline]
pub fn f32_to_f16(f: f32) -> u16 {
    let bits = f.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let mant = bits & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if mant != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        // Subnormal half: shift the full mantissa (with the implicit 1) into place.
        let m = mant | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = m >> shift;
        let rem = m & ((1 << shift) - 1);
        let mid = 1 << (shift - 1);
        let round = (rem > mid || (rem == mid && (half & 1) == 1)) as u32;
        return sign | (half + round) as u16;
    }
    let half = ((e as u32) << 10) | (mant >> 13);
    let rem = mant & 0x1fff;
    let round = (rem > 0x1000 || (rem == 0x1000 && (half & 1) == 1)) as u32;
    // A carry out of the mantissa correctly bumps the exponent (up to infinity).
    sign | (half + round) as u16
}

/// Elements per block of the kernels below: fixed-size arrays (no bounds checks in the inner
/// loop), so the compiler vectorizes them.
const LANES: usize = 16;

/// Decodes element `j` of a block of `LANES` elements of kind `K` (0 f32, 1 bf16, 2 f16).
#[inline(always)]
fn decode<const K: u8, const B: usize>(s: &[u8; B], j: usize) -> f32 {
    match K {
        0 => f32::from_ne_bytes([s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3]]),
        1 => f32::from_bits((u16::from_ne_bytes([s[2 * j], s[2 * j + 1]]) as u32) << 16),
        _ => f16_to_f32(u16::from_ne_bytes([s[2 * j], s[2 * j + 1]])),
    }
}

#[inline(always)]
fn add_blocks<const K: u8, const B: usize, const SCALED: bool>(
    acc: &mut [f32],
    src: &[u8],
    w: f32,
) {
    let es = B / LANES;
    let split = acc.len() - acc.len() % LANES;
    let (body, tail) = acc.split_at_mut(split);
    for (a, s) in body.chunks_exact_mut(LANES).zip(src.chunks_exact(B)) {
        let a: &mut [f32; LANES] = a.try_into().expect("block");
        let s: &[u8; B] = s.try_into().expect("block");
        for (j, aj) in a.iter_mut().enumerate() {
            let x = decode::<K, B>(s, j);
            *aj += if SCALED { w * x } else { x };
        }
    }
    for (j, aj) in tail.iter_mut().enumerate() {
        let o = (split + j) * es;
        let mut one = [0u8; B];
        one[..es].copy_from_slice(&src[o..o + es]);
        let x = decode::<K, B>(&one, 0);
        *aj += if SCALED { w * x } else { x };
    }
}

fn add_kind<const SCALED: bool>(acc: &mut [f32], src: &[u8], kind: FloatKind, w: f32) {
    debug_assert_eq!(src.len(), acc.len() * kind.size());
    match kind {
        FloatKind::F32 => add_blocks::<0, { LANES * 4 }, SCALED>(acc, src, w),
        FloatKind::Bf16 => add_blocks::<1, { LANES * 2 }, SCALED>(acc, src, w),
        FloatKind::F16 => add_blocks::<2, { LANES * 2 }, SCALED>(acc, src, w),
    }
}

/// Adds the elements of `src` (of kind `kind`, native-endian bytes) to `acc`.
pub fn accumulate(acc: &mut [f32], src: &[u8], kind: FloatKind) {
    add_kind::<false>(acc, src, kind, 1.0);
}

/// Adds `w` times the elements of `src` (of kind `kind`) to `acc`.
pub fn accumulate_scaled(acc: &mut [f32], src: &[u8], kind: FloatKind, w: f32) {
    add_kind::<true>(acc, src, kind, w);
}

#[inline(always)]
fn encode<const K: u8, const B: usize>(d: &mut [u8; B], j: usize, v: f32) {
    match K {
        0 => d[4 * j..4 * j + 4].copy_from_slice(&v.to_ne_bytes()),
        1 => d[2 * j..2 * j + 2].copy_from_slice(&f32_to_bf16(v).to_ne_bytes()),
        _ => d[2 * j..2 * j + 2].copy_from_slice(&f32_to_f16(v).to_ne_bytes()),
    }
}

#[inline(always)]
fn store_blocks<const K: u8, const B: usize>(acc: &[f32], dst: &mut [u8]) {
    let es = B / LANES;
    let split = acc.len() - acc.len() % LANES;
    for (a, d) in acc[..split]
        .chunks_exact(LANES)
        .zip(dst.chunks_exact_mut(B))
    {
        let a: &[f32; LANES] = a.try_into().expect("block");
        let d: &mut [u8; B] = d.try_into().expect("block");
        for (j, &aj) in a.iter().enumerate() {
            encode::<K, B>(d, j, aj);
        }
    }
    for (j, &aj) in acc[split..].iter().enumerate() {
        let o = (split + j) * es;
        let mut one = [0u8; B];
        encode::<K, B>(&mut one, 0, aj);
        dst[o..o + es].copy_from_slice(&one[..es]);
    }
}

/// Writes `acc` into `dst` as elements of kind `kind`.
pub fn store(acc: &[f32], dst: &mut [u8], kind: FloatKind) {
    debug_assert_eq!(dst.len(), acc.len() * kind.size());
    match kind {
        FloatKind::F32 => store_blocks::<0, { LANES * 4 }>(acc, dst),
        FloatKind::Bf16 => store_blocks::<1, { LANES * 2 }>(acc, dst),
        FloatKind::F16 => store_blocks::<2, { LANES * 2 }>(acc, dst),
    }
}

/// Converts elements to f32.
pub fn to_f32(src: &[u8], kind: FloatKind) -> Vec<f32> {
    let mut acc = vec![0.0; src.len() / kind.size()];
    accumulate(&mut acc, src, kind);
    acc
}

/// Converts f32 values to bytes of `kind`.
pub fn from_f32(values: &[f32], kind: FloatKind) -> Vec<u8> {
    let mut out = vec![0u8; values.len() * kind.size()];
    store(values, &mut out, kind);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_and_rounding() {
        for v in [0.0f32, 1.0, -2.5, 3.140625, 2f32.powi(-100), 65536.0] {
            assert_eq!(bf16_to_f32(f32_to_bf16(v)), v);
        }
        // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 1.0 / 256.0)), 1.0);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
    }

    #[test]
    fn f16_exhaustive_round_trip() {
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if f.is_nan() {
                assert!(f16_to_f32(f32_to_f16(f)).is_nan());
            } else {
                assert_eq!(f32_to_f16(f), h, "half bits {h:#06x} -> {f}");
            }
        }
        assert_eq!(f32_to_f16(1e6), 0x7c00);
        assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00); // tie to even
        assert_eq!(f32_to_f16(1.0 + 3.0 / 2048.0), 0x3c02);
    }

    #[test]
    fn accumulate_and_store() {
        for kind in [FloatKind::F32, FloatKind::Bf16, FloatKind::F16] {
            let a = from_f32(&[1.0, 2.0, -3.0], kind);
            let mut acc = vec![0.5f32; 3];
            accumulate(&mut acc, &a, kind);
            assert_eq!(acc, vec![1.5, 2.5, -2.5]);
            assert_eq!(to_f32(&from_f32(&acc, kind), kind), acc);
        }
    }
}
