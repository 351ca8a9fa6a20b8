//! Each layout's contract as data: what one received row stands for, the capacity rule, which
//! outputs exist and their shapes, who applies the top-k weights, metadata bytes per row and
//! buffer row counts. [`contract`] is the one `match` on [`Layout`] that states a contract;
//! every other fact is derived from its fields, so a new layout is a compile error here and
//! nowhere else that only needs facts. The CPU manager, the plan, the toy experts, the sizing
//! functions, the GPU path, the C views and the layout tables of docs/design.md (checked by
//! `tests/moe.rs`) all read it.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::select::all2all::Layout;

/// What one received row stands for, which is also the receive order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Every token of every rank, on every rank (source rank, then token).
    EveryToken,
    /// One row per (source, token) that goes to this rank (source rank, then token).
    Token,
    /// One row per (source, token, local expert) (local expert, then source rank, then token).
    TokenExpert,
}

/// How many rows the receive buffer has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capacity {
    /// Exactly the rows received.
    Exact,
    /// A region of M rows per source rank (R·M rows); a rank with T > M is an error.
    PerSourceRank,
    /// A bucket of M·R rows per local expert (E_local·M·R rows); a rank with T > M is an error.
    PerLocalExpert,
}

/// Who multiplies expert outputs by the top-k weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightsBy {
    /// The holder: each returned row is already the weighted sum over its experts, and the
    /// source sums rows with weight 1.
    Holder,
    /// The source: it multiplies each returned row by that (token, expert)'s weight.
    Source,
}

/// The `topk_ids` output (int64, `[rows, K]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ids {
    /// Not produced.
    None,
    /// The token's ids as sent (padding rows of fixed regions: all -1).
    AsSent,
    /// The ids this rank owns; the others set to -1.
    Local,
}

/// The `topk_weights` output (float32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weights {
    /// Not produced.
    None,
    /// `[rows, K]`, the weight of each id of `topk_ids` (0.0 where the id is -1 by `Local`).
    PerId,
    /// `[rows]`, the weight of the row's (token, expert).
    PerRow,
}

/// The `counts` output (int32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counts {
    /// Not produced.
    None,
    /// `[E_local]`: rows (token layouts) or (token, expert) pairs (expert layouts) per local
    /// expert; the same number either way.
    PerLocalExpert,
    /// `[R]`: rows received from each source rank (`recv_counts`).
    PerSourceRank,
}

/// One layout's contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contract {
    /// The layout this is the contract of.
    pub layout: Layout,
    /// What one received row stands for.
    pub unit: Unit,
    /// Rows of the receive buffer.
    pub capacity: Capacity,
    /// Who applies the top-k weights.
    pub weights_by: WeightsBy,
    /// The `topk_ids` output.
    pub topk_ids: Ids,
    /// The `topk_weights` output.
    pub topk_weights: Weights,
    /// The `counts` output.
    pub counts: Counts,
    /// Whether `expert_offsets [E_local + 1]` is produced.
    pub expert_offsets: bool,
    /// Whether `src_rank` and `src_token [rows]` (int32) are produced.
    pub src: bool,
}

/// The contract of `layout`; `None` for MOONEP_SLOTS, whose kernels are not part of epcomm.
pub fn contract(layout: Layout) -> Option<Contract> {
    let c = |unit, capacity, weights_by, topk_ids, topk_weights, counts| Contract {
        layout,
        unit,
        capacity,
        weights_by,
        topk_ids,
        topk_weights,
        counts,
        expert_offsets: false,
        src: false,
    };
    use Capacity::{Exact, PerLocalExpert, PerSourceRank};
    use WeightsBy::{Holder, Source};
    Some(match layout {
        Layout::Replicated => c(
            Unit::EveryToken,
            Exact,
            Holder,
            Ids::AsSent,
            Weights::PerId,
            Counts::None,
        ),
        Layout::TokenMajor => c(
            Unit::Token,
            Exact,
            Holder,
            Ids::Local,
            Weights::PerId,
            Counts::PerLocalExpert,
        ),
        Layout::ExpertMajor => c(
            Unit::TokenExpert,
            PerLocalExpert,
            Source,
            Ids::None,
            Weights::None,
            Counts::PerLocalExpert,
        ),
        Layout::ExpertPacked => Contract {
            expert_offsets: true,
            src: true,
            ..c(
                Unit::TokenExpert,
                Exact,
                Source,
                Ids::None,
                Weights::PerRow,
                Counts::None,
            )
        },
        Layout::RankMajor => c(
            Unit::Token,
            PerSourceRank,
            Holder,
            Ids::AsSent,
            Weights::PerId,
            Counts::PerSourceRank,
        ),
        Layout::MoonepSlots => return None,
    })
}

