//! vLLM's default EPLB policy (DeepSeek's algorithm, `DefaultEplbPolicy`), bit for bit:
//! balanced packing, replication by load per replica, the hierarchical placement (groups to
//! nodes, replicas within nodes, replicas to GPUs), the global fallback, keeping experts in
//! their old GPU slots, and the logical maps.
//!
//! Arithmetic follows vLLM's numpy code: loads are float32, sums over a group use numpy's
//! pairwise float32 summation, load per replica and pack weights are float64, sorts are stable
//! descending (equal loads keep ascending index), and ties pick the first minimum/maximum.

use crate::error::{Error, Result};
use crate::log;

/// numpy's pairwise summation of a contiguous float32 array (`np.sum`), so group loads round
/// exactly as vLLM's do even past 2^24 tokens.
pub fn np_sum_f32(a: &[f32]) -> f32 {
    const BLOCK: usize = 128;
    let n = a.len();
    if n < 8 {
        let mut res = 0f32;
        for &x in a {
            res += x;
        }
        res
    } else if n <= BLOCK {
        let mut r = [0f32; 8];
        r.copy_from_slice(&a[..8]);
        let mut i = 8;
        while i < n - (n % 8) {
            for j in 0..8 {
                r[j] += a[i + j];
            }
            i += 8;
        }
        let mut res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        while i < n {
            res += a[i];
            i += 1;
        }
        res
    } else {
        let mut n2 = n / 2;
        n2 -= n2 % 8;
        np_sum_f32(&a[..n2]) + np_sum_f32(&a[n2..])
    }
}

/// Packs `n` weighted items of each row into `m` packs of `n/m` items, heaviest first, each to
/// the lightest pack that still has room. Returns (pack index, rank in pack) per item.
pub fn balanced_packing(weights: &[Vec<f64>], m: usize) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
    let mut packs = Vec::with_capacity(weights.len());
    let mut ranks = Vec::with_capacity(weights.len());
    for w in weights {
        let n = w.len();
        debug_assert!(m > 0 && n % m == 0);
        let per = n / m;
        if per == 1 {
            packs.push((0..n).collect());
            ranks.push(vec![0; n]);
            continue;
        }
        let mut order: Vec<usize> = (0..n).collect();
        // Stable descending: equal weights keep ascending index.
        order.sort_by(|&a, &b| w[b].total_cmp(&w[a]));
        let mut pack_w = vec![0f64; m];
        let mut pack_n = vec![0usize; m];
        let (mut pi, mut rk) = (vec![0usize; n], vec![0usize; n]);
        for &item in &order {
            let mut best = usize::MAX;
            for p in 0..m {
                if pack_n[p] < per && (best == usize::MAX || pack_w[p] < pack_w[best]) {
                    best = p;
                }
            }
            pi[item] = best;
            rk[item] = pack_n[best];
            pack_w[best] += w[item];
            pack_n[best] += 1;
        }
        packs.push(pi);
        ranks.push(rk);
    }
    (packs, ranks)
}

/// Replicates experts of each row into `num_phy` slots: the first slots are the experts
/// themselves; each extra slot goes to the expert with the largest load per replica.
/// Returns (physical → logical, replica count per logical).
pub fn replicate_experts(
    weights: &[Vec<f32>],
    num_phy: usize,
) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
    let mut p2l = Vec::with_capacity(weights.len());
    let mut cnts = Vec::with_capacity(weights.len());
    for w in weights {
        let nl = w.len();
        let mut map: Vec<usize> = (0..nl).collect();
        let mut cnt = vec![1usize; nl];
        // Load per replica, updated only for the expert that gains a replica (same division,
        // so the same float64 values as recomputing them all).
        let mut per_replica: Vec<f64> = w.iter().map(|&x| x as f64).collect();
        for _ in nl..num_phy {
            let mut best = 0;
            let mut best_v = f64::NEG_INFINITY;
            for (e, &v) in per_replica.iter().enumerate() {
                if v > best_v {
                    best_v = v;
                    best = e;
                }
            }
            map.push(best);
            cnt[best] += 1;
            per_replica[best] = w[best] as f64 / cnt[best] as f64;
        }
        p2l.push(map);
        cnts.push(cnt);
    }
    (p2l, cnts)
}

