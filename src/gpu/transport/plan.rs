//! Host-side planning of the GPU transport (pure Rust, no CUDA): the counts row every rank
//! all-gathers, its parsing into the R×R matrices the exchanges need, receive offsets, the
//! recursive scan's levels, grid sizing, and the shape of every layout's outputs for given
//! counts. Everything here is unit-tested on the CPU (`tests/gpu_plan.rs`); the `nccl`-feature
//! manager ([`super::GpuManager`]) only feeds it numbers read back from the device.
//!
//! # The counts row (one `ncclAllGather` of int32, one host sync per dispatch)
//! `[T, err_lo, err_hi, rank_counts[R], expert_counts[E]]`: `T` = tokens of the rank,
//! `err` = its `ep_layout` device error word (u64 as two little-endian int32 halves, so every
//! rank learns that a peer rejected its input and all return an error instead of hanging),
//! `rank_counts[d]` = tokens going to rank d, `expert_counts[e]` = (token, expert e) pairs (the
//! EPLB load histogram). Everything the receiver's layouts need is derived from this matrix:
//! rows received per source, EXPERT_PACKED's exact row count, and the (token, k) pairs the
//! expert layouts return in combine.

use crate::error::{Error, Result};
pub use crate::gpu::calls::{blocks_for, scan_blocks, scan_levels, scan_scratch_elems};
use crate::gpu::kernels::{decode_error_word, DeviceError};
use crate::gpu::nccl::plan::{ExchangePlan, LocalCopy, PeerTransfer};
use crate::moe::layout::{self, Capacity, Unit};
use crate::select::all2all::{Backend, Layout};

/// Offset of `T` in the counts row.
pub const ROW_TOKENS: usize = 0;
/// Offset of the error word's low half (the high half follows).
pub const ROW_ERROR: usize = 1;
/// Offset of `rank_counts` in the counts row.
pub const ROW_RANK_COUNTS: usize = 3;

/// int32 entries of one rank's counts row for `world` ranks and `num_experts` experts.
pub fn counts_row_len(world: usize, num_experts: usize) -> usize {
    ROW_RANK_COUNTS + world + num_experts
}

/// Offset of `expert_counts` in the counts row.
pub fn row_expert_counts(world: usize) -> usize {
    ROW_RANK_COUNTS + world
}

/// The all-gathered counts rows of every rank, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gathered {
    /// Ranks.
    pub world: usize,
    /// Experts (physical).
    pub num_experts: usize,
    /// Tokens of each rank.
    pub tokens: Vec<usize>,
    /// Each rank's device error word (0 = none).
    pub errors: Vec<u64>,
    /// `rank_counts[src * world + dst]`: tokens `src` sends to `dst`.
    pub rank_counts: Vec<i32>,
    /// `expert_counts[src * num_experts + e]`: pairs of `src`'s tokens routed to expert `e`.
    pub expert_counts: Vec<i32>,
}

fn bad(msg: String) -> Error {
    Error::Internal(format!("GPU counts exchange: {msg}"))
}

impl Gathered {
    /// Parses `world` counts rows (`raw.len() == world * counts_row_len`). Negative entries
    /// are an internal error (the kernels only add).
    pub fn parse(raw: &[i32], world: usize, num_experts: usize) -> Result<Gathered> {
        let len = counts_row_len(world, num_experts);
        if world == 0 || raw.len() != world * len {
            return Err(bad(format!(
                "{} entries for {world} ranks, expected {}",
                raw.len(),
                world * len
            )));
        }
        let mut g = Gathered {
            world,
            num_experts,
            tokens: Vec::with_capacity(world),
            errors: Vec::with_capacity(world),
            rank_counts: Vec::with_capacity(world * world),
            expert_counts: Vec::with_capacity(world * num_experts),
        };
        for (src, row) in raw.chunks_exact(len).enumerate() {
            let t = usize::try_from(row[ROW_TOKENS])
                .map_err(|_| bad(format!("rank {src} reports {} tokens", row[ROW_TOKENS])))?;
            g.tokens.push(t);
            let lo = row[ROW_ERROR] as u32 as u64;
            let hi = row[ROW_ERROR + 1] as u32 as u64;
            g.errors.push(lo | (hi << 32));
            let body = &row[ROW_RANK_COUNTS..];
            if let Some((i, &c)) = body.iter().enumerate().find(|(_, &c)| c < 0) {
                return Err(bad(format!(
                    "rank {src} reports a negative count {c} at {i}"
                )));
            }
            g.rank_counts.extend_from_slice(&body[..world]);
            g.expert_counts.extend_from_slice(&body[world..]);
        }
        Ok(g)
    }

