//! The transfer plan of a rearrangement (vLLM's `rebalance_execute`): for one layer and one
//! rank, which slots stay, which are copied locally, which experts are sent where and received
//! from whom (vLLM's sender/receiver pairing, so mixed deployments agree), and which received
//! rows are duplicated. Scale-up and scale-down go through a rank mapping.

use crate::error::{Error, Result};

/// What one rank does for one layer. Rows are local slots `0..n_local`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerPlan {
    /// Slots whose expert does not change.
    pub unchanged: Vec<bool>,
    /// (destination slot, source slot): experts this rank already holds.
    pub local_copies: Vec<(usize, usize)>,
    /// (expert, source slot, destination rank), experts ascending, vLLM's order.
    pub sends: Vec<(i64, usize, usize)>,
    /// (expert, primary slot, source rank), experts ascending.
    pub recvs: Vec<(i64, usize, usize)>,
    /// (destination slot, primary slot): further slots of a received expert.
    pub duplicates: Vec<(usize, usize)>,
}

impl LayerPlan {
    /// Nothing moves.
    pub fn is_noop(&self) -> bool {
        self.unchanged.iter().all(|&u| u)
    }
}

/// Ranks holding `e` in `map` (slots of `n_local` per rank), ascending, unique.
fn ranks_with(map: &[i64], n_local: usize, e: i64) -> Vec<usize> {
    let mut v: Vec<usize> = Vec::new();
    for (slot, &x) in map.iter().enumerate() {
        let r = slot / n_local;
        if x == e && v.last() != Some(&r) {
            v.push(r);
        }
    }
    v
}

/// The plan of rank `rank` for one layer, from the old and new physical → logical maps (`-1`
/// = an empty slot). Both maps have `ranks * n_local` slots.
///
/// A new map that needs an expert no rank holds in the old map is an InvalidArgument error
/// ("expert {e} is needed on rank {r} but no rank holds it in the old placement"). vLLM
/// v0.33.0's `rebalance_execute` skips such an expert silently and later fills the slot from a
/// receive-buffer row nothing was written to; epcomm refuses the layer instead, so no slot ever
/// holds unwritten weights.
pub fn plan_layer(old: &[i64], new: &[i64], n_local: usize, rank: usize) -> Result<LayerPlan> {
    if old.len() != new.len() || n_local == 0 || !old.len().is_multiple_of(n_local) {
        return Err(Error::InvalidArgument(format!(
            "old and new maps must have the same number of slots, a multiple of the slots per rank ({n_local}); got {} and {}",
            old.len(),
            new.len()
        )));
    }
    let base = rank * n_local;
    if base + n_local > old.len() {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} has no slots in a map of {} slots ({n_local} per rank)",
            old.len()
        )));
    }
    let old_local = &old[base..base + n_local];
    let new_local = &new[base..base + n_local];
    let first_old_row = |e: i64| old_local.iter().position(|&x| x == e);
    let unchanged: Vec<bool> = (0..n_local).map(|i| old_local[i] == new_local[i]).collect();
    let received_locally: Vec<bool> = (0..n_local)
        .map(|i| unchanged[i] || (new_local[i] != -1 && old_local.contains(&new_local[i])))
        .collect();
    let mut p = LayerPlan {
        unchanged: unchanged.clone(),
        ..LayerPlan::default()
    };
    for i in 0..n_local {
        // A slot received locally holds an expert of the old local block: `first_old_row` finds it.
        if let (false, true, Some(src)) = (
            unchanged[i],
            received_locally[i],
            first_old_row(new_local[i]),
        ) {
            p.local_copies.push((i, src));
        }
    }
    let maps = Maps {
        old,
        new,
        n_local,
        rank,
    };
    p.sends = maps.sends(old_local);
    let (recvs, duplicates) = maps.recvs(new_local, &received_locally)?;
    p.recvs = recvs;
    p.duplicates = duplicates;
    Ok(p)
}

