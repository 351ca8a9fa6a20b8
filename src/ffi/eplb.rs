//! EPLB: the rebalancing policy and the logical maps.

use super::eplb_args::{checked_len, dims, non_null, read_rows, write_rows};
use super::guard;
use crate::eplb::{policy, scale_down};
use crate::error::{Error, Result};

// epcomm_eplb_rebalance_experts's parameters but `flags`, spelled out for the header (see the
// module doc of `ffi`): one call.
/// Computes a new placement with vLLM's default EPLB policy (DeepSeek's algorithm) as vLLM's
/// eplb_state caller runs it: exactly epcomm_eplb_rebalance_experts with
/// EPCOMM_EPLB_ONE_NODE_FALLBACK (one behaviour whichever entry point). `weight` is
/// [num_layers, num_logical_experts] token counts (as float), the result `phy2log_out`
/// [num_layers, num_replicas] maps every physical slot to a logical expert. Uses the
/// hierarchical policy when groups divide into nodes, else the global one; when
/// num_ranks % num_nodes != 0 it uses one node and logs vLLM's warning. With `old_phy2log`
/// (NULL = none), experts that stay on a GPU keep their old slots; a negative old entry (vLLM's
/// -1, an unused slot) matches no expert. Violated preconditions (E % G, G % N, R % N, P % R)
/// are EPCOMM_ERROR_ASSERTION, as vLLM's asserts. Bit-exact with vLLM when the packed loads have
/// no ties; with ties epcomm takes equal loads in ascending index (stable), where vLLM's
/// unstable numpy sort differs between machines (docs/api.md).
///
/// # Safety
/// `weight` holds num_layers*num_logical_experts floats; `old_phy2log` is NULL or holds and
/// `phy2log_out` has room for num_layers*num_replicas int64.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_rebalance(
    weight: *const f32,
    num_layers: i64,
    num_logical_experts: i64,
    num_replicas: i64,
    num_groups: i64,
    num_nodes: i64,
    num_ranks: i64,
    old_phy2log: *const i64,
    phy2log_out: *mut i64,
) -> i32 {
    // SAFETY: the same contract.
    unsafe {
        super::eplb_algo::epcomm_eplb_rebalance_experts(
            weight,
            num_layers,
            num_logical_experts,
            num_replicas,
            num_groups,
            num_nodes,
            num_ranks,
            old_phy2log,
            super::eplb_algo::EPCOMM_EPLB_ONE_NODE_FALLBACK,
            phy2log_out,
        )
    }
}

/// From physical → logical maps [num_layers, num_physical], writes the replica count per
/// logical expert `logcnt_out` [num_layers, num_logical] and the logical → physical map
/// `log2phy_out` [num_layers, num_logical, max_replicas] (ascending slots, padded with -1).
/// An expert with more than max_replicas replicas is an error naming it.
///
/// # Safety
/// Buffers hold the sizes above.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_logical_maps(
    phy2log: *const i64,
    num_layers: i64,
    num_physical: i64,
    num_logical: i64,
    max_replicas: i64,
    logcnt_out: *mut i64,
    log2phy_out: *mut i64,
) -> i32 {
    guard::call(|| {
        let [l, p, e, width] = dims!(num_layers, num_physical, num_logical, max_replicas);
        non_null(&[
            (phy2log.is_null(), "phy2log"),
            (logcnt_out.is_null(), "logcnt_out"),
            (log2phy_out.is_null(), "log2phy_out"),
        ])?;
        let pl = checked_len(l, p, "num_layers * num_physical")?;
        let el = checked_len(l, e, "num_layers * num_logical")?;
        let mapl = checked_len(el, width, "num_layers * num_logical * max_replicas")?;
        // SAFETY: caller contract.
        let src = unsafe { guard::slice_arg(phy2log, pl, "phy2log") }?;
        if let Some((i, &bad)) = src
            .iter()
            .enumerate()
            .find(|(_, &x)| x < 0 || x >= e as i64)
        {
            return Err(Error::InvalidArgument(format!(
                "phy2log[{i}] is {bad}; expected a logical expert id in [0, {e})"
            )));
        }
        let rows: Vec<Vec<usize>> = src
            .chunks(p)
            .map(|c| c.iter().map(|&x| x as usize).collect())
            .collect();
        let (cnt, maps) = policy::compute_logical_maps(&rows, e);
        if let Some((layer, expert, c)) = cnt
            .iter()
            .enumerate()
            .flat_map(|(li, row)| row.iter().enumerate().map(move |(x, &c)| (li, x, c)))
            .find(|&(_, _, c)| c > width)
        {
            return Err(Error::InvalidArgument(format!(
                "expert {expert} of layer {layer} has {c} replicas, more than max_replicas = {width}"
            )));
        }
        // SAFETY: caller contract; written only on success.
        let cnt_out = unsafe { guard::slice_mut_arg(logcnt_out, el, "logcnt_out") }?;
        let map_out = unsafe { guard::slice_mut_arg(log2phy_out, mapl, "log2phy_out") }?;
        for (d, &c) in cnt_out.iter_mut().zip(cnt.iter().flatten()) {
            *d = c as i64;
        }
        map_out.fill(-1);
        for (li, layer) in maps.iter().enumerate() {
            for (x, slots) in layer.iter().enumerate() {
                let base = (li * e + x) * width;
                map_out[base..base + slots.len().min(width)]
                    .copy_from_slice(&slots[..slots.len().min(width)]);
            }
        }
        Ok(())
    })
}

