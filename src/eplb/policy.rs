//! vLLM's default EPLB policy (DeepSeek's algorithm, `DefaultEplbPolicy` of v0.33.0): balanced
//! packing, replication by load per replica, the hierarchical placement (groups to nodes,
//! replicas within nodes, replicas to GPUs), the global fallback, keeping experts in their old
//! GPU slots, and the logical maps; each step is its own public function, as vLLM's classmethods.
//!
//! Arithmetic follows vLLM's numpy code: loads are float32, sums over a group use numpy's
//! pairwise float32 summation, load per replica and pack weights are float64, and ties pick the
//! first minimum/maximum. The one deliberate difference is the packing order: vLLM sorts with
//! numpy's default `np.argsort(-weight)`, which is not stable (on x86 numpy dispatches it to SIMD
//! sorting networks, so vLLM's own order of tied loads depends on the CPU and numpy version);
//! epcomm sorts stably (equal loads keep ascending index), so its result is the same on every
//! machine and equals vLLM's with `kind="stable"`. Without ties in the packed loads the result
//! is vLLM's, bit for bit; with ties it is one of the placements vLLM can return.
//!
//! Layers whose loads are all +0.0 to +inf (token counts) take a fast path (`fast`) that makes
//! the same comparisons on integer keys; the others, and the per-step functions, take the
//! general one. Both are checked against a plain transcription of vLLM's code.

use crate::error::{Error, Result};
use crate::log;

mod fast;

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

/// The balanced packing's reusable buffers (a rebalance allocates once, not per row).
#[derive(Default)]
struct Packer {
    keys: Vec<u128>,
    pack_w: Vec<f64>,
    pack_n: Vec<usize>,
    free_w: Vec<f64>,
}

/// The replication's reusable buffers and its result for the last row: physical → logical
/// (`phy2mlog`) and replicas per logical (`mlogcnt`).
#[derive(Default)]
struct Replicas {
    per_replica: Vec<f64>,
    phy2mlog: Vec<usize>,
    mlogcnt: Vec<usize>,
}

/// Orders f64 like `total_cmp`, descending, with ascending index on ties: the order of
/// vLLM's stable descending sort, as one integer key (unique, so an unstable sort is exact).
#[inline]
fn desc_key(w: f64, index: usize) -> u128 {
    let b = w.to_bits() as i64;
    let ordered = (b ^ ((((b >> 63) as u64) >> 1) as i64)) as u64 ^ (1 << 63);
    ((!ordered as u128) << 64) | index as u128
}

impl Packer {
    /// Packs the `n` weighted items `w` into `m` packs of `n/m` items, heaviest first, each to the
    /// lightest pack that still has room (the first such on ties). Writes (pack, rank in pack) per
    /// item into `pi`/`rk`.
    fn pack(&mut self, w: &[f64], m: usize, pi: &mut Vec<usize>, rk: &mut Vec<usize>) {
        let n = w.len();
        debug_assert!(m > 0 && n.is_multiple_of(m));
        let per = n / m;
        pi.clear();
        rk.clear();
        if per == 1 {
            pi.extend(0..n);
            rk.resize(n, 0);
            return;
        }
        pi.resize(n, 0);
        rk.resize(n, 0);
        self.keys.clear();
        self.keys
            .extend(w.iter().enumerate().map(|(i, &x)| desc_key(x, i)));
        self.keys.sort_unstable();
        self.pack_w.clear();
        self.pack_w.resize(m, 0.0);
        self.pack_n.clear();
        self.pack_n.resize(m, 0);
        // Weights of packs with room; a full pack reads +inf so a plain first-minimum scan skips
        // it. If the minimum is itself +inf (overflowed sums), fall back to the exact rule.
        self.free_w.clear();
        self.free_w.resize(m, 0.0);
        for &key in &self.keys {
            let item = key as u64 as usize;
            let mut best = 0;
            for p in 1..m {
                if self.free_w[p] < self.free_w[best] {
                    best = p;
                }
            }
            if self.pack_n[best] >= per {
                best = (0..m)
                    .filter(|&p| self.pack_n[p] < per)
                    .fold(usize::MAX, |b, p| {
                        if b == usize::MAX || self.pack_w[p] < self.pack_w[b] {
                            p
                        } else {
                            b
                        }
                    });
            }
            pi[item] = best;
            rk[item] = self.pack_n[best];
            self.pack_w[best] += w[item];
            self.pack_n[best] += 1;
            self.free_w[best] = if self.pack_n[best] < per {
                self.pack_w[best]
            } else {
                f64::INFINITY
            };
        }
    }
}

