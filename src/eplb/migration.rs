//! vLLM v0.33.0's migration scheduler (`vllm/distributed/eplb/migration_scheduler.py`): one
//! layer's remote expert transfers grouped by directed rank pair into flows, and the flows
//! packed into batches in which every rank talks to at most one peer. With
//! `EPLBConfig.enable_migration_batching` (and async EPLB) vLLM's rearrangement runs one
//! communicator `execute()` per batch (`rebalance_execute._execute_migration_batches`).
//!
//! The scheduler keeps the unbatched path's choice of sender for every copy (ranks holding the
//! expert, ascending, each serving an equal block of the receivers plus one of the remainder),
//! so batching changes the order of the transfers, not their sources.
//!
//! An expert the new map needs but no rank holds is skipped here, exactly as vLLM does; epcomm's
//! rearrangement refuses such a layer before it schedules anything (see
//! [`super::transfer::plan_layer`]).

use std::collections::{BTreeMap, HashMap};

use crate::error::{Error, Result};

/// Expert transfers between one directed rank pair (vLLM's `MigrationFlow`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MigrationFlow {
    /// The rank that sends (holds the experts in the old map).
    pub src_rank: usize,
    /// The rank that receives (gains the experts in the new map).
    pub dst_rank: usize,
    /// The experts sent from `src_rank` to `dst_rank`, ascending.
    pub expert_ids: Vec<i64>,
}

/// Batches of flows; no rank appears in two flows of one batch.
pub type Batches = Vec<Vec<MigrationFlow>>;

fn assertion(cond: bool, what: impl FnOnce() -> String) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::Assertion(what()))
    }
}

/// The experts of one rank's block, without `-1` (vLLM's `set(...)` minus `{-1}`).
fn experts_of(block: &[i64]) -> Vec<i64> {
    let mut v: Vec<i64> = block.iter().copied().filter(|&e| e != -1).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// Per expert that some rank gains, the ranks gaining it (ascending) and the ranks holding it
/// in the old map (ascending). Experts ascending (vLLM's `sorted(recv_ranks_by_expert)`).
fn gains_and_holders(
    n_local: usize,
    old: &[i64],
    new: &[i64],
) -> BTreeMap<i64, (Vec<usize>, Vec<usize>)> {
    let olds: Vec<Vec<i64>> = old.chunks(n_local).map(experts_of).collect();
    let mut by_expert: BTreeMap<i64, (Vec<usize>, Vec<usize>)> = BTreeMap::new();
    for (rank, block) in new.chunks(n_local).enumerate() {
        for e in experts_of(block) {
            if olds[rank].binary_search(&e).is_err() {
                by_expert.entry(e).or_default().0.push(rank);
            }
        }
    }
    for (rank, held) in olds.iter().enumerate() {
        for e in held {
            if let Some(entry) = by_expert.get_mut(e) {
                entry.1.push(rank);
            }
        }
    }
    by_expert
}

/// The flows in vLLM's dict insertion order: experts ascending; per expert, senders in rank
/// order, each first taking its block of `len(recv) // len(send)` receivers, then one of the
/// remainder (divmod).
fn flows(n_local: usize, old: &[i64], new: &[i64]) -> Vec<MigrationFlow> {
    let mut out: Vec<MigrationFlow> = Vec::new();
    let mut index: HashMap<(usize, usize), usize> = HashMap::new();
    let mut add = |src: usize, dst: usize, e: i64| {
        let i = *index.entry((src, dst)).or_insert_with(|| {
            out.push(MigrationFlow {
                src_rank: src,
                dst_rank: dst,
                expert_ids: Vec::new(),
            });
            out.len() - 1
        });
        out[i].expert_ids.push(e);
    };
    for (e, (recv, send)) in gains_and_holders(n_local, old, new) {
        if send.is_empty() {
            // vLLM: `if not send_ranks: continue`.
            continue;
        }
        let (per_sender, remainder) = (recv.len() / send.len(), recv.len() % send.len());
        let remainder_start = send.len() * per_sender;
        for (i, &src) in send.iter().enumerate() {
            for &dst in &recv[i * per_sender..(i + 1) * per_sender] {
                add(src, dst, e);
            }
            if i < remainder {
                add(src, recv[remainder_start + i], e);
            }
        }
    }
    out
}

/// A set of ranks (vLLM uses a Python int as the endpoint mask, which has no width limit).
#[derive(Debug, Clone)]
struct RankSet(Vec<u64>);

impl RankSet {
    fn of(ranks: [usize; 2], words: usize) -> RankSet {
        let mut s = RankSet(vec![0; words]);
        for r in ranks {
            s.0[r / 64] |= 1 << (r % 64);
        }
        s
    }

    fn meets(&self, other: &RankSet) -> bool {
        self.0.iter().zip(&other.0).any(|(a, b)| a & b != 0)
    }

    fn add(&mut self, other: &RankSet) {
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            *a |= b;
        }
    }
}