/// The smallest num_redundant_experts that makes num_logical + redundant divisible by ep_size.
///
/// # Safety
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_min_redundant_experts(
    num_logical: i64,
    ep_size: i64,
    out: *mut i64,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let out = unsafe { guard::out_arg(out, "out") }?;
        let [e, r] = dims!(num_logical, ep_size);
        *out = policy::min_redundant_experts(e, r) as i64;
        Ok(())
    })
}

/// A non-negative count given as i64.
fn count(v: i64, what: &str) -> Result<usize> {
    usize::try_from(v)
        .map_err(|_| Error::InvalidArgument(format!("{what} is {v}; expected a value >= 0")))
}

/// The `n` values at `p`, each a [`count`] (`p` is read only when n > 0).
///
/// # Safety
/// `p` holds `n` int64 when n > 0.
unsafe fn counts(p: *const i64, n: usize, what: &str) -> Result<Vec<usize>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the caller's contract.
    let values = unsafe { std::slice::from_raw_parts(p, n) };
    values.iter().map(|&v| count(v, what)).collect()
}

/// vLLM v0.34.0's `compute_dead_ep_ranks` (scale-down after peer death): each of the `num_dead`
/// dead DP ranks owns the `tp_size * pcp_size` EP ranks from `dp * tp_size * pcp_size`. Writes
/// them ascending, without repeats, to `ep_ranks_out` (room for num_dead * tp_size * pcp_size)
/// and their number to `count_out`.
///
/// # Safety
/// `dead_dp_ranks` holds `num_dead` int64 (NULL when 0); `ep_ranks_out` has the room above;
/// `count_out` is writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_dead_ep_ranks(
    dead_dp_ranks: *const i64,
    num_dead: usize,
    tp_size: i64,
    pcp_size: i64,
    ep_ranks_out: *mut i64,
    count_out: *mut usize,
) -> i32 {
    guard::call(|| {
        let [tp, pcp] = dims!(tp_size, pcp_size);
        if num_dead > 0 && dead_dp_ranks.is_null() {
            return Err(Error::NullPointer("dead_dp_ranks"));
        }
        if ep_ranks_out.is_null() {
            return Err(Error::NullPointer("ep_ranks_out"));
        }
        // SAFETY: caller contract.
        let count_out = unsafe { guard::out_arg(count_out, "count_out") }?;
        // SAFETY: caller contract.
        let dead = unsafe { counts(dead_dp_ranks, num_dead, "a dead DP rank") }?;
        let ranks = scale_down::dead_ep_ranks(&dead, tp, pcp)?;
        // SAFETY: caller contract: room for num_dead * tp * pcp >= ranks.len().
        let out = unsafe { std::slice::from_raw_parts_mut(ep_ranks_out, ranks.len()) };
        for (o, r) in out.iter_mut().zip(&ranks) {
            *o = *r as i64;
        }
        *count_out = ranks.len();
        Ok(())
    })
}