/// A rank's receives and duplicates, as in [`LayerPlan`].
type Receives = (Vec<(i64, usize, usize)>, Vec<(usize, usize)>);

/// One layer's old and new maps as one rank plans them.
struct Maps<'a> {
    old: &'a [i64],
    new: &'a [i64],
    n_local: usize,
    rank: usize,
}

impl Maps<'_> {
    /// vLLM's pairing for expert `e`: the ranks holding it before (senders) and the ranks that
    /// hold it only after (receivers), ascending.
    fn pairing(&self, e: i64) -> (Vec<usize>, Vec<usize>) {
        let s = ranks_with(self.old, self.n_local, e);
        let d: Vec<usize> = ranks_with(self.new, self.n_local, e)
            .into_iter()
            .filter(|r| !s.contains(r))
            .collect();
        (s, d)
    }

    /// Sends: every expert this rank held, ascending, from its first slot, to its share of the
    /// receivers.
    fn sends(&self, old_local: &[i64]) -> Vec<(i64, usize, usize)> {
        let mut held: Vec<(i64, usize)> = Vec::new();
        for (i, &e) in old_local.iter().enumerate() {
            if e >= 0 && !held.iter().any(|h| h.0 == e) {
                held.push((e, i));
            }
        }
        held.sort();
        let mut sends = Vec::new();
        for (e, row) in held {
            let (s, d) = self.pairing(e);
            if s.is_empty() || d.is_empty() {
                continue;
            }
            let k = d.len() / s.len();
            // `e` comes from this rank's old block, so the rank is among its holders `s`.
            let Some(pos) = s.iter().position(|&r| r == self.rank) else {
                continue;
            };
            for &dst in &d[pos * k..(pos + 1) * k] {
                sends.push((e, row, dst));
            }
            if let Some(&dst) = d.get(s.len() * k + pos) {
                sends.push((e, row, dst));
            }
        }
        sends
    }

    /// Receives: experts new to this rank, ascending, into their first slot (with the sender
    /// vLLM pairs it with); further slots of the same expert duplicate that slot.
    fn recvs(&self, new_local: &[i64], received_locally: &[bool]) -> Result<Receives> {
        let (mut primaries, mut duplicates): (Vec<(i64, usize)>, _) = (Vec::new(), Vec::new());
        for (i, &e) in new_local.iter().enumerate() {
            if received_locally[i] || e == -1 {
                continue;
            }
            match primaries.iter().find(|x| x.0 == e) {
                Some(&(_, primary)) => duplicates.push((i, primary)),
                None => primaries.push((e, i)),
            }
        }
        primaries.sort();
        let mut recvs = Vec::with_capacity(primaries.len());
        for (e, row) in primaries {
            let (s, d) = self.pairing(e);
            if s.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "expert {e} is needed on rank {} but no rank holds it in the old placement",
                    self.rank
                )));
            }
            let k = d.len() / s.len();
            let Some(q) = d.iter().position(|&r| r == self.rank) else {
                return Err(Error::Internal(format!(
                    "expert {e} is new to rank {} but the rank is not among its receivers",
                    self.rank
                )));
            };
            let src = if q < s.len() * k {
                s[q / k]
            } else {
                s[q - s.len() * k]
            };
            recvs.push((e, row, src));
        }
        Ok((recvs, duplicates))
    }
}

/// Which new ranks the surviving old ranks of a rank mapping take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NewRanks {
    /// Every rank `0..n`, one surviving old rank each: a scale-down (on the old group, or on
    /// the survivors' group after a failure).
    Exactly(usize),
    /// Distinct ranks below `n`; the others are new ranks that start empty: a scale-up.
    Below(usize),
}