fn inverse(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    inv
}

fn assertion(cond: bool, what: &str) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::Assertion(what.to_owned()))
    }
}

/// The hierarchical policy for `weight` (`layers` rows of `num_logical` f32 loads):
/// `num_physical` slots, `num_groups` expert groups, `num_nodes` nodes, `num_gpus` GPUs.
/// Returns physical → logical per layer.
pub fn rebalance_hierarchical(
    weight: &[Vec<f32>],
    num_physical: usize,
    num_groups: usize,
    num_nodes: usize,
    num_gpus: usize,
) -> Result<Vec<Vec<usize>>> {
    let e = weight.first().map_or(0, Vec::len);
    let (p, g, n, r) = (num_physical, num_groups, num_nodes, num_gpus);
    assertion(
        g > 0 && e % g == 0,
        &format!("num_logical_experts % num_groups == 0 ({e} % {g})"),
    )?;
    assertion(
        n > 0 && g % n == 0,
        &format!("num_groups % num_nodes == 0 ({g} % {n})"),
    )?;
    assertion(
        r > 0 && r % n == 0,
        &format!("num_gpus % num_nodes == 0 ({r} % {n})"),
    )?;
    assertion(
        p % r == 0,
        &format!("num_physical_experts % num_gpus == 0 ({p} % {r})"),
    )?;
    assertion(
        p >= e,
        &format!("num_physical_experts >= num_logical_experts ({p} >= {e})"),
    )?;
    let gs = e / g;
    let gpn = g / n;
    let ppg = p / r;
    let (en, pn) = (e / n, p / n);

    // 1. Groups onto nodes by group load.
    let group_load: Vec<Vec<f64>> = weight
        .iter()
        .map(|w| w.chunks(gs).map(|c| np_sum_f32(c) as f64).collect())
        .collect();
    let (gpi, grk) = balanced_packing(&group_load, n);
    let mut mlog2log = Vec::with_capacity(weight.len());
    for l in 0..weight.len() {
        let log2mlog: Vec<usize> = (0..e)
            .map(|x| {
                let grp = x / gs;
                (gpi[l][grp] * gpn + grk[l][grp]) * gs + x % gs
            })
            .collect();
        mlog2log.push(inverse(&log2mlog));
    }

    // 2. Replicas within each node.
    let tpm: Vec<Vec<f32>> = (0..weight.len() * n)
        .map(|b| {
            let (l, node) = (b / n, b % n);
            (0..en)
                .map(|i| weight[l][mlog2log[l][node * en + i]])
                .collect()
        })
        .collect();
    let (phy2mlog, mlogcnt) = replicate_experts(&tpm, pn);

    // 3. Physical experts onto the node's GPUs by load per replica.
    let tpp: Vec<Vec<f64>> = (0..tpm.len())
        .map(|b| {
            phy2mlog[b]
                .iter()
                .map(|&m| tpm[b][m] as f64 / mlogcnt[b][m] as f64)
                .collect()
        })
        .collect();
    let (pi, rk) = balanced_packing(&tpp, r / n);
    let pphy2phy: Vec<Vec<usize>> = (0..tpp.len())
        .map(|b| {
            inverse(
                &(0..pn)
                    .map(|x| pi[b][x] * ppg + rk[b][x])
                    .collect::<Vec<_>>(),
            )
        })
        .collect();

    // 4. Compose back to logical ids.
    Ok((0..weight.len())
        .map(|l| {
            (0..p)
                .map(|slot| {
                    let (node, q) = (slot / pn, slot % pn);
                    let b = l * n + node;
                    let mlog = phy2mlog[b][pphy2phy[b][q]] + node * en;
                    mlog2log[l][mlog]
                })
                .collect()
        })
        .collect())
}

