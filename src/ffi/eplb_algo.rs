//! EPLB: vLLM v0.33.0's policy steps one by one (`DefaultEplbPolicy`'s classmethods and
//! `compute_logical_maps`), each as its own entry point.
//!
//! What is bit-exact with vLLM: `replicate_experts`, `preserve_intragpu_slots` and
//! `compute_logical_maps` always (their ties are resolved by numpy's first-maximum rule or by
//! slot order, the same everywhere). `balanced_packing` and everything built on it
//! (`rebalance_experts_hierarchical`, `rebalance_experts`) whenever the loads being packed have no
//! ties. With tied loads vLLM's result depends on the machine: it sorts with numpy's default
//! `np.argsort(-weight)`, which is not stable, and on x86 numpy runs it with SIMD sorting
//! networks, so the order of equal loads differs between CPUs and numpy builds. epcomm takes
//! equal loads in ascending index (vLLM with `kind="stable"`): the same result on every machine,
//! one of those vLLM can return. Integer token counts tie often, so expect different (equally
//! balanced) placements from vLLM on real loads.

use super::eplb_args::{checked_len, dims, id, non_null, read_rows, write_rows};
use super::guard;
use super::handle::Handle;
use crate::eplb::migration;
use crate::eplb::policy::{self, NodeFallback, Placement};
use crate::error::{Error, Result};

/// `flags` bit of [`epcomm_eplb_rebalance_experts`]: apply vLLM's eplb_state caller rule first —
/// when num_ranks % num_nodes != 0, log "num_gpus % num_nodes != 0, not using hierarchical
/// rearrangement algorithm." once and use one node (without it that case is vLLM's policy
/// AssertionError whenever groups divide into nodes).
pub const EPCOMM_EPLB_ONE_NODE_FALLBACK: u32 = 1;

/// One output of [`run_pairs`]: the pointer, its argument name, its entries per row.
type Out = (*mut i64, &'static str, usize);

/// The steps from float64 rows to two per-row index arrays (`balanced_packing`,
/// `replicate_experts`): checks the pointers and sizes, runs `step` on the `rows × cols`
/// weights, then writes both results (only on success).
///
/// # Safety
/// A non-NULL `weight` holds rows*cols doubles; a non-NULL output has room for rows times its
/// entries per row.
unsafe fn run_pairs(
    weight: *const f64,
    (rows, cols): (usize, usize),
    outs: [Out; 2],
    step: impl FnOnce(&[Vec<f64>]) -> Result<policy::Pairs>,
) -> Result<()> {
    let [(a, a_name, a_cols), (b, b_name, b_cols)] = outs;
    non_null(&[
        (weight.is_null(), "weight"),
        (a.is_null(), a_name),
        (b.is_null(), b_name),
    ])?;
    for n in [cols, a_cols, b_cols] {
        checked_len(rows, n, "num_rows * entries per row")?;
    }
    // SAFETY: the caller's contract (sizes checked above).
    let (first, second) = step(&unsafe { read_rows(weight, rows, cols) })?;
    // SAFETY: the caller's contract; written only on success.
    unsafe {
        write_rows(a, &first, a_cols, id);
        write_rows(b, &second, b_cols, id);
    }
    Ok(())
}

/// vLLM's `DefaultEplbPolicy.rebalance_experts`: `weight` [num_layers, num_logical_experts] token
/// counts (float32, as vLLM converts them) → `phy2log_out` [num_layers, num_replicas]. The
/// hierarchical policy when num_groups % num_nodes == 0, else the global one (one group, one
/// node); vLLM's asserts (E % G, G % N, R % N, P % R, P >= E) are EPCOMM_ERROR_ASSERTION in
/// vLLM's order (vLLM's bare `assert` has no text; the message states the condition). With
/// `old_phy2log` [num_layers, num_replicas] (NULL = none) experts that stay on a rank keep their
/// old slots (`preserve_intragpu_slots`); a negative old entry (vLLM's -1, an unused slot after a
/// scale-up) matches no expert. `flags`: 0, or EPCOMM_EPLB_ONE_NODE_FALLBACK for vLLM's
/// eplb_state rule. Bit-exact with vLLM when the packed loads have no ties; with ties epcomm
/// takes equal loads in ascending index (stable), where vLLM's unstable numpy sort differs
/// between machines (docs/api.md, "Ties").
///
/// # Safety
/// `weight` holds num_layers*num_logical_experts floats; `old_phy2log` is NULL or holds, and
/// `phy2log_out` has room for, num_layers*num_replicas int64.
// The arguments of epcomm_eplb_rebalance (ffi/eplb.rs), flags appended: the C ABI only appends.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_rebalance_experts(
    weight: *const f32,
    num_layers: i64,
    num_logical_experts: i64,
    num_replicas: i64,
    num_groups: i64,
    num_nodes: i64,
    num_ranks: i64,
    old_phy2log: *const i64,
    flags: u32,
    phy2log_out: *mut i64,
) -> i32 {
    guard::call(|| {
        let [l, e, num_replicas, num_groups, num_nodes, num_ranks] = dims!(
            num_layers,
            num_logical_experts,
            num_replicas,
            num_groups,
            num_nodes,
            num_ranks
        );
        let shape = Placement {
            num_replicas,
            num_groups,
            num_nodes,
            num_ranks,
        };
        let fallback = match flags {
            0 => NodeFallback::Policy,
            EPCOMM_EPLB_ONE_NODE_FALLBACK => NodeFallback::OneNode,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "flags is {other}; expected 0 or EPCOMM_EPLB_ONE_NODE_FALLBACK (1)"
                )))
            }
        };
        non_null(&[
            (weight.is_null(), "weight"),
            (phy2log_out.is_null(), "phy2log_out"),
        ])?;
        let p = shape.num_replicas;
        checked_len(l, e, "num_layers * num_logical_experts")?;
        checked_len(l, p, "num_layers * num_replicas")?;
        // SAFETY: the caller's contract (sizes above).
        let rows = unsafe { read_rows(weight, l, e) };
        // SAFETY: the caller's contract.
        let old = (!old_phy2log.is_null()).then(|| unsafe { read_rows(old_phy2log, l, p) });
        let map = policy::rebalance(&rows, shape, old.as_deref(), fallback)?;
        // SAFETY: the caller's contract; written only on success.
        unsafe { write_rows(phy2log_out, &map, p, id) };
        Ok(())
    })
}