impl Replicas {
    /// Replicates the experts `w` into `num_phy` slots: the first slots are the experts
    /// themselves; each extra slot goes to the expert with the largest load per replica (the first
    /// on ties). Fills `phy2mlog` (physical → logical) and `mlogcnt` (replicas per logical).
    fn replicate(&mut self, w: &[f64], num_phy: usize) {
        let nl = w.len();
        self.phy2mlog.clear();
        self.phy2mlog.extend(0..nl);
        self.mlogcnt.clear();
        self.mlogcnt.resize(nl, 1);
        // Load per replica, updated only for the expert that gains a replica (same division, so
        // the same float64 values as recomputing them all).
        self.per_replica.clear();
        self.per_replica.extend_from_slice(w);
        for _ in nl..num_phy {
            let mut best = 0;
            let mut best_v = f64::NEG_INFINITY;
            for (e, &v) in self.per_replica.iter().enumerate() {
                if v > best_v {
                    best_v = v;
                    best = e;
                }
            }
            self.phy2mlog.push(best);
            self.mlogcnt[best] += 1;
            self.per_replica[best] = w[best] / self.mlogcnt[best] as f64;
        }
    }
}

fn assertion(cond: bool, what: impl FnOnce() -> String) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(Error::Assertion(what()))
    }
}

/// The common length of the rows of a 2-D argument (vLLM's arrays are rectangular; ragged rows
/// are a ValueError naming the row).
fn row_len<T>(rows: &[Vec<T>], what: &str) -> Result<usize> {
    let n = rows.first().map_or(0, Vec::len);
    match rows.iter().position(|r| r.len() != n) {
        None => Ok(n),
        Some(bad) => Err(Error::InvalidArgument(format!(
            "{what} row {bad} has {} entries; row 0 has {n}",
            rows[bad].len()
        ))),
    }
}

/// Two per-row index arrays: (pack index, rank in pack) or (physical → logical, replicas per
/// logical).
pub type Pairs = (Vec<Vec<usize>>, Vec<Vec<usize>>);

/// vLLM's `balanced_packing`: packs the `n` weighted items of each row of `weight` into
/// `num_packs` packs of `n / num_packs` items, heaviest first, each to the lightest pack that
/// still has room (the first such on ties). Returns (pack index, rank in pack) per item. Equal
/// weights are taken in ascending index (a stable sort; see the module doc).
pub fn balanced_packing(weight: &[Vec<f64>], num_packs: usize) -> Result<Pairs> {
    let n = row_len(weight, "weight")?;
    assertion(num_packs > 0 && n % num_packs == 0, || {
        format!("num_groups % num_packs == 0 ({n} % {num_packs})")
    })?;
    let mut packer = Packer::default();
    let (mut packs, mut ranks) = (
        Vec::with_capacity(weight.len()),
        Vec::with_capacity(weight.len()),
    );
    for w in weight {
        let (mut pi, mut rk) = (Vec::new(), Vec::new());
        packer.pack(w, num_packs, &mut pi, &mut rk);
        packs.push(pi);
        ranks.push(rk);
    }
    Ok((packs, ranks))
}

