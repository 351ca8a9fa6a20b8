//! The kernel launches of [`crate::gpu::launch::Kernels`] as data (pure, always built): which
//! entry point, grid, block and arguments each helper issues. The `cuda` launcher executes
//! these [`Call`]s on a stream; `tests/gpu_pipeline_counts_emu.rs` executes the same calls
//! with the real kernel sources compiled for the host, so the arguments the manager passes
//! (order, sizes, grids, the scan's recursion) are checked without a GPU.

use crate::error::{Error, Result};
pub use crate::gpu::kernels::Arg;
use crate::gpu::kernels::{
    self, CombineReturnExpertArgs, CombineReturnRankMajorArgs, KernelSig, LayoutArgs,
    LocalCopyArgs, PackArgs, PairRowsArgs, RecvFlagsArgs, ScanAddArgs, ScanBlockArgs, SumRanksArgs,
    UnpackExpertMajorArgs, UnpackExpertPackedArgs, UnpackRankMajorArgs, UnpackTokenMajorArgs,
    WeightedCombineArgs, SCAN_THREADS, SCAN_TILE,
};

// ---- grids ----

/// Element counts of each level of the recursive scan of `n` int32: `[n, tiles(n),
/// tiles(tiles(n)), …]`, stopping at the first level that fits one tile. `ep_scan_block` runs
/// on every level (block sums of level i are the input of level i+1), then `ep_scan_add` walks
/// back down adding each tile's offset.
pub fn scan_levels(n: usize) -> Vec<usize> {
    let tile = SCAN_TILE as usize;
    let mut v = vec![n];
    let mut cur = n;
    while cur > tile {
        cur = cur.div_ceil(tile);
        v.push(cur);
    }
    v
}

/// Blocks of `ep_scan_block` for `n` elements (at least 1, so `out[0]` is written for n = 0).
pub fn scan_blocks(n: usize) -> u32 {
    n.div_ceil(SCAN_TILE as usize).max(1) as u32
}

/// int32 scratch a scan of `n` needs beyond its output: one `tiles + 1` array per level above
/// the first (the block sums, scanned in place into that level's tile offsets).
pub fn scan_scratch_elems(n: usize) -> usize {
    scan_levels(n)[1..].iter().map(|&m| m + 1).sum()
}

/// Blocks for a grid-stride kernel: `units` work items of `per_block` each, capped at
/// `max_blocks` (≥ 1 block, so kernels that write a header for empty input still run).
pub fn blocks_for(units: u64, per_block: u64, max_blocks: u32) -> u32 {
    let b = units.div_ceil(per_block.max(1));
    b.clamp(1, u64::from(max_blocks.max(1))) as u32
}

/// Threads per block of the grid-stride kernels.
pub const BLOCK: u32 = 256;

/// Which loaded kernel a call runs. `PairRowsWire` is `ep_pair_rows` of the int32-id variant
/// (capacity mode runs it on the wire ids); unpack always uses the int64-id variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// `ep_layout` (caller's id dtype).
    Layout,
    /// `ep_pair_rows` (caller's id dtype).
    PairRows,
    /// `ep_pair_rows` (int32 ids).
    PairRowsWire,
    /// `ep_recv_flags`.
    RecvFlags,
    /// `ep_scan_block`.
    ScanBlock,
    /// `ep_scan_add`.
    ScanAdd,
    /// `ep_pack` (caller's id dtype).
    Pack,
    /// `ep_local_copy`.
    LocalCopy,
    /// `ep_unpack_token_major` (int64 output ids).
    UnpackTokenMajor,
    /// `ep_unpack_expert_major`.
    UnpackExpertMajor,
    /// `ep_unpack_expert_packed`.
    UnpackExpertPacked,
    /// `ep_unpack_rank_major` (int64 output ids).
    UnpackRankMajor,
    /// `ep_combine_return_expert`.
    CombineReturnExpert,
    /// `ep_combine_return_rank_major`.
    CombineReturnRankMajor,
    /// `ep_weighted_combine`.
    WeightedCombine,
    /// `ep_sum_ranks`.
    SumRanks,
}

impl KernelId {
    /// Every kernel a configuration loads, in declaration order (`id as usize` indexes it).
    pub const ALL: [KernelId; 16] = [
        KernelId::Layout,
        KernelId::PairRows,
        KernelId::PairRowsWire,
        KernelId::RecvFlags,
        KernelId::ScanBlock,
        KernelId::ScanAdd,
        KernelId::Pack,
        KernelId::LocalCopy,
        KernelId::UnpackTokenMajor,
        KernelId::UnpackExpertMajor,
        KernelId::UnpackExpertPacked,
        KernelId::UnpackRankMajor,
        KernelId::CombineReturnExpert,
        KernelId::CombineReturnRankMajor,
        KernelId::WeightedCombine,
        KernelId::SumRanks,
    ];

