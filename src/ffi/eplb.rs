//! EPLB: the rebalancing policy and the logical maps.

use super::guard;
use crate::eplb::policy;
use crate::error::{Error, Result};

/// A positive dimension argument (shared with the policy steps in `eplb_algo`).
pub(super) fn dim(v: i64, what: &str) -> Result<usize> {
    usize::try_from(v)
        .ok()
        .filter(|&x| x > 0)
        .ok_or_else(|| Error::InvalidArgument(format!("{what} is {v}; expected a positive value")))
}

/// `a × b` entries, bounded by 2^40 (the allocations a wrong size could ask for).
pub(super) fn checked_len(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b)
        .filter(|&n| n <= (1usize << 40))
        .ok_or_else(|| Error::InvalidArgument(format!("{what} is too large")))
}

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
        let l = dim(num_layers, "num_layers")?;
        let p = dim(num_physical, "num_physical")?;
        let e = dim(num_logical, "num_logical")?;
        let width = dim(max_replicas, "max_replicas")?;
        for (ptr, what) in [
            (phy2log.is_null(), "phy2log"),
            (logcnt_out.is_null(), "logcnt_out"),
            (log2phy_out.is_null(), "log2phy_out"),
        ] {
            if ptr {
                return Err(Error::NullPointer(what));
            }
        }
        let pl = checked_len(l, p, "num_layers * num_physical")?;
        let el = checked_len(l, e, "num_layers * num_logical")?;
        let mapl = checked_len(el, width, "num_layers * num_logical * max_replicas")?;
        // SAFETY: caller contract.
        let src = unsafe { std::slice::from_raw_parts(phy2log, pl) };
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
        let cnt_out = unsafe { std::slice::from_raw_parts_mut(logcnt_out, el) };
        let map_out = unsafe { std::slice::from_raw_parts_mut(log2phy_out, mapl) };
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
        let e = dim(num_logical, "num_logical")?;
        let r = dim(ep_size, "ep_size")?;
        *out = policy::min_redundant_experts(e, r) as i64;
        Ok(())
    })
}
