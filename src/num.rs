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

/// float8 e4m3fn bits → f32 (exact). e4m3fn (OCP FP8, PyTorch's `float8_e4m3fn`): bias 7,
/// no infinities, `S.1111.111` is NaN, largest finite 448, smallest subnormal 2^-9.
#[inline]
pub fn e4m3fn_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = ((b >> 3) & 0xf, b & 7);
    if exp == 0xf && man == 7 {
        return f32::NAN;
    }
    let mag = if exp == 0 {
        f32::from(man) * (1.0 / 512.0)
    } else {
        (1.0 + f32::from(man) / 8.0) * f32::from_bits(((i32::from(exp) - 7 + 127) as u32) << 23)
    };
    sign * mag
}

/// f32 → float8 e4m3fn bits, round to nearest even, saturating (CUDA's `__NV_SATFINITE`, as
/// DeepEP's cast): |x| ≥ 448 (infinity included) gives ±448, NaN gives NaN (`0x7f`, signed).
/// Integer-only selects, no branches, so the quantisation loops vectorize.
#[inline(always)]
pub fn f32_to_e4m3fn(f: f32) -> u8 {
    let bits = f.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abits = bits & 0x7fff_ffff;
    // Normal range: drop 20 mantissa bits rounding to nearest even, rebias 127 → 7.
    let rounded = abits.wrapping_add(0x7_ffff + ((abits >> 20) & 1)) >> 20;
    let normal = rounded.wrapping_sub(120 << 3).min(0x7e);
    // Below 2^-6 the codes are multiples of 2^-9: adding 2^14 (whose ulp is 2^-9) rounds to
    // nearest even in the FPU and leaves the code in the low mantissa bits.
    let sub = (f32::from_bits(abits) + 16384.0).to_bits() - 16384f32.to_bits();
    let code = if abits < 0x3c80_0000 { sub } else { normal };
    let code = if abits > 0x7f80_0000 { 0x7f } else { code };
    (sign | code) as u8
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
        // NaN keeps its top payload bits and is made quiet, as x86's F16C conversion does, so
        // the scalar and vector paths agree bit for bit.
        return sign
            | 0x7c00
            | if mant != 0 {
                0x200 | (mant >> 13) as u16
            } else {
                0
            };
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
fn add_blocks<const K: u8, const B: usize, const SCALED: bool, const FIRST: bool>(
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
            let v = if SCALED { w * x } else { x };
            // FIRST: the accumulator's old contents are ignored; 0.0 + v is what adding to a
            // zeroed accumulator gives (-0.0 becomes +0.0), so the sums stay bit-identical.
            *aj = if FIRST { 0.0 + v } else { *aj + v };
        }
    }
    for (j, aj) in tail.iter_mut().enumerate() {
        let o = (split + j) * es;
        let mut one = [0u8; B];
        one[..es].copy_from_slice(&src[o..o + es]);
        let x = decode::<K, B>(&one, 0);
        let v = if SCALED { w * x } else { x };
        *aj = if FIRST { 0.0 + v } else { *aj + v };
    }
}

#[inline(always)]
fn add_kind_generic<const SCALED: bool, const FIRST: bool>(
    acc: &mut [f32],
    src: &[u8],
    kind: FloatKind,
    w: f32,
) {
    match kind {
        FloatKind::F32 => add_blocks::<0, { LANES * 4 }, SCALED, FIRST>(acc, src, w),
        FloatKind::Bf16 => add_blocks::<1, { LANES * 2 }, SCALED, FIRST>(acc, src, w),
        FloatKind::F16 => add_blocks::<2, { LANES * 2 }, SCALED, FIRST>(acc, src, w),
    }
}

fn add_kind<const SCALED: bool, const FIRST: bool>(
    acc: &mut [f32],
    src: &[u8],
    kind: FloatKind,
    w: f32,
) {
    debug_assert_eq!(src.len(), acc.len() * kind.size());
    #[cfg(target_arch = "x86_64")]
    if x86::has_avx2_f16c() {
        // SAFETY: the CPU supports AVX2 and F16C (checked at run time).
        return unsafe { x86::add_kind::<SCALED, FIRST>(acc, src, kind, w) };
    }
    add_kind_generic::<SCALED, FIRST>(acc, src, kind, w)
}

