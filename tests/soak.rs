//! Soak (docs/reliability.md): in one process, a 2-rank shared-memory
//! group on two threads runs ITERS dispatch/combine iterations (rotating through the five
//! layouts, with token counts that change every iteration, each result checked against the
//! single-process reference), then CYCLES group + manager create/destroy cycles under one name
//! (each with a barrier and a dispatch/combine). Resident memory (VmRSS) and open file
//! descriptors are sampled after a warm-up and at the end: RSS may grow by less than
//! 16 MiB, the descriptor count and the number of mapped epcomm segments must not change, and nothing of the soak's groups may be left in
//! /dev/shm.
//!
//! CI runs the short version (`cargo test --test soak`: 2000 iterations, 100 cycles). The long
//! version (10^5 iterations, 10^3 cycles, release build) is `scripts/soak.sh`, which sets
//! `EPCOMM_SOAK_ITERS` and `EPCOMM_SOAK_CYCLES` and prints the figures.
//!
//! One test only: RSS and descriptors are per process, so nothing else may run beside it.

mod ranks;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions};
use epcomm::moe::reference::{unit, ToyExperts};
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::{self, FloatKind};

const WORLD: usize = 2;
const EXPERTS: usize = 8;
const TOP_K: usize = 2;
const HIDDEN: usize = 32;
const MAX_TOKENS: usize = 32;
const BACKENDS: [&str; 5] = [
    "allgather_reducescatter",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "flashinfer_nvlink_two_sided",
];
/// The largest RSS growth allowed between the samples.
const RSS_BOUND_KIB: i64 = 16 << 10;

fn env_count(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// VmRSS of this process in KiB.
fn rss_kib() -> i64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

/// Open file descriptors of this process.
fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Mappings of epcomm shared-memory segments in this process (sealed memfds, which
/// /proc/self/maps shows as `/memfd:epcomm.…`).
fn shm_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("/memfd:epcomm."))
        .count()
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    rss_kib: i64,
    fds: usize,
    maps: usize,
}

fn sample() -> Sample {
    Sample {
        rss_kib: rss_kib(),
        fds: fd_count(),
        maps: shm_mappings(),
    }
}

fn opts() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(60),
        ..GroupOptions::default()
    }
}

fn cfg() -> MoeConfig {
    MoeConfig {
        num_experts: EXPERTS,
        top_k: TOP_K,
        hidden: HIDDEN,
        hidden_dtype: FloatKind::F32.dtype(),
        expert_dtype: FloatKind::F32,
        out_dtype: FloatKind::F32,
        max_tokens_per_rank: MAX_TOKENS,
        extra_row_bytes: vec![],
        apply_router_weight_on_input: false,
    }
}

/// One dispatch/combine of iteration `it` on `m`, checked against the reference.
fn step(g: &mut ShmGroup, m: &mut Manager, experts: &ToyExperts, rank: usize, it: u64) {
    let seed = it.wrapping_mul(0x9e37_79b9) ^ (rank as u64) << 40;
    let t = ((unit(seed, 0) + 1.0) / 2.0 * (MAX_TOKENS + 1) as f32) as usize % (MAX_TOKENS + 1);
    let x: Vec<f32> = (0..(t * HIDDEN) as u64)
        .map(|i| unit(seed, i + 1))
        .collect();
    let mut ids = Vec::with_capacity(t * TOP_K);
    for tok in 0..t {
        let a = ((unit(seed ^ 0xabc, tok as u64) + 1.0) / 2.0 * EXPERTS as f32) as usize % EXPERTS;
        let b = (a + 1 + tok % (EXPERTS - 1)) % EXPERTS;
        ids.extend([a as i64, if tok % 7 == 3 { -1 } else { b as i64 }]);
    }
    let ws: Vec<f32> = ids.iter().map(|&e| if e < 0 { 0.0 } else { 0.5 }).collect();
    let xb = num::from_f32(&x, FloatKind::F32);
    let y = {
        let v = m.dispatch(g, &xb, &ids, &ws, &[]).expect("dispatch");
        experts.run_local(&v, FloatKind::F32, rank, WORLD, TOP_K)
    };
    let yb = num::from_f32(&y, FloatKind::F32);
    let mut out = vec![0u8; t * HIDDEN * 4];
    m.combine(g, &yb, &mut out).expect("combine");
    let got = num::to_f32(&out, FloatKind::F32);
    let want = experts.reference(&x, &ids, &ws, TOP_K, false);
    let err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
        .fold(0f32, f32::max);
    assert!(err <= 1e-5, "iteration {it} rank {rank}: error {err}");
}