/// vLLM's `rebalance_experts_hierarchical`: `weight` [num_layers, num_logical_experts] (float32)
/// → `phy2log_out` [num_layers, num_physical_experts], groups packed onto nodes, replicas made
/// within each node, physical experts packed onto the node's GPUs. vLLM's asserts are
/// EPCOMM_ERROR_ASSERTION. Bit-exact with vLLM when the packed loads have no ties (see
/// epcomm_eplb_rebalance_experts).
///
/// # Safety
/// `weight` holds num_layers*num_logical_experts floats; `phy2log_out` has room for
/// num_layers*num_physical_experts int64.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_rebalance_experts_hierarchical(
    weight: *const f32,
    num_layers: i64,
    num_logical_experts: i64,
    num_physical_experts: i64,
    num_groups: i64,
    num_nodes: i64,
    num_gpus: i64,
    phy2log_out: *mut i64,
) -> i32 {
    guard::call(|| {
        let [l, e, p, g, n, r] = dims!(
            num_layers,
            num_logical_experts,
            num_physical_experts,
            num_groups,
            num_nodes,
            num_gpus
        );
        non_null(&[
            (weight.is_null(), "weight"),
            (phy2log_out.is_null(), "phy2log_out"),
        ])?;
        checked_len(l, e, "num_layers * num_logical_experts")?;
        checked_len(l, p, "num_layers * num_physical_experts")?;
        // SAFETY: the caller's contract (sizes above).
        let rows = unsafe { read_rows(weight, l, e) };
        let map = policy::rebalance_hierarchical(&rows, p, g, n, r)?;
        // SAFETY: the caller's contract; written only on success.
        unsafe { write_rows(phy2log_out, &map, p, id) };
        Ok(())
    })
}