/// The one check of a rank mapping (vLLM's: `mapping[old rank]` is the new rank, or -1 when the
/// old rank is removed), whatever uses it: at least one rank survives, every entry is -1 or a
/// rank below the new EP size, no two old ranks take the same new rank, and with
/// [`NewRanks::Exactly`] every new rank is taken. Reads no entry before it knows the length
/// is the caller's. Returns the removed old ranks, ascending.
pub fn check_rank_mapping(mapping: &[i64], new_ranks: NewRanks) -> Result<Vec<usize>> {
    let removed: Vec<usize> = (0..mapping.len()).filter(|&r| mapping[r] == -1).collect();
    if removed.len() == mapping.len() {
        return Err(Error::InvalidArgument(format!(
            "rank_mapping removes all of its {} ranks (every entry is -1); expected at least one surviving rank (an entry >= 0)",
            mapping.len()
        )));
    }
    let n = match new_ranks {
        NewRanks::Exactly(n) | NewRanks::Below(n) => n,
    };
    let mut taken = vec![None; n];
    for (r, &m) in mapping.iter().enumerate() {
        if m == -1 {
            continue;
        }
        let Some(slot) = usize::try_from(m).ok().and_then(|m| taken.get_mut(m)) else {
            return Err(Error::InvalidArgument(format!(
                "rank_mapping[{r}] is {m}; expected -1 (removed) or a rank below the new EP size {n}"
            )));
        };
        if let Some(first) = slot.replace(r) {
            return Err(Error::InvalidArgument(format!(
                "rank_mapping[{first}] and rank_mapping[{r}] are both {m}; every surviving rank needs a rank of its own"
            )));
        }
    }
    if let NewRanks::Exactly(n) = new_ranks {
        if let Some(gap) = taken.iter().position(Option::is_none) {
            return Err(Error::InvalidArgument(format!(
                "rank_mapping gives new rank {gap} to no surviving rank; expected the new ranks 0 to {} (the new EP size {n}) to be taken by one surviving rank each",
                n - 1
            )));
        }
    }
    Ok(removed)
}

/// `old_slots` slots as one block of `n_local` per entry of a rank mapping of `entries`
/// entries (checked before any entry is read).
fn check_blocks(old_slots: usize, n_local: usize, entries: usize) -> Result<()> {
    if n_local == 0 || !old_slots.is_multiple_of(n_local) || old_slots / n_local != entries {
        return Err(Error::InvalidArgument(format!(
            "the old placement has {old_slots} slots; expected one block of {n_local} slots per entry of the rank mapping ({entries} entries)"
        )));
    }
    Ok(())
}

/// Widens maps for a change of EP size. `mapping[old_rank]` is the new rank (or -1 if
/// removed; checked by [`check_rank_mapping`]). When `new` has no more ranks than `old`
/// (scale-down), the survivors take every new rank and `new` is widened to the old size
/// (removed ranks get empty slots); otherwise (scale-up) `old` is widened to the new size (new
/// ranks start empty). Returns (old, new) of equal size.
pub fn apply_rank_mapping(
    old: &[i64],
    new: &[i64],
    n_local: usize,
    mapping: &[i64],
) -> Result<(Vec<i64>, Vec<i64>)> {
    if n_local == 0 || !old.len().is_multiple_of(n_local) || !new.len().is_multiple_of(n_local) {
        return Err(Error::InvalidArgument(format!(
            "maps of {} and {} slots are not multiples of the slots per rank ({n_local})",
            old.len(),
            new.len()
        )));
    }
    let (old_ranks, new_ranks) = (old.len() / n_local, new.len() / n_local);
    if mapping.len() != old_ranks {
        return Err(Error::InvalidArgument(format!(
            "the rank mapping has {} entries; expected one per old rank ({old_ranks})",
            mapping.len()
        )));
    }
    let block = |map: &[i64], r: usize| map[r * n_local..(r + 1) * n_local].to_vec();
    if new_ranks <= old_ranks {
        check_rank_mapping(mapping, NewRanks::Exactly(new_ranks))?;
        // Scale-down (or same size): the new map in old-rank positions.
        let mut wide = vec![-1i64; old.len()];
        for (r, &m) in mapping.iter().enumerate() {
            if let Ok(m) = usize::try_from(m) {
                wide[r * n_local..(r + 1) * n_local].copy_from_slice(&block(new, m));
            }
        }
        Ok((old.to_vec(), wide))
    } else {
        check_rank_mapping(mapping, NewRanks::Below(new_ranks))?;
        // Scale-up: the old map in new-rank positions.
        let mut wide = vec![-1i64; new.len()];
        for (r, &m) in mapping.iter().enumerate() {
            if let Ok(m) = usize::try_from(m) {
                wide[m * n_local..(m + 1) * n_local].copy_from_slice(&block(old, r));
            }
        }
        Ok((wide, new.to_vec()))
    }
}

