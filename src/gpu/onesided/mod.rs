//! Host-side bookkeeping of the one-node one-sided transport (docs/gpu.md): every rank
//! owns a workspace its peers write into directly (their receive slabs, counts, completion
//! flags), plus a device error word the kernels fill on timeout.
//!
//! - [`WorkspaceLayout`]: byte offsets inside one rank's workspace (pure, unit-tested).
//! - [`Epoch`] / [`epoch_reached`]: monotonic u32 epochs, compared wraparound-safely; `0` means
//!   "never signalled", so freshly zeroed flags never look complete (`ep_epoch_next` and
//!   `ep_epoch_reached` in kernels/signal.cu are the same rules, checked in the emulation).
//! - [`ErrorWord`]: the kernels' 64-bit device error word and its status naming the peer.
//! - [`PeerTable`]: R base pointers and how each was obtained.
//! - [`fdpass`]: SCM_RIGHTS fd passing and the group rendezvous over a Unix socket.
//!
//! Status: **not wired yet**; nothing in the library calls this module. Its caller will be a
//! one-sided [`crate::gpu::transport::Fabric`] for ranks on one node (the
//! `flashinfer_nvlink_one_sided` transport, and capacity mode without NCCL): it reserves one
//! VA range ([`crate::gpu::driver::VaRange`]), exports each rank's `cuMemCreate` workspace as a
//! POSIX fd and all-gathers the fds with [`fdpass::exchange_fds`], maps every peer's workspace
//! at [`WorkspaceLayout`] strides into a [`PeerTable`], and orders writes with the
//! `ep_signal`/`ep_wait` kernels (kernels/signal.cu) over [`Epoch`] flags, decoding timeouts
//! with [`ErrorWord`]. Until then tests/gpu_host.rs covers every item here on the CPU:
//! `workspace_layout_is_aligned_and_disjoint`, `epochs_skip_zero_and_compare_across_wraparound`,
//! `device_error_words`, `signal_kernels_agree_with_the_host_on_the_host` (signal.cu's epochs,
//! wait and error word run on the CPU), `peer_table`, `scm_rights_over_a_socket_pair`,
//! `oversized_message_is_an_error_and_fds_are_closed` and the `rendezvous_*` tests (threads
//! and a child process).

pub mod fdpass;

use crate::error::{Error, Result};
use crate::gpu::kernels::{self, DeviceError};
use crate::gpu::nccl::plan::align_up;

/// Alignment of each row inside a slab (16-byte vector loads/stores).
pub const ROW_ALIGN: usize = 16;
/// Alignment of every region of the workspace (a cache line / NVLink write granule).
pub const REGION_ALIGN: usize = 128;
/// Bytes of the device error word (one u64, [`ErrorWord`]).
pub const ERROR_WORD_BYTES: usize = 8;

/// Byte offsets of one rank's one-sided workspace. Every rank has the same layout, so a sender
/// computes the address in a peer's workspace from the peer's base pointer alone.
///
/// ```text
/// [data slabs:  src 0..R × capacity rows × row_stride ]  (rows 16-byte aligned)
/// [meta slabs:  src 0..R × capacity × meta_stride     ]  (ids / weights / scales per row)
/// [counts:      src 0..R × u32                         ]  rows src wrote in this epoch
/// [flags:       src 0..R × u32                         ]  epoch src last completed
/// [error word:  u64 (ErrorWord)                        ]
/// ```
/// Each region starts 128-byte aligned; the total is a multiple of 128 (round it up to the VMM
/// granularity when allocating).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkspaceLayout {
    /// The number of ranks (source slabs).
    pub world: usize,
    /// Rows per source slab (`max_tokens_per_rank`, times top-k where a token can be sent once
    /// per expert).
    pub capacity: usize,
    /// Payload bytes per row.
    pub row_bytes: usize,
    /// `row_bytes` rounded up to [`ROW_ALIGN`].
    pub row_stride: usize,
    /// Metadata bytes per row (ids, weights, scales; 0 for none).
    pub meta_bytes: usize,
    /// `meta_bytes` rounded up to [`ROW_ALIGN`] (0 when there is no metadata).
    pub meta_stride: usize,
    /// One source's data slab, rounded up to [`REGION_ALIGN`].
    pub slab_bytes: usize,
    /// One source's metadata slab, rounded up to [`REGION_ALIGN`].
    pub meta_slab_bytes: usize,
    /// Offset of the data slabs.
    pub data_offset: usize,
    /// Offset of the metadata slabs.
    pub meta_offset: usize,
    /// Offset of the per-source row counts (u32 each).
    pub counts_offset: usize,
    /// Offset of the per-source completion flags (u32 epochs).
    pub flags_offset: usize,
    /// Offset of the device error word.
    pub error_offset: usize,
    /// Bytes of the whole workspace (a multiple of 128).
    pub total_bytes: usize,
}

fn too_big() -> Error {
    Error::InvalidArgument("one-sided workspace: the size overflows the address space".into())
}

fn up(n: usize, a: usize) -> Result<usize> {
    align_up(n, a).ok_or_else(too_big)
}

