//! The hierarchical placement of one layer whose loads are all plain counts, +0.0 to +inf (no
//! NaN, no negative value, no -0.0): for such values, their sums and their quotients by
//! replica counts, the float order is the order of the bits, so each of vLLM's comparisons
//! becomes an integer comparison with the same outcome, and these shortcuts are exact:
//!
//! - Replication: a node's extra replicas go only to its `k` heaviest experts (`k` = extra
//!   slots, ties by index). An expert behind `k` others always has one of them still
//!   unreplicated, at least as heavy and earlier, which vLLM's first-maximum argmax prefers; so
//!   each step looks at `k` candidates, not every expert.
//! - The GPU packing's input order (the node's slots by load per replica, descending, ties by
//!   slot) is the experts' order without the replicated ones, which the replication sorted
//!   already, merged with the few replicated experts' slots, sorted apart.
//! - The packing keeps its packs' keys in registers and picks the lightest by a tree of
//!   comparisons (the first on ties, as vLLM's scan).
//!
//! Other loads take the general path, vLLM's comparisons as they are.

use super::{desc_key, np_sum_f32, Dims};

/// Whether every load of `w` is +0.0 to +inf, the values this module handles.
#[inline]
pub(super) fn plain_loads(w: &[f32]) -> bool {
    // No early exit: a branch-free pass the compiler vectorises.
    w.iter()
        .fold(true, |ok, x| ok & (x.to_bits() <= f32::INFINITY.to_bits()))
}

/// The balanced packing of items given heaviest first (`(item, weight)`, ties by item),
/// `per` items to each of `m` packs: each to the lightest pack with room (the first on ties).
/// Writes `slots[pack * per + rank] = item`. Weights are +0.0 to +inf, so their bits order
/// them; a pack's key is its weight's bits while it has room, u64::MAX once full.
#[inline]
fn pack(
    items: impl Iterator<Item = (usize, f64)>,
    m: usize,
    per: usize,
    slots: &mut [usize],
    wide: &mut Vec<(u64, usize)>,
) {
    if m <= 8 {
        return pack8(items, m, per, slots);
    }
    wide.clear();
    wide.resize(m, (0, 0));
    for (item, w) in items {
        let best = first_min(wide);
        let (key, n) = &mut wide[best];
        slots[best * per + *n] = item;
        *n += 1;
        let weight = f64::from_bits(*key) + w;
        *key = if *n < per { weight.to_bits() } else { u64::MAX };
    }
}

/// [`pack`] for at most 8 packs, their keys in registers: each step is a tree of independent
/// comparisons (each keeps its left side on ties, so the first minimum wins) and one addition.
#[inline(always)]
fn pack8(items: impl Iterator<Item = (usize, f64)>, m: usize, per: usize, slots: &mut [usize]) {
    let mut key = [u64::MAX; 8];
    for (j, k) in key.iter_mut().enumerate() {
        if j < m {
            *k = 0;
        }
    }
    let mut count = [0usize; 8];
    for (item, w) in items {
        let pick = |a: (u64, usize), b: (u64, usize)| if b.0 < a.0 { b } else { a };
        let lanes: [(u64, usize); 8] = std::array::from_fn(|j| (key[j], j));
        let (l, r) = (
            pick(pick(lanes[0], lanes[1]), pick(lanes[2], lanes[3])),
            pick(pick(lanes[4], lanes[5]), pick(lanes[6], lanes[7])),
        );
        let (min, best) = pick(l, r);
        let n = count[best & 7] + 1;
        count[best & 7] = n;
        slots[best * per + n - 1] = item;
        let next = if n < per {
            (f64::from_bits(min) + w).to_bits()
        } else {
            u64::MAX
        };
        // A select per lane, not a branch on `best`.
        for (j, k) in key.iter_mut().enumerate() {
            let mask = ((j == best) as u64).wrapping_neg();
            *k = (*k & !mask) | (next & mask);
        }
    }
}