    /// The first rank (lowest) whose input was rejected, with its decoded error.
    pub fn first_error(&self) -> Option<(usize, DeviceError)> {
        self.errors
            .iter()
            .enumerate()
            .find_map(|(r, &w)| decode_error_word(w).map(|e| (r, e)))
    }

    /// The error every rank returns when some rank's input was rejected: this rank's own
    /// error as is, a peer's error naming the peer.
    pub fn check(&self, rank: usize) -> Result<()> {
        if let Some(e) = decode_error_word(self.errors.get(rank).copied().unwrap_or(0)) {
            return Err(e.to_error());
        }
        if let Some((r, e)) = self.first_error() {
            return Err(Error::InvalidArgument(format!(
                "rank {r} rejected its dispatch input: {e}"
            )));
        }
        Ok(())
    }

    /// Experts per rank.
    pub fn experts_per_rank(&self) -> usize {
        self.num_experts / self.world
    }

    /// `m[src * world + dst]` = (token, k) pairs `src` routes to experts of `dst` (the rows the
    /// expert layouts return to `src` in combine, and EXPERT_PACKED's row count per source).
    pub fn pair_counts(&self) -> Vec<i32> {
        let (r, el) = (self.world, self.experts_per_rank());
        let mut m = vec![0i32; r * r];
        for src in 0..r {
            for dst in 0..r {
                let row = &self.expert_counts[src * self.num_experts..][dst * el..(dst + 1) * el];
                m[src * r + dst] = row.iter().sum();
            }
        }
        m
    }

    /// REPLICATED's matrix: every rank sends all its tokens to every rank.
    pub fn replicated_counts(&self) -> Vec<i32> {
        let r = self.world;
        (0..r * r).map(|i| self.tokens[i / r] as i32).collect()
    }
}

/// `m` transposed (`world × world`): the combine direction of a dispatch matrix.
pub fn transpose(m: &[i32], world: usize) -> Vec<i32> {
    (0..world * world)
        .map(|i| m[(i % world) * world + i / world])
        .collect()
}

/// Column `dst` of `m` as receive offsets `[world + 1]` (rows from source s are
/// `[off[s], off[s+1])`), the `recv_offsets` the unpack kernels read.
pub fn recv_offsets(m: &[i32], world: usize, dst: usize) -> Vec<i32> {
    let mut off = Vec::with_capacity(world + 1);
    let mut acc = 0i32;
    off.push(0);
    for src in 0..world {
        acc += m[src * world + dst];
        off.push(acc);
    }
    off
}

/// A broadcast exchange: every rank sends the same `rows[rank]` rows (offset 0 of its send
/// buffer) to every peer and receives `rows[src]` rows from each source, grouped by source.
/// REPLICATED's all-gather (rows = tokens of each rank) and capacity mode's static slabs
/// (rows = M everywhere) use it; the self slot is a local copy. Without zero-size p2p
/// (`zero_size` false, NCCL < 2.12.10) empty transfers are left out on both sides.
pub fn broadcast_plan(
    rows: &[usize],
    rank: usize,
    row_bytes: usize,
    zero_size: bool,
) -> ExchangePlan {
    let world = rows.len();
    let mine = rows[rank] * row_bytes;
    let mut plan = ExchangePlan {
        rank,
        world,
        row_bytes,
        send_bytes: mine,
        ..ExchangePlan::default()
    };
    let mut off = 0;
    for (src, &t) in rows.iter().enumerate() {
        let b = t * row_bytes;
        plan.recv_rows.push(t);
        if src == rank {
            if b > 0 {
                plan.local = Some(LocalCopy {
                    send_offset: 0,
                    recv_offset: off,
                    bytes: b,
                });
            }
        } else {
            if mine > 0 || zero_size {
                plan.sends.push(PeerTransfer {
                    peer: src,
                    offset: 0,
                    bytes: mine,
                });
            }
            if b > 0 || zero_size {
                plan.recvs.push(PeerTransfer {
                    peer: src,
                    offset: off,
                    bytes: b,
                });
            }
        }
        off += b;
    }
    plan.recv_bytes = off;
    plan
}

