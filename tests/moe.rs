//! MoE dispatch/combine for every backend name: the worked example of docs/design.md exactly, then
//! property runs (ranks 1..8, uneven and zero token counts, skewed and uniform routing, masked ids,
//! f32/bf16/f16) against the single-process f32 reference, with the dispatch layout checked row by
//! row (over shared memory, and one backend per layout over host-callback groups, where
//! dispatch's routing travels with its rows); and bad input that must fail on every rank
//! without hanging.
//!
//! Tolerances (max |out - ref| / max(1, |ref|)): f32 1e-5; f16 hidden/outputs 4e-3;
//! bf16 3e-2 (one rounding of the inputs is shared with the reference; the expert outputs and
//! the result are rounded once each).

// Reference checks index several parallel arrays by rank; plain index loops read clearest.
#![allow(clippy::needless_range_loop)]

#[path = "common/channel.rs"]
mod channel;
mod ranks;

use std::time::Duration;

use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions};

use epcomm::moe::layout::{self, Capacity, Contract, Counts, Ids, Unit, Weights, WeightsBy};
use epcomm::moe::reference::{unit, ToyExperts};
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::{self, FloatKind};
use epcomm::select::all2all::{Backend, Layout, ACCEPTED_NAMES};
use epcomm::Status;

fn opts() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(30),
        ..GroupOptions::default()
    }
}

/// Runs `f(rank, group)` on `world` threads of one shm group; returns the results in rank order.
fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize, &mut ShmGroup) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let name = ranks::unique("m", "g");
    ranks::on_threads(world, move |r| {
        let mut g = ShmGroup::join(&name, r, world, opts()).unwrap();
        f(r, &mut g)
    })
}

fn cfg(e: usize, k: usize, h: usize, kind: FloatKind, m: usize) -> MoeConfig {
    MoeConfig {
        num_experts: e,
        top_k: k,
        hidden: h,
        hidden_dtype: kind.dtype(),
        expert_dtype: kind,
        out_dtype: kind,
        max_tokens_per_rank: m,
        extra_row_bytes: vec![],
        apply_router_weight_on_input: false,
    }
}

// ---- the worked example (docs/design.md, section 3) ---------------------------------------------

const X: [[f32; 3]; 2] = [[10.0, 11.0, 12.0], [20.0, 21.0, 0.0]];
const IDS: [&[i64]; 2] = [&[0, 2, 1, 0, 3, -1], &[2, 3, 1, -1]];
const W: [&[f32]; 2] = [&[0.5, 0.5, 0.25, 0.75, 1.0, 0.0], &[0.5, 0.5, 1.0, 0.0]];

/// Expert e computes (e+1)·x; the holder side as the layout's contract says.
fn example_expert_side(layout: Layout, rank: usize, v: &epcomm::moe::DispatchView<'_>) -> Vec<f32> {
    let x = num::to_f32(v.hidden, FloatKind::F32);
    let owned = |e: i64| e >= 0 && e as usize / 2 == rank;
    match layout {
        Layout::Replicated | Layout::TokenMajor | Layout::RankMajor => x
            .iter()
            .enumerate()
            .map(|(r, &xv)| {
                (0..2)
                    .filter(|&k| owned(v.topk_ids[r * 2 + k]))
                    .map(|k| v.topk_weights[r * 2 + k] * (v.topk_ids[r * 2 + k] + 1) as f32 * xv)
                    .sum()
            })
            .collect(),
        Layout::ExpertMajor => {
            let cap = x.len() / 2;
            x.iter()
                .enumerate()
                .map(|(r, &xv)| ((rank * 2 + r / cap) + 1) as f32 * xv)
                .collect()
        }
        Layout::ExpertPacked => x
            .iter()
            .enumerate()
            .map(|(r, &xv)| {
                let j = if (r as i64) < v.expert_offsets[1] {
                    0
                } else {
                    1
                };
                ((rank * 2 + j) + 1) as f32 * xv
            })
            .collect(),
        Layout::MoonepSlots => unreachable!(),
    }
}

