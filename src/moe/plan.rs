//! The routing plan of one dispatch: from every rank's top-k ids, where each token row goes and in
//! which order (docs/design.md, section 3). Every rank computes the same plan from the same
//! gathered routing, so senders and receivers agree without exchanging per-row metadata.
//!
//! Order: token layouts (REPLICATED, TOKEN_MAJOR, RANK_MAJOR) by source rank, then source token
//! index; expert layouts (EXPERT_MAJOR, EXPERT_PACKED) by local expert, then source rank, then
//! source token index.

use super::layout::{self, Contract, Counts, Unit};
use crate::error::{Error, Result};
use crate::select::all2all::Layout;

/// One rank's routing: `t` tokens, `k` ids and weights per token (row-major).
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub t: usize,
    pub k: usize,
    pub ids: Vec<i64>,
    pub weights: Vec<f32>,
}

impl Routing {
    fn ids_of(&self, t: usize) -> &[i64] {
        &self.ids[t * self.k..(t + 1) * self.k]
    }

    fn weights_of(&self, t: usize) -> &[f32] {
        &self.weights[t * self.k..(t + 1) * self.k]
    }
}

/// Checks ids: each in [-1, E); no expert twice in one token. Names the token. Returns the
/// tokens per expert (the same pass records EPLB load).
pub fn validate_ids(ids: &[i64], k: usize, num_experts: usize) -> Result<Vec<u32>> {
    let mut counts = vec![0u32; num_experts];
    for (t, row) in ids.chunks(k).enumerate() {
        for (j, &e) in row.iter().enumerate() {
            if e < -1 || e >= num_experts as i64 {
                return Err(Error::InvalidArgument(format!(
                    "topk_ids[{t}][{j}] = {e} is out of range: expected -1 (masked) or an expert id in [0, {num_experts})"
                )));
            }
            if e >= 0 && row[..j].contains(&e) {
                return Err(Error::InvalidArgument(format!(
                    "topk_ids[{t}] = {row:?} routes token {t} to expert {e} twice: the top-k experts of a token must be distinct"
                )));
            }
            if e >= 0 {
                counts[e as usize] += 1;
            }
        }
    }
    Ok(counts)
}

pub use super::layout::Geometry;

/// What this rank does in one dispatch/combine.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// Rows of the receive buffer (including fixed-capacity padding).
    pub buffer_rows: usize,
    /// Rows actually received.
    pub received_rows: usize,
    /// Sender side: for each destination, this rank's token indices in the receiver's order.
    pub give: Vec<Vec<u32>>,
    /// Receiver side: for each source, the buffer rows its tokens land in (source's order).
    pub take: Vec<Vec<u32>>,
    /// Combine, source side: for each holder rank, (token, weight) per row it returns.
    pub combine_take: Vec<Vec<(u32, f32)>>,
    /// Receiver metadata per buffer row: ids (k per row; TOKEN_MAJOR, RANK_MAJOR, REPLICATED).
    pub row_ids: Vec<i64>,
    /// Weights per buffer row: k per row, or one per row (EXPERT_PACKED).
    pub row_weights: Vec<f32>,
    /// TOKEN_MAJOR tokens_per_local_expert, EXPERT_MAJOR counts, RANK_MAJOR recv_counts.
    pub counts: Vec<i32>,
    /// EXPERT_PACKED expert_offsets (E_local + 1).
    pub offsets: Vec<i64>,
    /// EXPERT_PACKED source (rank, token) per row.
    pub src_rank: Vec<i32>,
    pub src_token: Vec<i32>,
}

/// Builds the plan of rank `me` from every rank's routing. With `weights_on_input`, weights
/// were applied before dispatch: combine and the received weights use 1.0.
pub fn build(
    layout: Layout,
    geo: &Geometry,
    me: usize,
    all: &[Routing],
    weights_on_input: bool,
) -> Plan {
    let world = geo.world;
    let mut p = Plan {
        give: vec![Vec::new(); world],
        take: vec![Vec::new(); world],
        combine_take: vec![Vec::new(); world],
        ..Plan::default()
    };
    let Some(contract) = layout::contract(layout) else {
        return p;
    };
    // The expert layouts' rows per (token, expert) pair, grouped by expert once (every
    // expert of this rank's tokens for the send side).
    let mine_by_expert =
        (contract.unit == Unit::TokenExpert).then(|| ByExpert::of(&all[me], 0, geo.num_experts));
    let b = Builder {
        contract,
        geo,
        me,
        all,
        weights_on_input,
        mine_by_expert,
    };
    for d in 0..world {
        b.send_side(d, &mut p);
    }
    // The receive side is each layout's own placement.
    match layout {
        Layout::Replicated => b.receive_replicated(&mut p),
        Layout::TokenMajor => b.receive_token_major(&mut p),
        Layout::ExpertMajor | Layout::ExpertPacked => b.receive_by_expert(&mut p),
        Layout::RankMajor => b.receive_rank_major(&mut p),
        Layout::MoonepSlots => {}
    }
    p
}