/// The logical experts of one layer's old placement (`old`: physical → logical, `n_local`
/// slots per old rank, one block per entry of `rank_mapping`) that have no replica on a
/// surviving rank (`rank_mapping[r] >= 0`): after a failure their weights are gone. Sorted,
/// unique; `-1` slots are no expert. The mapping is checked as the rearrangement after the
/// failure checks it ([`check_rank_mapping`]): the survivors take the new ranks 0 to
/// (survivors - 1), one each.
pub fn lost_experts(old: &[i64], n_local: usize, rank_mapping: &[i64]) -> Result<Vec<i64>> {
    check_blocks(old.len(), n_local, rank_mapping.len())?;
    let survivors = rank_mapping.iter().filter(|&&m| m != -1).count();
    check_rank_mapping(rank_mapping, NewRanks::Exactly(survivors))?;
    let survives = |slot: usize| rank_mapping[slot / n_local] >= 0;
    let kept: Vec<i64> = (0..old.len())
        .filter(|&s| survives(s))
        .map(|s| old[s])
        .collect();
    let mut lost: Vec<i64> = old
        .iter()
        .copied()
        .filter(|&e| e >= 0 && !kept.contains(&e))
        .collect();
    lost.sort_unstable();
    lost.dedup();
    Ok(lost)
}

/// The old placement of a scale-down after a failure, as the group of survivors holds it: the
/// block of each surviving old rank `r` moves to new rank `rank_mapping[r]`; the blocks of
/// removed ranks are gone (vLLM's `_map_old_expert_indices_with_rank_mapping` with the new EP
/// size). Returns the map of `new_ranks * n_local` slots and the removed old ranks.
pub fn survivors_placement(
    old: &[i64],
    n_local: usize,
    rank_mapping: &[i64],
    new_ranks: usize,
) -> Result<(Vec<i64>, Vec<usize>)> {
    check_blocks(old.len(), n_local, rank_mapping.len())?;
    let removed = check_rank_mapping(rank_mapping, NewRanks::Exactly(new_ranks))?;
    let mut map = vec![-1i64; new_ranks * n_local];
    for (r, &m) in rank_mapping.iter().enumerate() {
        if let Ok(m) = usize::try_from(m) {
            map[m * n_local..(m + 1) * n_local]
                .copy_from_slice(&old[r * n_local..(r + 1) * n_local]);
        }
    }
    Ok((map, removed))
}

