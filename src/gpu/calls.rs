//! The kernel launches of [`crate::gpu::launch::Kernels`] as data (pure, always built): which
//! entry point, grid, block and arguments each helper issues. The `cuda` launcher executes
//! these [`Call`]s on a stream; `tests/gpu_pipeline_counts_emu.rs` executes the same calls
//! with the real kernel sources compiled for the host, so the arguments the manager passes
//! (order, sizes, grids, the scan's recursion) are checked without a GPU.
#![allow(clippy::too_many_arguments)]

use crate::error::{Error, Result};
use crate::gpu::kernels::{self, KernelSig, SCAN_THREADS};
use crate::gpu::transport::plan::{blocks_for, scan_blocks, scan_levels};

/// Threads per block of the grid-stride kernels.
pub const BLOCK: u32 = 256;

/// One kernel argument. Device pointers are `u64` addresses (0 = NULL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arg {
    /// A device pointer.
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `unsigned long long`.
    U64(u64),
}

impl Arg {
    /// The 8-byte parameter slot `cuLaunchKernel` reads (an `int` is the slot's low 4
    /// bytes, little-endian).
    pub fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) | Arg::U64(p) => p,
            Arg::I32(v) => u64::from(v as u32),
        }
    }
}

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
            _ => false,
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
    pub fn layout(
        &self,
        topk_ids: u64,
        t: i32,
        e: i32,
        e_local: i32,
        r: i32,
        rank_flag: u64,
        pair_flag: u64,
        rank_counts: u64,
        expert_counts: u64,
        err: u64,
    ) -> Vec<Call> {
        if t <= 0 {
            return Vec::new();
        }
        let args = vec![
            Arg::Ptr(topk_ids),
            Arg::I32(t),
            Arg::I32(e),
            Arg::I32(e_local),
            Arg::I32(r),
            Arg::Ptr(rank_flag),
            Arg::Ptr(pair_flag),
            Arg::Ptr(rank_counts),
            Arg::Ptr(expert_counts),
            Arg::Ptr(err),
        ];
        call(KernelId::Layout, self.threads(t as u64), BLOCK, args)
    }

    /// `ep_pair_rows` on the caller's ids (`wire` = false) or on int32 wire ids.
    pub fn pair_rows(
        &self,
        wire: bool,
        topk_ids: u64,
        t: i32,
        e: i32,
        e_local: i32,
        pair_pos: u64,
        rows: u64,
    ) -> Vec<Call> {
        if t <= 0 {
            return Vec::new();
        }
        let kernel = if wire {
            KernelId::PairRowsWire
        } else {
            KernelId::PairRows
        };
        let units = t as u64 * u64::from(self.top_k);
        let args = vec![
            Arg::Ptr(topk_ids),
            Arg::I32(t),
            Arg::I32(e),
            Arg::I32(e_local),
            Arg::Ptr(pair_pos),
            Arg::Ptr(rows),
        ];
        call(kernel, self.threads(units), BLOCK, args)
    }

    /// `ep_recv_flags` (thread per received row).
    pub fn recv_flags(
        &self,
        recv_ids: u64,
        n: i32,
        e_local: i32,
        rank: i32,
        expert_flag: u64,
        pair_flag: u64,
        local_counts: u64,
    ) -> Vec<Call> {
        if n <= 0 {
            return Vec::new();
        }
        let args = vec![
            Arg::Ptr(recv_ids),
            Arg::I32(n),
            Arg::I32(e_local),
            Arg::I32(rank),
            Arg::Ptr(expert_flag),
            Arg::Ptr(pair_flag),
            Arg::Ptr(local_counts),
        ];
        call(KernelId::RecvFlags, self.threads(n as u64), BLOCK, args)
    }

    /// Exclusive scan of `n` int32 at `input` into `out[0..=n]` (`out[n]` = total; `input ==
    /// out` allowed), recursing over block sums: `scratch` holds
    /// [`crate::gpu::transport::plan::scan_scratch_elems`]`(n)` int32.
    pub fn scan(&self, input: u64, out: u64, n: usize, scratch: u64) -> Vec<Call> {
        let levels = scan_levels(n);
        if levels.len() == 1 {
            let args = vec![
                Arg::Ptr(input),
                Arg::Ptr(out),
                Arg::U64(n as u64),
                Arg::Ptr(0),
            ];
            return call(KernelId::ScanBlock, 1, SCAN_THREADS, args);
        }
        let tiles = levels[1];
        let sums = scratch;
        let args = vec![
            Arg::Ptr(input),
            Arg::Ptr(out),
            Arg::U64(n as u64),
            Arg::Ptr(sums),
        ];
        let mut v = call(KernelId::ScanBlock, scan_blocks(n), SCAN_THREADS, args);
        // Tile offsets: the exclusive scan of the block sums, in place, one level up.
        let rest = sums + 4 * (tiles as u64 + 1);
        v.extend(self.scan(sums, sums, tiles, rest));
        let args = vec![Arg::Ptr(out), Arg::U64(n as u64), Arg::Ptr(sums)];
        v.extend(call(
            KernelId::ScanAdd,
            self.threads(n as u64 + 1),
            BLOCK,
            args,
        ));
        v
    }

    /// `ep_pack` (warp per (rank, token)).
    pub fn pack(
        &self,
        rows: u64,
        row_bytes: u64,
        topk_ids: u64,
        topk_weights: u64,
        t: i32,
        r: i32,
        rank_flag: u64,
        send_pos: u64,
        send_rows: u64,
        send_ids: u64,
        send_weights: u64,
        send_src: u64,
    ) -> Vec<Call> {
        if t <= 0 {
            return Vec::new();
        }
        let args = vec![
            Arg::Ptr(rows),
            Arg::U64(row_bytes),
            Arg::Ptr(topk_ids),
            Arg::Ptr(topk_weights),
            Arg::I32(t),
            Arg::I32(r),
            Arg::Ptr(rank_flag),
            Arg::Ptr(send_pos),
            Arg::Ptr(send_rows),
            Arg::Ptr(send_ids),
            Arg::Ptr(send_weights),
            Arg::Ptr(send_src),
        ];
        call(
            KernelId::Pack,
            self.warps(t as u64 * r.max(0) as u64),
            BLOCK,
            args,
        )
    }

    /// `ep_local_copy` of `bytes`.
    pub fn local_copy(&self, dst: u64, src: u64, bytes: u64) -> Vec<Call> {
        if bytes == 0 {
            return Vec::new();
        }
        let args = vec![Arg::Ptr(dst), Arg::Ptr(src), Arg::U64(bytes)];
        call(
            KernelId::LocalCopy,
            self.threads(bytes.div_ceil(16)),
            BLOCK,
            args,
        )
    }

    /// `ep_unpack_token_major` (warp per row).
    pub fn unpack_token_major(
        &self,
        recv_rows: u64,
        recv_ids: u64,
        recv_w: u64,
        n: i32,
        row_bytes: u64,
        e_local: i32,
        rank: i32,
        out_rows: u64,
        out_ids: u64,
        out_w: u64,
    ) -> Vec<Call> {
        if n <= 0 {
            return Vec::new();
        }
        let args = vec![
            Arg::Ptr(recv_rows),
            Arg::Ptr(recv_ids),
            Arg::Ptr(recv_w),
            Arg::I32(n),
            Arg::U64(row_bytes),
            Arg::I32(e_local),
            Arg::I32(rank),
            Arg::Ptr(out_rows),
            Arg::Ptr(out_ids),
            Arg::Ptr(out_w),
        ];
        call(
            KernelId::UnpackTokenMajor,
            self.warps(n as u64),
            BLOCK,
            args,
        )
    }

    /// `ep_unpack_expert_major` (warp per (local expert, row)); `counts` is always written.
    pub fn unpack_expert_major(
        &self,
        recv: [u64; 5],
        n: i32,
        r: i32,
        row_bytes: u64,
        e_local: i32,
        rank: i32,
        expert_flag: u64,
        expert_pos: u64,
        capacity: i32,
        out_rows: u64,
        counts: u64,
        out_w: u64,
        out_src_rank: u64,
        out_src_token: u64,
        err: u64,
    ) -> Vec<Call> {
        let [rows, ids, w, src, offsets] = recv;
        let args = vec![
            Arg::Ptr(rows),
            Arg::Ptr(ids),
            Arg::Ptr(w),
            Arg::Ptr(src),
            Arg::Ptr(offsets),
            Arg::I32(n),
            Arg::I32(r),
            Arg::U64(row_bytes),
            Arg::I32(e_local),
            Arg::I32(rank),
            Arg::Ptr(expert_flag),
            Arg::Ptr(expert_pos),
            Arg::I32(capacity),
            Arg::Ptr(out_rows),
            Arg::Ptr(counts),
            Arg::Ptr(out_w),
            Arg::Ptr(out_src_rank),
            Arg::Ptr(out_src_token),
            Arg::Ptr(err),
        ];
        let (el, n) = (e_local.max(0) as u64, n.max(0) as u64);
        let units = (el * n).max(el);
        call(KernelId::UnpackExpertMajor, self.warps(units), BLOCK, args)
    }

    /// `ep_unpack_expert_packed` (warp per (local expert, row)); offsets always written.
    pub fn unpack_expert_packed(
        &self,
        recv: [u64; 5],
        n: i32,
        r: i32,
        row_bytes: u64,
        e_local: i32,
        rank: i32,
        expert_flag: u64,
        expert_pos: u64,
        out_rows: u64,
        expert_offsets: u64,
        out_w: u64,
        out_src_rank: u64,
        out_src_token: u64,
    ) -> Vec<Call> {
        let [rows, ids, w, src, offsets] = recv;
        let args = vec![
            Arg::Ptr(rows),
            Arg::Ptr(ids),
            Arg::Ptr(w),
            Arg::Ptr(src),
            Arg::Ptr(offsets),
            Arg::I32(n),
            Arg::I32(r),
            Arg::U64(row_bytes),
            Arg::I32(e_local),
            Arg::I32(rank),
            Arg::Ptr(expert_flag),
            Arg::Ptr(expert_pos),
            Arg::Ptr(out_rows),
            Arg::Ptr(expert_offsets),
            Arg::Ptr(out_w),
            Arg::Ptr(out_src_rank),
            Arg::Ptr(out_src_token),
        ];
        let (el, n) = (e_local.max(0) as u64, n.max(0) as u64);
        let units = (el * n).max(el + 1);
        call(KernelId::UnpackExpertPacked, self.warps(units), BLOCK, args)
    }

    /// `ep_unpack_rank_major` (warp per (source, slot)).
    pub fn unpack_rank_major(
        &self,
        recv_rows: u64,
        recv_ids: u64,
        recv_w: u64,
        recv_offsets: u64,
        r: i32,
        m: i32,
        row_bytes: u64,
        out_rows: u64,
        out_ids: u64,
        out_w: u64,
        recv_counts: u64,
        err: u64,
    ) -> Vec<Call> {
        let args = vec![
            Arg::Ptr(recv_rows),
            Arg::Ptr(recv_ids),
            Arg::Ptr(recv_w),
            Arg::Ptr(recv_offsets),
            Arg::I32(r),
            Arg::I32(m),
            Arg::U64(row_bytes),
            Arg::Ptr(out_rows),
            Arg::Ptr(out_ids),
            Arg::Ptr(out_w),
            Arg::Ptr(recv_counts),
            Arg::Ptr(err),
        ];
        call(
            KernelId::UnpackRankMajor,
            self.warps(r.max(0) as u64 * m.max(0) as u64),
            BLOCK,
            args,
        )
    }

    /// `ep_combine_return_expert` (warp per (row, k)).
    pub fn combine_return_expert(
        &self,
        y: u64,
        row_bytes: u64,
        recv_ids: u64,
        n: i32,
        e_local: i32,
        rank: i32,
        expert_pos: u64,
        capacity: i32,
        pair_pos: u64,
        send_rows: u64,
    ) -> Vec<Call> {
        if n <= 0 {
            return Vec::new();
        }
        let args = vec![
            Arg::Ptr(y),
            Arg::U64(row_bytes),
            Arg::Ptr(recv_ids),
            Arg::I32(n),
            Arg::I32(e_local),
            Arg::I32(rank),
            Arg::Ptr(expert_pos),
            Arg::I32(capacity),
            Arg::Ptr(pair_pos),
            Arg::Ptr(send_rows),
        ];
        let units = n as u64 * u64::from(self.top_k);
        call(
            KernelId::CombineReturnExpert,
            self.warps(units),
            BLOCK,
            args,
        )
    }

    /// `ep_combine_return_rank_major` (warp per (source, slot)).
    pub fn combine_return_rank_major(
        &self,
        y: u64,
        row_bytes: u64,
        recv_offsets: u64,
        r: i32,
        m: i32,
        send_rows: u64,
    ) -> Vec<Call> {
        let args = vec![
            Arg::Ptr(y),
            Arg::U64(row_bytes),
            Arg::Ptr(recv_offsets),
            Arg::I32(r),
            Arg::I32(m),
            Arg::Ptr(send_rows),
        ];
        call(
            KernelId::CombineReturnRankMajor,
            self.warps(r.max(0) as u64 * m.max(0) as u64),
            BLOCK,
            args,
        )
    }

    /// `ep_weighted_combine` (block per token).
    pub fn weighted_combine(
        &self,
        y: u64,
        rows: u64,
        w: u64,
        t: i32,
        h: i32,
        out: u64,
    ) -> Vec<Call> {
        if t <= 0 {
            return Vec::new();
        }
        let args = vec![
            Arg::Ptr(y),
            Arg::Ptr(rows),
            Arg::Ptr(w),
            Arg::I32(t),
            Arg::I32(h),
            Arg::Ptr(out),
        ];
        call(
            KernelId::WeightedCombine,
            self.per_token(t as u64),
            BLOCK,
            args,
        )
    }

    /// `ep_sum_ranks` (block per token).
    pub fn sum_ranks(
        &self,
        y: u64,
        rank_flag: u64,
        send_pos: u64,
        t: i32,
        r: i32,
        h: i32,
        out: u64,
    ) -> Vec<Call> {
        if t <= 0 {
            return Vec::new();
        }
        let args = vec![
            Arg::Ptr(y),
            Arg::Ptr(rank_flag),
            Arg::Ptr(send_pos),
            Arg::I32(t),
            Arg::I32(r),
            Arg::I32(h),
            Arg::Ptr(out),
        ];
        call(KernelId::SumRanks, self.per_token(t as u64), BLOCK, args)
    }
}