fn mul(a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(too_big)
}

fn add(a: usize, b: usize) -> Result<usize> {
    a.checked_add(b).ok_or_else(too_big)
}

impl WorkspaceLayout {
    /// The layout for `world` sources of `capacity` rows of `row_bytes` payload and
    /// `meta_bytes` metadata each.
    pub fn new(
        world: usize,
        capacity: usize,
        row_bytes: usize,
        meta_bytes: usize,
    ) -> Result<WorkspaceLayout> {
        if world == 0 {
            return Err(Error::InvalidArgument(
                "one-sided workspace: world size must be at least 1".into(),
            ));
        }
        if u32::try_from(capacity).is_err() {
            return Err(Error::InvalidArgument(format!(
                "one-sided workspace: capacity {capacity} does not fit the u32 count words"
            )));
        }
        let row_stride = up(row_bytes, ROW_ALIGN)?;
        let meta_stride = up(meta_bytes, ROW_ALIGN)?;
        let slab_bytes = up(mul(capacity, row_stride)?, REGION_ALIGN)?;
        let meta_slab_bytes = up(mul(capacity, meta_stride)?, REGION_ALIGN)?;
        let data_offset = 0;
        let meta_offset = add(data_offset, mul(world, slab_bytes)?)?;
        let counts_offset = add(meta_offset, mul(world, meta_slab_bytes)?)?;
        let flags_offset = add(counts_offset, up(mul(world, 4)?, REGION_ALIGN)?)?;
        let error_offset = add(flags_offset, up(mul(world, 4)?, REGION_ALIGN)?)?;
        let total_bytes = add(error_offset, up(ERROR_WORD_BYTES, REGION_ALIGN)?)?;
        Ok(WorkspaceLayout {
            world,
            capacity,
            row_bytes,
            row_stride,
            meta_bytes,
            meta_stride,
            slab_bytes,
            meta_slab_bytes,
            data_offset,
            meta_offset,
            counts_offset,
            flags_offset,
            error_offset,
            total_bytes,
        })
    }

    /// Byte offset of row `row` of source `src`'s data slab.
    pub fn row_offset(&self, src: usize, row: usize) -> usize {
        self.data_offset + src * self.slab_bytes + row * self.row_stride
    }

    /// Byte offset of row `row` of source `src`'s metadata slab.
    pub fn meta_offset_of(&self, src: usize, row: usize) -> usize {
        self.meta_offset + src * self.meta_slab_bytes + row * self.meta_stride
    }

    /// Byte offset of source `src`'s row count.
    pub fn count_offset(&self, src: usize) -> usize {
        self.counts_offset + 4 * src
    }

    /// Byte offset of source `src`'s completion flag.
    pub fn flag_offset(&self, src: usize) -> usize {
        self.flags_offset + 4 * src
    }

    /// The total rounded up to an allocation granularity (a power of two, e.g. the VMM one).
    pub fn allocation_bytes(&self, granularity: usize) -> Result<usize> {
        if !granularity.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "one-sided workspace: granularity {granularity} is not a power of two"
            )));
        }
        up(self.total_bytes, granularity)
    }
}

/// A monotonic u32 epoch: one per one-sided operation, bumped identically on every rank.
/// Zero is skipped on wraparound because a zeroed flag means "never signalled".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Epoch(pub u32);

impl Epoch {
    /// The epoch after this one (1, 2, …, u32::MAX, 1, …).
    pub fn next(self) -> Epoch {
        match self.0.wrapping_add(1) {
            0 => Epoch(1),
            n => Epoch(n),
        }
    }

    /// Advances in place and returns the new epoch.
    pub fn advance(&mut self) -> Epoch {
        *self = self.next();
        *self
    }
}

/// Whether a flag holding `flag` shows epoch `want` (or a later one) completed.
/// Serial-number arithmetic: correct as long as the two are less than 2^31 epochs apart, which
/// holds because a peer is never more than a few operations ahead. A zero flag never counts.
pub fn epoch_reached(flag: u32, want: u32) -> bool {
    flag != 0 && (flag.wrapping_sub(want) as i32) >= 0
}

/// The device error word of a one-sided operation, as `ep_wait` (kernels/signal.cu) writes it
/// into the workspace: the kernels' 64-bit word ([`kernels::encode_error_word`]: code, then `a`
/// = the peer, then `b`; 0 = no error), so host and device share one layout
/// ([`kernels::ERROR_WORD_DEFINES`]). The kernels keep the word of the lowest peer and return
/// instead of trapping, so the context survives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ErrorWord(pub u64);

impl ErrorWord {
    /// From the [`ERROR_WORD_BYTES`] read back (native endianness, as the device wrote them).
    pub fn from_bytes(b: &[u8; ERROR_WORD_BYTES]) -> ErrorWord {
        ErrorWord(u64::from_ne_bytes(*b))
    }

    /// The decoded condition, `None` for 0.
    pub fn decode(self) -> Option<DeviceError> {
        kernels::decode_error_word(self.0)
    }