/// The index of the first smallest key of `(key, count)` pairs.
fn first_min(k: &[(u64, usize)]) -> usize {
    let mut best = 0;
    for (i, &(x, _)) in k.iter().enumerate().skip(1) {
        if x < k[best].0 {
            best = i;
        }
    }
    best
}

/// One layer's reusable buffers.
#[derive(Default)]
pub(super) struct Layer {
    keys: Vec<u128>,
    wide: Vec<(u64, usize)>,
    groups: Vec<usize>,
    mlog2log: Vec<usize>,
    node: Node,
}

/// One node's reusable buffers and its result: `slots` (GPU-major slot → node slot) and
/// `phy2mlog` (node slot → node expert: the experts themselves, then the extra replicas).
#[derive(Default)]
struct Node {
    /// The node's loads' bits (+0.0 to +inf: ordered as integers).
    bits: Vec<u32>,
    /// The node's experts, heaviest first (ties by expert).
    order: Vec<u32>,
    lanes: Vec<i32>,
    sort_keys: Vec<u64>,
    cand: Vec<u128>,
    count: Vec<u32>,
    phy2mlog: Vec<usize>,
    keys: Vec<u128>,
    /// The node's slots heaviest first, as [`desc_key`]s (the packing's input).
    sorted: Vec<u128>,
    wide: Vec<(u64, usize)>,
    slots: Vec<usize>,
}

impl Layer {
    /// Places the layer `w` (all loads plain, at least one expert): physical → logical into
    /// `row`.
    #[inline]
    pub(super) fn place(&mut self, w: &[f32], d: Dims, row: &mut [usize]) {
        let Dims { e, p, g, n, r } = d;
        let (gs, gpn) = (e / g, g / n);
        // 1. Groups onto nodes by group load.
        self.groups.resize(g, 0);
        if gpn == 1 {
            self.groups.iter_mut().enumerate().for_each(|(i, s)| *s = i);
        } else {
            self.keys.clear();
            self.keys.extend(
                w.chunks(gs)
                    .enumerate()
                    .map(|(i, c)| desc_key(np_sum_f32(c) as f64, i)),
            );
            self.keys.sort_unstable();
            let items = self.keys.iter().map(|&k| (k as u64 as usize, weight_of(k)));
            pack(items, n, gpn, &mut self.groups, &mut self.wide);
        }
        self.mlog2log.resize(e, 0);
        for (s, &grp) in self.groups.iter().enumerate() {
            let dst = &mut self.mlog2log[s * gs..(s + 1) * gs];
            dst.iter_mut()
                .enumerate()
                .for_each(|(o, x)| *x = grp * gs + o);
        }
        let (en, pn) = (e / n, p / n);
        for node in 0..n {
            let logical = &self.mlog2log[node * en..(node + 1) * en];
            let nd = &mut self.node;
            nd.bits.clear();
            nd.bits.extend(logical.iter().map(|&x| w[x].to_bits()));
            nd.place(pn, r / n);
            // 4. Compose back to logical ids.
            let out = &mut row[node * pn..(node + 1) * pn];
            for (dst, &q) in out.iter_mut().zip(&nd.slots) {
                *dst = logical[nd.phy2mlog[q]];
            }
        }
    }
}

/// The experts of `bits` heaviest first, ties by index, into `order`. With AVX2, expert i's
/// place is the number of experts ahead of it, `i - #{j < i: x_j < x_i} + #{j > i: x_j >
/// x_i}`, counted 8 experts at a time (for a node's few experts, faster than a comparison
/// sort); otherwise a sort of (load, index) keys. `lanes` and `keys` are scratch.
#[inline]
fn rank_order(bits: &[u32], order: &mut Vec<u32>, lanes: &mut Vec<i32>, keys: &mut Vec<u64>) {
    let n = bits.len();
    order.clear();
    order.resize(n, 0);
    #[cfg(target_arch = "x86_64")]
    if n <= 512 && simd::has_avx2() {
        // Bits of +0.0 to +inf are below 2^31: as i32 they compare the same.
        lanes.clear();
        lanes.extend(bits.iter().map(|&b| b as i32));
        lanes.resize(n.div_ceil(8) * 8, 0);
        // SAFETY: the CPU supports AVX2; `lanes` holds n rounded up to 8 entries.
        unsafe { simd::rank_order(lanes, n, order) };
        return;
    }
    let _ = lanes;
    keys.clear();
    keys.extend(
        bits.iter()
            .enumerate()
            .map(|(i, &b)| (u64::from(!b) << 32) | i as u64),
    );
    keys.sort_unstable();
    order
        .iter_mut()
        .zip(keys.iter())
        .for_each(|(o, &k)| *o = k as u32);
}