/// Adds the elements of `src` (of kind `kind`, native-endian bytes) to `acc`.
pub fn accumulate(acc: &mut [f32], src: &[u8], kind: FloatKind) {
    add_kind::<false, false>(acc, src, kind, 1.0);
}

/// Adds `w` times the elements of `src` (of kind `kind`) to `acc`.
pub fn accumulate_scaled(acc: &mut [f32], src: &[u8], kind: FloatKind, w: f32) {
    add_kind::<true, false>(acc, src, kind, w);
}

/// Sets `acc` to what `accumulate_scaled` (or `accumulate` when `w` is 1) gives on a zeroed
/// accumulator, bit for bit, without reading or zeroing `acc` first.
pub fn assign_scaled(acc: &mut [f32], src: &[u8], kind: FloatKind, w: f32) {
    if w == 1.0 {
        add_kind::<false, true>(acc, src, kind, 1.0);
    } else {
        add_kind::<true, true>(acc, src, kind, w);
    }
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

#[inline(always)]
fn store_generic(acc: &[f32], dst: &mut [u8], kind: FloatKind) {
    match kind {
        FloatKind::F32 => store_blocks::<0, { LANES * 4 }>(acc, dst),
        FloatKind::Bf16 => store_blocks::<1, { LANES * 2 }>(acc, dst),
        FloatKind::F16 => store_blocks::<2, { LANES * 2 }>(acc, dst),
    }
}

/// Writes `acc` into `dst` as elements of kind `kind`.
pub fn store(acc: &[f32], dst: &mut [u8], kind: FloatKind) {
    debug_assert_eq!(dst.len(), acc.len() * kind.size());
    #[cfg(target_arch = "x86_64")]
    if x86::has_avx2_f16c() {
        // SAFETY: the CPU supports AVX2 and F16C (checked at run time).
        return unsafe { x86::store(acc, dst, kind) };
    }
    store_generic(acc, dst, kind)
}

/// Like `store`, for a large output that is not read again soon: on AVX2 machines it writes
/// with non-temporal stores, which skip reading the destination lines into the cache first
/// (a third less memory traffic for a write-once output). Call [`streaming_fence`] after
/// the batch, before the output is handed to another thread.
pub fn store_streaming(acc: &[f32], dst: &mut [u8], kind: FloatKind) {
    debug_assert_eq!(dst.len(), acc.len() * kind.size());
    #[cfg(target_arch = "x86_64")]
    if x86::has_avx2_f16c() {
        // SAFETY: the CPU supports AVX2 and F16C (checked at run time).
        return unsafe { x86::store_streaming(acc, dst, kind) };
    }
    store_generic(acc, dst, kind)
}

/// One output row in one pass: `dst` (elements of `out_kind`) = the sum over `rows` of
/// `w · row` (elements of `kind`), added in f32 in the order given, without FMA. Bit-identical
/// to [`assign_scaled`] of the first row, [`accumulate_scaled`] of the rest and [`store`]
/// (multiplying by 1 changes no value), but the partial sums stay in registers: each input
/// byte is read once and each output byte written once. No rows give zeros. `streaming`
/// writes past the caches as [`store_streaming`] does (call [`streaming_fence`] after the
/// batch).
pub fn sum_rows(
    rows: &[(&[u8], f32)],
    kind: FloatKind,
    dst: &mut [u8],
    out_kind: FloatKind,
    streaming: bool,
) {
    let n = dst.len() / out_kind.size();
    debug_assert!(rows.iter().all(|(r, _)| r.len() == n * kind.size()));
    #[cfg(target_arch = "x86_64")]
    if x86::has_avx2_f16c() {
        // SAFETY: the CPU supports AVX2 and F16C (checked at run time); every row holds `n`
        // elements (the callers check the row sizes).
        return unsafe { x86::sum_rows(rows, kind, dst, out_kind, streaming) };
    }
    sum_rows_generic(rows, kind, dst, out_kind)
}

/// Element `j` of [`sum_rows`] (the generic kernels on one element: the same arithmetic).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn sum_one(rows: &[(&[u8], f32)], kind: FloatKind, dst: &mut [u8], out_kind: FloatKind, j: usize) {
    let es = kind.size();
    let mut acc = [0f32];
    for (i, (row, w)) in rows.iter().enumerate() {
        let x = &row[es * j..es * (j + 1)];
        if i == 0 {
            add_kind_generic::<true, true>(&mut acc, x, kind, *w);
        } else {
            add_kind_generic::<true, false>(&mut acc, x, kind, *w);
        }
    }
    store_generic(&acc, dst, out_kind);
}

