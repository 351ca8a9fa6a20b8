//! Maps every rank's one-sided workspace into this process with VMM + POSIX fds (CUDA's virtual
//! memory management API): `cuMemCreate(POSIX_FD)` → export fd → [`exchange_fds`] → import → one
//! reserved VA range with rank `r` at `r * stride` → `cuMemSetAccess`. Works for ranks as processes
//! on one host and for ranks as threads of one process (a rank may import its peers' fds from its
//! own process; DeepEP does the same).

use std::os::fd::AsFd;
use std::time::Duration;

use super::fdpass::exchange_fds;
use super::{PeerEntry, PeerSource, PeerTable, WorkspaceLayout};
use crate::error::{Error, Result};
use crate::gpu::driver::{self, Device, VaRange, VmmAllocation};

/// This rank's view of all workspaces: the peer table plus the mappings behind it (unmapped
/// and freed on drop). The physical memory stays alive while any rank maps it.
#[derive(Debug)]
pub struct VmmWorkspaces {
    table: PeerTable,
    stride: usize,
    range: VaRange,
}

impl VmmWorkspaces {
    /// The R base pointers and their sources.
    pub fn table(&self) -> &PeerTable {
        &self.table
    }

    /// Bytes between consecutive ranks' workspaces in the reserved range (each rank's
    /// allocation size).
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Start of the reserved range (rank 0's workspace).
    pub fn base(&self) -> u64 {
        self.range.base()
    }
}

fn encode_payload(bytes: usize) -> Vec<u8> {
    let mut p = (bytes as u64).to_le_bytes().to_vec();
    p.extend_from_slice(&std::process::id().to_le_bytes());
    p
}

fn decode_size(payload: &[u8]) -> Option<usize> {
    let b: [u8; 8] = payload.get(..8)?.try_into().ok()?;
    usize::try_from(u64::from_le_bytes(b)).ok()
}

/// Allocates this rank's workspace for `layout` on `device`, all-gathers the fds of `group`
/// (bounded by `timeout`; errors name the rank) and maps every rank's workspace. The device's
/// primary context must be current on the calling thread.
pub fn map_workspaces(
    group: &str,
    rank: usize,
    world: usize,
    device: &Device,
    layout: &WorkspaceLayout,
    timeout: Duration,
) -> Result<VmmWorkspaces> {
    if layout.world != world {
        return Err(Error::InvalidArgument(format!(
            "one-sided workspace: layout for {} ranks, group has {world}",
            layout.world
        )));
    }
    let granularity = driver::vmm_granularity(device)?;
    let bytes = layout.allocation_bytes(granularity.next_power_of_two())?;
    let local = VmmAllocation::create(device, bytes, false)?;
    let stride = local.bytes();
    let fd = local.export_fd()?;
    let peers = exchange_fds(
        group,
        rank,
        world,
        Some(fd.as_fd()),
        &encode_payload(stride),
        timeout,
    )?;
    drop(fd); // Peers hold their own duplicates now.

    let total = stride.checked_mul(world).ok_or_else(|| {
        Error::InvalidArgument("one-sided workspace: the VA range overflows".into())
    })?;
    let mut range = VaRange::reserve(total, granularity)?;
    let mut table = PeerTable::new(rank, world)?;
    for p in peers {
        let size = decode_size(&p.payload);
        if size != Some(stride) {
            return Err(Error::InvalidArgument(format!(
                "one-sided workspace of group '{group}': rank {} allocated {size:?} bytes, rank {rank} {stride}; the ranks disagree on the layout",
                p.rank
            )));
        }
        let (addr, source) = if p.rank == rank {
            (range.map(rank * stride, &local, device)?, PeerSource::Local)
        } else {
            let fd = p.fd.ok_or_else(|| {
                Error::PeerFailure(format!(
                    "one-sided workspace of group '{group}': rank {} sent no fd",
                    p.rank
                ))
            })?;
            // The imported handle may be released once mapped: the mapping keeps the memory.
            let imported = VmmAllocation::import_fd(fd.as_fd(), stride)?;
            (
                range.map(p.rank * stride, &imported, device)?,
                PeerSource::VmmFd,
            )
        };
        table.set(
            p.rank,
            PeerEntry {
                base: addr,
                bytes: stride,
                source,
            },
        )?;
    }
    Ok(VmmWorkspaces {
        table,
        stride,
        range,
    })
}