    /// The status of the operation at `epoch` on rank `rank`: `Ok` when the word holds no
    /// error; a timeout names the peer that never signalled (peer 0 included).
    pub fn check(self, rank: usize, epoch: Epoch) -> Result<()> {
        let at = format!("one-sided transport: rank {rank}, epoch {}", epoch.0);
        match self.decode() {
            None => Ok(()),
            Some(DeviceError::WaitTimeout { peer }) => Err(Error::Timeout(format!(
                "one-sided transport: rank {rank} timed out waiting for rank {peer} (epoch {}); the peer is slow, stuck or gone",
                epoch.0
            ))),
            Some(DeviceError::RankCapacity { source, rows }) => Err(Error::InvalidArgument(format!(
                "one-sided transport: rank {source} sent {rows} rows to rank {rank} (epoch {}), more than the workspace capacity",
                epoch.0
            ))),
            Some(
                e @ (DeviceError::IdOutOfRange { .. }
                | DeviceError::DuplicateId { .. }
                | DeviceError::Capacity { .. }
                | DeviceError::HostRejected),
            ) => Err(Error::InvalidArgument(format!("{at}: {e}"))),
            Some(e @ DeviceError::Unknown { .. }) => Err(Error::Internal(format!("{at}: {e}"))),
        }
    }
}

/// How a peer's base pointer was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerSource {
    /// This rank's own workspace.
    Local,
    /// A rank in the same process (threads as ranks): its pointer is used as is.
    SameProcess,
    /// `cuIpcOpenMemHandle` of a peer's 64-byte handle.
    LegacyIpc,
    /// A VMM allocation imported from a POSIX fd (SCM_RIGHTS) and mapped here.
    VmmFd,
    /// A VMM allocation imported from a fabric handle (multi-node NVLink; not used yet).
    VmmFabric,
}

impl PeerSource {
    /// Short name for logs and the capability JSON.
    pub fn name(self) -> &'static str {
        match self {
            PeerSource::Local => "local",
            PeerSource::SameProcess => "same_process",
            PeerSource::LegacyIpc => "legacy_ipc",
            PeerSource::VmmFd => "vmm_fd",
            PeerSource::VmmFabric => "vmm_fabric",
        }
    }
}

/// One peer's workspace as seen from this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerEntry {
    /// Device address of the peer's workspace in this process.
    pub base: u64,
    /// Bytes mapped at `base`.
    pub bytes: usize,
    /// How the address was obtained.
    pub source: PeerSource,
}

/// The R workspace base pointers the kernels see (they never learn how they were mapped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerTable {
    rank: usize,
    entries: Vec<Option<PeerEntry>>,
}

impl PeerTable {
    /// An empty table for `rank` of `world`.
    pub fn new(rank: usize, world: usize) -> Result<PeerTable> {
        if rank >= world {
            return Err(Error::InvalidArgument(format!(
                "peer table: rank {rank} is out of range for world size {world}"
            )));
        }
        Ok(PeerTable {
            rank,
            entries: vec![None; world],
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.entries.len()
    }

    /// Records `peer`'s workspace. The own rank must be [`PeerSource::Local`] and no other may
    /// be; a NULL base or a second entry for a rank is an error.
    pub fn set(&mut self, peer: usize, entry: PeerEntry) -> Result<()> {
        let world = self.world();
        let slot = self.entries.get_mut(peer).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "peer table: rank {peer} is out of range for world size {world}"
            ))
        })?;
        if entry.base == 0 {
            return Err(Error::InvalidArgument(format!(
                "peer table: rank {peer}'s workspace address is NULL"
            )));
        }
        if (peer == self.rank) != (entry.source == PeerSource::Local) {
            return Err(Error::InvalidArgument(format!(
                "peer table: rank {peer} recorded as {} on rank {}; only the own rank is local",
                entry.source.name(),
                self.rank
            )));
        }
        if slot.is_some() {
            return Err(Error::InvalidState(format!(
                "peer table: rank {peer}'s workspace was already recorded"
            )));
        }
        *slot = Some(entry);
        Ok(())
    }

    /// The entry of `peer`, if recorded.
    pub fn get(&self, peer: usize) -> Option<&PeerEntry> {
        self.entries.get(peer)?.as_ref()
    }

    /// The base addresses in rank order (what the kernels take), once every rank is recorded
    /// with at least `min_bytes` mapped; the error names the first rank missing or too small.
    pub fn bases(&self, min_bytes: usize) -> Result<Vec<u64>> {
        self.entries
            .iter()
            .enumerate()
            .map(|(r, e)| match e {
                None => Err(Error::InvalidState(format!(
                    "peer table: rank {r}'s workspace is not mapped on rank {}",
                    self.rank
                ))),
                Some(e) if e.bytes < min_bytes => Err(Error::InvalidArgument(format!(
                    "peer table: rank {r}'s workspace has {} bytes, the layout needs {min_bytes}",
                    e.bytes
                ))),
                Some(e) => Ok(e.base),
            })
            .collect()
    }
}