/// vLLM's `schedule_migration_batches`: one layer's flows (from the old and new physical →
/// logical maps, `n_local` slots per rank, `-1` = empty slot) in batches, by deterministic
/// first-fit edge colouring: each flow, in insertion order, goes to the first batch using
/// neither of its ranks, else to a new batch. Experts that only move between the slots of one
/// rank need no transfer. vLLM's AssertionError when the maps differ in size; an InvalidArgument
/// when they do not split into blocks of `n_local` (numpy's reshape ValueError in vLLM).
pub fn schedule_migration_batches(n_local: usize, old: &[i64], new: &[i64]) -> Result<Batches> {
    assertion(old.len() == new.len(), || {
        format!(
            "old_indices.shape == new_indices.shape (({},) != ({},))",
            old.len(),
            new.len()
        )
    })?;
    if n_local == 0 || !old.len().is_multiple_of(n_local) {
        return Err(Error::InvalidArgument(format!(
            "cannot reshape a map of {} slots into blocks of {n_local} slots per rank",
            old.len()
        )));
    }
    let words = (old.len() / n_local).div_ceil(64).max(1);
    let mut batches: Batches = Vec::new();
    let mut used: Vec<RankSet> = Vec::new();
    for flow in flows(n_local, old, new) {
        let ends = RankSet::of([flow.src_rank, flow.dst_rank], words);
        match used.iter().position(|u| !u.meets(&ends)) {
            Some(b) => {
                used[b].add(&ends);
                batches[b].push(flow);
            }
            None => {
                used.push(ends);
                batches.push(vec![flow]);
            }
        }
    }
    Ok(batches)
}

/// vLLM's `schedule_migration_batches_for_layers`: every layer's schedule, each layer on its
/// own (no flow combines layers). The maps are `[layers][slots]`, both of one shape.
pub fn schedule_migration_batches_for_layers(
    n_local: usize,
    old: &[Vec<i64>],
    new: &[Vec<i64>],
) -> Result<Vec<Batches>> {
    let slots = old.first().map_or(0, Vec::len);
    let rect = |m: &[Vec<i64>]| m.iter().all(|l| l.len() == slots);
    assertion(old.len() == new.len() && rect(old) && rect(new), || {
        format!(
            "old_indices.shape == new_indices.shape ({} and {} layers, or rows of unequal length)",
            old.len(),
            new.len()
        )
    })?;
    old.iter()
        .zip(new)
        .map(|(o, n)| schedule_migration_batches(n_local, o, n))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_than_64_ranks() {
        // Rank 70 sends expert 0 to rank 1, rank 1 sends expert 1 to rank 130: they share
        // rank 1, so two batches (a u64 mask would alias rank 70 with rank 6, 130 with 2).
        let mut old = vec![-1i64; 131];
        let mut new = vec![-1i64; 131];
        (old[70], new[1]) = (0, 0);
        (old[1], new[130]) = (1, 1);
        (old[6], new[2]) = (2, 2);
        let b = schedule_migration_batches(1, &old, &new).unwrap();
        let ends: Vec<Vec<(usize, usize)>> = b
            .iter()
            .map(|f| f.iter().map(|f| (f.src_rank, f.dst_rank)).collect())
            .collect();
        assert_eq!(ends, vec![vec![(70, 1), (6, 2)], vec![(1, 130)]]);
    }
}
