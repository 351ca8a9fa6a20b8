//! The child side of the campaign: one rank's multi-step workload through the Rust API, every
//! OK result checked against a reference, reported as `FC_RESULT` (and `FC_EPLB`, `FC_JOBS`)
//! lines on stdout.

use std::path::Path;
use std::time::{Duration, Instant};

use epcomm::eplb::rearrange::rearrange;
use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions, ReduceScatterv};
use epcomm::moe::reference::{unit, ToyExperts};
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::{self, FloatKind};

use super::{Class, EPLB, JOBS, RESULT};
use crate::common::eplb_fixture::{self, Weights};
use crate::common::moe_fixture::{round_trip_error, Tokens};

/// Ranks of a signal or tamper run; a same-name run has two jobs of `SAME_NAME_WORLD`.
pub const WORLD: usize = 3;
pub const SAME_NAME_WORLD: usize = 2;

const BACKEND: &str = "deepep_high_throughput";
const EXPERTS: usize = 6;
const TOP_K: usize = 2;
const HIDDEN: usize = 8;
const MAX_TOKENS: usize = 16;

/// Steps per run: enough that a random moment lands in the middle of the work.
pub fn steps(class: Class) -> u64 {
    match class {
        Class::Moe => 80,
        Class::Eplb => 30,
        Class::Collectives => 800,
        Class::SameName => 100,
        Class::Tamper => 800,
    }
}

/// How a step failed: an error from the library, or an OK call whose result was wrong.
enum StepError {
    Lib(epcomm::Error),
    Wrong(String),
}

impl From<epcomm::Error> for StepError {
    fn from(e: epcomm::Error) -> Self {
        StepError::Lib(e)
    }
}

fn env(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| panic!("{key} is not set"))
}

