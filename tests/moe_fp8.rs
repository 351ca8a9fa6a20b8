//! FP8 dispatch: the e4m3fn conversions and DeepEP's per-128-element block quantisation checked
//! against independent scalar references (nearest code by enumeration, ties to the even code;
//! scales from the formula), the stated error bound, the edge cases (all-zero blocks,
//! denormals, amax exactly 448·2^k, NaN and infinity refused), and dispatch in every layout on
//! 2 and 4 ranks: each received fp8 row and its scales equal the reference quantisation of the
//! row the bf16 dispatch delivers at the same place, at (H + H/32) / 2H of the bytes.

mod ranks;

use std::time::Duration;

use epcomm::dtype::DType;
use epcomm::group::shm::ShmGroup;
use epcomm::group::GroupOptions;
use epcomm::moe::fp8::{self, Scales};
use epcomm::moe::reference::unit;
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::{self, FloatKind};

// ---- independent references -----------------------------------------------------------------

/// e4m3fn code → value by the definition (bias 7, 3 mantissa bits, S.1111.111 NaN).
fn ref_decode(c: u8) -> f64 {
    let (s, e, m) = (c >> 7, (c >> 3) & 15, c & 7);
    let mag = if e == 0 {
        m as f64 / 8.0 * 2f64.powi(-6)
    } else {
        (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7)
    };
    if s == 1 {
        -mag
    } else {
        mag
    }
}

/// Nearest finite e4m3fn code of `x` (ties to the even code, saturating at ±448), by search.
fn ref_encode(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs() as f64;
    let mut best = 0u8;
    for c in 0..=0x7eu8 {
        let (d, db) = ((ref_decode(c) - a).abs(), (ref_decode(best) - a).abs());
        if d < db || (d == db && c % 2 == 0 && best % 2 == 1) {
            best = c;
        }
    }
    sign | best
}

/// (scale, scale_inv) by DeepEP's formula, computed here without the library.
fn ref_scale(amax: f32, scales: Scales) -> (f32, f32) {
    let amax = amax.max(1e-4);
    match scales {
        Scales::Exact => (448.0 / amax, amax * (1.0 / 448.0)),
        Scales::Ue8m0 => {
            let want = amax * (1.0 / 448.0);
            let k = (-130..130).find(|&k| 2f64.powi(k) >= want as f64).unwrap();
            ((2f64.powi(-k)) as f32, (2f64.powi(k)) as f32)
        }
    }
}

fn bf16_row(vals: &[f32]) -> Vec<u8> {
    num::from_f32(vals, FloatKind::Bf16)
}

fn bf16_vals(row: &[u8]) -> Vec<f32> {
    num::to_f32(row, FloatKind::Bf16)
}

/// Reference quantisation of bf16 rows: (codes, scale_inv per block).
fn ref_quantize(row: &[u8], scales: Scales) -> (Vec<u8>, Vec<f32>) {
    let x = bf16_vals(row);
    let (mut q, mut inv) = (Vec::new(), Vec::new());
    for b in x.chunks(128) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let (s, i) = ref_scale(amax, scales);
        q.extend(b.iter().map(|v| ref_encode(v * s)));
        inv.push(i);
    }
    (q, inv)
}

fn lib_quantize(row: &[u8], h: usize, scales: Scales) -> (Vec<u8>, Vec<f32>) {
    let (mut q, mut s) = (Vec::new(), Vec::new());
    fp8::quantize(row, FloatKind::Bf16, h, scales, &mut q, &mut s).unwrap();
    (q, num::to_f32(&s, FloatKind::F32))
}

// ---- conversions ------------------------------------------------------------------------------

#[test]
fn e4m3fn_decode_matches_the_definition_for_all_256_codes() {
    for c in 0..=255u8 {
        let v = num::e4m3fn_to_f32(c);
        if c & 0x7f == 0x7f {
            assert!(v.is_nan(), "code {c:#04x}");
        } else {
            assert_eq!(v as f64, ref_decode(c), "code {c:#04x}");
            assert_eq!(num::f32_to_e4m3fn(v), c, "round trip of {c:#04x}");
        }
    }
    assert_eq!(num::e4m3fn_to_f32(0x7e), 448.0);
    assert_eq!(num::e4m3fn_to_f32(0x01), 2f32.powi(-9));
}