/// Keeps experts that stay on a GPU in their old slots (first unused match); the others fill
/// the free slots in order. Only reorders within each GPU's block.
pub fn preserve_intragpu_slots(new: &mut [Vec<usize>], num_gpus: usize, old: &[Vec<usize>]) {
    let p = new.first().map_or(0, Vec::len);
    if num_gpus == 0 || p % num_gpus != 0 {
        return;
    }
    let s = p / num_gpus;
    for (row, old_row) in new.iter_mut().zip(old) {
        for gpu in 0..num_gpus {
            let block = &row[gpu * s..(gpu + 1) * s];
            let old_block = &old_row[gpu * s..(gpu + 1) * s];
            let mut used = vec![false; s];
            let mut out: Vec<Option<usize>> = vec![None; s];
            for (slot, &want) in old_block.iter().enumerate() {
                if let Some(j) = (0..s).find(|&j| !used[j] && block[j] == want) {
                    used[j] = true;
                    out[slot] = Some(want);
                }
            }
            let mut rest = (0..s).filter(|&j| !used[j]).map(|j| block[j]);
            let filled: Vec<usize> = out
                .into_iter()
                .map(|o| o.unwrap_or_else(|| rest.next().expect("as many free slots as unused")))
                .collect();
            row[gpu * s..(gpu + 1) * s].copy_from_slice(&filled);
        }
    }
}

/// The caller's warning when GPUs do not divide into nodes (vLLM's text).
pub fn nodes_warning(num_gpus: usize, num_nodes: usize) -> String {
    format!(
        "num_gpus % num_nodes != 0, not using hierarchical rearrangement algorithm.\nnum_gpus={num_gpus}, num_nodes={num_nodes}"
    )
}

/// vLLM's `rebalance_experts`: `weight` holds integer token counts per logical expert and
/// layer (converted to float32 as vLLM does). Falls back to one node (with vLLM's warning) when
/// GPUs do not divide into nodes, and to the global policy when groups do not divide into
/// nodes; keeps old slots when `old` is given. Returns physical → logical per layer.
pub fn rebalance_experts(
    weight: &[Vec<f32>],
    num_replicas: usize,
    num_groups: usize,
    num_nodes: usize,
    num_gpus: usize,
    old: Option<&[Vec<usize>]>,
) -> Result<Vec<Vec<usize>>> {
    let mut nodes = num_nodes;
    if nodes == 0 || num_gpus % nodes != 0 {
        log::log_once(log::Level::Warn, &nodes_warning(num_gpus, num_nodes));
        nodes = 1;
    }
    let mut map = if num_groups > 0 && num_groups % nodes == 0 {
        rebalance_hierarchical(weight, num_replicas, num_groups, nodes, num_gpus)?
    } else {
        rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)?
    };
    if let Some(old) = old {
        preserve_intragpu_slots(&mut map, num_gpus, old);
    }
    Ok(map)
}

/// Replica counts per logical expert and the logical → physical map (ascending slots, padded
/// with -1 to the largest replica count of any expert in any layer).
pub fn compute_logical_maps(
    phy2log: &[Vec<usize>],
    num_logical: usize,
) -> (Vec<Vec<usize>>, Vec<Vec<Vec<i64>>>) {
    let counts: Vec<Vec<usize>> = phy2log
        .iter()
        .map(|row| {
            let mut c = vec![0; num_logical];
            for &e in row {
                c[e] += 1;
            }
            c
        })
        .collect();
    let width = counts.iter().flatten().copied().max().unwrap_or(0);
    let maps = phy2log
        .iter()
        .map(|row| {
            let mut m = vec![vec![-1i64; width]; num_logical];
            let mut fill = vec![0usize; num_logical];
            for (slot, &e) in row.iter().enumerate() {
                m[e][fill[e]] = slot as i64;
                fill[e] += 1;
            }
            m
        })
        .collect();
    (counts, maps)
}

/// The smallest number of redundant experts that makes the physical experts divisible by the
/// EP size.
pub fn min_redundant_experts(num_logical: usize, ep_size: usize) -> usize {
    if ep_size == 0 {
        0
    } else {
        (ep_size - num_logical % ep_size) % ep_size
    }
}