/// What every part of [`build`] reads.
struct Builder<'a> {
    contract: Contract,
    geo: &'a Geometry,
    me: usize,
    all: &'a [Routing],
    weights_on_input: bool,
    /// This rank's (token, expert) pairs by expert (the expert layouts).
    mine_by_expert: Option<ByExpert>,
}

/// The (token, top-k slot) pairs of one rank's routing whose expert lies in a range, grouped
/// by expert (ascending) and by token within an expert: a counting sort, O(T·K + experts),
/// where scanning the tokens once per expert would cost O(experts·T·K).
struct ByExpert {
    /// `starts[i]..starts[i + 1]`: the pairs of the range's expert `i`.
    starts: Vec<u32>,
    pairs: Vec<(u32, u32)>,
}

impl ByExpert {
    /// The pairs of `r` routed to experts `[first, first + n)`.
    fn of(r: &Routing, first: usize, n: usize) -> ByExpert {
        let slot = |e: i64| {
            usize::try_from(e)
                .ok()
                .and_then(|e| e.checked_sub(first))
                .filter(|&i| i < n)
        };
        let mut starts = vec![0u32; n + 1];
        for i in r.ids.iter().filter_map(|&e| slot(e)) {
            starts[i + 1] += 1;
        }
        for i in 0..n {
            starts[i + 1] += starts[i];
        }
        let mut next = starts[..n].to_vec();
        let mut pairs = vec![(0u32, 0u32); starts[n] as usize];
        for (i, &e) in r.ids.iter().enumerate() {
            if let Some(x) = slot(e) {
                pairs[next[x] as usize] = ((i / r.k) as u32, (i % r.k) as u32);
                next[x] += 1;
            }
        }
        ByExpert { starts, pairs }
    }

    /// The pairs of experts `from..to` of the range, by expert then token.
    fn experts(&self, from: usize, to: usize) -> &[(u32, u32)] {
        &self.pairs[self.starts[from] as usize..self.starts[to] as usize]
    }
}