#[test]
fn e4m3fn_encode_rounds_to_nearest_even_and_saturates() {
    // Every midpoint between neighbouring codes (the ties), and just either side of it.
    for c in 0..0x7eu8 {
        let mid = ((ref_decode(c) + ref_decode(c + 1)) / 2.0) as f32;
        let even = if c % 2 == 0 { c } else { c + 1 };
        assert_eq!(num::f32_to_e4m3fn(mid), even, "tie above {c:#04x}");
        assert_eq!(num::f32_to_e4m3fn(-mid), 0x80 | even, "tie below -{c:#04x}");
        assert_eq!(num::f32_to_e4m3fn(f32::from_bits(mid.to_bits() - 1)), c);
        assert_eq!(num::f32_to_e4m3fn(f32::from_bits(mid.to_bits() + 1)), c + 1);
    }
    for i in 0..200_000u64 {
        let x = unit(7, i) * 2f32.powi((i % 24) as i32 - 14);
        assert_eq!(num::f32_to_e4m3fn(x), ref_encode(x), "x = {x:e}");
    }
    for (x, c) in [
        (448.0, 0x7e),
        (464.0, 0x7e),
        (1e6, 0x7e),
        (f32::INFINITY, 0x7e),
        (f32::NEG_INFINITY, 0xfe),
        (f32::MIN_POSITIVE / 4.0, 0x00),
        (-0.0, 0x80),
    ] {
        assert_eq!(num::f32_to_e4m3fn(x), c, "x = {x:e}");
    }
    assert_eq!(num::f32_to_e4m3fn(f32::NAN) & 0x7f, 0x7f);
}

// ---- block quantisation ----------------------------------------------------------------------

/// bf16 rows of 4 blocks at magnitudes from 2^-20 to 2^20.
fn sample_rows(seed: u64, rows: usize) -> Vec<Vec<u8>> {
    (0..rows)
        .map(|r| {
            let vals: Vec<f32> = (0..512)
                .map(|j| {
                    let mag = 2f32.powi(((r * 4 + j / 128) % 41) as i32 - 20);
                    unit(seed, (r * 512 + j) as u64) * mag
                })
                .collect();
            bf16_row(&vals)
        })
        .collect()
}

#[test]
fn quantisation_matches_the_reference_bit_for_bit() {
    for scales in [Scales::Exact, Scales::Ue8m0] {
        for row in sample_rows(3, 64) {
            let (rq, rs) = ref_quantize(&row, scales);
            let (q, s) = lib_quantize(&row, 512, scales);
            assert_eq!(q, rq, "{scales:?}");
            assert_eq!(
                s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                rs.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{scales:?}"
            );
        }
    }
}

/// The bound the module states: |deq − x| ≤ max(|x|·2^-4, inv·2^-10) and ≤ 16·inv, each up
/// to the f32 rounding of x·scale and of the dequantising product (relative 2^-22 covers both).
#[test]
fn dequantised_error_is_within_half_an_e4m3_ulp() {
    let slop = 1.0 + 2f32.powi(-22);
    for scales in [Scales::Exact, Scales::Ue8m0] {
        let mut worst = 0.0f32;
        for row in sample_rows(11, 128) {
            let (q, s) = lib_quantize(&row, 512, scales);
            let sb: Vec<u8> = s.iter().flat_map(|v| v.to_ne_bytes()).collect();
            let d = fp8::dequantize(&q, &sb, 512);
            for (j, (x, y)) in bf16_vals(&row).iter().zip(&d).enumerate() {
                let inv = s[j / 128];
                let err = (x - y).abs();
                assert!(
                    err <= (x.abs() / 16.0).max(inv / 1024.0) * slop,
                    "{x:e} → {y:e}"
                );
                assert!(err <= 16.0 * inv * slop, "{x:e} → {y:e}");
                worst = worst.max(err / inv);
            }
        }
        // The block-wide bound is reached within a factor 2, so it is the right one.
        assert!(
            worst >= 8.0 && worst <= 16.0 * slop,
            "{scales:?}: worst {worst}"
        );
    }
}

#[test]
fn all_zero_blocks_get_the_margin_scale() {
    let row = bf16_row(&[0.0; 128]);
    let (q, s) = lib_quantize(&row, 128, Scales::Exact);
    assert_eq!((q, s), (vec![0u8; 128], vec![1e-4f32 * (1.0 / 448.0)]));
    let (q, s) = lib_quantize(&row, 128, Scales::Ue8m0);
    assert_eq!((q, s), (vec![0u8; 128], vec![2f32.powi(-22)]));
}

#[test]
fn bf16_denormals_quantise_to_zero_within_the_bound() {
    // bf16 bits 0x0001..: below the 1e-4 margin, so the block's scale is the margin's and the
    // values (~1e-39) are far under half the smallest e4m3 step times scale_inv.
    let bits: Vec<u16> = (1..=128u16)
        .map(|b| if b % 2 == 0 { b } else { 0x8000 | b })
        .collect();
    let row: Vec<u8> = bits.iter().flat_map(|b| b.to_ne_bytes()).collect();
    for scales in [Scales::Exact, Scales::Ue8m0] {
        let (q, s) = lib_quantize(&row, 128, scales);
        let (rq, rs) = ref_quantize(&row, scales);
        assert_eq!((&q, &s), (&rq, &rs));
        assert!(q.iter().all(|&c| c & 0x7f == 0), "{q:?}");
    }
}

