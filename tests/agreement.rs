//! Ranks that disagree: every rank gets an error before any data moves (the full message
//! checked on every rank), at once (no waiting for the timeout), and the group stays usable: a
//! correct op follows on the same handles.
//! Ranks are threads of this process, over shared memory.

mod ranks;

use std::time::{Duration, Instant};

use epcomm::dtype::{Code, DType};
use epcomm::eplb::communicator::{self, EplbCommunicator};
use epcomm::eplb::rearrange::{rearrange, rearrange_typed};
use epcomm::group::shm::ShmGroup;
use epcomm::group::GroupOptions;
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::FloatKind;
use epcomm::select::eplb::DeviceKind;

/// Far above how long any of these calls may take: an error must not wait for it.
const TIMEOUT: Duration = Duration::from_secs(20);
const FAST: Duration = Duration::from_secs(5);

fn join(name: &str, rank: usize, world: usize) -> ShmGroup {
    let opts = GroupOptions {
        timeout: TIMEOUT,
        ..GroupOptions::default()
    };
    ShmGroup::join(name, rank, world, opts).expect("join")
}

/// Runs `f(rank, group)` on `world` thread ranks of a fresh group; returns the results and how
/// long each rank's `f` took.
fn on_group<T: Send + 'static>(
    tag: &str,
    world: usize,
    f: impl Fn(usize, &mut ShmGroup) -> T + Send + Sync + Clone + 'static,
) -> (String, Vec<(T, Duration)>) {
    let name = ranks::unique("ag", tag);
    let n = name.clone();
    let res = ranks::on_threads(world, move |rank| {
        let mut g = join(&n, rank, world);
        let start = Instant::now();
        let r = f(rank, &mut g);
        (r, start.elapsed())
    });
    assert!(ranks::shm_leftovers(&name).is_empty());
    (name, res)
}

fn message(r: &epcomm::Result<()>) -> String {
    match r {
        Ok(()) => "ok".to_owned(),
        Err(e) => format!("{:?}: {e}", e.status()),
    }
}

// ---- MoE managers that disagree on dtypes ---------------------------------------------------

fn moe_cfg(hidden: usize, dtype: DType) -> MoeConfig {
    MoeConfig {
        num_experts: 4,
        top_k: 1,
        hidden,
        hidden_dtype: dtype,
        expert_dtype: FloatKind::F32,
        out_dtype: FloatKind::F32,
        max_tokens_per_rank: 4,
        extra_row_bytes: vec![],
        apply_router_weight_on_input: false,
    }
}

/// Dispatch with rank 1's manager configured as `(hidden, dtype)` and rank 0's as float32 x 8:
/// rank r gets `want[r]` (`{name}` = the group); then managers configured alike dispatch.
fn dispatch_disagreement(tag: &str, hidden: usize, dtype: DType, want: [&str; 2]) {
    let f32_ = FloatKind::F32.dtype();
    let (name, res) = on_group(tag, 2, move |rank, g| {
        let (h, d) = if rank == 1 {
            (hidden, dtype)
        } else {
            (8, f32_)
        };
        let mut m = Manager::new("deepep_high_throughput", moe_cfg(h, d), rank, 2).unwrap();
        let x = vec![0u8; 2 * 32];
        let bad = m.dispatch(g, &x, &[0, 3], &[1.0, 1.0], &[]).map(drop);
        let mut m = Manager::new("deepep_high_throughput", moe_cfg(8, f32_), rank, 2).unwrap();
        let good = m.dispatch(g, &x, &[0, 3], &[1.0, 1.0], &[]).map(drop);
        (message(&bad), message(&good))
    });
    for (rank, ((bad, good), took)) in res.into_iter().enumerate() {
        assert_eq!(bad, want[rank].replace("{name}", &name), "rank {rank}");
        assert_eq!(good, "ok", "rank {rank}");
        assert!(took < FAST, "rank {rank} took {took:?}");
    }
}

#[test]
fn managers_with_different_hidden_dtypes_fail_dispatch_on_every_rank() {
    // float32 x 8 against int32 x 8 (same row bytes) and bfloat16 x 16 (same row bytes).
    dispatch_disagreement(
        "moe-int",
        8,
        DType::new(Code::Int, 32),
        [
            "InvalidArgument: dispatch: rank 1 has hidden dtype = torch.int32 but rank 0 has torch.float32; every rank must create the manager with the same backend and configuration",
            "InvalidArgument: dispatch: rank 0 has hidden dtype = torch.float32 but rank 1 has torch.int32; every rank must create the manager with the same backend and configuration",
        ],
    );
    dispatch_disagreement(
        "moe-bf16",
        16,
        FloatKind::Bf16.dtype(),
        [
            "InvalidArgument: dispatch: rank 1 has hidden dtype = torch.bfloat16 but rank 0 has torch.float32; every rank must create the manager with the same backend and configuration",
            "InvalidArgument: dispatch: rank 0 has hidden dtype = torch.float32 but rank 1 has torch.bfloat16; every rank must create the manager with the same backend and configuration",
        ],
    );
}