/// The logical experts `new` places that no slot of `old` holds (maps of the same group),
/// sorted, unique.
pub fn unsourced_experts(old: &[i64], new: &[i64]) -> Vec<i64> {
    let mut v: Vec<i64> = new
        .iter()
        .copied()
        .filter(|&e| e >= 0 && !old.contains(&e))
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_maps_move_nothing() {
        let m = [0, 1, 2, 3];
        for r in 0..2 {
            let p = plan_layer(&m, &m, 2, r).unwrap();
            assert!(p.is_noop());
            assert!(p.sends.is_empty() && p.recvs.is_empty() && p.local_copies.is_empty());
        }
    }

    #[test]
    fn pairing_matches_vllm() {
        // Expert 0 held by ranks 0 and 1; needed additionally on ranks 2, 3, 4 (k = 1, one
        // extra): rank 0 serves D[0] = 2 and D[2] = 4, rank 1 serves D[1] = 3.
        let old = [0, 5, 0, 6, 7, 8, 9, 10, 11, 12];
        let new = [0, 5, 0, 6, 0, 8, 0, 10, 0, 12];
        let sends = |r| plan_layer(&old, &new, 2, r).unwrap().sends;
        assert_eq!(sends(0), vec![(0, 0, 2), (0, 0, 4)]);
        assert_eq!(sends(1), vec![(0, 0, 3)]);
        let recvs = |r| plan_layer(&old, &new, 2, r).unwrap().recvs;
        assert_eq!(recvs(2), vec![(0, 0, 0)]);
        assert_eq!(recvs(3), vec![(0, 0, 1)]);
        assert_eq!(recvs(4), vec![(0, 0, 0)]);
    }

    #[test]
    fn local_copies_and_duplicates() {
        // Rank 0: old [1, 2], new [2, 3]; rank 1: old [3, 4], new [3, 3]... as a 2-rank map.
        let old = [1, 2, 3, 4];
        let new = [2, 3, 4, 4];
        let p0 = plan_layer(&old, &new, 2, 0).unwrap();
        assert_eq!(p0.local_copies, vec![(0, 1)]);
        assert_eq!(p0.recvs, vec![(3, 1, 1)]);
        let p1 = plan_layer(&old, &new, 2, 1).unwrap();
        assert_eq!(p1.local_copies, vec![(0, 1)]);
        assert_eq!(p1.sends, vec![(3, 0, 0)]);
        // Two new slots of the same expert: one receive, one duplicate.
        let old = [1, 2, 3, 4];
        let new = [3, 3, 4, 1];
        let p0 = plan_layer(&old, &new, 2, 0).unwrap();
        assert_eq!(p0.recvs, vec![(3, 0, 1)]);
        assert_eq!(p0.duplicates, vec![(1, 0)]);
    }

    #[test]
    fn rank_mapping_scale_down_and_up() {
        // Scale-down 3 -> 2 ranks, rank 1 removed.
        let (o, n) =
            apply_rank_mapping(&[0, 1, 2, 3, 4, 5], &[0, 1, 4, 5], 2, &[0, -1, 1]).unwrap();
        assert_eq!(o, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(n, vec![0, 1, -1, -1, 4, 5]);
        // Scale-up 2 -> 3 ranks.
        let (o, n) = apply_rank_mapping(&[0, 1, 2, 3], &[0, 1, 2, 3, 1, 2], 2, &[0, 1]).unwrap();
        assert_eq!(o, vec![0, 1, 2, 3, -1, -1]);
        assert_eq!(n, vec![0, 1, 2, 3, 1, 2]);
        assert!(apply_rank_mapping(&[0, 1], &[0, 1], 2, &[0, 1]).is_err());
    }

    /// vLLM skips an expert no rank holds (and fills its slot from an unwritten buffer row);
    /// epcomm refuses the layer on the rank that needs it, and plans the others as usual.
    #[test]
    fn an_expert_nobody_holds_is_refused() {
        let (old, new) = ([0, 1, 2, 3], [0, 1, 2, 4]);
        let e = plan_layer(&old, &new, 2, 1).unwrap_err();
        assert_eq!(
            e.to_string(),
            "expert 4 is needed on rank 1 but no rank holds it in the old placement"
        );
        assert_eq!(e.exception(), "ValueError");
        assert!(plan_layer(&old, &new, 2, 0).unwrap().is_noop());
    }

    /// The mappings the docs call invalid fail wherever a mapping is used, with one message.
    #[test]
    fn invalid_rank_mappings_fail_alike_everywhere() {
        let dup = "rank_mapping[0] and rank_mapping[1] are both 0; every surviving rank needs a rank of its own";
        let none = "rank_mapping removes all of its 3 ranks (every entry is -1); expected at least one surviving rank (an entry >= 0)";
        let old = [0, 1, 2, 3, 4, 5];
        for (mapping, want) in [(&[0, 0, 1], dup), (&[-1, -1, -1], none)] {
            let scale_down = apply_rank_mapping(&old, &[0, 1, 2, 3], 2, mapping).unwrap_err();
            let scale_up = apply_rank_mapping(&old, &[0; 8], 2, mapping).unwrap_err();
            let after_failure = survivors_placement(&old, 2, mapping, 2).unwrap_err();
            let lost = lost_experts(&old, 2, mapping).unwrap_err();
            for e in [scale_down, scale_up, after_failure, lost] {
                assert_eq!(e.to_string(), want);
                assert_eq!(e.status(), crate::error::Status::InvalidArgument);
            }
        }
        // Not dense: new rank 1 is nobody's (a scale-down to 2 ranks, or 2 survivors).
        let e = apply_rank_mapping(&old, &[0, 1, 2, 3], 2, &[0, -1, -1]).unwrap_err();
        assert_eq!(e.to_string(), "rank_mapping gives new rank 1 to no surviving rank; expected the new ranks 0 to 1 (the new EP size 2) to be taken by one surviving rank each");
        let e = lost_experts(&old, 2, &[0, 2, -1]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank_mapping[1] is 2; expected -1 (removed) or a rank below the new EP size 2"
        );
        let e = apply_rank_mapping(&old, &[0; 8], 2, &[0, 1, -2]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank_mapping[2] is -2; expected -1 (removed) or a rank below the new EP size 4"
        );
        // A scale-up leaves ranks to the newcomers, in any position.
        let (o, _) = apply_rank_mapping(&[0, 1], &[0; 3], 1, &[2, 0]).unwrap();
        assert_eq!(o, vec![1, -1, 0]);
        // A length that is not the caller's is refused before any entry is read.
        let e = lost_experts(&old, 2, &[0; 2]).unwrap_err();
        assert_eq!(e.to_string(), "the old placement has 6 slots; expected one block of 2 slots per entry of the rank mapping (2 entries)");
    }

    #[test]
    fn lost_experts_are_those_without_a_surviving_replica() {
        // 3 ranks of 2 slots; rank 1 dies: expert 2 had replicas on ranks 1 only, 1 on 0 and 1.
        let old = [0, 1, 1, 2, 3, 0];
        assert_eq!(lost_experts(&old, 2, &[0, -1, 1]).unwrap(), vec![2]);
        assert_eq!(
            lost_experts(&old, 2, &[0, 1, 2]).unwrap(),
            Vec::<i64>::new()
        );
        assert_eq!(lost_experts(&old, 2, &[-1, -1, 0]).unwrap(), vec![1, 2]);
        let e = lost_experts(&old, 2, &[0, 0, 1]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank_mapping[0] and rank_mapping[1] are both 0; every surviving rank needs a rank of its own"
        );
        let e = lost_experts(&old, 2, &[0, 1]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the old placement has 6 slots; expected one block of 2 slots per entry of the rank mapping (2 entries)"
        );
    }

    #[test]
    fn the_survivors_placement_renumbers_in_order() {
        let old = [0, 1, 1, 2, 3, 0];
        let (m, removed) = survivors_placement(&old, 2, &[0, -1, 1], 2).unwrap();
        assert_eq!((m, removed), (vec![0, 1, 3, 0], vec![1]));
        let e = survivors_placement(&old, 2, &[0, -1, 1], 3).unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank_mapping gives new rank 2 to no surviving rank; expected the new ranks 0 to 2 (the new EP size 3) to be taken by one surviving rank each"
        );
        let e = survivors_placement(&old, 2, &[0, -1, 2], 2).unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank_mapping[2] is 2; expected -1 (removed) or a rank below the new EP size 2"
        );
        assert_eq!(unsourced_experts(&[0, 1, 3, 0], &[2, 0, 1, 7]), vec![2, 7]);
    }
}