/// vLLM's `replicate_experts`: replicates the experts of each row of `weight` into `num_phy`
/// slots; the first slots are the experts themselves, each extra slot goes to the expert with
/// the largest load per replica (the first on ties). Returns (physical → logical, replicas per
/// logical).
pub fn replicate_experts(weight: &[Vec<f64>], num_phy: usize) -> Result<Pairs> {
    let num_log = row_len(weight, "weight")?;
    assertion(num_phy >= num_log, || {
        format!("num_redundant >= 0 ({num_phy} - {num_log})")
    })?;
    if num_log == 0 && !weight.is_empty() {
        let rows = no_experts(weight.len(), num_phy)?;
        return Ok((rows, vec![Vec::new(); weight.len()]));
    }
    let mut reps = Replicas::default();
    let (mut phy2log, mut logcnt) = (
        Vec::with_capacity(weight.len()),
        Vec::with_capacity(weight.len()),
    );
    for w in weight {
        reps.replicate(w, num_phy);
        phy2log.push(reps.phy2mlog.clone());
        logcnt.push(reps.mlogcnt.clone());
    }
    Ok((phy2log, logcnt))
}

/// vLLM's `rebalance_experts_hierarchical` for `weight` (`layers` rows of `num_logical` f32
/// loads): `num_physical` slots, `num_groups` expert groups, `num_nodes` nodes, `num_gpus` GPUs.
/// Returns physical → logical per layer. vLLM's asserts are AssertionErrors in its order (vLLM's
/// bare `assert` has no text; epcomm's message is the asserted condition with its values).
pub fn rebalance_hierarchical(
    weight: &[Vec<f32>],
    num_physical: usize,
    num_groups: usize,
    num_nodes: usize,
    num_gpus: usize,
) -> Result<Vec<Vec<usize>>> {
    let e = row_len(weight, "weight")?;
    let dims = check_dims(e, num_physical, num_groups, num_nodes, num_gpus)?;
    if e == 0 && !weight.is_empty() {
        return no_experts(weight.len(), num_physical);
    }
    // Layers are independent: only large policies are split over threads (same result), as a
    // thread that waits for a core on a busy machine costs more than a small policy.
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(MAX_POLICY_THREADS)
        .min(weight.len() * dims.p / MIN_SLOTS_PER_THREAD);
    Ok(place_threads(weight, dims, threads))
}

/// vLLM with no logical experts: empty rows without slots, else numpy's argmax error (its
/// replication takes the argmax over no experts).
fn no_experts(layers: usize, num_physical: usize) -> Result<Vec<Vec<usize>>> {
    if num_physical == 0 {
        Ok(vec![Vec::new(); layers])
    } else {
        Err(Error::InvalidArgument(
            "attempt to get argmax of an empty sequence".into(),
        ))
    }
}