#[test]
fn worked_example_in_every_layout() {
    for name in [
        "allgather_reducescatter",
        "deepep_high_throughput",
        "deepep_low_latency",
        "deepep_v2",
        "flashinfer_nvlink_one_sided",
    ] {
        let results = on_ranks(2, move |r, g| {
            let mut m = Manager::new(name, cfg(4, 2, 1, FloatKind::F32, 3), r, 2).unwrap();
            let t = if r == 0 { 3 } else { 2 };
            let hidden = num::from_f32(&X[r][..t], FloatKind::F32);
            let v = m.dispatch(g, &hidden, IDS[r], W[r], &[]).unwrap();
            let layout = v.layout;
            let rows = num::to_f32(v.hidden, FloatKind::F32);
            let (ids, ws, counts, offsets) = (
                v.topk_ids.to_vec(),
                v.topk_weights.to_vec(),
                v.counts.to_vec(),
                v.expert_offsets.to_vec(),
            );
            let y = num::from_f32(&example_expert_side(layout, r, &v), FloatKind::F32);
            let mut out = vec![0u8; t * 4];
            m.combine(g, &y, &mut out).unwrap();
            (
                layout,
                rows,
                ids,
                ws,
                counts,
                offsets,
                num::to_f32(&out, FloatKind::F32),
            )
        });
        let (layout, ..) = results[0].clone();
        let out0 = &results[0].6;
        let out1 = &results[1].6;
        assert_eq!(out0, &vec![20.0, 13.75, 48.0], "{name} rank 0");
        assert_eq!(out1, &vec![70.0, 42.0], "{name} rank 1");
        let (r0, r1) = (&results[0], &results[1]);
        match layout {
            Layout::TokenMajor => {
                assert_eq!(r0.1, vec![10.0, 11.0, 21.0]);
                assert_eq!(r0.2, vec![0, -1, 1, 0, 1, -1]);
                assert_eq!(r0.3, vec![0.5, 0.0, 0.25, 0.75, 1.0, 0.0]);
                assert_eq!(r0.4, vec![2, 2]);
                assert_eq!(r1.1, vec![10.0, 12.0, 20.0]);
                assert_eq!(r1.2, vec![-1, 2, 3, -1, 2, 3]);
                assert_eq!(r1.3, vec![0.0, 0.5, 1.0, 0.0, 0.5, 0.5]);
                assert_eq!(r1.4, vec![2, 2]);
            }
            Layout::ExpertMajor => {
                // Buckets of M*R = 6 rows; rows past the counts are unspecified.
                assert_eq!(r0.4, vec![2, 2]);
                assert_eq!(
                    (&r0.1[0..2], &r0.1[6..8]),
                    (&[10.0, 11.0][..], &[11.0, 21.0][..])
                );
                assert_eq!(r1.4, vec![2, 2]);
                assert_eq!(
                    (&r1.1[0..2], &r1.1[6..8]),
                    (&[10.0, 20.0][..], &[12.0, 20.0][..])
                );
            }
            Layout::ExpertPacked => {
                assert_eq!(r0.1, vec![10.0, 11.0, 11.0, 21.0]);
                assert_eq!(r0.5, vec![0, 2, 4]);
                assert_eq!(r0.3, vec![0.5, 0.75, 0.25, 1.0]);
                assert_eq!(r1.1, vec![10.0, 20.0, 12.0, 20.0]);
                assert_eq!(r1.5, vec![0, 2, 4]);
                assert_eq!(r1.3, vec![0.5, 0.5, 1.0, 0.5]);
            }
            Layout::RankMajor => {
                assert_eq!(r0.4, vec![2, 1]);
                assert_eq!((&r0.1[0..2], r0.1[3]), (&[10.0, 11.0][..], 21.0));
                assert_eq!(&r0.2[0..4], &[0, 2, 1, 0]);
                assert_eq!(&r0.2[4..6], &[-1, -1]);
                assert_eq!(r1.4, vec![2, 1]);
                assert_eq!((&r1.1[0..2], r1.1[3]), (&[10.0, 12.0][..], 20.0));
            }
            Layout::Replicated => {
                assert_eq!(r0.1, vec![10.0, 11.0, 12.0, 20.0, 21.0]);
                assert_eq!(r1.1, r0.1);
            }
            Layout::MoonepSlots => unreachable!(),
        }
    }
}

// ---- property runs against the reference --------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct Case {
    world: usize,
    experts: usize,
    k: usize,
    hidden: usize,
    kind: FloatKind,
    skewed: bool,
    seed: u64,
}

fn tokens_of(c: &Case, rank: usize) -> usize {
    // Uneven, sometimes zero, never above M = 24.
    [5, 0, 17, 24, 1, 9, 0, 13][(rank + c.seed as usize) % 8]
}

/// Routing of one rank: distinct experts per token, some masked, uniform or skewed.
fn routing(c: &Case, rank: usize) -> (Vec<i64>, Vec<f32>) {
    let t = tokens_of(c, rank);
    let mut ids = Vec::new();
    let mut ws = Vec::new();
    for tok in 0..t {
        let mut row: Vec<i64> = Vec::new();
        let mut i = 0u64;
        while row.len() < c.k {
            let u = (unit(c.seed ^ (rank as u64) << 32, (tok as u64) << 8 | i) + 1.0) / 2.0;
            // Skewed: most tokens pick from the first few experts.
            let e = if c.skewed {
                ((u * u * u) * c.experts as f32) as i64
            } else {
                (u * c.experts as f32) as i64
            };
            let e = e.min(c.experts as i64 - 1);
            i += 1;
            if !row.contains(&e) {
                row.push(e);
            }
        }
        // Mask some entries (every 5th token drops its last choice; every 11th is all masked).
        if tok % 5 == 4 {
            *row.last_mut().unwrap() = -1;
        }
        if tok % 11 == 10 {
            row.iter_mut().for_each(|e| *e = -1);
        }
        for (j, &e) in row.iter().enumerate() {
            ids.push(e);
            ws.push(if e < 0 { 0.0 } else { 0.2 + 0.1 * j as f32 });
        }
    }
    (ids, ws)
}

fn hidden_of(c: &Case, rank: usize) -> Vec<f32> {
    let t = tokens_of(c, rank);
    (0..(t * c.hidden) as u64)
        .map(|i| unit(c.seed ^ 0x77 ^ (rank as u64) << 40, i))
        .collect()
}

fn tolerance(kind: FloatKind) -> f32 {
    match kind {
        FloatKind::F32 => 1e-5,
        FloatKind::F16 => 4e-3,
        FloatKind::Bf16 => 3e-2,
    }
}

fn run_case(name: &'static str, c: Case) {
    let errs = on_ranks(c.world, move |r, g| case_error(name, c, r, g));
    check_errors(name, c, &errs);
}

/// [`run_case`] over host-callback groups (channels between threads; with the host's
/// all_to_allv or send/recv only): dispatch's routing travels with its rows there.
fn run_case_on_host(name: &'static str, c: Case, all_to_allv: bool) {
    let transports = channel::channel_transports_with(c.world, true, all_to_allv);
    let errs = channel::on_transports(transports, move |r, g| case_error(name, c, r, g));
    check_errors(name, c, &errs);
}

/// One rank's dispatch (checked row by row), expert side and combine: the largest relative
/// error against the reference.
fn case_error(name: &'static str, c: Case, r: usize, g: &mut dyn Group) -> f32 {
    let experts = ToyExperts::new(c.experts, c.hidden, c.seed);
    let mut m = Manager::new(name, cfg(c.experts, c.k, c.hidden, c.kind, 24), r, c.world).unwrap();
    let (ids, ws) = routing(&c, r);
    let x = num::from_f32(&hidden_of(&c, r), c.kind);
    let v = m.dispatch(g, &x, &ids, &ws, &[]).unwrap();
    check_layout(&c, r, &v);
    let y = experts.run_local(&v, c.kind, r, c.world, c.k);
    check_shapes(&m);
    let y = num::from_f32(&y, c.kind);
    let t = tokens_of(&c, r);
    let mut out = vec![0u8; t * c.hidden * c.kind.size()];
    m.combine(g, &y, &mut out).unwrap();
    let got = num::to_f32(&out, c.kind);
    // Reference on the same (rounded) inputs.
    let xr = num::to_f32(&x, c.kind);
    let want = experts.reference(&xr, &ids, &ws, c.k, false);
    got.iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
        .fold(0f32, f32::max)
}