/// [`sum_rows`] through the block kernels, in column chunks whose accumulator stays in L1.
fn sum_rows_generic(rows: &[(&[u8], f32)], kind: FloatKind, dst: &mut [u8], out_kind: FloatKind) {
    const CHUNK: usize = 256;
    let (es, out_es) = (kind.size(), out_kind.size());
    let n = dst.len() / out_es;
    let mut acc = [0f32; CHUNK];
    for c0 in (0..n).step_by(CHUNK) {
        let c1 = (c0 + CHUNK).min(n);
        let a = &mut acc[..c1 - c0];
        a.fill(0.0);
        for (i, (row, w)) in rows.iter().enumerate() {
            let part = &row[c0 * es..c1 * es];
            if i == 0 {
                add_kind_generic::<true, true>(a, part, kind, *w);
            } else {
                add_kind_generic::<true, false>(a, part, kind, *w);
            }
        }
        store_generic(a, &mut dst[c0 * out_es..c1 * out_es], out_kind);
    }
}

/// Whether the AVX2 kernels are in use (AVX2 and F16C present, `EPCOMM_NO_SIMD` unset or `0`).
pub fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        x86::has_avx2_f16c()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Orders every earlier non-temporal store of this thread before its later stores (e.g. the
/// release store that lets a peer read the destination). A no-op without the SIMD kernels.
pub fn streaming_fence() {
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        // SAFETY: SSE (sfence) is part of the x86-64 baseline.
        #[allow(unused_unsafe)]
        unsafe {
            std::arch::x86_64::_mm_sfence()
        };
    }
}