#[test]
fn amax_of_448_times_a_power_of_two_is_exact() {
    for k in -12..=12 {
        let amax = 448.0 * 2f32.powi(k);
        let vals: Vec<f32> = (0..128)
            .map(|j| {
                if j == 5 {
                    -amax
                } else {
                    amax * j as f32 / 256.0
                }
            })
            .collect();
        let row = bf16_row(&vals);
        for scales in [Scales::Exact, Scales::Ue8m0] {
            let (q, s) = lib_quantize(&row, 128, scales);
            assert_eq!(s, vec![2f32.powi(k)], "k={k} {scales:?}");
            assert_eq!(q[5], 0xfe, "-amax is -448");
            assert_eq!(num::e4m3fn_to_f32(q[5]) * s[0], -amax);
        }
    }
}

#[test]
fn non_finite_values_are_refused_with_their_position() {
    for (v, shown) in [
        (f32::INFINITY, "inf"),
        (f32::NEG_INFINITY, "-inf"),
        (f32::NAN, "NaN"),
    ] {
        let mut vals = vec![1.0f32; 256];
        vals[130] = v;
        let (mut q, mut s) = (Vec::new(), Vec::new());
        let err = fp8::quantize(
            &bf16_row(&vals),
            FloatKind::Bf16,
            128,
            Scales::Exact,
            &mut q,
            &mut s,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("hidden_states[1, 2] is {shown}: FP8 dispatch quantises finite values only (an infinity or NaN would turn its 128-element block into NaN)")
        );
    }
}

// ---- dispatch ---------------------------------------------------------------------------------

fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize, &mut ShmGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let name = ranks::unique("f8", "g");
    ranks::on_threads(world, move |r| {
        let opts = GroupOptions {
            timeout: Duration::from_secs(30),
            ..GroupOptions::default()
        };
        let mut g = ShmGroup::join(&name, r, world, opts).unwrap();
        f(r, &mut g)
    })
}

const H: usize = 256;

fn cfg(world: usize) -> MoeConfig {
    MoeConfig {
        num_experts: 4 * world,
        top_k: 3,
        hidden: H,
        hidden_dtype: DType::BF16,
        expert_dtype: FloatKind::Bf16,
        out_dtype: FloatKind::Bf16,
        max_tokens_per_rank: 8,
        extra_row_bytes: vec![],
        apply_router_weight_on_input: false,
    }
}

/// Rank r's tokens: 3 + r of them, distinct values, block magnitudes varying per token.
fn tokens(r: usize, world: usize) -> (Vec<u8>, Vec<i64>, Vec<f32>, usize) {
    let t = 3 + r;
    let vals: Vec<f32> = (0..t * H)
        .map(|i| unit(r as u64 + 1, i as u64) * 2f32.powi((i / 128 % 7) as i32 - 3))
        .collect();
    let ids: Vec<i64> = (0..t * 3)
        .map(|i| ((i * 7 + r * 5) % (4 * world)) as i64)
        .collect();
    let ids = ids
        .chunks(3)
        .flat_map(|p| {
            let mut p = p.to_vec();
            p.dedup();
            p.resize(3, -1);
            p
        })
        .collect();
    (bf16_row(&vals), ids, vec![0.25; t * 3], t)
}

struct Outcome {
    matched: usize,
    received: u64,
    bytes_bf16: u64,
    bytes_fp8: u64,
    dtype: DType,
}