fn check_errors(name: &str, c: Case, errs: &[f32]) {
    for (r, e) in errs.iter().enumerate() {
        assert!(
            *e <= tolerance(c.kind),
            "{name} {c:?} rank {r}: max relative error {e}"
        );
    }
}

/// Checks the dispatch output row by row against what the layout must contain.
fn check_layout(c: &Case, me: usize, v: &epcomm::moe::DispatchView<'_>) {
    let el = c.experts / c.world;
    let owned = |e: i64| e >= 0 && e as usize / el == me;
    let row_bytes = c.hidden * c.kind.size();
    let row = |r: usize| &v.hidden[r * row_bytes..(r + 1) * row_bytes];
    let src_row = |s: usize, t: usize| {
        num::from_f32(&hidden_of(c, s)[t * c.hidden..(t + 1) * c.hidden], c.kind)
    };
    let all: Vec<(Vec<i64>, Vec<f32>)> = (0..c.world).map(|s| routing(c, s)).collect();
    let k = c.k;
    let goes = |s: usize, t: usize| all[s].0[t * k..(t + 1) * k].iter().any(|&e| owned(e));
    match v.layout {
        Layout::TokenMajor | Layout::Replicated => {
            let mut r = 0;
            let mut counts = vec![0; el];
            for s in 0..c.world {
                for t in 0..tokens_of(c, s) {
                    if v.layout == Layout::TokenMajor && !goes(s, t) {
                        continue;
                    }
                    assert_eq!(row(r), &src_row(s, t)[..], "row {r} = ({s},{t})");
                    for j in 0..k {
                        let (e, w) = (all[s].0[t * k + j], all[s].1[t * k + j]);
                        let (ge, gw) = (v.topk_ids[r * k + j], v.topk_weights[r * k + j]);
                        if v.layout == Layout::Replicated {
                            assert_eq!((ge, gw), (e, w));
                        } else if owned(e) {
                            assert_eq!((ge, gw), (e, w));
                            counts[e as usize - me * el] += 1;
                        } else {
                            assert_eq!((ge, gw), (-1, 0.0));
                        }
                    }
                    r += 1;
                }
            }
            assert_eq!(r, v.received_rows);
            if v.layout == Layout::TokenMajor {
                assert_eq!(v.counts, &counts[..]);
            }
        }
        Layout::ExpertMajor | Layout::ExpertPacked => {
            let cap = 24 * c.world;
            let mut packed = 0;
            for j in 0..el {
                let e = (me * el + j) as i64;
                let mut n = 0;
                for s in 0..c.world {
                    for t in 0..tokens_of(c, s) {
                        if let Some(kk) = all[s].0[t * k..(t + 1) * k].iter().position(|&x| x == e)
                        {
                            let r = if v.layout == Layout::ExpertMajor {
                                j * cap + n
                            } else {
                                packed + n
                            };
                            assert_eq!(
                                row(r),
                                &src_row(s, t)[..],
                                "expert {e} row {n} = ({s},{t})"
                            );
                            if v.layout == Layout::ExpertPacked {
                                assert_eq!((v.src_rank[r], v.src_token[r]), (s as i32, t as i32));
                                assert_eq!(v.topk_weights[r], all[s].1[t * k + kk]);
                            }
                            n += 1;
                        }
                    }
                }
                if v.layout == Layout::ExpertMajor {
                    assert_eq!(v.counts[j], n as i32);
                } else {
                    assert_eq!(v.expert_offsets[j + 1] - v.expert_offsets[j], n as i64);
                }
                packed += n;
            }
        }
        Layout::RankMajor => {
            for s in 0..c.world {
                let mut n = 0;
                for t in 0..tokens_of(c, s) {
                    if goes(s, t) {
                        let r = s * 24 + n;
                        assert_eq!(row(r), &src_row(s, t)[..]);
                        assert_eq!(
                            &v.topk_ids[r * k..(r + 1) * k],
                            &all[s].0[t * k..(t + 1) * k]
                        );
                        n += 1;
                    }
                }
                assert_eq!(v.counts[s], n as i32);
                for r in s * 24 + n..(s + 1) * 24 {
                    assert!(
                        v.topk_ids[r * k..(r + 1) * k].iter().all(|&e| e == -1),
                        "padding row {r}"
                    );
                }
            }
        }
        Layout::MoonepSlots => unreachable!(),
    }
}

/// A property run's case on `world` ranks: 8 experts per rank (12 in all at 3 ranks), top-3,
/// 40 wide, seeded by `seed + world`.
fn property_case(world: usize, kind: FloatKind, skewed: bool, seed: u64) -> Case {
    Case {
        world,
        experts: if world == 3 { 12 } else { 8 * world },
        k: 3,
        hidden: 40,
        kind,
        skewed,
        seed: seed + world as u64,
    }
}

#[test]
fn every_backend_name_matches_the_reference() {
    for n in ACCEPTED_NAMES.iter().filter(|n| n.name != "moonep") {
        for (world, kind, skewed) in [
            (1, FloatKind::F32, false),
            (2, FloatKind::Bf16, true),
            (3, FloatKind::F16, false),
            (4, FloatKind::F32, true),
        ] {
            run_case(n.name, property_case(world, kind, skewed, 7));
        }
    }
}

/// The property runs over host-callback groups, one backend per layout (dispatch's routing
/// travels with its rows there; uneven and zero token counts, masked ids).
#[test]
fn every_layout_matches_the_reference_over_host_callbacks() {
    for name in one_backend_per_layout() {
        for (world, kind, skewed, a2av) in [
            (1, FloatKind::F32, false, true),
            (2, FloatKind::Bf16, true, true),
            (3, FloatKind::F16, false, false),
            (4, FloatKind::F32, true, true),
        ] {
            run_case_on_host(name, property_case(world, kind, skewed, 11), a2av);
        }
    }
}

