//! EPLB load statistics: window, rearrangement schedule (first after a quarter interval), the
//! balancedness log line, the window's logical load summed over ranks, and recording straight
//! from a dispatch.

mod ranks;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use epcomm::eplb::load::{balancedness_line, LoadState};
use epcomm::group::shm::ShmGroup;
use epcomm::group::GroupOptions;
use epcomm::log::{self, Level};
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::FloatKind;
use epcomm::select::config::EplbConfig;

/// One shm group of `world` ranks, joined on threads; the handles in rank order.
fn group(world: usize) -> Vec<ShmGroup> {
    let name = ranks::unique("l", &world.to_string());
    ranks::on_threads(world, move |r| {
        ShmGroup::join(
            &name,
            r,
            world,
            GroupOptions {
                timeout: Duration::from_secs(20),
                ..GroupOptions::default()
            },
        )
        .unwrap()
    })
}

/// The log sink is process-wide: the tests that install one take turns.
static SINK: Mutex<()> = Mutex::new(());

#[test]
fn schedule_window_and_logging() {
    let _sink = SINK.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = EplbConfig {
        window_size: 2,
        step_interval: 8,
        log_balancedness: true,
        ..EplbConfig::default()
    };
    let mut s = LoadState::new(&cfg, "toy", 1, 4).unwrap();
    assert_eq!(
        s.step_count(),
        6,
        "first rearrangement after a quarter interval"
    );
    let mut g = group(1).pop().unwrap();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let s2 = seen.clone();
    log::set_sink(Some(Arc::new(move |l, m| {
        if l == Level::Info && m.starts_with("EPLB step") {
            s2.lock().unwrap().push(m.to_owned());
        }
    })));
    s.record_ids(0, &[0, 1, 1, -1, 3]).unwrap();
    assert!(!s.step(&mut g, false, true).unwrap());
    s.record_ids(0, &[2, 2]).unwrap();
    assert!(
        s.step(&mut g, false, true).unwrap(),
        "rearrange after step_interval/4 steps"
    );
    assert_eq!(s.step_count(), 0);
    // Only the last window_size steps before a rearrangement are recorded.
    assert!(!s.recording());
    for _ in 0..6 {
        assert!(!s.step(&mut g, false, false).unwrap());
    }
    assert!(s.recording());
    let lines = seen.lock().unwrap().clone();
    log::set_sink(None);
    assert_eq!(
        lines,
        vec![
            "EPLB step: 6 for model toy: avg_tokens=4.00, max_tokens=4, balancedness=1.0000, steps until the next rearrangement: 2".to_owned(),
            "EPLB step: 7 for model toy: avg_tokens=2.00, max_tokens=2, balancedness=1.0000, steps until the next rearrangement: 1".to_owned(),
        ]
    );
    let load = s.logical_load(&mut g, &[vec![0, 1, 2, 3]], 4).unwrap();
    assert_eq!(load, vec![vec![1.0, 2.0, 2.0, 1.0]]);
    assert_eq!(balancedness_line(3, "m", 1.5, 2, 0.75, 10), "EPLB step: 3 for model m: avg_tokens=1.50, max_tokens=2, balancedness=0.7500, steps until the next rearrangement: 10");
}

#[test]
fn logical_load_sums_over_ranks_and_dispatch_records_without_a_second_pass() {
    let groups = group(2);
    let handles: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(r, mut g)| {
            std::thread::spawn(move || {
                let cfg = EplbConfig {
                    window_size: 30,
                    step_interval: 100,
                    ..EplbConfig::default()
                };
                let mut s = LoadState::new(&cfg, "m", 1, 4).unwrap();
                let mc = MoeConfig {
                    num_experts: 4,
                    top_k: 2,
                    hidden: 2,
                    hidden_dtype: FloatKind::F32.dtype(),
                    expert_dtype: FloatKind::F32,
                    out_dtype: FloatKind::F32,
                    max_tokens_per_rank: 4,
                    extra_row_bytes: vec![],
                    apply_router_weight_on_input: false,
                };
                let mut m = Manager::new("deepep_high_throughput", mc, r, 2).unwrap();
                let ids: Vec<i64> = if r == 0 {
                    vec![0, 1, 1, 3]
                } else {
                    vec![2, -1, 3, 0]
                };
                m.dispatch(&mut g, &[0u8; 16], &ids, &[0.5; 4], &[])
                    .unwrap();
                assert_eq!(
                    m.expert_counts(),
                    if r == 0 {
                        &[1, 2, 0, 1][..]
                    } else {
                        &[1, 0, 1, 1][..]
                    }
                );
                s.record_counts(0, m.expert_counts()).unwrap();
                s.step(&mut g, false, false).unwrap();
                // Slots 2 and 3 hold logical experts 3 and 2 (a permuted placement).
                s.logical_load(&mut g, &[vec![0, 1, 3, 2]], 4).unwrap()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), vec![vec![2.0, 2.0, 2.0, 1.0]]);
    }
}

/// vLLM's `_compute_eplb_load_stats`: the sum over layers of each layer's max over ranks (not
/// the max over ranks of tokens summed over layers). Here rank 0 is the busiest in layer 0 and
/// rank 1 in layer 1: avg 2 + 2, max 4 + 4, balancedness 0.5 (tokens summed over layers would
/// say 1.0).
#[test]
fn balancedness_sums_each_layers_busiest_rank_as_vllm_does() {
    let _sink = SINK.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = EplbConfig {
        log_balancedness: true,
        ..EplbConfig::default()
    };
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let s2 = seen.clone();
    log::set_sink(Some(Arc::new(move |l, m| {
        if l == Level::Info && m.starts_with("EPLB step") {
            s2.lock().unwrap().push(m.to_owned());
        }
    })));
    let groups = group(2);
    let handles: Vec<_> = groups
        .into_iter()
        .enumerate()
        .map(|(rank, mut g)| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let mut s = LoadState::new(&cfg, "toy", 2, 4).unwrap();
                if rank == 0 {
                    s.record_ids(0, &[0, 1, 0, 1]).unwrap(); // slots 0, 1: rank 0
                    s.record_ids(1, &[2, 3, 2, 3]).unwrap(); // slots 2, 3: rank 1
                }
                s.step(&mut g, false, true).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let lines = seen.lock().unwrap().clone();
    log::set_sink(None);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains(": avg_tokens=4.00, max_tokens=8, balancedness=0.5000, "),
        "{}",
        lines[0]
    );
}