/// The same kernels compiled for AVX2 (selected at run time: the crate is built for baseline
/// x86-64, so distributions can ship one binary). f16 uses F16C's conversions, which round
/// exactly like `f32_to_f16`; no FMA, so sums are bit-identical on every CPU.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    pub(super) fn has_avx2_f16c() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            !crate::env::no_simd()
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("f16c")
        })
    }

    /// 8 elements at `p` (bf16 or f16 bits) as f32.
    #[inline(always)]
    unsafe fn load8(p: *const u8, kind: FloatKind) -> __m256 {
        // SAFETY (caller): 16 bytes at `p` are readable.
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i);
            if kind == FloatKind::F16 {
                _mm256_cvtph_ps(h)
            } else {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn add_kind<const SCALED: bool, const FIRST: bool>(
        acc: &mut [f32],
        src: &[u8],
        kind: FloatKind,
        w: f32,
    ) {
        if kind == FloatKind::F32 {
            return add_kind_generic::<SCALED, FIRST>(acc, src, kind, w);
        }
        let n = acc.len().min(src.len() / 2);
        let body = n - n % 8;
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 <= n, so 16 source bytes and 8 accumulator lanes are in bounds.
            unsafe {
                let mut x = load8(src.as_ptr().add(2 * i), kind);
                if SCALED {
                    x = _mm256_mul_ps(wv, x);
                }
                let a = acc.as_mut_ptr().add(i);
                let old = if FIRST {
                    _mm256_setzero_ps()
                } else {
                    _mm256_loadu_ps(a)
                };
                _mm256_storeu_ps(a, _mm256_add_ps(old, x));
            }
            i += 8;
        }
        add_kind_generic::<SCALED, FIRST>(&mut acc[body..n], &src[2 * body..2 * n], kind, w);
    }

    /// 8 f32 → 8 bf16 (as the low halves of 32-bit lanes), rounding like `f32_to_bf16`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn bf16x8(x: __m256) -> __m256i {
        let bits = _mm256_castps_si256(x);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
            bits,
            _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb),
        ));
        let nan = _mm256_or_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(0x40));
        let abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fff_ffff));
        let is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80_0000));
        _mm256_blendv_epi8(rounded, nan, is_nan)
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn store(acc: &[f32], dst: &mut [u8], kind: FloatKind) {
        // SAFETY: the caller checked the CPU features.
        unsafe { store_with::<false>(acc, dst, kind) }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn store_streaming(acc: &[f32], dst: &mut [u8], kind: FloatKind) {
        // Non-temporal 16-byte stores need 16-byte aligned addresses: write a scalar head
        // up to the first aligned element (when the element size allows reaching one).
        let es = kind.size();
        let skip = (16 - dst.as_ptr() as usize % 16) % 16;
        if !skip.is_multiple_of(es) || acc.len() < 64 {
            // SAFETY: the caller checked the CPU features.
            return unsafe { store_with::<false>(acc, dst, kind) };
        }
        let head = (skip / es).min(acc.len());
        store_generic(&acc[..head], &mut dst[..head * es], kind);
        // SAFETY: as above; the rest starts 16-byte aligned.
        unsafe { store_with::<true>(&acc[head..], &mut dst[head * es..], kind) };
    }

    /// 8 elements at `p` (any kind) as f32.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8_any(p: *const u8, kind: FloatKind) -> __m256 {
        // SAFETY (caller): 8 elements at `p` are readable.
        unsafe {
            if kind == FloatKind::F32 {
                _mm256_loadu_ps(p as *const f32)
            } else {
                load8(p, kind)
            }
        }
    }

    /// 16 f32 (in two vectors) stored at `d` as `kind`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn put16<const NT: bool>(d: *mut u8, a: __m256, b: __m256, kind: FloatKind) {
        // SAFETY (caller): 16 elements of `kind` writable at `d`, 16-byte aligned when NT.
        unsafe {
            let d = d as *mut __m128i;
            match kind {
                FloatKind::F32 => {
                    let (a, b) = (_mm256_castps_si256(a), _mm256_castps_si256(b));
                    put::<NT>(d, _mm256_castsi256_si128(a));
                    put::<NT>(d.add(1), _mm256_extracti128_si256::<1>(a));
                    put::<NT>(d.add(2), _mm256_castsi256_si128(b));
                    put::<NT>(d.add(3), _mm256_extracti128_si256::<1>(b));
                }
                FloatKind::F16 => {
                    put::<NT>(d, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(a));
                    put::<NT>(d.add(1), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(b));
                }
                FloatKind::Bf16 => {
                    let packed = _mm256_packus_epi32(bf16x8(a), bf16x8(b));
                    let ordered = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
                    put::<NT>(d, _mm256_castsi256_si128(ordered));
                    put::<NT>(d.add(1), _mm256_extracti128_si256::<1>(ordered));
                }
            }
        }
    }

    /// One call of the sum kernels: elements `e0..e1` of `dst` (of `out_kind`) from `rows`
    /// (elements of `kind`, each with its weight).
    struct Sum<'a, 'd> {
        rows: &'a [(&'a [u8], f32)],
        kind: FloatKind,
        dst: &'d mut [u8],
        out_kind: FloatKind,
        e0: usize,
        e1: usize,
    }

    impl Sum<'_, '_> {
        /// Element `j`, with the generic kernels.
        #[inline(always)]
        fn one(&mut self, j: usize) {
            let es = self.out_kind.size();
            let out = &mut self.dst[es * j..es * (j + 1)];
            sum_one(self.rows, self.kind, out, self.out_kind, j);
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn sum_rows(
        rows: &[(&[u8], f32)],
        kind: FloatKind,
        dst: &mut [u8],
        out_kind: FloatKind,
        streaming: bool,
    ) {
        let out_es = out_kind.size();
        let n = dst.len() / out_es;
        // Non-temporal stores need 16-byte aligned addresses: a head up to the first one.
        let skip = (16 - dst.as_ptr() as usize % 16) % 16;
        let nt = streaming && skip.is_multiple_of(out_es) && n >= 64;
        let head = if nt { (skip / out_es).min(n) } else { 0 };
        let (e0, e1) = (head, n);
        let mut s = Sum {
            rows,
            kind,
            dst,
            out_kind,
            e0,
            e1,
        };
        for j in 0..head {
            s.one(j);
        }
        // SAFETY: the caller checked the features; rows hold `n` elements; dst + head is
        // 16-byte aligned when nt.
        unsafe {
            if nt {
                sum_body::<true>(s)
            } else {
                sum_body::<false>(s)
            }
        }
    }

    /// Elements `e0..e1` of [`sum_rows`]: with up to 8 rows, a kernel whose row pointers and
    /// weights sit in registers (unrolled over the rows); more rows loop over the slice.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn sum_body<const NT: bool>(s: Sum<'_, '_>) {
        // SAFETY (every arm): as the caller's.
        unsafe {
            // Weights of 1 (combine's usual case) skip the multiply: the same values, and no
            // microcode assist for subnormal inputs.
            let unit = s.rows.iter().all(|r| r.1 == 1.0);
            macro_rules! by_count {
                ($($n:literal)*) => {
                    match (s.rows.len(), unit) {
                        $(
                            ($n, true) => sum_fixed::<$n, NT, true>(s),
                            ($n, false) => sum_fixed::<$n, NT, false>(s),
                        )*
                        _ => sum_span::<NT>(s),
                    }
                };
            }
            by_count!(1 2 3 4 5 6 7 8)
        }
    }

    /// [`sum_span`] for exactly `N` rows, unrolled: the pointers and weights in registers;
    /// `UNIT`: every weight is 1.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn sum_fixed<const N: usize, const NT: bool, const UNIT: bool>(s: Sum<'_, '_>) {
        let (kind, es) = (s.kind, s.kind.size());
        let ptrs: [*const u8; N] = std::array::from_fn(|k| s.rows[k].0.as_ptr());
        let ws: [__m256; N] = std::array::from_fn(|k| _mm256_set1_ps(s.rows[k].1));
        // SAFETY (the closure): as the caller's; sum_loop passes i + 16 <= e1 <= n.
        unsafe {
            sum_loop::<NT>(s, |i| {
                let (mut a, mut b) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                for k in 0..N {
                    let p = ptrs[k].add(es * i);
                    let (mut x, mut y) = (load8_any(p, kind), load8_any(p.add(8 * es), kind));
                    if !UNIT {
                        (x, y) = (_mm256_mul_ps(ws[k], x), _mm256_mul_ps(ws[k], y));
                    }
                    (a, b) = (_mm256_add_ps(a, x), _mm256_add_ps(b, y));
                }
                (a, b)
            })
        }
    }

    /// Elements `e0..e1` of [`sum_rows`] for any number of rows: 16 at a time in registers, the
    /// rest generic.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn sum_span<const NT: bool>(s: Sum<'_, '_>) {
        let (rows, kind, es) = (s.rows, s.kind, s.kind.size());
        // SAFETY (the closure): as the caller's; sum_loop passes i + 16 <= e1 <= n.
        unsafe {
            sum_loop::<NT>(s, |i| {
                let (mut a, mut b) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                for (row, w) in rows {
                    let (p, wv) = (row.as_ptr().add(es * i), _mm256_set1_ps(*w));
                    a = _mm256_add_ps(a, _mm256_mul_ps(wv, load8_any(p, kind)));
                    b = _mm256_add_ps(b, _mm256_mul_ps(wv, load8_any(p.add(8 * es), kind)));
                }
                (a, b)
            })
        }
    }

    /// The loop of [`sum_fixed`] and [`sum_span`]: `sum16(i)` gives elements `i..i + 16` as
    /// two vectors, stored here; the last `(e1 - e0) % 16` elements are summed one by one.
    #[inline(always)]
    unsafe fn sum_loop<const NT: bool>(
        mut s: Sum<'_, '_>,
        sum16: impl Fn(usize) -> (__m256, __m256),
    ) {
        let out_es = s.out_kind.size();
        let body = s.e0 + (s.e1 - s.e0) / 16 * 16;
        let mut i = s.e0;
        while i < body {
            let (a, b) = sum16(i);
            // SAFETY: i + 16 <= e1 <= n: 16 elements of dst are in bounds; dst + i is 16-byte
            // aligned when NT (sum_rows skipped the head).
            unsafe { put16::<NT>(s.dst.as_mut_ptr().add(out_es * i), a, b, s.out_kind) };
            i += 16;
        }
        for j in body..s.e1 {
            s.one(j);
        }
    }

    #[inline(always)]
    unsafe fn put<const NT: bool>(d: *mut __m128i, v: __m128i) {
        // SAFETY (caller): 16 writable bytes at `d`, 16-byte aligned when NT.
        unsafe {
            if NT {
                _mm_stream_si128(d, v)
            } else {
                _mm_storeu_si128(d, v)
            }
        }
    }

    #[inline(always)]
    unsafe fn store_with<const NT: bool>(acc: &[f32], dst: &mut [u8], kind: FloatKind) {
        if kind == FloatKind::F32 && !NT {
            return store_generic(acc, dst, kind);
        }
        let es = kind.size();
        let n = acc.len().min(dst.len() / es);
        let body = n - n % 16;
        let mut i = 0;
        while i < body && kind == FloatKind::F32 {
            // SAFETY: i + 16 <= n: 64 bytes of each side in bounds; dst aligned (NT only).
            unsafe {
                let d = dst.as_mut_ptr().add(4 * i) as *mut __m128i;
                for q in 0..4 {
                    let v = _mm_loadu_si128(acc.as_ptr().add(i + 4 * q) as *const __m128i);
                    put::<NT>(d.add(q), v);
                }
            }
            i += 16;
        }
        while i < body {
            // SAFETY: i + 16 <= n, so 16 accumulator lanes and 32 destination bytes are in
            // bounds.
            unsafe {
                let a = _mm256_loadu_ps(acc.as_ptr().add(i));
                let b = _mm256_loadu_ps(acc.as_ptr().add(i + 8));
                let d = dst.as_mut_ptr().add(2 * i) as *mut __m128i;
                if kind == FloatKind::F16 {
                    put::<NT>(d, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(a));
                    put::<NT>(d.add(1), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(b));
                } else {
                    // packus works per 128-bit lane: [a0-3 b0-3 a4-7 b4-7] → reorder quarters.
                    let packed = _mm256_packus_epi32(bf16x8(a), bf16x8(b));
                    let ordered = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
                    put::<NT>(d, _mm256_castsi256_si128(ordered));
                    put::<NT>(d.add(1), _mm256_extracti128_si256::<1>(ordered));
                }
            }
            i += 16;
        }
        store_generic(&acc[body..n], &mut dst[es * body..es * n], kind);
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

    /// The run-time selected (SIMD) kernels give the same bits as the portable ones.
    #[test]
    fn simd_and_portable_kernels_agree() {
        // Every f16 value, then f32 values around bf16/f16 rounding boundaries and overflow.
        let mut vals: Vec<f32> = (0..=u16::MAX).map(f16_to_f32).collect();
        let mut x = 0x1234_5678u32;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            vals.push(f32::from_bits(x));
        }
        vals.extend([
            65504.0,
            65520.0,
            1e-8,
            -0.0,
            f32::INFINITY,
            f32::MIN_POSITIVE,
        ]);
        for kind in [FloatKind::F32, FloatKind::Bf16, FloatKind::F16] {
            for len in [vals.len(), vals.len() - 5, 7] {
                let v = &vals[..len];
                let mut a = vec![0u8; len * kind.size()];
                let mut b = a.clone();
                store(v, &mut a, kind);
                store_generic(v, &mut b, kind);
                assert_eq!(a, b, "store {kind:?}");
                // Streaming stores, at every alignment of the destination.
                for shift in 0..4 * kind.size() {
                    let mut c = vec![0u8; len * kind.size() + shift];
                    store_streaming(v, &mut c[shift..], kind);
                    assert_eq!(&c[shift..], &b[..], "streaming {kind:?} shift {shift}");
                }
                for w in [1.0f32, 0.3] {
                    let mut acc_a = vec![0.25f32; len];
                    let mut acc_b = acc_a.clone();
                    accumulate_scaled(&mut acc_a, &a, kind, w);
                    add_kind_generic::<true, false>(&mut acc_b, &a, kind, w);
                    let same = acc_a
                        .iter()
                        .zip(&acc_b)
                        .all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()));
                    assert!(same, "accumulate {kind:?} w={w}");
                    // assign_scaled == accumulate_scaled on zeros, bit for bit.
                    let mut zeroed = vec![0.0f32; len];
                    accumulate_scaled(&mut zeroed, &a, kind, w);
                    let mut assigned = vec![f32::NAN; len];
                    assign_scaled(&mut assigned, &a, kind, w);
                    let same = zeroed
                        .iter()
                        .zip(&assigned)
                        .all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()));
                    assert!(same, "assign {kind:?} w={w}");
                }
            }
        }
    }

    /// Decoded outputs equal bit for bit, NaNs by NaN-ness (payloads may differ by path).
    fn same_values(a: &[u8], b: &[u8], kind: FloatKind) -> bool {
        let (a, b) = (to_f32(a, kind), to_f32(b, kind));
        a.iter()
            .zip(&b)
            .all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()))
    }

    /// The one-pass row sum gives what the three-step path (assign, accumulate, store) gives,
    /// for every kind pair, row count, weight, length, destination alignment and both store
    /// modes, on the SIMD and the portable kernels.
    #[test]
    fn sum_rows_matches_the_three_step_path() {
        let mut x = 0x9e37_79b9u32;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        let kinds = [FloatKind::F32, FloatKind::Bf16, FloatKind::F16];
        for (kind, out_kind, len) in kinds
            .iter()
            .flat_map(|&k| kinds.iter().map(move |&o| (k, o)))
            .flat_map(|(k, o)| [1usize, 7, 16, 100, 1027].map(move |n| (k, o, n)))
        {
            for (nrows, unit) in [0usize, 1, 2, 3, 4, 5, 7, 8, 9, 12]
                .into_iter()
                .flat_map(|n| [(n, false), (n, true)])
            {
                // Values from random bits (NaN, infinity, -0.0 and subnormals included), a
                // tenth of them ordinary so sums are not all NaN.
                let rows: Vec<Vec<u8>> = (0..nrows)
                    .map(|_| {
                        let v: Vec<f32> = (0..len)
                            .map(|j| match j % 10 {
                                0 => f32::from_bits(next()),
                                1 => -0.0,
                                _ => (next() % 2001) as f32 / 100.0 - 10.0,
                            })
                            .collect();
                        from_f32(&v, kind)
                    })
                    .collect();
                let w = [1.0f32, 0.3, -1.5, 1.0, 0.7];
                let weight = |i: usize| if unit { 1.0 } else { w[i % w.len()] };
                let input: Vec<(&[u8], f32)> = rows
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (r.as_slice(), weight(i)))
                    .collect();
                let mut acc = vec![0f32; len];
                for (i, (r, w)) in input.iter().enumerate() {
                    match (i, *w == 1.0) {
                        (0, _) => assign_scaled(&mut acc, r, kind, *w),
                        (_, true) => accumulate(&mut acc, r, kind),
                        (_, false) => accumulate_scaled(&mut acc, r, kind, *w),
                    }
                }
                let mut want = vec![0u8; len * out_kind.size()];
                store(&acc, &mut want, out_kind);
                let mut portable = vec![0u8; want.len()];
                sum_rows_generic(&input, kind, &mut portable, out_kind);
                let case = format!("{kind:?}->{out_kind:?} len {len} rows {nrows} unit {unit}");
                assert!(same_values(&portable, &want, out_kind), "portable {case}");
                for (streaming, shift) in [false, true]
                    .into_iter()
                    .flat_map(|s| (0..4 * out_kind.size()).map(move |sh| (s, sh)))
                {
                    let mut buf = vec![0xa5u8; want.len() + shift];
                    sum_rows(&input, kind, &mut buf[shift..], out_kind, streaming);
                    streaming_fence();
                    let got = &buf[shift..];
                    assert!(
                        same_values(got, &want, out_kind),
                        "{case} streaming {streaming} shift {shift}"
                    );
                }
            }
        }
    }
}
