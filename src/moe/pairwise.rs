//! Dispatch over a group that carries a caller's header in its ops' headers
//! ([`Group::rides`]: the host transports), at any token count: each rank's row count for every
//! destination travels in the dispatch header, and the routing of the rows a rank sends
//! travels in front of them in the rows' own all_to_allv, so the routing takes no exchange of
//! its own (a dispatch is 4 engine calls at one token or thousands, instead of 6 once the
//! routing outgrows the header). The receiver rebuilds each source's routing of the tokens it
//! received (the other tokens' ids -1) and builds the plan from it: the plan of the whole
//! routing, since a rank's receive side reads only the tokens sent to it (every token, in
//! REPLICATED). The unit test below checks both plans alike for every layout.

use super::plan::{self, Plan, Routing};
use super::{Manager, Tokens, ROUTING_INLINE};
use crate::bytes;
use crate::error::{Error, Result};
use crate::group::{rows, Group};

/// Whether dispatch goes pairwise on `g`: a riding group small enough for one count per rank
/// in the header (30 ranks), no masked rank.
pub(super) fn applies(world: usize, g: &dyn Group, masked: bool) -> bool {
    g.rides() && world * 4 <= ROUTING_INLINE && !masked
}

/// Bytes of one routing entry in a chunk: the token (u32), its k ids (i64), its k weights (f32).
fn entry_bytes(k: usize) -> usize {
    4 + 12 * k
}

/// The header's inline bytes: this rank's row count for each destination (u32 each).
fn counts_bytes(give: &[Vec<u32>]) -> Vec<u8> {
    give.iter()
        .flat_map(|l| (l.len() as u32).to_ne_bytes())
        .collect()
}

/// Rank s's row count for `me` from the gathered inline bytes (`ROUTING_INLINE` per rank).
fn count_to(inline: &[u8], s: usize, me: usize) -> usize {
    let at = s * ROUTING_INLINE + 4 * me;
    bytes::word_at::<u32>(inline, at).unwrap_or(0) as usize
}

/// What the receiving side of one pairwise dispatch needs.
struct Receive<'a> {
    me: usize,
    k: usize,
    num_experts: usize,
    row_bytes: usize,
    /// Tokens of each rank (the headers), rows each source sends here.
    tokens: &'a [usize],
    to_me: &'a [usize],
}