/// [`place_layers`] split over `threads` threads (if more than one start).
fn place_threads(weight: &[Vec<f32>], dims: Dims, threads: usize) -> Vec<Vec<usize>> {
    if threads > 1 {
        let chunk = weight.len().div_ceil(threads);
        let parts: Option<Vec<Vec<Vec<usize>>>> = std::thread::scope(|sc| {
            let handles: Vec<_> = weight
                .chunks(chunk)
                .map(|c| {
                    std::thread::Builder::new()
                        .name("epcomm-eplb".into())
                        .spawn_scoped(sc, move || place_layers(c, dims))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.ok().and_then(|h| h.join().ok()))
                .collect()
        });
        // A thread that could not start (resource limits) only costs time: redo serially.
        if let Some(parts) = parts {
            return parts.into_iter().flatten().collect();
        }
    }
    place_layers(weight, dims)
}

/// vLLM's asserts of the hierarchical step, in its order, for `e` logical experts, `p` slots,
/// `g` groups, `n` nodes and `r` GPUs.
fn check_dims(e: usize, p: usize, g: usize, n: usize, r: usize) -> Result<Dims> {
    assertion(g > 0 && e.is_multiple_of(g), || {
        format!("num_logical_experts % num_groups == 0 ({e} % {g})")
    })?;
    assertion(n > 0 && g.is_multiple_of(n), || {
        format!("num_groups % num_nodes == 0 ({g} % {n})")
    })?;
    assertion(r > 0 && r.is_multiple_of(n), || {
        format!("num_gpus % num_nodes == 0 ({r} % {n})")
    })?;
    assertion(p.is_multiple_of(r), || {
        format!("num_physical_experts % num_gpus == 0 ({p} % {r})")
    })?;
    assertion(p >= e, || {
        format!("num_physical_experts >= num_logical_experts ({p} >= {e})")
    })?;
    Ok(Dims { e, p, g, n, r })
}

/// Above this many physical slots per thread (layers × P), the policy uses threads: about
/// 20 ms of work each (a layer of 288 slots takes about 6 µs), far above the cost of starting
/// a thread and of its wait for a core on a loaded machine. DeepSeek-V3's 58 × 288 slots run
/// on the caller's thread.
const MIN_SLOTS_PER_THREAD: usize = 1 << 20;
const MAX_POLICY_THREADS: usize = 8;

/// A validated hierarchical shape: logical experts, physical slots, groups, nodes, GPUs.
#[derive(Clone, Copy)]
struct Dims {
    e: usize,
    p: usize,
    g: usize,
    n: usize,
    r: usize,
}

/// Places each layer of `weight` (physical → logical): layers of plain loads (+0.0 to +inf)
/// by the fast path, others by the general one.
fn place_layers(weight: &[Vec<f32>], d: Dims) -> Vec<Vec<usize>> {
    let (mut plain, mut general) = (fast::Layer::default(), General::default());
    weight
        .iter()
        .map(|w| {
            let mut row = vec![0usize; d.p];
            if d.e > 0 && fast::plain_loads(w) {
                plain.place(w, d, &mut row);
            } else {
                general.place(w, d, &mut row);
            }
            row
        })
        .collect()
}

/// The general placement's reusable buffers: vLLM's steps with its float comparisons as they
/// are (NaN, negative loads and -0.0 included).
#[derive(Default)]
struct General {
    packer: Packer,
    reps: Replicas,
    gpi: Vec<usize>,
    grk: Vec<usize>,
    pi: Vec<usize>,
    rk: Vec<usize>,
    group_load: Vec<f64>,
    mlog2log: Vec<usize>,
    tpm: Vec<f64>,
    tpp: Vec<f64>,
    pphy2phy: Vec<usize>,
}

impl General {
    /// Places the layer `w`: physical → logical into `row`.
    fn place(&mut self, w: &[f32], d: Dims, row: &mut [usize]) {
        let Dims { e, p, g, n, r } = d;
        let gs = e / g;
        let gpn = g / n;
        let ppg = p / r;
        let (en, pn) = (e / n, p / n);
        // 1. Groups onto nodes by group load.
        self.group_load.clear();
        self.group_load
            .extend(w.chunks(gs).map(|c| np_sum_f32(c) as f64));
        self.packer
            .pack(&self.group_load, n, &mut self.gpi, &mut self.grk);
        // mlog2log = inverse of log → (node-major) logical.
        self.mlog2log.resize(e, 0);
        for x in 0..e {
            let grp = x / gs;
            self.mlog2log[(self.gpi[grp] * gpn + self.grk[grp]) * gs + x % gs] = x;
        }
        self.pphy2phy.resize(pn, 0);
        for node in 0..n {
            // 2. Replicas within the node.
            self.tpm.clear();
            let mlog2log = &self.mlog2log;
            self.tpm
                .extend((0..en).map(|i| w[mlog2log[node * en + i]] as f64));
            self.reps.replicate(&self.tpm, pn);
            // 3. Physical experts onto the node's GPUs by load per replica.
            let (tpm, reps) = (&self.tpm, &self.reps);
            self.tpp.clear();
            self.tpp.extend(
                reps.phy2mlog
                    .iter()
                    .map(|&m| tpm[m] / reps.mlogcnt[m] as f64),
            );
            self.packer
                .pack(&self.tpp, r / n, &mut self.pi, &mut self.rk);
            for x in 0..pn {
                self.pphy2phy[self.pi[x] * ppg + self.rk[x]] = x;
            }
            // 4. Compose back to logical ids.
            for q in 0..pn {
                let mlog = self.reps.phy2mlog[self.pphy2phy[q]] + node * en;
                row[node * pn + q] = self.mlog2log[mlog];
            }
        }
    }
}

/// vLLM's `preserve_intragpu_slots`: within each GPU's block of `P / num_ranks` slots, an
/// expert the new map keeps on that GPU takes its old slot (the first unused match), and the
/// others fill the remaining slots in order. Values are compared only, so any value (vLLM's -1
/// for an unused slot included) may appear in either map. Does nothing when `num_ranks` is 0 or
/// does not divide the slots, as vLLM.
pub fn preserve_intragpu_slots<T: Copy + PartialEq>(
    new: &mut [Vec<T>],
    num_ranks: usize,
    old: &[Vec<T>],
) {
    let p = new.first().map_or(0, Vec::len);
    if num_ranks == 0 || !p.is_multiple_of(num_ranks) || p == 0 {
        return;
    }
    let s = p / num_ranks;
    let (mut used, mut kept, mut block) = (vec![false; s], vec![false; s], Vec::with_capacity(s));
    for (row, old_row) in new.iter_mut().zip(old) {
        for (gpu_new, gpu_old) in row.chunks_mut(s).zip(old_row.chunks(s)) {
            block.clear();
            block.extend_from_slice(gpu_new);
            used.fill(false);
            kept.fill(false);
            for (slot, want) in gpu_old.iter().enumerate() {
                if let Some(j) = (0..s).find(|&j| !used[j] && block[j] == *want) {
                    used[j] = true;
                    kept[slot] = true;
                    gpu_new[slot] = block[j];
                }
            }
            let rest = (0..s).filter(|&j| !used[j]).map(|j| block[j]);
            for (slot, x) in (0..s).filter(|&k| !kept[k]).zip(rest) {
                gpu_new[slot] = x;
            }
        }
    }
}

/// The caller's warning when GPUs do not divide into nodes (vLLM's text; vLLM formats it after
/// setting the node count to 1, so `num_nodes` is the count used).
pub fn nodes_warning(num_gpus: usize, num_nodes: usize) -> String {
    format!(
        "num_gpus % num_nodes != 0, not using hierarchical rearrangement algorithm.\nnum_gpus={num_gpus}, num_nodes={num_nodes}"
    )
}

/// What [`rebalance`] does when the ranks do not divide into nodes (R % N != 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NodeFallback {
    /// `DefaultEplbPolicy.rebalance_experts` as it is: with G % N == 0 the hierarchical step
    /// asserts R % N == 0 (AssertionError); with G % N != 0 the global policy runs.
    #[default]
    Policy,
    /// The rule of vLLM's caller (`EplbState.rearrange`) applied first: R % N != 0 (or N = 0)
    /// logs its warning once ([`nodes_warning`]) and uses one node.
    OneNode,
}