/// vLLM's `balanced_packing`: packs the num_items weighted items of each of the num_rows rows of
/// `weight` (float64) into num_packs packs of num_items / num_packs items, heaviest first, each
/// to the lightest pack with room (the first on ties). Writes `pack_index_out` and
/// `rank_in_pack_out` [num_rows, num_items]. num_items % num_packs != 0 is
/// EPCOMM_ERROR_ASSERTION. Bit-exact with vLLM when a row has no tied weights; tied weights are
/// taken in ascending index (stable), where vLLM's unstable `np.argsort` differs between machines.
///
/// # Safety
/// `weight` holds num_rows*num_items doubles; both outputs have room for num_rows*num_items int64.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_balanced_packing(
    weight: *const f64,
    num_rows: i64,
    num_items: i64,
    num_packs: i64,
    pack_index_out: *mut i64,
    rank_in_pack_out: *mut i64,
) -> i32 {
    guard::call(|| {
        let [x, n, m] = dims!(num_rows, num_items, num_packs);
        let outs = [
            (pack_index_out, "pack_index_out", n),
            (rank_in_pack_out, "rank_in_pack_out", n),
        ];
        // SAFETY: the caller's contract (sizes above).
        unsafe {
            run_pairs(weight, (x, n), outs, |rows| {
                policy::balanced_packing(rows, m)
            })
        }
    })
}

// Shaped as epcomm_eplb_balanced_packing on purpose: both are `run_pairs` calls, spelled out
// for the header (see the module doc of `ffi`).
/// vLLM's `replicate_experts`: replicates the num_logical experts of each of the num_rows rows of
/// `weight` (float64) into num_physical slots, each extra slot to the expert with the largest
/// load per replica (the first on ties, as numpy's argmax). Writes `phy2log_out` [num_rows,
/// num_physical] and `logcnt_out` [num_rows, num_logical]. num_physical < num_logical is
/// EPCOMM_ERROR_ASSERTION. Bit-exact with vLLM.
///
/// # Safety
/// `weight` holds num_rows*num_logical doubles; the outputs have room for the sizes above.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_replicate_experts(
    weight: *const f64,
    num_rows: i64,
    num_logical: i64,
    num_physical: i64,
    phy2log_out: *mut i64,
    logcnt_out: *mut i64,
) -> i32 {
    guard::call(|| {
        let [x, e, p] = dims!(num_rows, num_logical, num_physical);
        let outs = [
            (phy2log_out, "phy2log_out", p),
            (logcnt_out, "logcnt_out", e),
        ];
        // SAFETY: the caller's contract (sizes above).
        unsafe {
            run_pairs(weight, (x, e), outs, |rows| {
                policy::replicate_experts(rows, p)
            })
        }
    })
}

/// vLLM's `preserve_intragpu_slots`: reorders each rank's block of num_physical / num_ranks slots
/// of `phy2log` [num_layers, num_physical] so that an expert that stays on the rank keeps its slot
/// of `old_phy2log` (same shape; the first unused match), the others filling the remaining slots
/// in order; the result goes to `phy2log_out` (which may be `phy2log` itself). Values are only
/// compared, so -1 (an unused slot) may appear in either map. num_ranks <= 0 or not dividing
/// num_physical copies `phy2log` unchanged, as vLLM. Bit-exact with vLLM.
///
/// # Safety
/// `phy2log`, `old_phy2log` and `phy2log_out` hold num_layers*num_physical int64.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_preserve_intragpu_slots(
    phy2log: *const i64,
    num_layers: i64,
    num_physical: i64,
    num_ranks: i64,
    old_phy2log: *const i64,
    phy2log_out: *mut i64,
) -> i32 {
    guard::call(|| {
        let [l, p] = dims!(num_layers, num_physical);
        non_null(&[
            (phy2log.is_null(), "phy2log"),
            (old_phy2log.is_null(), "old_phy2log"),
            (phy2log_out.is_null(), "phy2log_out"),
        ])?;
        checked_len(l, p, "num_layers * num_physical")?;
        // SAFETY: the caller's contract; both are copied before the output is borrowed, so the
        // output may alias the input.
        let (mut map, old) = unsafe { (read_rows(phy2log, l, p), read_rows(old_phy2log, l, p)) };
        policy::preserve_intragpu_slots(&mut map, usize::try_from(num_ranks).unwrap_or(0), &old);
        // SAFETY: the caller's contract; no slice of the inputs is alive.
        unsafe { write_rows(phy2log_out, &map, p, |x| x) };
        Ok(())
    })
}