impl Receive<'_> {
    /// Each source's routing of the tokens it sent here (`mine` for this rank), from the
    /// chunks' routing blocks; a bad entry is the sender's (or its transport's) error.
    fn routing(
        &self,
        recv: &[u8],
        rs: &[usize],
        lead: usize,
        mine: &Routing,
    ) -> Result<Vec<Routing>> {
        let (k, eb) = (self.k, entry_bytes(self.k));
        let mut all = Vec::with_capacity(self.tokens.len());
        for (s, &t) in self.tokens.iter().enumerate() {
            if s == self.me {
                all.push(mine.clone());
                continue;
            }
            let mut r = Routing {
                t,
                k,
                ids: vec![-1; t * k],
                weights: vec![0.0; t * k],
            };
            let block = &recv[rs[s] + lead..][..self.to_me[s] * eb];
            for e in block.chunks_exact(eb) {
                let tok = bytes::word_at::<u32>(e, 0).unwrap_or(u32::MAX) as usize;
                let bad = |why: String| {
                    Error::Runtime(format!(
                        "dispatch: the routing rank {s} sent with its rows is bad ({why}); the host transport garbled the bytes"
                    ))
                };
                if tok >= t {
                    return Err(bad(format!("token {tok} of its {t}")));
                }
                let (ids, ws) = (
                    &mut r.ids[tok * k..(tok + 1) * k],
                    &mut r.weights[tok * k..(tok + 1) * k],
                );
                ids.iter_mut()
                    .zip(bytes::words(&e[4..4 + 8 * k]))
                    .for_each(|(d, v)| *d = v);
                ws.iter_mut()
                    .zip(bytes::words(&e[4 + 8 * k..]))
                    .for_each(|(d, v)| *d = v);
                let ids = &*ids;
                if let Some(&e) = ids
                    .iter()
                    .find(|&&e| e < -1 || e >= self.num_experts as i64)
                {
                    return Err(bad(format!("expert {e} of {}", self.num_experts)));
                }
                if let Some((j, &e)) =
                    (ids.iter().enumerate()).find(|&(j, &e)| e >= 0 && ids[..j].contains(&e))
                {
                    return Err(bad(format!("expert {e} twice in token {tok} (slot {j})")));
                }
            }
            all.push(r);
        }
        Ok(all)
    }

    /// The rows of each source's chunk (after its routing block) into rows `take[s]` of `dst`.
    fn unpack(
        &self,
        recv: &[u8],
        rs: &[usize],
        lead: usize,
        plan: &Plan,
        dst: &mut [u8],
    ) -> Result<()> {
        let (rb, eb) = (self.row_bytes, entry_bytes(self.k));
        for (s, take) in plan.take.iter().enumerate() {
            if s == self.me {
                continue;
            }
            if take.len() != self.to_me[s] {
                return Err(Error::Runtime(format!(
                    "dispatch: rank {s} sent {} rows but the routing it sent places {} here; the host transport garbled the bytes",
                    self.to_me[s],
                    take.len()
                )));
            }
            let rows = &recv[rs[s] + lead + take.len() * eb..][..take.len() * rb];
            for (row, &r) in rows.chunks_exact(rb.max(1)).zip(take) {
                let r = r as usize * rb;
                let Some(to) = dst.get_mut(r..r + rb) else {
                    return Err(Error::Internal(format!(
                        "dispatch: rank {s}'s rows land past the receive buffer ({} bytes)",
                        dst.len()
                    )));
                };
                to.copy_from_slice(row);
            }
        }
        Ok(())
    }
}

/// Packs each destination's chunk (but this rank's): the routing entries of rows `give[d]`,
/// then the rows.
fn pack(
    mine: &Routing,
    (src, row_bytes): (&[u8], usize),
    give: &[Vec<u32>],
    me: usize,
    out: &mut [u8],
    (starts, lead): (&[usize], usize),
) {
    let k = mine.k;
    for (d, list) in give.iter().enumerate().filter(|&(d, _)| d != me) {
        let mut at = starts[d] + lead;
        for &t in list {
            let t = t as usize;
            out[at..at + 4].copy_from_slice(&(t as u32).to_ne_bytes());
            out[at + 4..at + 4 + 8 * k]
                .copy_from_slice(bytes::as_bytes(&mine.ids[t * k..(t + 1) * k]));
            out[at + 4 + 8 * k..at + 4 + 12 * k]
                .copy_from_slice(bytes::as_bytes(&mine.weights[t * k..(t + 1) * k]));
            at += entry_bytes(k);
        }
        for &t in list {
            let t = t as usize;
            out[at..at + row_bytes].copy_from_slice(&src[t * row_bytes..(t + 1) * row_bytes]);
            at += row_bytes;
        }
    }
}