#[test]
fn eight_ranks_all_dtypes() {
    for name in [
        "deepep_high_throughput",
        "deepep_low_latency",
        "deepep_v2",
        "flashinfer_nvlink_two_sided",
        "allgather_reducescatter",
    ] {
        for kind in [FloatKind::F32, FloatKind::Bf16, FloatKind::F16] {
            run_case(
                name,
                Case {
                    world: 8,
                    experts: 32,
                    k: 4,
                    hidden: 24,
                    kind,
                    skewed: true,
                    seed: 3,
                },
            );
        }
    }
}

#[test]
fn moonep_reports_unavailable() {
    let e = Manager::new("moonep", cfg(8, 2, 4, FloatKind::F32, 4), 0, 1).unwrap_err();
    assert_eq!(
        e.to_string(),
        "MoonEP not available. Install it from https://github.com/MoonshotAI/MoonEP."
    );
    assert_eq!(e.status(), Status::Runtime);
}

#[test]
fn configuration_errors() {
    let mut c = cfg(8, 2, 4, FloatKind::F32, 4);
    c.apply_router_weight_on_input = true;
    let e = Manager::new("deepep_low_latency", c, 0, 1).unwrap_err();
    assert_eq!(
        (e.status(), e.to_string().as_str()),
        (
            Status::Assertion,
            "apply_router_weight_on_input is only implemented for topk=1"
        )
    );
    let e = Manager::new("deepep_low_latency", cfg(6, 2, 4, FloatKind::F32, 4), 0, 4).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("num_experts is 6: expected a positive multiple of the EP size (4)"),
        "{e}"
    );
    let e = Manager::new("deepep_low_latency", cfg(8, 2, 4, FloatKind::F32, 0), 0, 1).unwrap_err();
    assert!(
        e.to_string().starts_with(
            "max_tokens_per_rank is 0: the deepep_low_latency backend (EXPERT_MAJOR layout) needs"
        ),
        "{e}"
    );
    let e = Manager::new("mori_ep", cfg(8, 2, 4, FloatKind::F32, 4), 0, 1).unwrap_err();
    assert_eq!(e.to_string(), "Unknown all2all backend: mori_ep");
    // vLLM 0.34.0's `mori` (MoRI EPv1) is a token-major manager.
    let m = Manager::new("mori", cfg(8, 2, 4, FloatKind::F32, 4), 0, 1).unwrap();
    assert_eq!(m.layout(), epcomm::select::all2all::Layout::TokenMajor);
    // One-sided: vLLM's assertion for heterogeneous layers.
    let m = Manager::new(
        "flashinfer_nvlink_one_sided",
        cfg(8, 2, 4, FloatKind::F32, 4),
        0,
        1,
    )
    .unwrap();
    let e = m.check_layer(6, 8).unwrap_err();
    assert_eq!(e.to_string(), "FlashInfer one-sided communication does not support heterogeneous top_k (got 6, was built with 2)");
    let e = m.check_layer(2, 16).unwrap_err();
    assert_eq!(e.to_string(), "FlashInfer one-sided communication does not support heterogeneous num_experts (got 16, was built with 8)");
    assert!(m.check_layer(2, 8).is_ok());
}

#[test]
fn apply_router_weight_on_input_top1() {
    let experts = ToyExperts::new(4, 8, 1);
    let errs = on_ranks(2, move |r, g| {
        let mut c = cfg(4, 1, 8, FloatKind::F32, 8);
        c.apply_router_weight_on_input = true;
        let mut m = Manager::new("deepep_low_latency", c, r, 2).unwrap();
        let ids: Vec<i64> = vec![(r * 3 % 4) as i64, 1, 2];
        let ws = vec![0.5, 2.0, 0.25];
        let x: Vec<f32> = (0..24).map(|i| (i as f32 - 10.0) / 7.0).collect();
        let v = m
            .dispatch(g, &num::from_f32(&x, FloatKind::F32), &ids, &ws, &[])
            .unwrap();
        let y = num::from_f32(
            &experts.run_local(&v, FloatKind::F32, r, 2, 1),
            FloatKind::F32,
        );
        let mut out = vec![0u8; 3 * 8 * 4];
        m.combine(g, &y, &mut out).unwrap();
        let want = experts.reference(&x, &ids, &ws, 1, true);
        num::to_f32(&out, FloatKind::F32)
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
    });
    assert!(errs.iter().all(|&e| e < 1e-5), "{errs:?}");
}

#[test]
fn extra_payloads_travel_with_their_rows() {
    let res = on_ranks(3, |r, g| extras_arrive_with_their_rows(r, g));
    assert!(res.iter().all(|&ok| ok));
    // Over host callbacks, where the rows' routing travels in front of them.
    let transports = channel::channel_transports_with(3, true, true);
    let res = channel::on_transports(transports, |r, g| extras_arrive_with_their_rows(r, g));
    assert!(res.iter().all(|&ok| ok));
}

/// One rank of three dispatches rows tagged with their source and token, and an extra payload
/// of the same tags: whether every received row's extra carries its row's tag.
fn extras_arrive_with_their_rows(r: usize, g: &mut dyn Group) -> bool {
    let mut c = cfg(6, 2, 4, FloatKind::F32, 8);
    c.extra_row_bytes = vec![3];
    let mut m = Manager::new("deepep_high_throughput", c, r, 3).unwrap();
    let t = 4;
    let ids: Vec<i64> = (0..t * 2)
        .map(|i| ((i * 5 + r) % 6) as i64)
        .collect::<Vec<_>>();
    let ids: Vec<i64> = ids
        .chunks(2)
        .flat_map(|p| {
            if p[0] == p[1] {
                vec![p[0], -1]
            } else {
                p.to_vec()
            }
        })
        .collect();
    let ws = vec![0.5; t * 2];
    let x: Vec<f32> = (0..t * 4).map(|i| (r * 100 + i / 4) as f32).collect();
    let extra: Vec<u8> = (0..t).flat_map(|tok| [r as u8, tok as u8, 0xee]).collect();
    let v = m
        .dispatch(g, &num::from_f32(&x, FloatKind::F32), &ids, &ws, &[&extra])
        .unwrap();
    let rows = num::to_f32(v.hidden, FloatKind::F32);
    let ex = v.extras[0].to_vec();
    (0..v.received_rows).all(|i| {
        let tag = rows[i * 4] as usize;
        ex[i * 3] as usize == tag / 100
            && ex[i * 3 + 1] as usize == tag % 100
            && ex[i * 3 + 2] == 0xee
    })
}

