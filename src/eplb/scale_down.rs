//! vLLM v0.34.0's scale-down placement (`vllm/v1/worker/sentinel/eplb_redistribute.py`): after
//! peers die, every survivor computes the same new placement from the same map, without
//! talking to the others, before reloading the experts that were lost. Pure functions of their
//! arguments, in vLLM's iteration order (so every survivor gets a bit-identical result).

use crate::error::{Error, Result};

/// vLLM's `compute_dead_ep_ranks`: each dead DP rank owns the contiguous block of
/// `tp_size * pcp_size` EP ranks `[dp * block, (dp + 1) * block)`. Ascending, without repeats.
pub fn dead_ep_ranks(
    dead_dp_ranks: &[usize],
    tp_size: usize,
    pcp_size: usize,
) -> Result<Vec<usize>> {
    let block = tp_size
        .checked_mul(pcp_size)
        .ok_or_else(|| Error::InvalidArgument("tp_size * pcp_size is too large".into()))?;
    let mut out = Vec::new();
    for &dp in dead_dp_ranks {
        let range = dp
            .checked_mul(block)
            .and_then(|first| Some(first..first.checked_add(block)?))
            .ok_or_else(|| {
                Error::InvalidArgument(format!("dead DP rank {dp} is too large for its EP block"))
            })?;
        out.extend(range);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// vLLM's `mark_dead_expert_slots_inplace`: every slot of each dead EP rank (rank `r` owns the
/// `num_local_experts` slots from `r * num_local_experts`) becomes -1, in every layer.
pub fn mark_dead_slots(
    phy2log: &mut [Vec<i64>],
    dead_ep_ranks: &[usize],
    num_local_experts: usize,
) -> Result<()> {
    if dead_ep_ranks.is_empty() {
        return Ok(());
    }
    let physical = check_shape(phy2log, num_local_experts)?;
    let ranks = physical / num_local_experts;
    if let Some(bad) = dead_ep_ranks.iter().find(|&&r| r >= ranks) {
        return Err(Error::InvalidArgument(format!(
            "dead EP rank {bad} is out of range: the map has {ranks} EP ranks of {num_local_experts} slots"
        )));
    }
    for row in phy2log.iter_mut() {
        for &r in dead_ep_ranks {
            row[r * num_local_experts..(r + 1) * num_local_experts].fill(-1);
        }
    }
    Ok(())
}

/// The number of physical slots of `phy2log` (every layer the same), a multiple of
/// `num_local_experts`.
fn check_shape(phy2log: &[Vec<i64>], num_local_experts: usize) -> Result<usize> {
    let physical = phy2log.first().map_or(0, Vec::len);
    if phy2log.iter().any(|r| r.len() != physical) {
        return Err(Error::InvalidArgument(
            "every layer of the map must have the same number of physical slots".into(),
        ));
    }
    if num_local_experts == 0 || !physical.is_multiple_of(num_local_experts) {
        return Err(Error::InvalidArgument(format!(
            "the map's {physical} physical slots are not a whole number of EP ranks of {num_local_experts} local experts"
        )));
    }
    Ok(physical)
}

/// What [`redistribute`] returns: the new physical-to-logical map, one row per layer, and the
/// (layer, logical expert) pairs whose weights must be reloaded.
pub type Redistributed = (Vec<Vec<i64>>, Vec<(usize, usize)>);

/// vLLM's `redistribute_expert_placement`: in each layer, every logical expert in
/// `[0, num_logical)` without a surviving replica (slots of -1 are dead) takes a slot from an
/// over-replicated expert (one with more than one replica), the spare slots interleaved
/// round-robin across EP ranks (each rank's sorted by replica count, then slot, descending) so
/// each rank reloads about as many experts. Returns the new map and the (layer, logical expert)
/// pairs that need their weights reloaded, ascending. Too little redundancy is vLLM's
/// RuntimeError `Layer {l}: no redundant slot for missing expert {e}. EPLB redundancy
/// insufficient.`; `phy2log` is then not changed (vLLM has rewritten the layers before it, but
/// the engine stops on that error anyway).
pub fn redistribute(
    phy2log: &[Vec<i64>],
    num_logical: usize,
    num_local_experts: usize,
) -> Result<Redistributed> {
    check_shape(phy2log, num_local_experts)?;
    let mut out = phy2log.to_vec();
    let mut reload = Vec::new();
    for (layer, row) in out.iter_mut().enumerate() {
        // Replica counts of the surviving slots (any id >= 0, as vLLM counts them).
        let mut count: std::collections::HashMap<i64, usize> = std::collections::HashMap::new();
        for &x in row.iter().filter(|x| **x >= 0) {
            *count.entry(x).or_default() += 1;
        }
        let missing: Vec<usize> = (0..num_logical)
            .filter(|e| !count.contains_key(&(*e as i64)))
            .collect();
        if missing.is_empty() {
            continue;
        }
        // Spare slots by owning EP rank, each bucket (replica count, slot) descending.
        let ranks = row.len() / num_local_experts;
        let mut buckets: Vec<Vec<(usize, usize)>> = vec![Vec::new(); ranks];
        for (slot, &x) in row.iter().enumerate() {
            let c = if x >= 0 { count[&x] } else { 0 };
            if c > 1 {
                buckets[slot / num_local_experts].push((c, slot));
            }
        }
        for b in &mut buckets {
            b.sort_unstable_by(|a, b| b.cmp(a));
        }
        // Round-robin across the ranks that have spare slots, ascending rank order.
        let depth = buckets.iter().map(Vec::len).max().unwrap_or(0);
        let interleaved: Vec<usize> = (0..depth)
            .flat_map(|i| {
                buckets
                    .iter()
                    .filter_map(move |b| b.get(i).map(|(_, s)| *s))
            })
            .collect();
        let mut slots = interleaved.into_iter();
        for e in missing {
            loop {
                let Some(slot) = slots.next() else {
                    return Err(Error::Runtime(format!(
                        "Layer {layer}: no redundant slot for missing expert {e}. EPLB redundancy insufficient."
                    )));
                };
                let prev = row[slot];
                // An earlier reuse may have left `prev` with a single replica.
                if count.get(&prev).copied().unwrap_or(0) > 1 {
                    row[slot] = e as i64;
                    if let Some(c) = count.get_mut(&prev) {
                        *c -= 1;
                    }
                    reload.push((layer, e));
                    break;
                }
            }
        }
    }
    reload.sort_unstable();
    reload.dedup();
    Ok((out, reload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_ranks_are_whole_blocks() {
        assert_eq!(dead_ep_ranks(&[2, 0], 2, 1).unwrap(), vec![0, 1, 4, 5]);
        assert_eq!(dead_ep_ranks(&[1, 1], 1, 2).unwrap(), vec![2, 3]);
        assert!(dead_ep_ranks(&[usize::MAX], 2, 1).is_err());
    }

    #[test]
    fn lost_experts_take_spare_slots_round_robin() {
        // 4 ranks of 2 slots; rank 1 dies, losing experts 2 and 3.
        let mut map = vec![vec![0, 1, 2, 3, 0, 1, 0, 1]];
        mark_dead_slots(&mut map, &[1], 2).unwrap();
        assert_eq!(map, vec![vec![0, 1, -1, -1, 0, 1, 0, 1]]);
        let (new, reload) = redistribute(&map, 4, 2).unwrap();
        // Spare: rank 0 [(3,1),(3,0)], rank 2 [(3,5),(3,4)], rank 3 [(3,7),(3,6)];
        // interleaved 1, 5, 7, 0, 4, 6: expert 2 takes slot 1, expert 3 slot 5.
        assert_eq!(new, vec![vec![0, 2, -1, -1, 0, 3, 0, 1]]);
        assert_eq!(reload, vec![(0, 2), (0, 3)]);
        let e = redistribute(&[vec![0, 1, -1, -1]], 3, 2).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Layer 0: no redundant slot for missing expert 2. EPLB redundancy insufficient."
        );
        assert_eq!(e.exception(), "RuntimeError");
        assert!(mark_dead_slots(&mut map, &[4], 2).is_err());
        assert!(redistribute(&map, 4, 3).is_err());
    }
}