/// The placement asked of the policy (the scalar arguments of vLLM's `rebalance_experts`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Physical expert slots in all (P, a multiple of the ranks).
    pub num_replicas: usize,
    /// Expert groups (G).
    pub num_groups: usize,
    /// Nodes (N).
    pub num_nodes: usize,
    /// Ranks, i.e. GPUs (R).
    pub num_ranks: usize,
}

/// vLLM's `DefaultEplbPolicy.rebalance_experts`: `weight` holds token counts per logical expert
/// and layer (as float32, as vLLM converts them). The hierarchical policy when groups divide into
/// nodes, else the global one (G = N = 1); with `old` [layers, P], experts that stay on a GPU keep
/// their old slots (negative old entries, vLLM's -1 for an unused slot, match nothing). `fallback`
/// chooses whether the eplb_state caller's one-node rule applies first. Returns physical →
/// logical per layer.
pub fn rebalance(
    weight: &[Vec<f32>],
    shape: Placement,
    old: Option<&[Vec<i64>]>,
    fallback: NodeFallback,
) -> Result<Vec<Vec<usize>>> {
    let Placement {
        num_replicas: p,
        num_groups: g,
        num_nodes: mut n,
        num_ranks: r,
    } = shape;
    match fallback {
        NodeFallback::OneNode if n == 0 || r % n != 0 => {
            n = 1;
            log::log_once(log::Level::Warn, &nodes_warning(r, n));
        }
        NodeFallback::OneNode | NodeFallback::Policy => {}
    }
    assertion(n > 0, || format!("num_groups % num_nodes == 0 ({g} % {n})"))?;
    let mut map = if g % n == 0 {
        rebalance_hierarchical(weight, p, g, n, r)?
    } else {
        rebalance_hierarchical(weight, p, 1, 1, r)?
    };
    if let Some(old) = old {
        if old.len() != map.len() || old.iter().any(|row| row.len() != p) {
            return Err(Error::InvalidArgument(format!(
                "old_global_expert_indices must have the shape of the new map [{}, {p}]",
                map.len()
            )));
        }
        // A negative old entry (an unused slot) becomes a value no new expert has.
        let old: Vec<Vec<usize>> = old
            .iter()
            .map(|row| {
                row.iter()
                    .map(|&x| usize::try_from(x).unwrap_or(usize::MAX))
                    .collect()
            })
            .collect();
        preserve_intragpu_slots(&mut map, r, &old);
    }
    Ok(map)
}