#[test]
fn bad_input_fails_on_every_rank_without_hanging() {
    // Rank 1 passes an out-of-range expert id: it gets the precise error, rank 0 is told.
    let res = on_ranks(2, |r, g| {
        let mut m = Manager::new(
            "deepep_high_throughput",
            cfg(4, 2, 2, FloatKind::F32, 4),
            r,
            2,
        )
        .unwrap();
        let ids: Vec<i64> = if r == 1 { vec![0, 9] } else { vec![0, 1] };
        let e = m
            .dispatch(
                g,
                &num::from_f32(&[1.0, 2.0], FloatKind::F32),
                &ids,
                &[0.5, 0.5],
                &[],
            )
            .unwrap_err();
        // The group stays usable: a good dispatch follows.
        let ok = m
            .dispatch(
                g,
                &num::from_f32(&[1.0, 2.0], FloatKind::F32),
                &[0, 1],
                &[0.5, 0.5],
                &[],
            )
            .is_ok();
        (e.status(), e.to_string(), ok)
    });
    assert_eq!(
        res[1].1,
        "topk_ids[0][1] = 9 is out of range: expected -1 (masked) or an expert id in [0, 4)"
    );
    assert_eq!(
        res[0].1,
        "dispatch: rank 1 rejected its input (see that rank's error); no data was exchanged"
    );
    assert!(res.iter().all(|r| r.0 == Status::InvalidArgument && r.2));

    // T > M on one rank: every rank reports it.
    let res = on_ranks(2, |r, g| {
        let mut m =
            Manager::new("deepep_low_latency", cfg(4, 1, 2, FloatKind::F32, 2), r, 2).unwrap();
        let t = if r == 0 { 3 } else { 1 };
        let x = vec![0u8; t * 2 * 4];
        m.dispatch(g, &x, &vec![0; t], &vec![1.0; t], &[])
            .unwrap_err()
            .to_string()
    });
    assert_eq!(res[0], "dispatch: rank 0 has 3 tokens, more than max_tokens_per_rank = 2 of the deepep_low_latency backend (EXPERT_MAJOR buffers hold M tokens per source rank)");
    assert_eq!(
        res[1],
        "dispatch: rank 0 rejected its input (see that rank's error); no data was exchanged"
    );

    // T > M with ids that are also bad (too few of them): the token count is checked first,
    // before topk_ids is read at all.
    let res = on_ranks(2, |r, g| {
        let mut m =
            Manager::new("deepep_low_latency", cfg(4, 1, 2, FloatKind::F32, 2), r, 2).unwrap();
        let t = if r == 0 { 3 } else { 1 };
        let x = vec![0u8; t * 2 * 4];
        let ids = if r == 0 { vec![9; 1] } else { vec![0; t] };
        m.dispatch(g, &x, &ids, &vec![1.0; t], &[])
            .unwrap_err()
            .to_string()
    });
    assert_eq!(res[0], "dispatch: rank 0 has 3 tokens, more than max_tokens_per_rank = 2 of the deepep_low_latency backend (EXPERT_MAJOR buffers hold M tokens per source rank)");
    assert_eq!(
        res[1],
        "dispatch: rank 0 rejected its input (see that rank's error); no data was exchanged"
    );

    // Managers created with different configurations.
    let res = on_ranks(2, |r, g| {
        let mut m = Manager::new(
            "deepep_high_throughput",
            cfg(4, 1 + r, 2, FloatKind::F32, 4),
            r,
            2,
        )
        .unwrap();
        let k = 1 + r;
        let ids: Vec<i64> = (0..k as i64).collect();
        m.dispatch(g, &[0u8; 8], &ids, &vec![1.0; k], &[])
            .unwrap_err()
            .to_string()
    });
    assert_eq!(res[0], "dispatch: rank 1 has top_k = 2 but rank 0 has 1; every rank must create the manager with the same backend and configuration");

    // Combine before dispatch, and with a wrong shape (peer is told).
    let res = on_ranks(2, |r, g| {
        let mut m = Manager::new("deepep_v2", cfg(4, 1, 2, FloatKind::F32, 4), r, 2).unwrap();
        let before = m.combine(g, &[], &mut []).unwrap_err();
        let _ = g.barrier();
        m.dispatch(
            g,
            &num::from_f32(&[1.0, 2.0], FloatKind::F32),
            &[(2 * r) as i64],
            &[1.0],
            &[],
        )
        .unwrap();
        let rows = m.combine_rows().unwrap();
        let y = vec![0u8; if r == 0 { rows * 8 + 4 } else { rows * 8 }];
        let mut out = vec![0u8; 8];
        (
            before.status(),
            m.combine(g, &y, &mut out).unwrap_err().to_string(),
        )
    });
    assert_eq!(res[0].0, Status::InvalidState);
    assert!(
        res[0].1.starts_with(
            "expert_output has 12 bytes; expected 1 rows x 2 float32 elements = 8 bytes"
        ),
        "{}",
        res[0].1
    );
    assert_eq!(
        res[1].1,
        "combine: rank 0 rejected its input (see that rank's error); no data was exchanged"
    );
}