// ---- EPLB rearrangements that disagree ------------------------------------------------------

const SLOTS: usize = 4; // 2 ranks x 2 local experts

fn eplb_comm() -> Box<dyn EplbCommunicator> {
    communicator::create(
        Some("torch_gloo"),
        false,
        DeviceKind::Cpu,
        &[],
        false,
        false,
    )
    .unwrap()
}

/// Rank `rank`'s weights for `layers` layers of `map`: one tensor, 8-byte rows = the expert id.
fn weights(map: &[i64], layers: usize, rank: usize) -> Vec<Vec<u8>> {
    (0..layers)
        .map(|_| {
            map[rank * 2..rank * 2 + 2]
                .iter()
                .flat_map(|&e| [e as u8; 8])
                .collect()
        })
        .collect()
}

/// A rearrangement where rank 1 passes (`layers1`, `new1`, `dtype1`) and rank 0 (1 layer,
/// [1,0,3,2], float32); both must fail with `want` and keep their weights, then a rearrangement
/// with matching arguments succeeds.
fn eplb_disagreement(tag: &str, layers1: usize, new1: [i64; SLOTS], dtype1: DType, want: &str) {
    let old = [0i64, 1, 2, 3];
    let (name, res) = on_group(tag, 2, move |rank, g| {
        let (layers, new, dtype) = if rank == 1 {
            (layers1, new1, dtype1)
        } else {
            (1, [1, 0, 3, 2], FloatKind::F32.dtype())
        };
        let olds = vec![old.to_vec(); layers];
        let news = vec![new.to_vec(); layers];
        let mut w = weights(&old, layers, rank);
        let mut c = eplb_comm();
        let bad = {
            let mut views: Vec<Vec<&mut [u8]>> = w.iter_mut().map(|l| vec![&mut l[..]]).collect();
            rearrange_typed(
                g,
                c.as_mut(),
                &olds,
                &news,
                &mut views,
                &[8],
                None,
                &[dtype],
            )
            .map(drop)
        };
        let kept = w == weights(&old, layers, rank);
        let mut w = weights(&old, 1, rank);
        let new = [1i64, 0, 3, 2];
        let good = {
            let mut views: Vec<Vec<&mut [u8]>> = w.iter_mut().map(|l| vec![&mut l[..]]).collect();
            rearrange(
                g,
                c.as_mut(),
                &[old.to_vec()],
                &[new.to_vec()],
                &mut views,
                &[8],
                None,
            )
            .map(drop)
        };
        let moved = w == weights(&new, 1, rank);
        (message(&bad), kept, message(&good), moved)
    });
    for (rank, ((bad, kept, good, moved), took)) in res.into_iter().enumerate() {
        assert_eq!(bad, want.replace("{name}", &name), "rank {rank}");
        assert!(kept, "rank {rank}: weights changed");
        assert_eq!(good, "ok", "rank {rank}");
        assert!(
            moved,
            "rank {rank}: the good rearrangement did not move the weights"
        );
        assert!(took < FAST, "rank {rank} took {took:?}");
    }
}

#[test]
fn eplb_with_different_weight_dtypes_fails_on_every_rank() {
    eplb_disagreement(
        "eplb-dtype",
        1,
        [1, 0, 3, 2],
        DType::new(Code::Int, 32),
        "InvalidArgument: rearrange: ranks disagree on the weight dtypes: rank 0 and rank 1 pass different ones; every rank must pass the same (EPLB rearrangement: no layer was changed)",
    );
}

#[test]
fn eplb_with_different_layer_counts_fails_on_every_rank() {
    eplb_disagreement(
        "eplb-layers",
        2,
        [1, 0, 3, 2],
        FloatKind::F32.dtype(),
        "InvalidArgument: rearrange: ranks disagree on the number of layers: rank 0 passes 1 but rank 1 passes 2; every rank must pass the same (EPLB rearrangement: no layer was changed)",
    );
}

#[test]
fn eplb_with_different_new_maps_fails_on_every_rank_with_its_layer_report() {
    eplb_disagreement(
        "eplb-maps",
        1,
        [2, 3, 0, 1],
        FloatKind::F32.dtype(),
        "InvalidArgument: rearrange: ranks disagree on the new placement: rank 0 and rank 1 pass different ones; every rank must pass the same (EPLB rearrangement: no layer was changed)",
    );
}