/// The configuration's sizes the kernels receive as 32-bit `int`s (or index with `int`
/// positions) must fit: `hidden`, `num_experts`, and for fixed-capacity buffers
/// `max_tokens_per_rank × world × top_k + 1` (capacity mode scans that many pair slots;
/// EXPERT_MAJOR passes `M × R` as the bucket capacity, RANK_MAJOR `M`). Checked when a
/// manager is created, so no `as i32` can wrap later.
pub fn check_index_limits(
    world: usize,
    num_experts: usize,
    top_k: usize,
    hidden: usize,
    max_tokens_per_rank: usize,
) -> Result<()> {
    let fits = |v: usize, what: &str| -> Result<()> {
        if v > i32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "{what} is {v}: the GPU kernels index with 32-bit ints (at most {})",
                i32::MAX
            )));
        }
        Ok(())
    };
    fits(hidden, "hidden")?;
    fits(num_experts, "num_experts")?;
    fits(
        max_tokens_per_rank
            .saturating_mul(world)
            .saturating_mul(top_k.max(1))
            .saturating_add(1),
        "max_tokens_per_rank x world_size x top_k",
    )
}

/// What a GPU dispatch returns on one rank, as shapes (element counts per dimension): the
/// layout contract's output shapes ([`layout::Shapes`], read through `Deref`: `hidden`,
/// `topk_ids`, `topk_weights`, `counts`, `expert_offsets`, `src`) and the row counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchShape {
    /// The layout.
    pub layout: Layout,
    /// Rows actually received (REPLICATED/TOKEN_MAJOR: rows of `hidden`; EXPERT_MAJOR: rows in
    /// all buckets; EXPERT_PACKED: rows; RANK_MAJOR: rows in all regions).
    pub received_rows: usize,
    /// Rows of the combine input, i.e. of `hidden` flattened over its leading dimensions.
    pub buffer_rows: usize,
    /// The outputs' shapes (an empty vector or 0 = not produced).
    pub shapes: layout::Shapes,
}

impl std::ops::Deref for DispatchShape {
    type Target = layout::Shapes;

    fn deref(&self) -> &layout::Shapes {
        &self.shapes
    }
}

impl DispatchShape {
    /// The shape of a buffer of `buffer_rows` rows, `received_rows` of them received, with the
    /// contract's output shapes.
    pub fn new(
        layout: Layout,
        received_rows: usize,
        buffer_rows: usize,
        shapes: layout::Shapes,
    ) -> DispatchShape {
        DispatchShape {
            layout,
            received_rows,
            buffer_rows,
            shapes,
        }
    }
}

/// The geometry a shape depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShapeGeometry {
    /// Ranks.
    pub world: usize,
    /// This rank.
    pub rank: usize,
    /// Physical experts.
    pub num_experts: usize,
    /// Top-k.
    pub top_k: usize,
    /// Elements per hidden row.
    pub hidden: usize,
    /// M (fixed-capacity layouts).
    pub max_tokens_per_rank: usize,
    /// The backend name (for the capacity error, worded as the CPU manager words it).
    pub backend: Backend,
}

impl ShapeGeometry {
    /// The same sizes as the layout contract's geometry.
    pub fn layout_geometry(&self) -> layout::Geometry {
        layout::Geometry {
            world: self.world,
            num_experts: self.num_experts,
            experts_per_rank: self.num_experts / self.world.max(1),
            top_k: self.top_k,
            max_tokens: self.max_tokens_per_rank,
        }
    }
}

