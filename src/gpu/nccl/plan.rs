//! The two-sided exchange plan (pure Rust): from the R×R count matrix every rank holds after the
//! counts all-gather, the byte offset and size of every `ncclSend`/`ncclRecv` of one rank.
//!
//! Buffers: a rank's send buffer holds its rows grouped by destination rank (0..R, its own slot
//! included); its receive buffer holds rows grouped by source rank (0..R). Every rank computes
//! the same plan from the same matrix, so a send of `src→dst` and the matching receive always
//! agree on the size without any further exchange.
//!
//! Capacity mode (no host sync; capturable in a CUDA graph): fixed per-peer slabs of `capacity`
//! rows, each led by an in-band count header, so every transfer has a static size.

use crate::error::{Error, Result};

/// The first NCCL that accepts zero-byte `ncclSend`/`ncclRecv` inside a group (2.12.10,
/// NVIDIA/nccl#696). Older versions need zero sizes skipped on both sides.
pub const ZERO_SIZE_P2P_MIN_VERSION: i32 = 21210;

/// Splits an `ncclGetVersion` code into (major, minor, patch). NCCL ≥ 2.9 encodes
/// `major*10000 + minor*100 + patch`, older ones `major*1000 + minor*100 + patch`.
pub fn version_parts(code: i32) -> (i32, i32, i32) {
    if code >= 10000 {
        (code / 10000, (code % 10000) / 100, code % 100)
    } else {
        (code / 1000, (code % 1000) / 100, code % 100)
    }
}

/// Whether NCCL `code` accepts zero-size point-to-point entries in a group.
pub fn supports_zero_size_p2p(code: i32) -> bool {
    code >= ZERO_SIZE_P2P_MIN_VERSION
}

/// One `ncclSend` or `ncclRecv`: the peer, the byte offset into the buffer and the byte count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerTransfer {
    /// The peer rank.
    pub peer: usize,
    /// Byte offset into this rank's send (or receive) buffer.
    pub offset: usize,
    /// Bytes to transfer (may be 0 when zero-size p2p is on).
    pub bytes: usize,
}

/// A copy of this rank's own rows from its send buffer to its receive buffer (done by a
/// local copy, not through NCCL, unless [`ExchangeOptions::self_via_nccl`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalCopy {
    /// Byte offset of the self slot in the send buffer.
    pub send_offset: usize,
    /// Byte offset of the self slot in the receive buffer.
    pub recv_offset: usize,
    /// Bytes to copy.
    pub bytes: usize,
}

/// How the plan is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExchangeOptions {
    /// Issue zero-byte transfers (NCCL ≥ 2.12.10). When false, a transfer of zero bytes is left
    /// out on both sides: rank s skips its send to d exactly when d skips its receive from s,
    /// since both read the same matrix entry.
    pub zero_size_p2p: bool,
    /// Send the self slot through NCCL too (a self send/recv pair) instead of a local copy.
    pub self_via_nccl: bool,
}

impl ExchangeOptions {
    /// The options for a runtime NCCL version code: zero sizes when it supports them, self
    /// traffic by a local copy.
    pub fn for_version(code: i32) -> Self {
        ExchangeOptions {
            zero_size_p2p: supports_zero_size_p2p(code),
            self_via_nccl: false,
        }
    }
}

/// What one rank issues in one exchange (ascending peer order; the same order on every rank
/// keeps NCCL's grouped p2p deterministic).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExchangePlan {
    /// The rank this plan is for.
    pub rank: usize,
    /// The number of ranks.
    pub world: usize,
    /// Bytes per row.
    pub row_bytes: usize,
    /// `ncclSend`s to issue, by ascending peer.
    pub sends: Vec<PeerTransfer>,
    /// `ncclRecv`s to issue, by ascending peer.
    pub recvs: Vec<PeerTransfer>,
    /// The self slot when it is not sent through NCCL (`None` also when it is empty).
    pub local: Option<LocalCopy>,
    /// Bytes the send buffer must hold.
    pub send_bytes: usize,
    /// Bytes the receive buffer must hold.
    pub recv_bytes: usize,
    /// Rows this rank receives from each source (its column of the matrix).
    pub recv_rows: Vec<usize>,
}

fn check_geometry(world: usize, rank: usize) -> Result<()> {
    if world == 0 {
        return Err(Error::InvalidArgument(
            "exchange plan: world size must be at least 1".into(),
        ));
    }
    if rank >= world {
        return Err(Error::InvalidArgument(format!(
            "exchange plan: rank {rank} is out of range for world size {world}"
        )));
    }
    Ok(())
}