#[test]
fn dispatch_and_combine_across_processes() {
    // Two real processes, one backend per layout.
    if let Ok(name) = std::env::var("EPCOMM_MOE_CHILD") {
        let rank: usize = std::env::var("EPCOMM_MOE_RANK").unwrap().parse().unwrap();
        let group: String = std::env::var("EPCOMM_MOE_GROUP").unwrap();
        let c = Case {
            world: 2,
            experts: 8,
            k: 2,
            hidden: 64,
            kind: FloatKind::Bf16,
            skewed: true,
            seed: 5,
        };
        let experts = ToyExperts::new(c.experts, c.hidden, c.seed);
        let mut g = ShmGroup::join(&group, rank, 2, opts()).unwrap();
        let mut m =
            Manager::new(&name, cfg(c.experts, c.k, c.hidden, c.kind, 24), rank, 2).unwrap();
        let (ids, ws) = routing(&c, rank);
        let x = num::from_f32(&hidden_of(&c, rank), c.kind);
        for _ in 0..3 {
            let v = m.dispatch(&mut g, &x, &ids, &ws, &[]).unwrap();
            check_layout(&c, rank, &v);
            let y = num::from_f32(&experts.run_local(&v, c.kind, rank, 2, c.k), c.kind);
            let mut out = vec![0u8; tokens_of(&c, rank) * c.hidden * 2];
            m.combine(&mut g, &y, &mut out).unwrap();
            let want = experts.reference(&num::to_f32(&x, c.kind), &ids, &ws, c.k, false);
            let err = num::to_f32(&out, c.kind)
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
                .fold(0f32, f32::max);
            assert!(err <= tolerance(c.kind), "{name}: {err}");
        }
        return;
    }
    for name in [
        "allgather_reducescatter",
        "mori_high_throughput",
        "nixl_ep",
        "deepep_v2",
        "flashinfer_all2allv",
    ] {
        let group = ranks::unique("m", "proc");
        let kids = ranks::spawn_ranks("dispatch_and_combine_across_processes", 0..2, |r| {
            vec![
                ("EPCOMM_MOE_CHILD", name.to_owned()),
                ("EPCOMM_MOE_RANK", r.to_string()),
                ("EPCOMM_MOE_GROUP", group.clone()),
            ]
        });
        for k in ranks::wait_all(kids, Duration::from_secs(60)) {
            assert!(k.success(), "{name}: {}{}", k.stdout, k.stderr);
        }
    }
}

// ---- receive buffers in the group's shared memory: hidden rows, FP8 scales, extras --------------------------------

/// Bytes per row of the extra payloads of [`extras_rounds`] (one longer than a page).
const EXTRA_BYTES: [usize; 3] = [3, 16, 4100];

/// One backend of every layout epcomm implements.
fn one_backend_per_layout() -> Vec<&'static str> {
    let mut seen: Vec<Layout> = Vec::new();
    Backend::ALL
        .iter()
        .filter(|b| layout::contract(b.layout()).is_some())
        .filter(|b| {
            let new = !seen.contains(&b.layout());
            seen.push(b.layout());
            new
        })
        .map(|b| b.name())
        .collect()
}

/// The tag of token `t` of rank `r` (never 0, the padding rows' value).
fn tag(r: usize, t: usize) -> usize {
    r * 1000 + t + 1
}

/// Byte `i` of extra payload `j` of the token tagged `tag`.
fn extra_byte(tag: usize, j: usize, i: usize) -> u8 {
    (i * 31 + tag * 7 + j * 13 + (i >> 8)) as u8
}

/// Rank `r`'s inputs of round `round`: hidden rows (element 0 the tag, f32), ids, weights, the
/// extra payloads.
#[allow(clippy::type_complexity)]
fn extras_inputs(
    r: usize,
    round: usize,
    (e, h): (usize, usize),
    extra_bytes: &[usize],
) -> (Vec<u8>, Vec<i64>, Vec<f32>, Vec<Vec<u8>>) {
    let t = 1 + (round * 3 + r) % 6;
    let tags: Vec<usize> = (0..t).map(|tok| tag(r, tok)).collect();
    let x: Vec<f32> = tags
        .iter()
        .flat_map(|&g| (0..h).map(move |i| (g + i) as f32))
        .collect();
    let ids: Vec<i64> = tags
        .iter()
        .flat_map(|&g| {
            let first = (g * 5 + round) % e;
            let second = (first + 1 + g % (e - 1)) % e;
            [first as i64, if g % 7 == 0 { -1 } else { second as i64 }]
        })
        .collect();
    let extras = extra_bytes
        .iter()
        .enumerate()
        .map(|(j, &b)| {
            tags.iter()
                .flat_map(|&g| (0..b).map(move |i| extra_byte(g, j, i)))
                .collect()
        })
        .collect();
    (
        num::from_f32(&x, FloatKind::F32),
        ids,
        vec![0.5; t * 2],
        extras,
    )
}

/// Three dispatches of `backend` (FP8 rows if `fp8`, extra payloads of `extra_bytes` per row)
/// over a group with shared memory and over a staged group (`direct_reads` off: heap receive
/// buffers, the group's own copies), the same inputs on both: every output byte identical
/// (hidden, FP8 scales, every extra payload, padding rows included), every received row's
/// extras its token's, and only the manager over the group with shared memory received in it.
fn extras_rounds(
    (backend, fp8): (&str, bool),
    extra_bytes: &[usize],
    r: usize,
    world: usize,
    names: (&str, &str),
) {
    let (e, h) = (2 * world, if fp8 { 128 } else { 8 });
    let mut c = cfg(e, 2, h, FloatKind::F32, 6);
    c.extra_row_bytes = extra_bytes.to_vec();
    let staged_opts = GroupOptions {
        direct_reads: false,
        ..opts()
    };
    let mut gw = ShmGroup::join(names.0, r, world, opts()).unwrap();
    let mut gs = ShmGroup::join(names.1, r, world, staged_opts).unwrap();
    let mut mw = Manager::new(backend, c.clone(), r, world).unwrap();
    let mut ms = Manager::new(backend, c, r, world).unwrap();
    let scales = fp8.then_some(epcomm::moe::fp8::Scales::Exact);
    mw.set_dispatch_fp8(scales).unwrap();
    ms.set_dispatch_fp8(scales).unwrap();
    for round in 0..3 {
        let (x, ids, ws, extras) = extras_inputs(r, round, (e, h), extra_bytes);
        let ex: Vec<&[u8]> = extras.iter().map(|v| v.as_slice()).collect();
        let why = format!(
            "{backend} fp8={fp8} extras {extra_bytes:?} rank {r} of {world}, round {round}"
        );
        mw.dispatch(&mut gw, &x, &ids, &ws, &ex).unwrap();
        ms.dispatch(&mut gs, &x, &ids, &ws, &ex).unwrap();
        let (vw, vs) = (mw.view(), ms.view());
        assert_eq!(vw.hidden, vs.hidden, "{why}");
        assert_eq!(vw.extras.len(), extra_bytes.len(), "{why}");
        assert!(vw.extras.iter().eq(vs.extras.iter()), "{why}");
        assert_eq!(mw.dispatch_scales(), ms.dispatch_scales(), "{why}");
        assert!(mw.dispatch_in_shared_memory(), "{why}");
        assert!(!ms.dispatch_in_shared_memory(), "{why}");
        // Each received row's extras are its token's (the tag: element 0 of an f32 row; the
        // scale of an FP8 row's block makes it unreadable, so FP8 rows are compared only).
        let rows = received_rows(mw.contract(), &vw, world, 6);
        assert_eq!(rows.len(), vw.received_rows, "{why}");
        let hidden = num::to_f32(vw.hidden, FloatKind::F32);
        for &row in rows.iter().filter(|_| !fp8) {
            let g = hidden[row * h] as usize;
            assert!(g != 0, "{why}: row {row} holds no token");
            for (j, &b) in extra_bytes.iter().enumerate() {
                let got = &vw.extras[j][row * b..(row + 1) * b];
                let want: Vec<u8> = (0..b).map(|i| extra_byte(g, j, i)).collect();
                assert_eq!(got, want, "{why}: row {row} (tag {g}), payload {j}");
            }
        }
    }
}