/// One bf16 and one FP8 dispatch of the same tokens; every fp8 row at a place the bf16
/// dispatch filled with a source row is that row's reference quantisation.
fn dispatch_both(name: &'static str, world: usize, scales: Scales) -> Vec<Outcome> {
    let all: Vec<_> = (0..world).map(|r| tokens(r, world)).collect();
    let sources: Vec<Vec<u8>> = all
        .iter()
        .flat_map(|(x, ..)| x.chunks(2 * H).map(<[u8]>::to_vec).collect::<Vec<_>>())
        .collect();
    on_ranks(world, move |r, g| {
        let (x, ids, w, t) = tokens(r, world);
        let mut m = Manager::new(name, cfg(world), r, world).unwrap();
        let plain = m.dispatch(g, &x, &ids, &w, &[]).unwrap().hidden.to_vec();
        let (received, bytes_bf16) = (
            m.stats().tokens_received.iter().sum(),
            m.stats().bytes_received.iter().sum(),
        );
        m.set_dispatch_fp8(Some(scales)).unwrap();
        let q = m.dispatch(g, &x, &ids, &w, &[]).unwrap().hidden.to_vec();
        let s = num::to_f32(m.dispatch_scales(), FloatKind::F32);
        assert_eq!((q.len(), s.len()), (plain.len() / 2, plain.len() / 2 / 128));
        let mut matched = 0;
        for (i, row) in plain.chunks(2 * H).enumerate() {
            if sources.contains(&row.to_vec()) {
                let (rq, rs) = ref_quantize(row, scales);
                assert_eq!(&q[i * H..(i + 1) * H], &rq[..], "{name} row {i}");
                assert_eq!(&s[i * 2..i * 2 + 2], &rs[..], "{name} row {i}");
                matched += 1;
            }
        }
        // Combine after an FP8 dispatch takes bf16 expert outputs of the same rows.
        let y = vec![0u8; plain.len()];
        let mut out = vec![0xffu8; t * H * 2];
        m.combine(g, &y, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 0));
        Outcome {
            matched,
            received,
            bytes_bf16,
            bytes_fp8: m.stats().bytes_received.iter().sum(),
            dtype: m.dispatch_hidden_dtype(),
        }
    })
}

#[test]
fn fp8_dispatch_in_every_layout_on_2_and_4_ranks() {
    for name in [
        "allgather_reducescatter",
        "deepep_high_throughput",
        "deepep_low_latency",
        "deepep_v2",
        "flashinfer_nvlink_one_sided",
    ] {
        for world in [2, 4] {
            for scales in [Scales::Exact, Scales::Ue8m0] {
                for (r, o) in dispatch_both(name, world, scales).iter().enumerate() {
                    let at = format!("{name} R={world} rank {r} {scales:?}");
                    assert!(o.received > 0, "{at}");
                    assert_eq!(o.matched as u64, o.received, "{at}");
                    // H bytes + H/128 f32 scales per row instead of 2H: (256 + 8) / 512.
                    assert_eq!(o.bytes_fp8 * 512, o.bytes_bf16 * 264, "{at}");
                    assert_eq!(o.dtype, DType::F8E4M3FN, "{at}");
                }
            }
        }
    }
}

#[test]
fn a_non_finite_value_fails_every_rank_before_data_moves() {
    let errs = on_ranks(2, |r, g| {
        let (mut x, ids, w, _) = tokens(r, 2);
        if r == 1 {
            // Token 2, element 129 = +inf (bf16 0x7f80).
            let at = (2 * H + 129) * 2;
            x[at..at + 2].copy_from_slice(&0x7f80u16.to_ne_bytes());
        }
        let mut m = Manager::new("deepep_low_latency", cfg(2), r, 2).unwrap();
        m.set_dispatch_fp8(Some(Scales::Exact)).unwrap();
        let err = m
            .dispatch(g, &x, &ids, &w, &[])
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(m.dispatch_scales().is_empty());
        err
    });
    assert_eq!(
        errs[1],
        "hidden_states[2, 129] is inf: FP8 dispatch quantises finite values only (an infinity or NaN would turn its 128-element block into NaN)"
    );
    assert_eq!(
        errs[0],
        "dispatch: rank 1 rejected its input (see that rank's error); no data was exchanged"
    );
}

#[test]
fn every_rank_must_agree_on_fp8_dispatch() {
    let errs = on_ranks(2, |r, g| {
        let (x, ids, w, _) = tokens(r, 2);
        let mut m = Manager::new("deepep_high_throughput", cfg(2), r, 2).unwrap();
        if r == 0 {
            m.set_dispatch_fp8(Some(Scales::Ue8m0)).unwrap();
        }
        m.dispatch(g, &x, &ids, &w, &[])
            .map(|_| ())
            .unwrap_err()
            .to_string()
    });
    assert_eq!(errs[0], "dispatch: rank 1 has dispatch fp8 = off but rank 0 has e4m3 (ue8m0 scales); every rank must create the manager with the same backend and configuration");
    assert_eq!(errs[1], "dispatch: rank 0 has dispatch fp8 = e4m3 (ue8m0 scales) but rank 1 has off; every rank must create the manager with the same backend and configuration");
}

#[test]
fn fp8_dispatch_needs_hidden_a_multiple_of_128() {
    let mut c = cfg(1);
    c.hidden = 200;
    let mut m = Manager::new("deepep_low_latency", c, 0, 1).unwrap();
    assert_eq!(
        m.set_dispatch_fp8(Some(Scales::Exact)).unwrap_err().to_string(),
        "DeepEP kernels quantize the inputs in blocks of shape 128 (hidden_size 200 is not a multiple of 128)"
    );
    assert_eq!(m.dispatch_fp8(), None);
}