    /// The entry point's parameter table.
    pub fn sig(self) -> &'static KernelSig {
        match self {
            KernelId::Layout => &kernels::EP_LAYOUT,
            KernelId::PairRows | KernelId::PairRowsWire => &kernels::EP_PAIR_ROWS,
            KernelId::RecvFlags => &kernels::EP_RECV_FLAGS,
            KernelId::ScanBlock => &kernels::EP_SCAN_BLOCK,
            KernelId::ScanAdd => &kernels::EP_SCAN_ADD,
            KernelId::Pack => &kernels::EP_PACK,
            KernelId::LocalCopy => &kernels::EP_LOCAL_COPY,
            KernelId::UnpackTokenMajor => &kernels::EP_UNPACK_TOKEN_MAJOR,
            KernelId::UnpackExpertMajor => &kernels::EP_UNPACK_EXPERT_MAJOR,
            KernelId::UnpackExpertPacked => &kernels::EP_UNPACK_EXPERT_PACKED,
            KernelId::UnpackRankMajor => &kernels::EP_UNPACK_RANK_MAJOR,
            KernelId::CombineReturnExpert => &kernels::EP_COMBINE_RETURN_EXPERT,
            KernelId::CombineReturnRankMajor => &kernels::EP_COMBINE_RETURN_RANK_MAJOR,
            KernelId::WeightedCombine => &kernels::EP_WEIGHTED_COMBINE,
            KernelId::SumRanks => &kernels::EP_SUM_RANKS,
        }
    }
}

/// One launch: kernel, grid (blocks), block (threads) and arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// The kernel.
    pub kernel: KernelId,
    /// Blocks (≥ 1).
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
    /// Arguments, in the entry point's order.
    pub args: Vec<Arg>,
}

fn call(kernel: KernelId, grid: u32, block: u32, args: Vec<Arg>) -> Vec<Call> {
    vec![Call {
        kernel,
        grid: grid.max(1),
        block,
        args,
    }]
}

/// Checks launch arguments against a parameter table: count, kind, and NULL only where
/// nullable (a mismatch is an internal error, never a bad launch).
pub fn check_args(sig: &KernelSig, args: &[Arg]) -> Result<()> {
    use crate::gpu::kernels::ParamType;
    if args.len() != sig.params.len() {
        return Err(Error::Internal(format!(
            "{}: {} arguments given, the kernel takes {}",
            sig.name,
            args.len(),
            sig.params.len()
        )));
    }
    for (p, a) in sig.params.iter().zip(args) {
        let ok = match (p.ty, a) {
            (ParamType::Ptr { nullable, .. }, Arg::Ptr(v)) => nullable || *v != 0,
            (ParamType::I32, Arg::I32(_)) | (ParamType::U64, Arg::U64(_)) => true,
            (ParamType::Ptr { .. }, Arg::I32(_) | Arg::U64(_))
            | (ParamType::I32, Arg::Ptr(_) | Arg::U64(_))
            | (ParamType::U64, Arg::Ptr(_) | Arg::I32(_)) => false,
        };
        if !ok {
            return Err(Error::Internal(format!(
                "{}: argument '{}' is {a:?}, the table says {:?}",
                sig.name, p.name, p.ty
            )));
        }
    }
    Ok(())
}

/// The launch builders of one configuration: `top_k` and the grid cap of the grid-stride
/// kernels. Each returns the calls to issue in order (empty when there is nothing to do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Calls {
    /// Top-k the kernels were specialised for.
    pub top_k: u32,
    /// Grid cap (blocks) of the grid-stride kernels.
    pub max_blocks: u32,
}

impl Calls {
    fn threads(&self, units: u64) -> u32 {
        blocks_for(units, u64::from(BLOCK), self.max_blocks)
    }

    fn warps(&self, units: u64) -> u32 {
        blocks_for(units, u64::from(BLOCK / 32), self.max_blocks)
    }

    fn per_token(&self, tokens: u64) -> u32 {
        blocks_for(tokens, 1, self.max_blocks)
    }

    /// `ep_layout` (thread per token).
    pub fn layout(&self, a: LayoutArgs) -> Vec<Call> {
        self.grid_stride(KernelId::Layout, a.T, self.threads(a.T as u64), a.args())
    }

    /// `ep_pair_rows` on the caller's ids (`wire` = false) or on int32 wire ids.
    pub fn pair_rows(&self, wire: bool, a: PairRowsArgs) -> Vec<Call> {
        let kernel = if wire {
            KernelId::PairRowsWire
        } else {
            KernelId::PairRows
        };
        let units = a.T.max(0) as u64 * u64::from(self.top_k);
        self.grid_stride(kernel, a.T, self.threads(units), a.args())
    }

    /// `ep_recv_flags` (thread per received row).
    pub fn recv_flags(&self, a: RecvFlagsArgs) -> Vec<Call> {
        self.grid_stride(KernelId::RecvFlags, a.N, self.threads(a.N as u64), a.args())
    }