impl Manager {
    /// Dispatch's exchanges when [`applies`]: the header with the row counts, the rows with
    /// their routing, then the FP8 scales and extra payloads as usual. Returns the plan.
    pub(super) fn dispatch_pairwise(
        &mut self,
        g: &mut dyn Group,
        inp: Tokens<'_>,
        t: usize,
    ) -> Result<Plan> {
        let (me, world, k) = (self.rank, self.world, self.cfg.top_k);
        let layout = self.contract.layout;
        let wi = self.cfg.apply_router_weight_on_input;
        let mine = Routing {
            t,
            k,
            ids: inp.topk_ids.to_vec(),
            weights: inp.topk_weights.to_vec(),
        };
        let mut solo: Vec<Routing> = (0..world)
            .map(|_| Routing {
                t: 0,
                k,
                ids: Vec::new(),
                weights: Vec::new(),
            })
            .collect();
        solo[me] = mine.clone();
        let give = plan::build(layout, &self.geo, me, &solo, wi).give;
        let agreed = self.agree(g, "dispatch", self.header(true, t), &counts_bytes(&give))?;
        crate::fault::point("dispatch:after_counts");
        let tokens: Vec<usize> = agreed.headers.iter().map(|h| h[1] as usize).collect();
        if let Some(r) = tokens.iter().position(|&c| !self.fits(c)) {
            return Err(self.too_many_tokens(r, tokens[r]));
        }
        let to_me: Vec<usize> = (0..world)
            .map(|s| {
                if s == me {
                    give[me].len()
                } else {
                    count_to(&agreed.routing, s, me)
                }
            })
            .collect();
        let row_bytes = self.wire_row_bytes();
        let eb = entry_bytes(k);
        let chunk = |n: usize, p: usize| if p == me { 0 } else { n * (eb + row_bytes) };
        let send_sizes: Vec<usize> = give
            .iter()
            .enumerate()
            .map(|(d, l)| chunk(l.len(), d))
            .collect();
        let recv_sizes: Vec<usize> = to_me
            .iter()
            .enumerate()
            .map(|(s, &n)| chunk(n, s))
            .collect();
        let buffer_rows = self.contract.buffer_rows(&self.geo, to_me.iter().sum());
        // The rows sent: the FP8 rows (taken out meanwhile), the weighted rows, or the input.
        let fp8_rows = std::mem::take(&mut self.fp8_send);
        let moved = self.move_pairwise(
            g,
            inp,
            &fp8_rows,
            Pairwise {
                mine: &mine,
                give: &give,
                tokens: &tokens,
                to_me: &to_me,
                sizes: (&send_sizes, &recv_sizes),
                buffer_rows,
            },
        );
        self.fp8_send = fp8_rows;
        let plan = moved?;
        self.move_more(g, &plan, inp.extras)?;
        Ok(plan)
    }

    /// The hidden rows' exchange of [`Manager::dispatch_pairwise`]: returns the plan.
    fn move_pairwise(
        &mut self,
        g: &mut dyn Group,
        inp: Tokens<'_>,
        fp8_rows: &[u8],
        pw: Pairwise<'_>,
    ) -> Result<Plan> {
        let (me, k, layout) = (self.rank, self.cfg.top_k, self.contract.layout);
        let wi = self.cfg.apply_router_weight_on_input;
        let row_bytes = self.wire_row_bytes();
        let scaled;
        let src: &[u8] = if self.fp8.is_some() {
            fp8_rows
        } else if wi {
            scaled = self.weighted(inp.hidden, inp.topk_weights)?;
            &scaled
        } else {
            inp.hidden
        };
        let Pairwise {
            mine,
            give,
            tokens,
            to_me,
            sizes,
            buffer_rows,
        } = pw;
        let spare = !self.contract.fixed_capacity();
        self.recv_shared = false;
        let dst = self.hidden.prepare(
            g,
            buffer_rows * row_bytes,
            spare,
            "the dispatch receive buffer",
        )?;
        let rx = Receive {
            me,
            k,
            num_experts: self.cfg.num_experts,
            row_bytes,
            tokens,
            to_me,
        };
        let geo = &self.geo;
        rows::swap_chunks(
            g,
            sizes,
            "dispatch",
            |out, ss, lead| pack(mine, (src, row_bytes), give, me, out, (ss, lead)),
            |recv, rs, lead| {
                let all = rx.routing(recv, rs, lead, mine)?;
                let plan = plan::build(layout, geo, me, &all, wi);
                if plan.buffer_rows != buffer_rows {
                    return Err(Error::Internal(format!(
                        "dispatch: the plan has {} rows but the counts said {buffer_rows}",
                        plan.buffer_rows
                    )));
                }
                rx.unpack(recv, rs, lead, &plan, dst)?;
                rows::copy_own_rows(src, row_bytes, &plan.give[me], &plan.take[me], dst, false);
                Ok(plan)
            },
        )
    }
}