/// Runs one rank as `FC_CLASS`, `FC_GROUP`, `FC_RANK`, `FC_WORLD` (and `FC_JOB`) say and prints
/// its report.
pub fn run_rank() {
    let class = Class::parse(&env("FC_CLASS")).expect("FC_CLASS names a class");
    let group = env("FC_GROUP");
    let rank: usize = env("FC_RANK").parse().unwrap();
    let world: usize = env("FC_WORLD").parse().unwrap();
    let job: u64 = std::env::var("FC_JOB")
        .ok()
        .and_then(|j| j.parse().ok())
        .unwrap_or(0);
    if let Ok(gate) = std::env::var("FC_GATE") {
        // At the start gate: the parent lets every rank of the job go at once.
        std::fs::write(format!("{gate}.{rank}.ready"), b"ready").expect("reach the start gate");
        let limit = Instant::now() + Duration::from_secs(60);
        while !Path::new(&format!("{gate}.go")).exists() {
            if Instant::now() > limit {
                println!("\n{RESULT}err 0 0 0 the campaign's start gate {gate} never opened");
                return;
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }
    let mut done = 0u64;
    let mut eplb_progress = None;
    let r = (|| -> Result<(), StepError> {
        let mut g = ShmGroup::join(&group, rank, world, GroupOptions::default())?;
        match class {
            Class::Moe => moe(&mut g, rank, &mut done),
            Class::Eplb => eplb(&mut g, rank, &mut done, &mut eplb_progress),
            Class::Collectives | Class::Tamper => {
                collectives(&mut g, rank, world, steps(class), &mut done)
            }
            Class::SameName => same_name(&mut g, world, job, &mut done),
        }
    })();
    if let Some((round, layers)) = eplb_progress {
        println!("\n{EPLB}{round} {layers}");
    }
    match r {
        Ok(()) => println!("\n{RESULT}ok 0 {done} 0 -"),
        Err(StepError::Lib(e)) => println!("\n{RESULT}err {} {done} 0 {e}", e.status() as i32),
        Err(StepError::Wrong(why)) => println!("\n{RESULT}ok 0 {done} 1 {why}"),
    }
}

fn moe_cfg() -> MoeConfig {
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

/// Rank `rank`'s tokens at `step`: the count and the routing change every step.
fn tokens(rank: usize, step: u64) -> (Vec<f32>, Vec<i64>, Vec<f32>) {
    let t = ((step as usize * 7 + rank * 3) % MAX_TOKENS) + 1;
    let seed = 0x5eed ^ ((rank as u64) << 32) ^ (step << 40);
    let x: Vec<f32> = (0..(t * HIDDEN) as u64).map(|i| unit(seed, i)).collect();
    let mut ids = Vec::new();
    let mut ws = Vec::new();
    for tok in 0..t {
        let first = (tok * 5 + rank + step as usize) % EXPERTS;
        ids.extend([first as i64, ((first + 1 + tok % 3) % EXPERTS) as i64]);
        ws.extend([0.6f32, 0.4]);
    }
    (x, ids, ws)
}

fn moe(g: &mut ShmGroup, rank: usize, done: &mut u64) -> Result<(), StepError> {
    let experts = ToyExperts::new(EXPERTS, HIDDEN, 7);
    let mut m = Manager::new(BACKEND, moe_cfg(), rank, WORLD)?;
    for step in 0..steps(Class::Moe) {
        let (x, ids, ws) = tokens(rank, step);
        let t = Tokens { x, ids, ws };
        let err = round_trip_error(&mut m, g, &experts, &t, (rank, WORLD, TOP_K))?;
        if err > 1e-5 {
            return Err(StepError::Wrong(format!(
                "step {step}: combine differs from the reference by {err}"
            )));
        }
        *done += 1;
    }
    Ok(())
}

/// Steps cycling through barrier, all_gatherv (sizes change), reduce_scatterv and broadcast
/// (the root changes), each result checked.
fn collectives(
    g: &mut ShmGroup,
    rank: usize,
    world: usize,
    steps: u64,
    done: &mut u64,
) -> Result<(), StepError> {
    for step in 0..steps {
        let byte = |r: usize, i: usize| (r * 31 + i * 7 + step as usize * 13) as u8;
        match step % 4 {
            0 => g.barrier()?,
            1 => {
                let sizes: Vec<usize> =
                    (0..world).map(|r| ((r + step as usize) % 4) * 24).collect();
                let mine: Vec<u8> = (0..sizes[rank]).map(|i| byte(rank, i)).collect();
                let mut out = vec![0u8; sizes.iter().sum()];
                g.all_gatherv(&mine, &sizes, &mut out)?;
                let want: Vec<u8> = (0..world)
                    .flat_map(|r| (0..sizes[r]).map(move |i| byte(r, i)))
                    .collect();
                if out != want {
                    return Err(StepError::Wrong(format!(
                        "step {step}: all_gatherv result differs from the ranks' inputs"
                    )));
                }
            }
            2 => {
                const ELEMS: usize = 4;
                let rows: Vec<usize> = (1..=world).collect();
                let total: usize = rows.iter().sum();
                let val = |r: usize, i: usize| (r * 100 + i + step as usize) as f32;
                let input: Vec<f32> = (0..total * ELEMS).map(|i| val(rank, i)).collect();
                let mut out = vec![0u8; rows[rank] * ELEMS * 4];
                g.reduce_scatterv(ReduceScatterv {
                    input: &num::from_f32(&input, FloatKind::F32),
                    rows: &rows,
                    row_elems: ELEMS,
                    kind: FloatKind::F32,
                    output: &mut out,
                })?;
                let first: usize = rows[..rank].iter().sum::<usize>() * ELEMS;
                let want: Vec<f32> = (0..rows[rank] * ELEMS)
                    .map(|i| (0..world).map(|r| val(r, first + i)).sum())
                    .collect();
                if num::to_f32(&out, FloatKind::F32) != want {
                    return Err(StepError::Wrong(format!(
                        "step {step}: reduce_scatterv result differs from the sum"
                    )));
                }
            }
            _ => {
                let root = (step as usize / 4) % world;
                let mut data: Vec<u8> = if rank == root {
                    (0..40).map(|i| byte(root, i)).collect()
                } else {
                    vec![0xEE; 40]
                };
                g.broadcast(root, &mut data)?;
                if data.iter().enumerate().any(|(i, &b)| b != byte(root, i)) {
                    return Err(StepError::Wrong(format!(
                        "step {step}: broadcast from rank {root} delivered other bytes"
                    )));
                }
            }
        }
        *done += 1;
    }
    Ok(())
}

/// Every member learns every member's job id first: a group mixing two jobs shows two ids.
fn same_name(g: &mut ShmGroup, world: usize, job: u64, done: &mut u64) -> Result<(), StepError> {
    let mut all = vec![0u8; 8 * world];
    g.all_gather(&job.to_ne_bytes(), &mut all)?;
    let ids: Vec<u64> = all
        .chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
        .collect();
    println!(
        "\n{JOBS}{}",
        ids.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
    );
    if ids.iter().any(|&j| j != job) {
        return Err(StepError::Wrong(format!(
            "the group's members belong to jobs {ids:?}; this rank is of job {job}"
        )));
    }
    for step in 0..steps(Class::SameName) {
        let mut out = vec![0u8; 8 * world];
        g.all_gather(&(job ^ step).to_ne_bytes(), &mut out)?;
        if out.chunks_exact(8).any(|c| c != (job ^ step).to_ne_bytes()) {
            return Err(StepError::Wrong(format!(
                "step {step}: all_gather of the job id returned another job's"
            )));
        }
        *done += 1;
    }
    Ok(())
}

// EPLB: synthetic weights whose bytes encode (expert, layer, tensor, element)
// (tests/common/eplb_fixture.rs).
const ROW_BYTES: [usize; 2] = [16, 40];
const PHYSICAL: usize = 12;
const LOGICAL: usize = 8;
pub const EPLB_LAYERS: usize = 3;

const WEIGHTS: Weights = Weights {
    world: WORLD,
    row_bytes: &ROW_BYTES,
};

fn placement_b() -> Vec<Vec<i64>> {
    let load = eplb_fixture::skewed_load(EPLB_LAYERS, LOGICAL, 1, 1.0);
    eplb_fixture::rebalanced(&load, PHYSICAL, WORLD)
}

/// The layers a failed rearrangement reports as done: 0 for "no layer was changed", L for
/// "layers before L were rearranged"; `None` when the message says neither.
pub fn eplb_layers_done(message: &str) -> Option<u64> {
    if message.ends_with("(EPLB rearrangement: no layer was changed)") {
        return Some(0);
    }
    let l: u64 = message
        .split("(EPLB rearrangement: layers before ")
        .nth(1)?
        .split(' ')
        .next()?
        .parse()
        .ok()?;
    message
        .ends_with(&format!(
            "were rearranged; layer {l} and later keep the old placement)"
        ))
        .then_some(l)
}

/// Rounds of rearrangement back and forth between two placements. After an OK round every
/// layer holds the target's bytes; after a failed one the layers the message reports as done
/// hold the target's and the others the source's; anything else is wrong.
fn eplb(
    g: &mut ShmGroup,
    rank: usize,
    done: &mut u64,
    progress: &mut Option<(u64, u64)>,
) -> Result<(), StepError> {
    let a = eplb_fixture::modulo_placement(EPLB_LAYERS, PHYSICAL, LOGICAL);
    let b = placement_b();
    let mut w = WEIGHTS.all(&a, rank);
    let mut c = eplb_fixture::gloo_cpu()?;
    for round in 0..steps(Class::Eplb) {
        let (from, to) = if round % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let r = {
            let mut views = eplb_fixture::views(&mut w);
            rearrange(g, c.as_mut(), from, to, &mut views, &ROW_BYTES, None)
        };
        let layers_done = match &r {
            Ok(_) => EPLB_LAYERS as u64,
            Err(e) => match eplb_layers_done(&e.to_string()) {
                Some(l) => l,
                None => {
                    *progress = Some((round, u64::MAX));
                    return Err(StepError::Lib(r.unwrap_err()));
                }
            },
        };
        *progress = Some((round, layers_done));
        for (l, layer) in w.iter().enumerate() {
            let want = if (l as u64) < layers_done { to } else { from };
            if *layer != WEIGHTS.layer(&want[l], l, rank) {
                return Err(StepError::Wrong(format!(
                    "round {round}: layer {l} holds neither placement as reported ({layers_done} layer(s) done)"
                )));
            }
        }
        r?;
        *done += 1;
    }
    Ok(())
}