fn overflow(what: &str) -> Error {
    Error::InvalidArgument(format!("exchange plan: {what} overflows the address space"))
}

/// Builds the counts-mode plan of `rank`: `counts[src * world + dst]` rows go from `src` to
/// `dst`, each `row_bytes` long. Negative counts and sizes that overflow are errors naming the
/// entry.
pub fn counts_plan(
    counts: &[i32],
    world: usize,
    rank: usize,
    row_bytes: usize,
    opts: ExchangeOptions,
) -> Result<ExchangePlan> {
    check_geometry(world, rank)?;
    let want = world
        .checked_mul(world)
        .ok_or_else(|| overflow("world size squared"))?;
    if counts.len() != want {
        return Err(Error::InvalidArgument(format!(
            "exchange plan: the count matrix has {} entries, expected world size squared = {want}",
            counts.len()
        )));
    }
    let rows = |src: usize, dst: usize| -> Result<usize> {
        let c = counts[src * world + dst];
        usize::try_from(c).map_err(|_| {
            Error::InvalidArgument(format!(
                "exchange plan: count from rank {src} to rank {dst} is {c}; counts must be >= 0"
            ))
        })
    };
    let geo = (world, rank, row_bytes);
    // Send side: this rank's row of the matrix, laid out by destination.
    let send = Side::lay_out(geo, opts, |dst| rows(rank, dst), "the send buffer")?;
    // Receive side: this rank's column, laid out by source.
    let recv = Side::lay_out(geo, opts, |src| rows(src, rank), "the receive buffer")?;
    let self_bytes = recv.rows[rank] * row_bytes;
    let local = (!opts.self_via_nccl && self_bytes > 0).then(|| LocalCopy {
        send_offset: send.offsets[rank],
        recv_offset: recv.offsets[rank],
        bytes: self_bytes,
    });
    Ok(ExchangePlan {
        rank,
        world,
        row_bytes,
        sends: send.transfers,
        recvs: recv.transfers,
        local,
        send_bytes: send.bytes,
        recv_bytes: recv.bytes,
        recv_rows: recv.rows,
    })
}

/// One side (send or receive) of a counts-mode plan: each peer's rows laid out by peer.
struct Side {
    /// What NCCL moves (the self slot only with `self_via_nccl`; empty ones only with
    /// zero-size p2p).
    transfers: Vec<PeerTransfer>,
    /// Byte offset of each peer's rows.
    offsets: Vec<usize>,
    /// Rows of each peer.
    rows: Vec<usize>,
    /// Bytes of the buffer.
    bytes: usize,
}

impl Side {
    /// The side of `rank` (of `world`, rows of `row_bytes`) whose peer `p` has `rows_of(p)`
    /// rows; `buffer` names it when its size overflows.
    fn lay_out(
        (world, rank, row_bytes): (usize, usize, usize),
        opts: ExchangeOptions,
        mut rows_of: impl FnMut(usize) -> Result<usize>,
        buffer: &str,
    ) -> Result<Side> {
        let mut side = Side {
            transfers: Vec::new(),
            offsets: Vec::with_capacity(world),
            rows: Vec::with_capacity(world),
            bytes: 0,
        };
        for peer in 0..world {
            let n = rows_of(peer)?;
            let bytes = n
                .checked_mul(row_bytes)
                .ok_or_else(|| overflow("a transfer"))?;
            side.offsets.push(side.bytes);
            side.rows.push(n);
            if (peer != rank || opts.self_via_nccl) && (bytes > 0 || opts.zero_size_p2p) {
                side.transfers.push(PeerTransfer {
                    peer,
                    offset: side.bytes,
                    bytes,
                });
            }
            side.bytes = side
                .bytes
                .checked_add(bytes)
                .ok_or_else(|| overflow(buffer))?;
        }
        Ok(side)
    }
}

/// Bytes of the in-band count header at the start of every capacity-mode slab: one `u32` row
/// count, padded so the rows that follow start 16-byte aligned (vectorised copies).
const CAPACITY_HEADER_BYTES: usize = 16;
/// Alignment of every capacity-mode slab.
const CAPACITY_SLAB_ALIGN: usize = 16;