/// [`rebalance`] as vLLM's caller `EplbState.rearrange` runs it ([`NodeFallback::OneNode`]),
/// with an old map of expert ids: the composition epcomm's earlier callers rely on.
pub fn rebalance_experts(
    weight: &[Vec<f32>],
    num_replicas: usize,
    num_groups: usize,
    num_nodes: usize,
    num_gpus: usize,
    old: Option<&[Vec<usize>]>,
) -> Result<Vec<Vec<usize>>> {
    let old: Option<Vec<Vec<i64>>> = old.map(|rows| {
        rows.iter()
            .map(|row| {
                row.iter()
                    .map(|&x| i64::try_from(x).unwrap_or(-1))
                    .collect()
            })
            .collect()
    });
    let shape = Placement {
        num_replicas,
        num_groups,
        num_nodes,
        num_ranks: num_gpus,
    };
    rebalance(weight, shape, old.as_deref(), NodeFallback::OneNode)
}

/// Replica counts and logical → physical maps: `logcnt[l][x]` and `log2phy[l][x]` (ascending
/// slots, padded with -1 to the largest count of any expert in any layer, vLLM's `max_replicas`).
pub type LogicalMaps = (Vec<Vec<usize>>, Vec<Vec<Vec<i64>>>);

/// The logical maps of `phy2log`, where `expert` reads a slot (`None` = an unused slot).
fn maps_of<T: Copy>(
    phy2log: &[Vec<T>],
    num_logical: usize,
    expert: impl Fn(T) -> Option<usize>,
) -> LogicalMaps {
    let counts: Vec<Vec<usize>> = phy2log
        .iter()
        .map(|row| {
            let mut c = vec![0; num_logical];
            for x in row.iter().filter_map(|&v| expert(v)) {
                c[x] += 1;
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
            for (slot, x) in row.iter().enumerate() {
                if let Some(x) = expert(*x) {
                    m[x][fill[x]] = slot as i64;
                    fill[x] += 1;
                }
            }
            m
        })
        .collect();
    (counts, maps)
}

/// Replica counts per logical expert and the logical → physical map of a map without unused
/// slots (every id below `num_logical`).
pub fn compute_logical_maps(phy2log: &[Vec<usize>], num_logical: usize) -> LogicalMaps {
    maps_of(phy2log, num_logical, Some)
}

/// vLLM's `compute_logical_maps`: as [`compute_logical_maps`], where a negative slot (vLLM's -1
/// after a scale-up) is unused and counted nowhere; the width is the largest replica count
/// (vLLM's `max(logcnt)`, 0 when every slot is unused). An id at or above `num_logical` is an
/// InvalidArgument naming it (vLLM's scatter raises torch's index error there).
pub fn logical_maps(phy2log: &[Vec<i64>], num_logical: usize) -> Result<LogicalMaps> {
    for (l, row) in phy2log.iter().enumerate() {
        if let Some((slot, &bad)) = row
            .iter()
            .enumerate()
            .find(|(_, &x)| x >= 0 && x as u64 >= num_logical as u64)
        {
            return Err(Error::InvalidArgument(format!(
                "phy2log[{l}][{slot}] is {bad}; expected a logical expert id in [0, {num_logical}) \
                 or -1 for an unused slot"
            )));
        }
    }
    Ok(maps_of(phy2log, num_logical, |x| usize::try_from(x).ok()))
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

/// The straightforward transcription of vLLM's code (per-step Vec<Vec<_>>), kept as the
/// reference the optimised placement must equal bit for bit.
#[cfg(test)]
mod reference {
    use super::np_sum_f32;
    use crate::error::Result;

    /// Packs the `n` weighted items of row `w` into `m` packs of `n/m` items, heaviest first,
    /// each to the lightest pack that still has room. Returns (pack index, rank in pack) per item.
    fn balanced_packing(w: &[f64], m: usize) -> (Vec<usize>, Vec<usize>) {
        let n = w.len();
        debug_assert!(m > 0 && n.is_multiple_of(m));
        let per = n / m;
        if per == 1 {
            return ((0..n).collect(), vec![0; n]);
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
        (pi, rk)
    }

    /// Replicates the experts of row `w` into `num_phy` slots: the first slots are the experts
    /// themselves; each extra slot goes to the expert with the largest load per replica.
    /// Returns (physical → logical, replica count per logical).
    fn replicate_experts(w: &[f32], num_phy: usize) -> (Vec<usize>, Vec<usize>) {
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
        (map, cnt)
    }

    fn inverse(perm: &[usize]) -> Vec<usize> {
        let mut inv = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        inv
    }

    // The arguments of super::rebalance_hierarchical, so that the tests call both alike.
    /// The hierarchical policy for `weight` (`layers` rows of `num_logical` f32 loads):
    /// `num_physical` slots, `num_groups` expert groups, `num_nodes` nodes, `num_gpus` GPUs.
    /// Returns physical → logical per layer.
    pub(super) fn rebalance_hierarchical(
        weight: &[Vec<f32>],
        num_physical: usize,
        num_groups: usize,
        num_nodes: usize,
        num_gpus: usize,
    ) -> Result<Vec<Vec<usize>>> {
        let e = weight.first().map_or(0, Vec::len);
        let super::Dims { p, g, n, r, .. } =
            super::check_dims(e, num_physical, num_groups, num_nodes, num_gpus)?;
        let gs = e / g;
        let gpn = g / n;
        let ppg = p / r;
        let (en, pn) = (e / n, p / n);

        // 1. Groups onto nodes by group load.
        let group_load: Vec<Vec<f64>> = weight
            .iter()
            .map(|w| w.chunks(gs).map(|c| np_sum_f32(c) as f64).collect())
            .collect();
        let (gpi, grk): (Vec<_>, Vec<_>) =
            group_load.iter().map(|w| balanced_packing(w, n)).unzip();
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
        let (phy2mlog, mlogcnt): (Vec<_>, Vec<_>) =
            tpm.iter().map(|w| replicate_experts(w, pn)).unzip();

        // 3. Physical experts onto the node's GPUs by load per replica.
        let tpp: Vec<Vec<f64>> = (0..tpm.len())
            .map(|b| {
                phy2mlog[b]
                    .iter()
                    .map(|&m| tpm[b][m] as f64 / mlogcnt[b][m] as f64)
                    .collect()
            })
            .collect();
        let (pi, rk): (Vec<_>, Vec<_>) = tpp.iter().map(|w| balanced_packing(w, r / n)).unzip();
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(x: &mut u64) -> u64 {
        *x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *x >> 33
    }

    /// A random load of kind `kind`: many ties, wide counts, zeros, huge values, a non-integer
    /// grid, or (kind 5) negative values and -0.0, which take the general path.
    fn load(x: &mut u64, kind: usize) -> f32 {
        match kind {
            0 => (lcg(x) % 4) as f32,
            1 => (lcg(x) % 100_000) as f32,
            2 => 0.0,
            3 => ((lcg(x) % 1000) as f32) * 1e30,
            4 => (lcg(x) % 7) as f32 / 3.0,
            _ => [-0.0, 0.0, -2.0, 5.0, 1.5][(lcg(x) % 5) as usize],
        }
    }

    /// The optimised policy (fast and general paths) equals the reference on random shapes.
    #[test]
    fn optimised_policy_equals_reference() {
        let mut x = 7u64;
        for case in 0..600 {
            let n = 1 + lcg(&mut x) as usize % 4;
            let gpn = 1 + lcg(&mut x) as usize % 4;
            let g = n * gpn;
            let gs = 1 + lcg(&mut x) as usize % 12;
            let e = g * gs;
            let r = n * (1 + lcg(&mut x) as usize % 10);
            let p = {
                let min = e.div_ceil(r) * r;
                min + r * (lcg(&mut x) as usize % 3)
            };
            let layers = 1 + lcg(&mut x) as usize % 4;
            let w: Vec<Vec<f32>> = (0..layers)
                .map(|_| (0..e).map(|_| load(&mut x, case % 6)).collect())
                .collect();
            let got = rebalance_hierarchical(&w, p, g, n, r).expect("valid");
            let want = reference::rebalance_hierarchical(&w, p, g, n, r).expect("valid");
            assert_eq!(got, want, "case {case}: e={e} p={p} g={g} n={n} r={r}");
            // On plain loads the general path gives the fast path's result too.
            let dims = check_dims(e, p, g, n, r).expect("valid");
            for (l, row) in w.iter().enumerate() {
                let mut general = vec![0; p];
                General::default().place(row, dims, &mut general);
                assert_eq!(general, want[l], "case {case}, layer {l}: general path");
            }
        }
        // The benchmark shape, split over threads.
        let w: Vec<Vec<f32>> = (0..58)
            .map(|_| (0..256).map(|_| (lcg(&mut x) % 10_000) as f32).collect())
            .collect();
        let dims = check_dims(256, 288, 8, 4, 32).expect("valid");
        assert_eq!(
            place_threads(&w, dims, 3),
            reference::rebalance_hierarchical(&w, 288, 8, 4, 32).expect("valid")
        );
    }

    /// No logical experts: vLLM's empty rows without slots, numpy's argmax error with slots.
    #[test]
    fn no_logical_experts() {
        let none: Vec<Vec<f32>> = vec![Vec::new(); 2];
        assert_eq!(
            rebalance_hierarchical(&none, 0, 1, 1, 4).unwrap(),
            vec![Vec::<usize>::new(); 2]
        );
        let e = rebalance_hierarchical(&none, 4, 1, 1, 4).unwrap_err();
        assert_eq!(
            (e.exception(), e.to_string().as_str()),
            ("ValueError", "attempt to get argmax of an empty sequence")
        );
        let e = replicate_experts(&[Vec::new()], 3).unwrap_err();
        assert_eq!(e.to_string(), "attempt to get argmax of an empty sequence");
        assert_eq!(
            replicate_experts(&[Vec::new()], 0).unwrap(),
            (vec![Vec::new()], vec![Vec::new()])
        );
    }
}