/// vLLM's `compute_logical_maps`: from `phy2log` [num_layers, num_physical] (a negative entry,
/// vLLM's -1, is an unused slot and counted nowhere) writes the replica count per logical expert
/// `logcnt_out` [num_layers, num_logical], the width W = the largest replica count (vLLM's
/// max(logcnt); 0 when every slot is unused) to `max_replicas_out`, and, when `log2phy_out` is
/// not NULL, the logical → physical map [num_layers, num_logical, W] (ascending slots, padded
/// with -1) into its `log2phy_capacity` int64. W <= num_physical, so a buffer of
/// num_layers*num_logical*num_physical always fits; else call once with `log2phy_out` NULL to
/// learn W. A capacity below num_layers*num_logical*W, or an id >= num_logical, is
/// EPCOMM_ERROR_INVALID_ARGUMENT (vLLM's scatter raises torch's index error for the latter).
/// Bit-exact with vLLM.
///
/// # Safety
/// `phy2log` holds num_layers*num_physical int64; `logcnt_out` has room for
/// num_layers*num_logical; `log2phy_out` is NULL or has room for `log2phy_capacity` int64;
/// `max_replicas_out` is writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_compute_logical_maps(
    phy2log: *const i64,
    num_layers: i64,
    num_physical: i64,
    num_logical: i64,
    logcnt_out: *mut i64,
    log2phy_out: *mut i64,
    log2phy_capacity: i64,
    max_replicas_out: *mut i64,
) -> i32 {
    guard::call(|| {
        let [l, p, e] = dims!(num_layers, num_physical, num_logical);
        non_null(&[
            (phy2log.is_null(), "phy2log"),
            (logcnt_out.is_null(), "logcnt_out"),
            (max_replicas_out.is_null(), "max_replicas_out"),
        ])?;
        checked_len(l, p, "num_layers * num_physical")?;
        let el = checked_len(l, e, "num_layers * num_logical")?;
        // SAFETY: the caller's contract (sizes above).
        let rows = unsafe { read_rows(phy2log, l, p) };
        let (logcnt, log2phy) = policy::logical_maps(&rows, e)?;
        let width = logcnt.iter().flatten().copied().max().unwrap_or(0);
        let need = checked_len(el, width, "num_layers * num_logical * max_replicas")?;
        if !log2phy_out.is_null() && usize::try_from(log2phy_capacity).unwrap_or(0) < need {
            return Err(Error::InvalidArgument(format!(
                "log2phy_capacity is {log2phy_capacity}; the map needs {need} int64 \
                 ([{l}, {e}, {width}])"
            )));
        }
        // SAFETY: the caller's contract; written only on success.
        unsafe {
            *max_replicas_out = width as i64;
            write_rows(logcnt_out, &logcnt, e, id);
            if !log2phy_out.is_null() {
                let flat: Vec<Vec<i64>> = log2phy.into_iter().flatten().collect();
                write_rows(log2phy_out, &flat, width, |x| x);
            }
        }
        Ok(())
    })
}

/// One layer's migration schedule (epcomm_eplb_schedule_migration_batches); immutable.
pub struct epcomm_eplb_migration_schedule {
    batch_starts: Vec<i64>,
    flows: Vec<i64>,
    expert_starts: Vec<i64>,
    expert_ids: Vec<i64>,
}

impl super::handle::Handle for epcomm_eplb_migration_schedule {
    const ARG: &'static str = "schedule";
}

/// Views of a migration schedule; valid until the schedule is destroyed.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct epcomm_eplb_schedule_view {
    /// Batches (0 when nothing moves).
    pub num_batches: i64,
    /// num_batches + 1 offsets into the flows: batch b is flows batch_starts[b] up to
    /// batch_starts[b + 1].
    pub batch_starts: *const i64,
    /// Flows, over all batches.
    pub num_flows: i64,
    /// [num_flows, 2]: (source rank, destination rank), in vLLM's order.
    pub flows: *const i64,
    /// num_flows + 1 offsets into expert_ids: flow f sends expert_ids[expert_starts[f]] up to
    /// expert_ids[expert_starts[f + 1]], ascending.
    pub expert_starts: *const i64,
    /// Expert ids, over all flows.
    pub num_expert_ids: i64,
    /// The flows' experts, flow after flow.
    pub expert_ids: *const i64,
}