impl Builder<'_> {
    /// A received or combine weight (1.0 when the weights were applied on the input).
    fn w_eff(&self, w: f32) -> f32 {
        if self.weights_on_input {
            1.0
        } else {
            w
        }
    }

    fn goes_to(&self, r: &Routing, t: usize, d: usize) -> bool {
        r.ids_of(t)
            .iter()
            .any(|&e| e >= 0 && self.geo.owner(e) == d)
    }

    /// This rank's first local expert.
    fn first_local(&self) -> i64 {
        (self.me * self.geo.experts_per_rank) as i64
    }

    /// Sender side and combine weights: this rank's tokens, in receiver `d`'s order.
    fn send_side(&self, d: usize, p: &mut Plan) {
        let mine = &self.all[self.me];
        let c = &self.contract;
        match c.unit {
            Unit::EveryToken | Unit::Token => {
                for t in 0..mine.t {
                    if c.unit == Unit::EveryToken || self.goes_to(mine, t, d) {
                        p.give[d].push(t as u32);
                        // The holder returns rows with the weights already applied.
                        p.combine_take[d].push((t as u32, c.combine_weight(1.0)));
                    }
                }
            }
            Unit::TokenExpert => {
                let el = self.geo.experts_per_rank;
                let Some(by) = &self.mine_by_expert else {
                    return;
                };
                for &(t, kk) in by.experts(d * el, (d + 1) * el) {
                    let w = self.w_eff(mine.weights_of(t as usize)[kk as usize]);
                    p.give[d].push(t);
                    p.combine_take[d].push((t, c.combine_weight(w)));
                }
            }
        }
    }

    /// Every token of every rank, ids and weights as sent.
    fn receive_replicated(&self, p: &mut Plan) {
        let mut row = 0u32;
        for (s, r) in self.all.iter().enumerate() {
            for t in 0..r.t {
                p.take[s].push(row);
                row += 1;
                p.row_ids.extend_from_slice(r.ids_of(t));
                p.row_weights
                    .extend(r.weights_of(t).iter().map(|&w| self.w_eff(w)));
            }
        }
        p.received_rows = row as usize;
        p.buffer_rows = row as usize;
    }

    /// Each token once per rank it goes to, the ids this rank owns kept.
    fn receive_token_major(&self, p: &mut Plan) {
        let el = self.geo.experts_per_rank;
        let first_local = self.first_local();
        let local = |e: i64| e >= first_local && e < first_local + el as i64;
        p.counts = vec![0; el];
        let mut row = 0u32;
        for (s, r) in self.all.iter().enumerate() {
            for t in 0..r.t {
                if !self.goes_to(r, t, self.me) {
                    continue;
                }
                p.take[s].push(row);
                row += 1;
                for (&e, &w) in r.ids_of(t).iter().zip(r.weights_of(t)) {
                    if e >= 0 && local(e) {
                        p.row_ids.push(e);
                        p.row_weights.push(self.w_eff(w));
                        p.counts[(e - first_local) as usize] += 1;
                    } else {
                        p.row_ids.push(-1);
                        p.row_weights.push(0.0);
                    }
                }
            }
        }
        p.received_rows = row as usize;
        p.buffer_rows = row as usize;
    }

    /// One row per (token, local expert), grouped by expert: fixed buckets (EXPERT_MAJOR) or
    /// packed (EXPERT_PACKED, with weights and sources per row).
    fn receive_by_expert(&self, p: &mut Plan) {
        let (el, c) = (self.geo.experts_per_rank, &self.contract);
        let bucket = self.geo.max_tokens * self.geo.world;
        let fixed = c.fixed_capacity();
        p.counts = vec![0; el];
        p.offsets = vec![0; el + 1];
        let first = self.me * el;
        let by: Vec<ByExpert> = self
            .all
            .iter()
            .map(|r| ByExpert::of(r, first, el))
            .collect();
        let mut packed_row = 0u32;
        for j in 0..el {
            let mut n = 0u32;
            for (s, r) in self.all.iter().enumerate() {
                for &(t, kk) in by[s].experts(j, j + 1) {
                    let row = if fixed {
                        (j * bucket) as u32 + n
                    } else {
                        let w = r.weights_of(t as usize)[kk as usize];
                        p.row_weights.push(self.w_eff(w));
                        p.src_rank.push(s as i32);
                        p.src_token.push(t as i32);
                        packed_row + n
                    };
                    p.take[s].push(row);
                    n += 1;
                }
            }
            p.counts[j] = n as i32;
            packed_row += n;
            p.offsets[j + 1] = packed_row as i64;
        }
        p.received_rows = packed_row as usize;
        p.buffer_rows = c.buffer_rows(self.geo, packed_row as usize);
        if !c.expert_offsets {
            p.offsets.clear();
        }
        if c.counts == Counts::None {
            p.counts.clear();
        }
    }

    /// A region of M rows per source rank, ids and weights as sent, padding rows all -1.
    fn receive_rank_major(&self, p: &mut Plan) {
        let (world, m, k) = (self.geo.world, self.geo.max_tokens, self.geo.top_k);
        p.counts = vec![0; world];
        p.row_ids = vec![-1; world * m * k];
        p.row_weights = vec![0.0; world * m * k];
        for (s, r) in self.all.iter().enumerate() {
            let mut n = 0usize;
            for t in 0..r.t {
                if !self.goes_to(r, t, self.me) {
                    continue;
                }
                let row = s * m + n;
                p.take[s].push(row as u32);
                p.row_ids[row * k..(row + 1) * k].copy_from_slice(r.ids_of(t));
                for (dst, &w) in p.row_weights[row * k..(row + 1) * k]
                    .iter_mut()
                    .zip(r.weights_of(t))
                {
                    *dst = self.w_eff(w);
                }
                n += 1;
            }
            p.counts[s] = n as i32;
            p.received_rows += n;
        }
        p.buffer_rows = self.contract.buffer_rows(self.geo, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worked example of docs/design.md: R=2, E=4, K=2.
    fn example() -> Vec<Routing> {
        vec![
            Routing {
                t: 3,
                k: 2,
                ids: vec![0, 2, 1, 0, 3, -1],
                weights: vec![0.5, 0.5, 0.25, 0.75, 1.0, 0.0],
            },
            Routing {
                t: 2,
                k: 2,
                ids: vec![2, 3, 1, -1],
                weights: vec![0.5, 0.5, 1.0, 0.0],
            },
        ]
    }

    /// The source token of every received row, as (source, token), in buffer order.
    fn rows(
        p: &Plan,
        all: &[Routing],
        gives_to_me: impl Fn(usize) -> Vec<u32>,
    ) -> Vec<(usize, u32, u32)> {
        let mut v = Vec::new();
        for s in 0..all.len() {
            let give = gives_to_me(s);
            for (i, &row) in p.take[s].iter().enumerate() {
                v.push((s, give[i], row));
            }
        }
        v.sort_by_key(|x| x.2);
        v
    }

    fn plans(layout: Layout) -> Vec<Plan> {
        let all = example();
        (0..2)
            .map(|me| build(layout, &layout::WORKED_EXAMPLE, me, &all, false))
            .collect()
    }

    /// (buffer row, x) of every row rank `me` received, in buffer order.
    fn landed(plans: &[Plan], me: usize) -> Vec<(u32, i32)> {
        rows(&plans[me], &example(), |s| plans[s].give[me].clone())
            .iter()
            .map(|&(s, t, row)| (row, [[10, 11, 12], [20, 21, 0]][s][t as usize]))
            .collect()
    }

    #[test]
    fn token_major_matches_the_worked_example() {
        let p = plans(Layout::TokenMajor);
        let x = |me: usize| -> Vec<i32> { landed(&p, me).iter().map(|l| l.1).collect() };
        assert_eq!(x(0), vec![10, 11, 21]);
        assert_eq!(p[0].row_ids, vec![0, -1, 1, 0, 1, -1]);
        assert_eq!(p[0].row_weights, vec![0.5, 0.0, 0.25, 0.75, 1.0, 0.0]);
        assert_eq!(p[0].counts, vec![2, 2]);
        assert_eq!(x(1), vec![10, 12, 20]);
        assert_eq!(p[1].row_ids, vec![-1, 2, 3, -1, 2, 3]);
        assert_eq!(p[1].row_weights, vec![0.0, 0.5, 1.0, 0.0, 0.5, 0.5]);
        assert_eq!(p[1].counts, vec![2, 2]);
    }

    #[test]
    fn expert_layouts_match_the_worked_example() {
        let major = plans(Layout::ExpertMajor);
        assert_eq!(major[0].counts, vec![2, 2]);
        assert_eq!(major[1].counts, vec![2, 2]);
        assert_eq!(major[0].buffer_rows, 2 * 3 * 2);
        let packed = plans(Layout::ExpertPacked);
        assert_eq!(packed[0].offsets, vec![0, 2, 4]);
        assert_eq!(packed[0].row_weights, vec![0.5, 0.75, 0.25, 1.0]);
        assert_eq!(packed[1].row_weights, vec![0.5, 0.5, 1.0, 0.5]);
        // Buckets of capacity M*R = 6: expert 0 rows 0.., expert 1 rows 6...
        assert_eq!(landed(&major, 0), vec![(0, 10), (1, 11), (6, 11), (7, 21)]);
        assert_eq!(landed(&major, 1), vec![(0, 10), (1, 20), (6, 12), (7, 20)]);
        assert_eq!(landed(&packed, 0), vec![(0, 10), (1, 11), (2, 11), (3, 21)]);
        assert_eq!(landed(&packed, 1), vec![(0, 10), (1, 20), (2, 12), (3, 20)]);
        assert_eq!(packed[1].src_rank, vec![0, 1, 0, 1]);
        assert_eq!(packed[1].src_token, vec![0, 0, 2, 0]);
    }

    #[test]
    fn rank_major_matches_the_worked_example() {
        let p = plans(Layout::RankMajor);
        assert_eq!(p[0].counts, vec![2, 1]);
        assert_eq!(p[1].counts, vec![2, 1]);
        // Regions of capacity M = 3.
        assert_eq!(landed(&p, 0), vec![(0, 10), (1, 11), (3, 21)]);
        assert_eq!(landed(&p, 1), vec![(0, 10), (1, 12), (3, 20)]);
        assert_eq!(&p[0].row_ids[..4], &[0, 2, 1, 0]);
        assert_eq!(
            &p[0].row_ids[4..6],
            &[-1, -1],
            "padding rows have all ids -1"
        );
        assert_eq!(&p[0].row_ids[6..8], &[1, -1]);
    }

    /// The expert layouts' plan as the definition says it, scanning every rank's tokens once
    /// per expert: (give, combine weights, take, row weights, sources) of rank `me`.
    #[allow(clippy::type_complexity)]
    fn expert_plan_by_definition(
        geo: &Geometry,
        me: usize,
        all: &[Routing],
        fixed: bool,
    ) -> (
        Vec<Vec<u32>>,
        Vec<Vec<(u32, f32)>>,
        Vec<Vec<u32>>,
        Vec<f32>,
        Vec<i32>,
    ) {
        let (el, world) = (geo.experts_per_rank, geo.world);
        let at = |r: &Routing, t: usize, e: usize| r.ids_of(t).iter().position(|&x| x == e as i64);
        let (mut give, mut comb) = (vec![Vec::new(); world], vec![Vec::new(); world]);
        for d in 0..world {
            for e in d * el..(d + 1) * el {
                for t in 0..all[me].t {
                    if let Some(kk) = at(&all[me], t, e) {
                        give[d].push(t as u32);
                        comb[d].push((t as u32, all[me].weights_of(t)[kk]));
                    }
                }
            }
        }
        let (mut take, mut weights, mut src) = (vec![Vec::new(); world], Vec::new(), Vec::new());
        let mut packed = 0u32;
        for j in 0..el {
            let mut n = 0u32;
            for (s, r) in all.iter().enumerate() {
                for t in 0..r.t {
                    if let Some(kk) = at(r, t, me * el + j) {
                        let bucket = (j * geo.max_tokens * world) as u32;
                        take[s].push(if fixed { bucket + n } else { packed + n });
                        weights.push(r.weights_of(t)[kk]);
                        src.push(s as i32);
                        n += 1;
                    }
                }
            }
            packed += n;
        }
        (give, comb, take, weights, src)
    }

    #[test]
    fn expert_layouts_follow_their_definition_on_random_routings() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % m as u64) as usize
        };
        for (world, el, k, m) in [(1, 4, 2, 5), (2, 8, 3, 9), (3, 2, 2, 4), (4, 16, 8, 7)] {
            let e = world * el;
            let all: Vec<Routing> = (0..world)
                .map(|_| {
                    let t = next(m + 1);
                    // Distinct experts per token, some slots masked (-1).
                    let mut ids: Vec<i64> = Vec::new();
                    for _ in 0..t {
                        let row_start = ids.len();
                        for _ in 0..k {
                            let id = next(e + 1) as i64 - 1;
                            let dup = ids[row_start..].contains(&id);
                            ids.push(if dup { -1 } else { id });
                        }
                    }
                    let weights = (0..t * k).map(|i| i as f32 / 8.0).collect();
                    Routing { t, k, ids, weights }
                })
                .collect();
            let geo = Geometry {
                world,
                num_experts: e,
                experts_per_rank: el,
                top_k: k,
                max_tokens: m,
            };
            for me in 0..world {
                for (layout, fixed) in [(Layout::ExpertMajor, true), (Layout::ExpertPacked, false)]
                {
                    let p = build(layout, &geo, me, &all, false);
                    let (give, comb, take, weights, src) =
                        expert_plan_by_definition(&geo, me, &all, fixed);
                    let why = format!("{layout:?} world {world} rank {me}");
                    assert_eq!(p.give, give, "{why}");
                    assert_eq!(p.combine_take, comb, "{why}");
                    assert_eq!(p.take, take, "{why}");
                    if !fixed {
                        assert_eq!(p.row_weights, weights, "{why}");
                        assert_eq!(p.src_rank, src, "{why}");
                    }
                }
            }
        }
    }

    #[test]
    fn ids_are_validated() {
        assert!(validate_ids(&[0, 1, -1, 3], 2, 4).is_ok());
        let e = validate_ids(&[0, 4], 2, 4).unwrap_err();
        assert_eq!(
            e.to_string(),
            "topk_ids[0][1] = 4 is out of range: expected -1 (masked) or an expert id in [0, 4)"
        );
        let e = validate_ids(&[0, 1, 2, 2], 2, 4).unwrap_err();
        assert_eq!(e.to_string(), "topk_ids[1] = [2, 2] routes token 1 to expert 2 twice: the top-k experts of a token must be distinct");
        assert!(validate_ids(&[-1, -1], 2, 4).is_ok());
        assert!(validate_ids(&[-2, 0], 2, 4).is_err());
    }
}