/// [`contract`], or MoonEP's "not available" error (what creating its manager says).
pub fn require(layout: Layout) -> Result<Contract> {
    contract(layout).ok_or(Error::MoonEpUnavailable)
}

/// The contracts of every implemented layout, in [`Layout::ALL`] order.
pub fn all() -> impl Iterator<Item = Contract> {
    Layout::ALL.into_iter().filter_map(contract)
}

/// The sizes every rank shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Ranks R.
    pub world: usize,
    /// Physical experts E.
    pub num_experts: usize,
    /// E_local = E / R.
    pub experts_per_rank: usize,
    /// K.
    pub top_k: usize,
    /// M, the capacity per source rank of the fixed-capacity layouts.
    pub max_tokens: usize,
}

impl Geometry {
    /// The rank owning expert `e` (experts are placed contiguously).
    pub fn owner(&self, e: i64) -> usize {
        e as usize / self.experts_per_rank
    }
}

/// The shapes of one dispatch's outputs (element counts per dimension; an empty vector or a 0
/// length means the output is not produced).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shapes {
    /// `hidden` (the last dimension is the hidden size; extras replace it by their bytes).
    pub hidden: Vec<usize>,
    /// int64 `topk_ids`.
    pub topk_ids: Vec<usize>,
    /// float32 `topk_weights`.
    pub topk_weights: Vec<usize>,
    /// int32 `counts` length.
    pub counts: usize,
    /// `expert_offsets` length.
    pub expert_offsets: usize,
    /// int32 `src_rank` and `src_token` length.
    pub src: usize,
}

impl Contract {
    /// Whether the buffers hold M tokens per source rank (T > M is an error on every rank).
    pub const fn fixed_capacity(&self) -> bool {
        match self.capacity {
            Capacity::Exact => false,
            Capacity::PerSourceRank | Capacity::PerLocalExpert => true,
        }
    }

    /// Rows of the receive buffer, padding included, for `received` rows actually received.
    pub fn buffer_rows(&self, geo: &Geometry, received: usize) -> usize {
        match self.capacity {
            Capacity::Exact => received,
            Capacity::PerSourceRank => geo.world * geo.max_tokens,
            Capacity::PerLocalExpert => geo.experts_per_rank * geo.max_tokens * geo.world,
        }
    }

    /// Worst-case rows of the receive buffer for `tokens` tokens on every rank (`geo.max_tokens`
    /// is the M the fixed layouts use); `None` when it does not fit.
    pub fn worst_case_rows(&self, geo: &Geometry, tokens: usize) -> Option<usize> {
        let (r, el, m) = (geo.world, geo.experts_per_rank, geo.max_tokens);
        match self.capacity {
            Capacity::Exact => match self.unit {
                Unit::EveryToken | Unit::Token => r.checked_mul(tokens),
                Unit::TokenExpert => r.checked_mul(tokens)?.checked_mul(geo.top_k.min(el)),
            },
            Capacity::PerSourceRank => r.checked_mul(m),
            Capacity::PerLocalExpert => el.checked_mul(m)?.checked_mul(r),
        }
    }

    /// Bytes of per-row metadata (ids, weights, source) on the receiver for top-k `k`.
    pub fn meta_bytes_per_row(&self, k: usize) -> Option<usize> {
        let ids = match self.topk_ids {
            Ids::None => 0,
            Ids::AsSent | Ids::Local => k.checked_mul(8)?,
        };
        let weights = match self.topk_weights {
            Weights::None => 0,
            Weights::PerId => k.checked_mul(4)?,
            Weights::PerRow => 4,
        };
        let src = if self.src { 8 } else { 0 };
        ids.checked_add(weights)?.checked_add(src)
    }

    /// The shape of `hidden` (`hidden` elements per row) for a buffer of `buffer_rows` rows.
    pub fn hidden_shape(&self, geo: &Geometry, hidden: usize, buffer_rows: usize) -> Vec<usize> {
        let (r, m) = (geo.world, geo.max_tokens);
        match self.capacity {
            Capacity::Exact => vec![buffer_rows, hidden],
            Capacity::PerSourceRank => vec![r, m, hidden],
            Capacity::PerLocalExpert => vec![geo.experts_per_rank, m * r, hidden],
        }
    }