/// Runs `work(rank, phase_barrier)` on two threads; rank 0 takes a sample whenever both reach
/// the points `work` marks by calling the closure it gets.
fn on_two_threads(
    work: impl Fn(usize, &dyn Fn()) + Send + Sync + Clone + 'static,
) -> Vec<(Sample, Instant)> {
    let sync = Arc::new(Barrier::new(WORLD));
    let samples = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handles: Vec<_> = (0..WORLD)
        .map(|rank| {
            let (sync, samples, work) = (sync.clone(), samples.clone(), work.clone());
            std::thread::spawn(move || {
                let mark = || {
                    sync.wait();
                    if rank == 0 {
                        samples.lock().unwrap().push((sample(), Instant::now()));
                    }
                    sync.wait();
                };
                work(rank, &mark);
            })
        })
        .collect();
    for h in handles {
        h.join().expect("rank panicked");
    }
    Arc::try_unwrap(samples).unwrap().into_inner().unwrap()
}

/// Prints the figures of one phase; returns (RSS growth in KiB, change of open fds, change of
/// shm mappings).
fn report(what: &str, n: usize, s: &[(Sample, Instant)]) -> (i64, i64, i64) {
    let ((a, t0), (b, t1)) = (s[0], s[1]);
    let secs = t1.duration_since(t0).as_secs_f64();
    let growth = b.rss_kib - a.rss_kib;
    println!(
        "soak {what}: {n} in {secs:.2} s ({:.1} us each); VmRSS {} -> {} KiB ({growth:+} KiB); open fds {} -> {}; epcomm shm mappings {} -> {}",
        secs * 1e6 / n.max(1) as f64,
        a.rss_kib,
        b.rss_kib,
        a.fds,
        b.fds,
        a.maps,
        b.maps
    );
    (
        growth,
        b.fds as i64 - a.fds as i64,
        b.maps as i64 - a.maps as i64,
    )
}

#[test]
fn rss_fds_and_shm_stay_flat() {
    let iters = env_count("EPCOMM_SOAK_ITERS", 2000);
    let cycles = env_count("EPCOMM_SOAK_CYCLES", 100);
    let warm_iters = (iters / 10).clamp(1, 1000);
    let warm_cycles = (cycles / 10).clamp(1, 20);

    // ---- dispatch/combine iterations ----
    let group = ranks::unique("soak", "a2a");
    let name = group.clone();
    let s = on_two_threads(move |rank, mark| {
        let experts = ToyExperts::new(EXPERTS, HIDDEN, 11);
        let mut g = ShmGroup::join(&name, rank, WORLD, opts()).unwrap();
        // The mapping count below must see the group's segments, or it proves nothing.
        assert!(
            shm_mappings() > 0,
            "no /memfd:epcomm. mapping while a group is open"
        );
        let mut managers: Vec<Manager> = BACKENDS
            .iter()
            .map(|b| Manager::new(b, cfg(), rank, WORLD).unwrap())
            .collect();
        let total = warm_iters + iters;
        for it in 0..total {
            if it == warm_iters {
                mark();
            }
            let m = &mut managers[it % BACKENDS.len()];
            step(&mut g, m, &experts, rank, it as u64);
        }
        g.barrier().unwrap();
        mark();
    });
    let (rss_a2a, fds_a2a, maps_a2a) = report("dispatch/combine iterations", iters, &s);
    let left = ranks::shm_leftovers(&group);
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");

    // ---- group + manager create/destroy cycles (one name) ----
    let group = ranks::unique("soak", "cycle");
    let name = group.clone();
    let s = on_two_threads(move |rank, mark| {
        let experts = ToyExperts::new(EXPERTS, HIDDEN, 13);
        for c in 0..warm_cycles + cycles {
            if c == warm_cycles {
                mark();
            }
            let mut g = ShmGroup::join(&name, rank, WORLD, opts()).unwrap();
            let mut m = Manager::new(BACKENDS[c % BACKENDS.len()], cfg(), rank, WORLD).unwrap();
            g.barrier().unwrap();
            step(&mut g, &mut m, &experts, rank, c as u64);
            drop(m);
            drop(g);
        }
        mark();
    });
    let (rss_cyc, fds_cyc, maps_cyc) = report("group+manager create/destroy cycles", cycles, &s);
    let left = ranks::shm_leftovers(&group);
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");

    assert!(
        rss_a2a < RSS_BOUND_KIB,
        "RSS grew by {rss_a2a} KiB over {iters} dispatch/combine iterations"
    );
    assert!(
        rss_cyc < RSS_BOUND_KIB,
        "RSS grew by {rss_cyc} KiB over {cycles} create/destroy cycles"
    );
    assert_eq!(fds_a2a, 0, "open fds changed over the iterations");
    assert_eq!(
        fds_cyc, 0,
        "open fds changed over the create/destroy cycles"
    );
    assert_eq!(maps_a2a, 0, "shm mappings changed over the iterations");
    assert_eq!(
        maps_cyc, 0,
        "shm mappings changed over the create/destroy cycles"
    );
}