/// The buffer rows a dispatch filled: all of an exact-size layout's, the first `counts[i]` of
/// each region of a fixed-capacity one (M rows per source rank, M x R per local expert).
fn received_rows(
    c: &Contract,
    v: &epcomm::moe::DispatchView<'_>,
    world: usize,
    m: usize,
) -> Vec<usize> {
    let region = match c.capacity {
        Capacity::Exact => return (0..v.received_rows).collect(),
        Capacity::PerSourceRank => m,
        Capacity::PerLocalExpert => m * world,
    };
    v.counts
        .iter()
        .enumerate()
        .flat_map(|(i, &n)| i * region..i * region + n as usize)
        .collect()
}

/// [`extras_rounds`] for one backend of every layout, plus FP8 rows for deepep_low_latency,
/// without and with extra payloads.
fn extras_every_layout(r: usize, world: usize, prefix: &str) {
    let runs = one_backend_per_layout()
        .into_iter()
        .map(|b| (b, false))
        .chain([("deepep_low_latency", true)]);
    for (i, run) in runs.enumerate() {
        for (j, extra_bytes) in [&[][..], &EXTRA_BYTES].into_iter().enumerate() {
            let (w, s) = (format!("{prefix}w{i}.{j}"), format!("{prefix}s{i}.{j}"));
            extras_rounds(run, extra_bytes, r, world, (&w, &s));
        }
    }
}

#[test]
fn receive_buffers_match_the_staged_path_on_threads() {
    for world in [2, 4] {
        let prefix = ranks::unique("m", "xt");
        ranks::on_threads(world, move |r| extras_every_layout(r, world, &prefix));
    }
}

#[test]
fn receive_buffers_match_the_staged_path_across_processes() {
    if let Ok(prefix) = std::env::var("EPCOMM_MOE_XP_PREFIX") {
        let rank: usize = std::env::var("EPCOMM_MOE_RANK").unwrap().parse().unwrap();
        let world: usize = std::env::var("EPCOMM_MOE_WORLD").unwrap().parse().unwrap();
        extras_every_layout(rank, world, &prefix);
        return;
    }
    for world in [2, 4] {
        let prefix = ranks::unique("m", "xp");
        let kids = ranks::spawn_ranks(
            "receive_buffers_match_the_staged_path_across_processes",
            0..world,
            |r| {
                vec![
                    ("EPCOMM_MOE_XP_PREFIX", prefix.clone()),
                    ("EPCOMM_MOE_RANK", r.to_string()),
                    ("EPCOMM_MOE_WORLD", world.to_string()),
                ]
            },
        );
        for k in ranks::wait_all(kids, Duration::from_secs(120)) {
            assert!(k.success(), "{world} ranks: {}{}", k.stdout, k.stderr);
        }
    }
}

// ---- the layout tables of docs/design.md, rendered from moe::layout ------------------------------

/// The row count of a layout's buffer, as the docs write it.
fn rows_symbol(c: &Contract) -> &'static str {
    match c.capacity {
        Capacity::Exact => match c.unit {
            Unit::EveryToken => "ΣT",
            Unit::Token => "N_recv",
            Unit::TokenExpert => "N_rows",
        },
        Capacity::PerSourceRank => "R·M",
        Capacity::PerLocalExpert => "E_local·M·R",
    }
}

/// `[dims]` in the docs' notation, or "empty".
fn dims(d: &[&str]) -> String {
    if d.is_empty() {
        "empty".into()
    } else {
        format!("`[{}]`", d.join(", "))
    }
}

fn received_symbol(c: &Contract) -> &'static str {
    match c.capacity {
        Capacity::Exact => rows_symbol(c),
        Capacity::PerSourceRank | Capacity::PerLocalExpert => match c.counts {
            Counts::PerSourceRank => "Σ recv_counts",
            Counts::PerLocalExpert => "Σ counts",
            Counts::None => "not stated",
        },
    }
}