/// vLLM v0.33.0's `schedule_migration_batches` (vllm/distributed/eplb/migration_scheduler.py)
/// for one layer: the old and new physical → logical maps (`num_slots` entries each,
/// `slots_per_rank` per rank; only -1 is an empty slot, as in vLLM) give the remote copies; the
/// copies between one directed rank pair form a flow (experts ascending); flows are placed by
/// first fit into batches where each rank is in at most one flow. The senders are the unbatched
/// path's (vLLM's balanced assignment). An expert no rank holds is skipped, as vLLM does;
/// epcomm_eplb_rearrange refuses such a layer instead. The batches epcomm_eplb_rearrange_with
/// runs with migration_batching.
///
/// # Safety
/// `old_phy2log` and `new_phy2log` hold num_slots entries; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_schedule_migration_batches(
    old_phy2log: *const i64,
    new_phy2log: *const i64,
    num_slots: i64,
    slots_per_rank: i64,
    out: *mut *mut epcomm_eplb_migration_schedule,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(out, "out") }?;
        let [p, n] = dims!(num_slots, slots_per_rank);
        checked_len(p, 1, "num_slots")?;
        non_null(&[
            (old_phy2log.is_null(), "old_phy2log"),
            (new_phy2log.is_null(), "new_phy2log"),
        ])?;
        // SAFETY: num_slots entries each (caller contract).
        let (old, new) = unsafe { (read_rows(old_phy2log, 1, p), read_rows(new_phy2log, 1, p)) };
        let batches = migration::schedule_migration_batches(n, &old[0], &new[0])?;
        let mut s = epcomm_eplb_migration_schedule {
            batch_starts: vec![0],
            flows: Vec::new(),
            expert_starts: vec![0],
            expert_ids: Vec::new(),
        };
        for f in batches.iter().flatten() {
            s.flows.extend([f.src_rank as i64, f.dst_rank as i64]);
            s.expert_ids.extend(&f.expert_ids);
            s.expert_starts.push(s.expert_ids.len() as i64);
        }
        for b in &batches {
            s.batch_starts
                .push(s.batch_starts[s.batch_starts.len() - 1] + b.len() as i64);
        }
        *out = s.into_raw();
        Ok(())
    })
}

/// Describes a migration schedule.
///
/// # Safety
/// `schedule` is NULL or live; `view_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_migration_schedule_view(
    schedule: *const epcomm_eplb_migration_schedule,
    view_out: *mut epcomm_eplb_schedule_view,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(view_out, "view_out") }?;
        let s = unsafe { epcomm_eplb_migration_schedule::borrow(schedule) }?;
        *out = epcomm_eplb_schedule_view {
            num_batches: s.batch_starts.len() as i64 - 1,
            batch_starts: s.batch_starts.as_ptr(),
            num_flows: s.flows.len() as i64 / 2,
            flows: s.flows.as_ptr(),
            expert_starts: s.expert_starts.as_ptr(),
            num_expert_ids: s.expert_ids.len() as i64,
            expert_ids: s.expert_ids.as_ptr(),
        };
        Ok(())
    })
}

/// Releases a migration schedule (NULL is a no-op), as
/// epcomm_eplb_migration_schedule_destroy_checked, whose status this void form cannot return:
/// a refused destroy frees nothing and records the error for epcomm_last_error_message.
///
/// # Safety
/// `schedule` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_migration_schedule_destroy(
    schedule: *mut epcomm_eplb_migration_schedule,
) {
    if !schedule.is_null() {
        // SAFETY: caller contract.
        unsafe { epcomm_eplb_migration_schedule_destroy_checked(schedule) };
    }
}

/// Releases a migration schedule: EPCOMM_OK; its views become invalid. NULL is
/// EPCOMM_ERROR_NULL_POINTER. Refused with EPCOMM_ERROR_INVALID_STATE, freeing nothing: while
/// another thread's call on it is in flight; on a schedule destroyed already; in a forked child of
/// the process that made it.
///
/// # Safety
/// `schedule` is NULL or any pointer (a destroyed or foreign one is refused, not freed).
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_migration_schedule_destroy_checked(
    schedule: *mut epcomm_eplb_migration_schedule,
) -> i32 {
    // SAFETY: only a registered handle is freed.
    guard::call(|| unsafe { epcomm_eplb_migration_schedule::destroy(schedule) })
}