    /// Exclusive scan of `n` int32 at `input` into `out[0..=n]` (`out[n]` = total; `input ==
    /// out` allowed), recursing over block sums: `scratch` holds
    /// [`scan_scratch_elems`]`(n)` int32.
    pub fn scan(&self, input: u64, out: u64, n: usize, scratch: u64) -> Vec<Call> {
        let levels = scan_levels(n);
        let block = |block_sums| ScanBlockArgs {
            input,
            out,
            n: n as u64,
            block_sums,
        };
        if levels.len() == 1 {
            return call(KernelId::ScanBlock, 1, SCAN_THREADS, block(0).args());
        }
        let tiles = levels[1];
        let sums = scratch;
        let mut v = call(
            KernelId::ScanBlock,
            scan_blocks(n),
            SCAN_THREADS,
            block(sums).args(),
        );
        // Tile offsets: the exclusive scan of the block sums, in place, one level up.
        let rest = sums + 4 * (tiles as u64 + 1);
        v.extend(self.scan(sums, sums, tiles, rest));
        let add = ScanAddArgs {
            out,
            n: n as u64,
            offsets: sums,
        };
        v.extend(call(
            KernelId::ScanAdd,
            self.threads(n as u64 + 1),
            BLOCK,
            add.args(),
        ));
        v
    }

    /// `ep_pack` (warp per (rank, token)).
    pub fn pack(&self, a: PackArgs) -> Vec<Call> {
        let units = a.T.max(0) as u64 * a.R.max(0) as u64;
        self.grid_stride(KernelId::Pack, a.T, self.warps(units), a.args())
    }

    /// `ep_local_copy` of `bytes`.
    pub fn local_copy(&self, a: LocalCopyArgs) -> Vec<Call> {
        if a.bytes == 0 {
            return Vec::new();
        }
        let grid = self.threads(a.bytes.div_ceil(16));
        call(KernelId::LocalCopy, grid, BLOCK, a.args())
    }

    /// `ep_unpack_token_major` (warp per row).
    pub fn unpack_token_major(&self, a: UnpackTokenMajorArgs) -> Vec<Call> {
        let grid = self.warps(a.N as u64);
        self.grid_stride(KernelId::UnpackTokenMajor, a.N, grid, a.args())
    }

    /// `ep_unpack_expert_major` (warp per (local expert, row)); `counts` is always written.
    pub fn unpack_expert_major(&self, a: UnpackExpertMajorArgs) -> Vec<Call> {
        let (el, n) = (a.E_local.max(0) as u64, a.N.max(0) as u64);
        let grid = self.warps((el * n).max(el));
        call(KernelId::UnpackExpertMajor, grid, BLOCK, a.args())
    }

    /// `ep_unpack_expert_packed` (warp per (local expert, row)); offsets always written.
    pub fn unpack_expert_packed(&self, a: UnpackExpertPackedArgs) -> Vec<Call> {
        let (el, n) = (a.E_local.max(0) as u64, a.N.max(0) as u64);
        let grid = self.warps((el * n).max(el + 1));
        call(KernelId::UnpackExpertPacked, grid, BLOCK, a.args())
    }

    /// `ep_unpack_rank_major` (warp per (source, slot)).
    pub fn unpack_rank_major(&self, a: UnpackRankMajorArgs) -> Vec<Call> {
        let grid = self.warps(a.R.max(0) as u64 * a.M.max(0) as u64);
        call(KernelId::UnpackRankMajor, grid, BLOCK, a.args())
    }

    /// `ep_combine_return_expert` (warp per (row, k)).
    pub fn combine_return_expert(&self, a: CombineReturnExpertArgs) -> Vec<Call> {
        let grid = self.warps(a.N.max(0) as u64 * u64::from(self.top_k));
        self.grid_stride(KernelId::CombineReturnExpert, a.N, grid, a.args())
    }

    /// `ep_combine_return_rank_major` (warp per (source, slot)).
    pub fn combine_return_rank_major(&self, a: CombineReturnRankMajorArgs) -> Vec<Call> {
        let grid = self.warps(a.R.max(0) as u64 * a.M.max(0) as u64);
        call(KernelId::CombineReturnRankMajor, grid, BLOCK, a.args())
    }

    /// `ep_weighted_combine` (block per token).
    pub fn weighted_combine(&self, a: WeightedCombineArgs) -> Vec<Call> {
        let grid = self.per_token(a.T as u64);
        self.grid_stride(KernelId::WeightedCombine, a.T, grid, a.args())
    }

    /// `ep_sum_ranks` (block per token).
    pub fn sum_ranks(&self, a: SumRanksArgs) -> Vec<Call> {
        let grid = self.per_token(a.T as u64);
        self.grid_stride(KernelId::SumRanks, a.T, grid, a.args())
    }

    /// One launch of `kernel` over `units` work items (none when there are none).
    fn grid_stride(&self, kernel: KernelId, units: i32, grid: u32, args: Vec<Arg>) -> Vec<Call> {
        if units <= 0 {
            return Vec::new();
        }
        call(kernel, grid, BLOCK, args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_ids_index_their_table() {
        for (i, id) in KernelId::ALL.iter().enumerate() {
            assert_eq!(*id as usize, i, "{id:?}");
        }
    }
}