/// The AVX2 counting of [`rank_order`] (selected at run time: the crate is built for baseline
/// x86-64). Integer comparisons only, so the order is the same on every CPU.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    /// Whether the CPU has AVX2 and `EPCOMM_NO_SIMD` does not turn it off.
    pub(super) fn has_avx2() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| !crate::env::no_simd() && is_x86_feature_detected!("avx2"))
    }

    /// [`super::rank_order`] of the first `n` of `lanes` (padded to a multiple of 8).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn rank_order(lanes: &[i32], n: usize, order: &mut [u32]) {
        debug_assert!(lanes.len() >= n.div_ceil(8) * 8 && order.len() == n);
        let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for lo in (0..n).step_by(8) {
            // SAFETY: lo + 8 <= lanes.len().
            let xi = unsafe { _mm256_loadu_si256(lanes.as_ptr().add(lo) as *const __m256i) };
            // Lanes count down (cmpgt is -1 when true): j < lo is before every lane.
            let mut acc = _mm256_setzero_si256();
            for &xj in &lanes[..lo] {
                acc = _mm256_add_epi32(acc, _mm256_cmpgt_epi32(xi, _mm256_set1_epi32(xj)));
            }
            let mut ahead = _mm256_setzero_si256();
            for &xj in &lanes[(lo + 8).min(n)..n] {
                ahead = _mm256_sub_epi32(ahead, _mm256_cmpgt_epi32(_mm256_set1_epi32(xj), xi));
            }
            for (d, &xj) in (0..8).zip(&lanes[lo..(lo + 8).min(n)]) {
                let (xj, dv) = (_mm256_set1_epi32(xj), _mm256_set1_epi32(d));
                let later =
                    _mm256_and_si256(_mm256_cmpgt_epi32(dv, iota), _mm256_cmpgt_epi32(xj, xi));
                let earlier =
                    _mm256_and_si256(_mm256_cmpgt_epi32(iota, dv), _mm256_cmpgt_epi32(xi, xj));
                acc = _mm256_add_epi32(acc, _mm256_sub_epi32(earlier, later));
            }
            let mut rank = [0i32; 8];
            // SAFETY: `rank` has 8 lanes.
            unsafe {
                _mm256_storeu_si256(
                    rank.as_mut_ptr() as *mut __m256i,
                    _mm256_add_epi32(acc, ahead),
                )
            };
            for (l, &a) in rank.iter().enumerate().take(n - lo) {
                order[((lo + l) as i32 + a) as usize] = (lo + l) as u32;
            }
        }
    }
}

impl Node {
    /// Places the experts of `bits` on `pn` slots of `gpus` GPUs.
    #[inline]
    fn place(&mut self, pn: usize, gpus: usize) {
        let en = self.bits.len();
        // 2. Replicas within the node, the extra ones among the k heaviest.
        rank_order(
            &self.bits,
            &mut self.order,
            &mut self.lanes,
            &mut self.sort_keys,
        );
        let k = pn - en;
        // Candidates as keys: the smallest key is the largest load per replica, the first
        // expert on ties (vLLM's first maximum).
        let bits = &self.bits;
        let load = |x: usize| f32::from_bits(bits[x]) as f64;
        self.cand.clear();
        self.cand.extend(
            self.order[..k.min(en)]
                .iter()
                .map(|&x| desc_key(load(x as usize), x as usize)),
        );
        self.count.clear();
        self.count.resize(en, 1);
        self.phy2mlog.clear();
        self.phy2mlog.extend(0..en);
        for _ in 0..k {
            let mut best = 0;
            for (c, &key) in self.cand.iter().enumerate() {
                if key < self.cand[best] {
                    best = c;
                }
            }
            let x = self.cand[best] as u64 as usize;
            self.phy2mlog.push(x);
            self.count[x] += 1;
            self.cand[best] = desc_key(load(x) / self.count[x] as f64, x);
        }
        // 3. The node's slots heaviest first (load per replica), onto its GPUs.
        let ppg = pn / gpus;
        self.slots.resize(pn, 0);
        if ppg == 1 {
            self.slots.iter_mut().enumerate().for_each(|(i, s)| *s = i);
        } else {
            self.sorted_slots();
            let items = self
                .sorted
                .iter()
                .map(|&k| (k as u64 as usize, weight_of(k)));
            pack(items, gpus, ppg, &mut self.slots, &mut self.wide);
        }
    }