/// The dispatch output shapes of `layout` on `geo.rank` for the gathered counts; errors when a
/// fixed-capacity layout would overflow (naming the source rank), as the CPU path does. The
/// shapes follow the layout's contract ([`layout::Contract::shapes`]).
pub fn dispatch_shape(layout: Layout, geo: &ShapeGeometry, g: &Gathered) -> Result<DispatchShape> {
    let c = layout::contract(layout)
        .ok_or_else(|| Error::NotImplemented("the GPU path has no MoonEP layout".into()))?;
    check_capacity(&c, geo, g)?;
    let (r, d) = (geo.world, geo.rank);
    let col = |mat: &[i32]| -> usize { (0..r).map(|s| mat[s * r + d] as usize).sum() };
    let received_rows = match c.unit {
        Unit::EveryToken => g.tokens.iter().sum(),
        Unit::Token => col(&g.rank_counts),
        Unit::TokenExpert => col(&g.pair_counts()),
    };
    let lg = geo.layout_geometry();
    let buffer_rows = c.buffer_rows(&lg, received_rows);
    let sh = c.shapes(&lg, geo.hidden, buffer_rows);
    Ok(DispatchShape::new(layout, received_rows, buffer_rows, sh))
}

/// The fixed-capacity rules on the gathered counts: T ≤ M on every source rank (as the CPU
/// path: even when every destination gets ≤ M rows), and ≤ M rows from each source in a
/// RANK_MAJOR region.
fn check_capacity(c: &layout::Contract, geo: &ShapeGeometry, g: &Gathered) -> Result<()> {
    let (r, d, m) = (geo.world, geo.rank, geo.max_tokens_per_rank);
    if !c.fixed_capacity() {
        return Ok(());
    }
    for src in 0..r {
        if g.tokens[src] > m {
            return Err(crate::moe::too_many_tokens(
                src,
                g.tokens[src],
                m,
                geo.backend,
                c.layout,
            ));
        }
        let n = g.rank_counts[src * r + d] as usize;
        if c.capacity == Capacity::PerSourceRank && n > m {
            return Err(Error::InvalidArgument(format!(
                "rank {src} sends {n} tokens to rank {d}, more than max_tokens_per_rank = {m}"
            )));
        }
    }
    Ok(())
}

/// The matrix of rows the combine exchange moves (`[src * world + dst]`, src = the expert
/// rank sending results back): the transpose of the rows dispatch moved for the token layouts,
/// of the (token, k) pairs for the expert layouts.
pub fn combine_counts(layout: Layout, g: &Gathered) -> Vec<i32> {
    let moved = match layout::contract(layout).map(|c| c.unit) {
        Some(Unit::EveryToken) => g.replicated_counts(),
        // MOONEP_SLOTS has no GPU dispatch (dispatch_shape refuses it); rows as moved.
        Some(Unit::Token) | None => g.rank_counts.clone(),
        Some(Unit::TokenExpert) => g.pair_counts(),
    };
    transpose(&moved, g.world)
}

/// Capacity mode (no host sync, CUDA-graph capturable): which layouts it serves. Only
/// EXPERT_MAJOR (DeepEP LL / NIXL EP, the decode layouts graphs are used for): every rank
/// sends its `M` padded rows to every peer (static sizes: `R × M` rows, padding rows carry ids
/// −1 so no kernel selects them) and combine returns `M × K` pair rows per peer at fixed
/// positions.
pub fn capacity_supported(layout: Layout) -> bool {
    layout == Layout::ExpertMajor
}

/// Bytes capacity mode moves per rank and direction for `world` ranks, M tokens, a row of
/// `row_bytes` and `top_k` (dispatch: rows + int32 ids + f32 weights + int32 source per
/// row, to every peer; combine: `M·K` expert rows of `expert_row_bytes` per peer).
pub fn capacity_bytes(
    world: usize,
    max_tokens: usize,
    row_bytes: usize,
    top_k: usize,
    expert_row_bytes: usize,
) -> (usize, usize) {
    let per_row = row_bytes + 8 * top_k + 4;
    (
        world * max_tokens * per_row,
        world * max_tokens * top_k * expert_row_bytes,
    )
}