/// The table of which outputs exist, one column per implemented layout.
fn outputs_table() -> String {
    let all: Vec<Contract> = layout::all().collect();
    let mut t = String::from("| output |");
    for c in &all {
        t += &format!(" {} |", c.layout.name());
    }
    t += "\n|---|";
    t += &"---|".repeat(all.len());
    let mut line = |name: &str, cell: &dyn Fn(&Contract) -> String| {
        t += &format!("\n| {name} |");
        for c in &all {
            t += &format!(" {} |", cell(c));
        }
    };
    line("`hidden`", &|c| match c.capacity {
        Capacity::Exact => dims(&[rows_symbol(c), "H"]),
        Capacity::PerSourceRank => dims(&["R", "M", "H"]),
        Capacity::PerLocalExpert => dims(&["E_local", "M·R", "H"]),
    });
    line("`topk_ids` (int64)", &|c| match c.topk_ids {
        Ids::None => dims(&[]),
        Ids::AsSent | Ids::Local => dims(&[rows_symbol(c), "K"]),
    });
    line("`topk_weights` (f32)", &|c| match c.topk_weights {
        Weights::None => dims(&[]),
        Weights::PerId => dims(&[rows_symbol(c), "K"]),
        Weights::PerRow => dims(&[rows_symbol(c)]),
    });
    line("`counts` (int32)", &|c| match c.counts {
        Counts::None => dims(&[]),
        Counts::PerLocalExpert => dims(&["E_local"]),
        Counts::PerSourceRank => dims(&["R"]),
    });
    let offsets = |c: &Contract| {
        dims(if c.expert_offsets {
            &["E_local + 1"]
        } else {
            &[]
        })
    };
    line("`expert_offsets` (int64 host, int32 GPU)", &offsets);
    let src = |c: &Contract| {
        if c.src {
            dims(&[rows_symbol(c)])
        } else {
            dims(&[])
        }
    };
    line("`src_rank`, `src_token` (int32)", &src);
    line("`received_rows`", &|c| received_symbol(c).to_string());
    t + "\n"
}

/// Metadata bytes per received row as `a·K + b`, checked against the library's figure.
fn meta_symbol(c: &Contract) -> String {
    let per_k = match c.topk_ids {
        Ids::None => 0,
        Ids::AsSent | Ids::Local => 8,
    } + match c.topk_weights {
        Weights::PerId => 4,
        Weights::None | Weights::PerRow => 0,
    };
    let fixed = match c.topk_weights {
        Weights::PerRow => 4,
        Weights::None | Weights::PerId => 0,
    } + if c.src { 8 } else { 0 };
    for k in 1..5 {
        assert_eq!(c.meta_bytes_per_row(k), Some(per_k * k + fixed));
    }
    match (per_k, fixed) {
        (0, b) => b.to_string(),
        (a, 0) => format!("{a}·K"),
        (a, b) => format!("{a}·K + {b}"),
    }
}

/// The table of each layout's contract facts.
fn contract_table() -> String {
    let mut t = String::from(
        "| layout | backends | one row per | buffer rows | top-k weights applied by | metadata bytes per row | worst-case rows (T tokens per rank) |\n|---|---|---|---|---|---|---|\n",
    );
    for c in layout::all() {
        let backends: Vec<String> = Backend::ALL
            .iter()
            .filter(|b| b.layout() == c.layout)
            .map(|b| format!("`{}`", b.name()))
            .collect();
        let unit = match c.unit {
            Unit::EveryToken => "token of every rank",
            Unit::Token => "(source, token) routed to this rank",
            Unit::TokenExpert => "(source, token, local expert)",
        };
        let capacity = match c.capacity {
            Capacity::Exact => "exact".to_string(),
            Capacity::PerSourceRank => "fixed: M per source rank, T > M is an error".into(),
            Capacity::PerLocalExpert => "fixed: M·R per local expert, T > M is an error".into(),
        };
        let by = match c.weights_by {
            WeightsBy::Holder => "holder",
            WeightsBy::Source => "source",
        };
        let worst = match c.capacity {
            Capacity::Exact => match c.unit {
                Unit::EveryToken | Unit::Token => "R·T",
                Unit::TokenExpert => "R·T·min(K, E_local)",
            },
            Capacity::PerSourceRank | Capacity::PerLocalExpert => rows_symbol(&c),
        };
        t += &format!(
            "| {} | {} | {unit} | {} ({capacity}) | {by} | {} | {worst} |\n",
            c.layout.name(),
            backends.join(", "),
            rows_symbol(&c),
            meta_symbol(&c),
        );
    }
    t
}

/// Replaces the text between `<!-- {tag} -->` and `<!-- /{tag} -->` in `doc` by `body`.
fn splice(doc: &str, tag: &str, body: &str) -> String {
    let (open, close) = (format!("<!-- {tag} -->\n"), format!("<!-- /{tag} -->"));
    let a = doc
        .find(&open)
        .unwrap_or_else(|| panic!("docs/design.md lacks {open}"))
        + open.len();
    let b = doc
        .find(&close)
        .unwrap_or_else(|| panic!("docs/design.md lacks {close}"));
    format!("{}{body}{}", &doc[..a], &doc[b..])
}

/// docs/design.md's layout tables are rendered from `moe::layout`, so they cannot drift from the
/// contract the code follows: this test fails when they differ (regenerate them with
/// `BLESS=1 cargo test --test moe design_md`).
#[test]
fn design_md_layout_tables_match_the_contracts() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/design.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let want = splice(&doc, "layout-contracts", &contract_table());
    let want = splice(&want, "layout-outputs", &outputs_table());
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(path, &want).unwrap();
    } else {
        assert!(
            doc == want,
            "docs/design.md's layout tables are stale: run BLESS=1 cargo test --test moe design_md"
        );
    }
}

/// The shapes the contract states are the lengths of the outputs the manager returns.
fn check_shapes(m: &Manager) {
    let (v, s) = (m.view(), m.output_shapes());
    let len = |d: &[usize]| if d.is_empty() { 0 } else { d.iter().product() };
    assert_eq!(v.shape, &s.hidden[..], "{:?}", v.layout);
    assert_eq!(v.topk_ids.len(), len(&s.topk_ids), "{:?}", v.layout);
    assert_eq!(v.topk_weights.len(), len(&s.topk_weights), "{:?}", v.layout);
    assert_eq!(v.counts.len(), s.counts, "{:?}", v.layout);
    assert_eq!(v.expert_offsets.len(), s.expert_offsets, "{:?}", v.layout);
    assert_eq!((v.src_rank.len(), v.src_token.len()), (s.src, s.src));
}