/// Rounds `n` up to a multiple of `align` (a power of two); `None` on overflow.
pub fn align_up(n: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two());
    Some(n.checked_add(align - 1)? & !(align - 1))
}

/// The capacity-mode buffer layout, the same for the send buffer (slabs by destination) and
/// the receive buffer (slabs by source): `world` slabs of `slab_bytes`, each
/// `[u32 count][pad to 16][capacity rows of row_bytes][pad to 16]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapacityLayout {
    /// The number of ranks (slabs).
    pub world: usize,
    /// Rows per peer slab (`max_tokens_per_rank`).
    pub capacity: usize,
    /// Bytes per row.
    pub row_bytes: usize,
    /// Bytes of the count header ([`CAPACITY_HEADER_BYTES`]).
    pub header_bytes: usize,
    /// Bytes of one slab (header + rows, 16-byte aligned).
    pub slab_bytes: usize,
    /// Bytes of the whole buffer (`world` slabs).
    pub total_bytes: usize,
}

impl CapacityLayout {
    /// The layout for `world` peers, `capacity` rows each of `row_bytes`.
    pub fn new(world: usize, capacity: usize, row_bytes: usize) -> Result<CapacityLayout> {
        if world == 0 {
            return Err(Error::InvalidArgument(
                "capacity layout: world size must be at least 1".into(),
            ));
        }
        let rows = capacity
            .checked_mul(row_bytes)
            .ok_or_else(|| overflow("a capacity slab"))?;
        let slab_bytes = CAPACITY_HEADER_BYTES
            .checked_add(rows)
            .and_then(|n| align_up(n, CAPACITY_SLAB_ALIGN))
            .ok_or_else(|| overflow("a capacity slab"))?;
        let total_bytes = slab_bytes
            .checked_mul(world)
            .ok_or_else(|| overflow("the capacity buffer"))?;
        Ok(CapacityLayout {
            world,
            capacity,
            row_bytes,
            header_bytes: CAPACITY_HEADER_BYTES,
            slab_bytes,
            total_bytes,
        })
    }

    /// Byte offset of the slab of `peer` (its count header).
    pub fn slab_offset(&self, peer: usize) -> usize {
        peer * self.slab_bytes
    }

    /// Byte offset of the `u32` row count of `peer`'s slab.
    pub fn count_offset(&self, peer: usize) -> usize {
        self.slab_offset(peer)
    }

    /// Byte offset of row `row` of `peer`'s slab.
    pub fn row_offset(&self, peer: usize, row: usize) -> usize {
        self.slab_offset(peer) + self.header_bytes + row * self.row_bytes
    }

    /// Checks one rank's outgoing counts (`counts[dst]`) against the capacity; the error names
    /// the destination, as the device kernels would only see the overflow later.
    pub fn check_counts(&self, rank: usize, counts: &[i32]) -> Result<()> {
        if counts.len() != self.world {
            return Err(Error::InvalidArgument(format!(
                "capacity mode: {} counts given, expected one per rank ({})",
                counts.len(),
                self.world
            )));
        }
        for (dst, &c) in counts.iter().enumerate() {
            if c < 0 || c as usize > self.capacity {
                return Err(Error::InvalidArgument(format!(
                    "capacity mode: rank {rank} sends {c} rows to rank {dst}, outside the capacity of 0..={} rows per peer (max_tokens_per_rank)",
                    self.capacity
                )));
            }
        }
        Ok(())
    }

    /// The static plan of `rank`: every peer gets one whole slab, whatever the counts (so the
    /// same calls can be captured once and replayed).
    pub fn plan(&self, rank: usize, self_via_nccl: bool) -> Result<ExchangePlan> {
        check_geometry(self.world, rank)?;
        let mut plan = ExchangePlan {
            rank,
            world: self.world,
            row_bytes: self.row_bytes,
            send_bytes: self.total_bytes,
            recv_bytes: self.total_bytes,
            recv_rows: vec![self.capacity; self.world],
            ..ExchangePlan::default()
        };
        for peer in 0..self.world {
            let t = PeerTransfer {
                peer,
                offset: self.slab_offset(peer),
                bytes: self.slab_bytes,
            };
            if peer == rank && !self_via_nccl {
                plan.local = Some(LocalCopy {
                    send_offset: t.offset,
                    recv_offset: t.offset,
                    bytes: t.bytes,
                });
            } else {
                plan.sends.push(t);
                plan.recvs.push(t);
            }
        }
        Ok(plan)
    }
}