/// vLLM v0.34.0's `mark_dead_expert_slots_inplace`: in `phy2log` [num_layers, num_physical]
/// every slot of each of the `num_dead` dead EP ranks (rank r owns the num_local_experts slots
/// from r * num_local_experts) becomes -1, in place (only on success).
///
/// # Safety
/// `phy2log` holds num_layers * num_physical int64; `dead_ep_ranks` holds `num_dead` int64
/// (NULL when 0).
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_mark_dead_expert_slots(
    phy2log: *mut i64,
    num_layers: i64,
    num_physical: i64,
    dead_ep_ranks: *const i64,
    num_dead: usize,
    num_local_experts: i64,
) -> i32 {
    guard::call(|| {
        let [l, p, local] = dims!(num_layers, num_physical, num_local_experts);
        checked_len(l, p, "num_layers * num_physical")?;
        if phy2log.is_null() {
            return Err(Error::NullPointer("phy2log"));
        }
        if num_dead > 0 && dead_ep_ranks.is_null() {
            return Err(Error::NullPointer("dead_ep_ranks"));
        }
        // SAFETY: caller contract.
        let dead = unsafe { counts(dead_ep_ranks, num_dead, "a dead EP rank") }?;
        // SAFETY: caller contract (sizes above).
        let mut map = unsafe { read_rows(phy2log, l, p) };
        scale_down::mark_dead_slots(&mut map, &dead, local)?;
        // SAFETY: caller contract.
        unsafe { write_rows(phy2log, &map, p, |x| x) };
        Ok(())
    })
}

/// vLLM v0.34.0's `redistribute_expert_placement`, which every survivor of a scale-down runs
/// on the same map and gets the same result from, without talking to the others: in each layer
/// of `phy2log` [num_layers, num_physical] (-1 = a dead slot), every logical expert in
/// [0, num_logical) without a surviving replica takes a slot of an over-replicated expert,
/// spread round-robin over the EP ranks. Rewrites `phy2log` in place and sets
/// `reload_out[layer * num_logical + expert]` to 1 for each expert whose weights must be
/// reloaded (0 otherwise); both only on success. Too little redundancy is EPCOMM_ERROR_RUNTIME
/// with vLLM's `Layer {l}: no redundant slot for missing expert {e}. EPLB redundancy
/// insufficient.`
///
/// # Safety
/// `phy2log` holds num_layers * num_physical int64; `reload_out` has room for
/// num_layers * num_logical bytes.
#[no_mangle]
pub unsafe extern "C" fn epcomm_eplb_redistribute_expert_placement(
    phy2log: *mut i64,
    num_layers: i64,
    num_physical: i64,
    num_logical: i64,
    num_local_experts: i64,
    reload_out: *mut u8,
) -> i32 {
    guard::call(|| {
        let [l, p] = dims!(num_layers, num_physical);
        let e = count(num_logical, "num_logical")?;
        let [local] = dims!(num_local_experts);
        checked_len(l, p, "num_layers * num_physical")?;
        let flags = checked_len(l, e, "num_layers * num_logical")?;
        if phy2log.is_null() {
            return Err(Error::NullPointer("phy2log"));
        }
        if reload_out.is_null() && flags > 0 {
            return Err(Error::NullPointer("reload_out"));
        }
        // SAFETY: caller contract (sizes above).
        let map = unsafe { read_rows(phy2log, l, p) };
        let (new, reload) = scale_down::redistribute(&map, e, local)?;
        // SAFETY: caller contract; written only on success.
        unsafe { write_rows(phy2log, &new, p, |x| x) };
        if flags > 0 {
            // SAFETY: caller contract.
            let out = unsafe { std::slice::from_raw_parts_mut(reload_out, flags) };
            out.fill(0);
            for (layer, expert) in reload {
                out[layer * e + expert] = 1;
            }
        }
        Ok(())
    })
}