    /// The shapes of every output for a buffer of `buffer_rows` rows.
    pub fn shapes(&self, geo: &Geometry, hidden: usize, buffer_rows: usize) -> Shapes {
        let (rows, k, el) = (buffer_rows, geo.top_k, geo.experts_per_rank);
        Shapes {
            hidden: self.hidden_shape(geo, hidden, rows),
            topk_ids: match self.topk_ids {
                Ids::None => Vec::new(),
                Ids::AsSent | Ids::Local => vec![rows, k],
            },
            topk_weights: match self.topk_weights {
                Weights::None => Vec::new(),
                Weights::PerId => vec![rows, k],
                Weights::PerRow => vec![rows],
            },
            counts: match self.counts {
                Counts::None => 0,
                Counts::PerLocalExpert => el,
                Counts::PerSourceRank => geo.world,
            },
            expert_offsets: if self.expert_offsets { el + 1 } else { 0 },
            src: if self.src { rows } else { 0 },
        }
    }

    /// The weight combine gives a returned row whose (token, expert) has routing weight `w`.
    pub fn combine_weight(&self, w: f32) -> f32 {
        match self.weights_by {
            WeightsBy::Holder => 1.0,
            WeightsBy::Source => w,
        }
    }

    /// The buffer rows holding local expert `j`'s rows, from the dispatch's `counts` and
    /// `expert_offsets` (`bucket_rows` = M·R, the rows of one fixed bucket); `None` for the
    /// layouts whose rows are not grouped by expert, or when the outputs do not say.
    pub fn expert_rows(
        &self,
        j: usize,
        bucket_rows: usize,
        counts: &[i32],
        offsets: &[i64],
    ) -> Option<Range<usize>> {
        match self.unit {
            Unit::EveryToken | Unit::Token => None,
            Unit::TokenExpert => match self.capacity {
                Capacity::PerLocalExpert => {
                    let start = j * bucket_rows;
                    Some(start..start + usize::try_from(*counts.get(j)?).ok()?)
                }
                Capacity::Exact | Capacity::PerSourceRank => {
                    let at = |i: usize| offsets.get(i).and_then(|&o| usize::try_from(o).ok());
                    Some(at(j)?..at(j + 1)?)
                }
            },
        }
    }
}

/// The worked example's geometry (docs/design.md, section 3): R = 2, E = 4, K = 2, M = 3.
#[cfg(test)]
pub(super) const WORKED_EXAMPLE: Geometry = Geometry {
    world: 2,
    num_experts: 4,
    experts_per_rank: 2,
    top_k: 2,
    max_tokens: 3,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_but_moonep_has_a_contract() {
        for l in Layout::ALL {
            assert_eq!(
                contract(l).map(|c| c.layout),
                (l != Layout::MoonepSlots).then_some(l)
            );
        }
        assert_eq!(require(Layout::MoonepSlots), Err(Error::MoonEpUnavailable));
        assert_eq!(all().count(), 5);
    }

    #[test]
    fn sizes_follow_the_worked_example() {
        let g = WORKED_EXAMPLE;
        let rows = |l| require(l).map(|c| c.buffer_rows(&g, 4));
        assert_eq!(rows(Layout::ExpertMajor), Ok(12));
        assert_eq!(rows(Layout::RankMajor), Ok(6));
        assert_eq!(rows(Layout::ExpertPacked), Ok(4));
        let c = require(Layout::ExpertPacked).unwrap();
        assert_eq!(c.meta_bytes_per_row(2), Some(12));
        assert_eq!(c.worst_case_rows(&g, 3), Some(12));
        let s = c.shapes(&g, 1, 4);
        assert_eq!((s.topk_weights, s.expert_offsets, s.src), (vec![4], 3, 4));
        assert_eq!(c.expert_rows(1, 0, &[], &[0, 2, 4]), Some(2..4));
        let m = require(Layout::ExpertMajor).unwrap();
        assert_eq!(m.expert_rows(1, 6, &[2, 2], &[]), Some(6..8));
        assert_eq!(m.hidden_shape(&g, 1, 12), vec![2, 6, 1]);
        assert_eq!(
            require(Layout::TokenMajor).unwrap().meta_bytes_per_row(2),
            Some(24)
        );
    }
}