    /// The node's slots heaviest load per replica first (ties by slot) into `sorted`: the
    /// replicated experts' slots (`keys`, sorted apart) merged into the other experts, which
    /// keep the order of `order`.
    #[inline]
    fn sorted_slots(&mut self) {
        let en = self.bits.len();
        let (bits, count) = (&self.bits, &self.count);
        let load = |x: usize| f32::from_bits(bits[x]) as f64;
        self.keys.clear();
        // The replicated experts' own slots (their keys hold their final load per replica),
        // then the extra slots.
        self.keys.extend(
            self.cand
                .iter()
                .filter(|&&c| count[c as u64 as usize] > 1)
                .copied(),
        );
        for (q, &x) in self.phy2mlog.iter().enumerate().skip(en) {
            self.keys.push(desc_key(load(x) / count[x] as f64, q));
        }
        self.keys.sort_unstable();
        self.keys.push(u128::MAX);
        // The experts without extra replicas in their order (the replicated ones are among
        // the first k), the replicated slots merged in.
        let k = self.cand.len();
        self.sorted.clear();
        self.sorted.resize(self.phy2mlog.len(), 0);
        let (mut out, mut j) = (0, 0);
        let reps = &self.keys;
        for (r, &x) in self.order.iter().enumerate() {
            let x = x as usize;
            if r < k && count[x] > 1 {
                continue;
            }
            let key = desc_key(load(x), x);
            while reps[j] < key {
                self.sorted[out] = reps[j];
                out += 1;
                j += 1;
            }
            self.sorted[out] = key;
            out += 1;
        }
        while reps[j] != u128::MAX {
            self.sorted[out] = reps[j];
            out += 1;
            j += 1;
        }
        debug_assert_eq!(out, self.sorted.len());
    }
}

/// The weight a [`desc_key`] of a value +0.0 to +inf was made of.
#[inline]
fn weight_of(key: u128) -> f64 {
    f64::from_bits(!((key >> 64) as u64) ^ (1 << 63))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 counting and the sort give the same order (ties, zeros, +inf, sizes around
    /// the 8-lane chunks).
    #[test]
    fn rank_order_paths_agree() {
        let mut x = 1u64;
        for n in (0..40).chain([63, 64, 65, 200, 512]) {
            for kind in 0..3u64 {
                let bits: Vec<u32> = (0..n)
                    .map(|_| {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let r = x >> 33;
                        match kind {
                            0 => (r % 3) as f32,
                            1 => [0.0, f32::INFINITY, f32::MAX, 1e-40][(r % 4) as usize],
                            _ => r as f32,
                        }
                        .to_bits()
                    })
                    .collect();
                let mut keys: Vec<u64> = bits
                    .iter()
                    .enumerate()
                    .map(|(i, &b)| (u64::from(!b) << 32) | i as u64)
                    .collect();
                keys.sort_unstable();
                let want: Vec<u32> = keys.iter().map(|&k| k as u32).collect();
                let (mut order, mut lanes, mut scratch) = (Vec::new(), Vec::new(), Vec::new());
                rank_order(&bits, &mut order, &mut lanes, &mut scratch);
                assert_eq!(order, want, "n={n} kind={kind}");
            }
        }
    }
}