/// What [`Manager::move_pairwise`] takes from the header exchange.
struct Pairwise<'a> {
    mine: &'a Routing,
    give: &'a [Vec<u32>],
    tokens: &'a [usize],
    to_me: &'a [usize],
    sizes: (&'a [usize], &'a [usize]),
    buffer_rows: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::layout::Geometry;
    use crate::select::all2all::Layout;

    /// A routing of `t` tokens over `e` experts, top-`k` distinct ids, some masked (-1).
    fn routing(seed: &mut u64, t: usize, k: usize, e: usize) -> Routing {
        let mut next = || {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (*seed >> 33) as usize
        };
        let mut ids = Vec::with_capacity(t * k);
        for _ in 0..t {
            let mut row: Vec<i64> = Vec::new();
            while row.len() < k {
                let id = if next() % 7 == 0 {
                    -1
                } else {
                    (next() % e) as i64
                };
                if id < 0 || !row.contains(&id) {
                    row.push(id);
                }
            }
            ids.extend(row);
        }
        let weights = (0..t * k).map(|i| (i % 5) as f32 * 0.25).collect();
        Routing { t, k, ids, weights }
    }

    /// What rank `me` rebuilds of every source's routing: the tokens each sent it, by the
    /// source's own send side, the rest -1 (as [`Receive::routing`] does from the chunks).
    fn received(layout: Layout, geo: &Geometry, me: usize, all: &[Routing]) -> Vec<Routing> {
        let k = geo.top_k;
        (0..geo.world)
            .map(|s| {
                if s == me {
                    return all[me].clone();
                }
                let mut solo: Vec<Routing> = (0..geo.world)
                    .map(|_| Routing {
                        t: 0,
                        k,
                        ids: vec![],
                        weights: vec![],
                    })
                    .collect();
                solo[s] = all[s].clone();
                let give = plan::build(layout, geo, s, &solo, false).give;
                let t = all[s].t;
                let mut r = Routing {
                    t,
                    k,
                    ids: vec![-1; t * k],
                    weights: vec![0.0; t * k],
                };
                for &tok in &give[me] {
                    let tok = tok as usize;
                    let row = tok * k..(tok + 1) * k;
                    r.ids[row.clone()].copy_from_slice(&all[s].ids[row.clone()]);
                    r.weights[row.clone()].copy_from_slice(&all[s].weights[row]);
                }
                r
            })
            .collect()
    }

    /// Every layout a token goes pairwise in: the plan from what a rank receives is the plan
    /// from every rank's whole routing (random routings, 2 to 4 ranks, 0 to 6 tokens each).
    #[test]
    fn the_received_routing_gives_the_whole_routings_plan() {
        let mut seed = 7u64;
        for layout in [
            Layout::Replicated,
            Layout::TokenMajor,
            Layout::ExpertMajor,
            Layout::ExpertPacked,
            Layout::RankMajor,
        ] {
            for world in 2..=4 {
                for k in 1..=3 {
                    let e = 2 * world;
                    let geo = Geometry {
                        world,
                        num_experts: e,
                        experts_per_rank: 2,
                        top_k: k,
                        max_tokens: 6,
                    };
                    let all: Vec<Routing> = (0..world)
                        .map(|r| routing(&mut seed, (r * 5 + k) % 7, k, e))
                        .collect();
                    for me in 0..world {
                        let whole = plan::build(layout, &geo, me, &all, false);
                        let part = received(layout, &geo, me, &all);
                        assert_eq!(
                            plan::build(layout, &geo, me, &part, false),
                            whole,
                            "{layout:?}, world {world}, k {k}, rank {me}"
                        );
                    }
                }
            }
        }
    }
}
