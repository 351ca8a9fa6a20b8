//! The control segment's layout: a header, one slot of counters per rank and one data
//! descriptor per rank, all shared atomics; and the op header at the start of each rank's
//! data segment.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::segment::{Segment, SharedAtomics};
use super::wait::Wake;
use super::ShmGroup;
use crate::bytes;

pub(super) const MAGIC: u64 = 0x6570_636f_6d6d_0006; // "epcomm" + layout version 6
/// 6: the survivors' membership (`Header::members`, a presence word and a proposal pair per
/// rank after the data descriptors: [`super::membership`]). 5: slots end in a futex word and
/// its sleeper count ([`Wake`]); the header counts the ranks polling (`Header::polling`).
pub(super) const LAYOUT_VERSION: u32 = 6;
pub(super) const HEADER_BYTES: usize = 4096;
/// `Header::conflict_pid` once the group formed without a conflict.
pub(super) const FORMED: u64 = u64::MAX;
/// `Header::conflict_pid` once a rank timed out waiting for rank 0 to set [`FORMED`]: the group
/// does not form, on any rank.
pub(super) const ABANDONED: u64 = u64::MAX - 1;
pub(super) const OP_HEADER_BYTES: usize = 64;

#[repr(C, align(64))]
pub(super) struct Header {
    pub(super) magic: AtomicU64,
    pub(super) version: AtomicU32,
    pub(super) world: AtomicU32,
    pub(super) creator_pid: AtomicU32,
    /// Ranks of the group yielding in a wait now (see [`Waiter`](super::wait::Waiter)).
    pub(super) polling: AtomicU32,
    pub(super) session: AtomicU64,
    /// A rank that tried to join with another world size: rank + 1 (0 = none).
    pub(super) mismatch_rank: AtomicU64,
    pub(super) mismatch_world: AtomicU64,
    /// When rank 0 created the segment (ns since the Unix epoch).
    pub(super) created_ns: AtomicU64,
    /// pid of a process of another job that tried to join this group under the same name
    /// (0 = none): the group must not form. Rank 0 sets [`FORMED`] once the group has waited
    /// out its settle time, a rank tired of waiting for that sets [`ABANDONED`]; the first to
    /// set the word decides, so every rank agrees.
    pub(super) conflict_pid: AtomicU64,
    /// The identity (st_dev, st_ino) of the rendezvous record rank 0 created, so it is removed
    /// even when another process overwrote or truncated its contents.
    pub(super) record_dev: AtomicU64,
    pub(super) record_ino: AtomicU64,
    /// After a failure, the ranks the survivors agreed to leave out: `epoch << 16 | decider + 1`,
    /// the set in the decider's proposal of that epoch (0 = none left out;
    /// [`super::membership`]).
    pub(super) members: AtomicU64,
}
// SAFETY: atomics only; all-zero is the valid "uninitialised" state.
unsafe impl SharedAtomics for Header {}

pub(super) const SLOT_EMPTY: u32 = 0;
pub(super) const SLOT_ACTIVE: u32 = 1;
pub(super) const SLOT_LEFT: u32 = 2;
pub(super) const SLOT_FAILED: u32 = 3;
/// Gave up waiting for the others to join (timed out); not a failure the others report.
pub(super) const SLOT_GAVE_UP: u32 = 4;

pub(super) fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[repr(C, align(128))]
pub(super) struct Slot {
    pub(super) token: AtomicU64,
    pub(super) pid: AtomicU32,
    pub(super) state: AtomicU32,
    pub(super) data_gen: AtomicU64,
    pub(super) data_bytes: AtomicU64,
    pub(super) published: AtomicU64,
    pub(super) consumed: AtomicU64,
    pub(super) op_kind: AtomicU32,
    /// Direct reads of this rank's memory work for peers: 0 unknown, 1 yes, 2 no.
    pub(super) direct_ok: AtomicU32,
    /// Address of a private probe word (holding `token`) for the direct-read check.
    pub(super) probe_addr: AtomicU64,
    /// Rank 0's slot only: the group's decision word, the latest op decided and how
    /// (see [`Decision`](super::decision::Decision)). Every rank obeys it, so all reach the same outcome for every op.
    pub(super) decision: AtomicU64,
    /// `n << 8 | verdict` of the op `n` this rank published: [`VERDICT_OK`] or
    /// [`VERDICT_REJECTED`] (its arguments failed its own checks; it sends nothing).
    pub(super) verdict: AtomicU64,
    /// The op's parameters every rank must agree on (root, dtype, sizes digest, ...).
    pub(super) params: [AtomicU64; PARAMS],
    /// Notified after every change of this slot a peer may wait for (and of the decision
    /// word, on every slot); peers waiting for this rank sleep on it.
    pub(super) wake: Wake,
}
// SAFETY: atomics only; all-zero means an empty slot.
unsafe impl SharedAtomics for Slot {}

/// Parameter words per op that every rank compares before any data moves.
pub(super) const PARAMS: usize = 5;
pub(super) const VERDICT_OK: u64 = 1;
pub(super) const VERDICT_REJECTED: u64 = 2;

/// Where a rank's data segment is: the creator's descriptor number and the file's identity,
/// which peers check when they open it. `gen` is stored last (release).
#[repr(C, align(64))]
pub(super) struct DataDesc {
    pub(super) fd: AtomicU32,
    pub(super) _pad: AtomicU32,
    pub(super) dev: AtomicU64,
    pub(super) ino: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) gen: AtomicU64,
    /// When this rank called join (ns since the Unix epoch): the spread of the ranks' arrivals
    /// sets how long the group waits for a conflicting job to show up.
    pub(super) started_ns: AtomicU64,
}
// SAFETY: atomics only; all-zero means "not created yet".
unsafe impl SharedAtomics for DataDesc {}

pub(super) fn control_bytes(world: usize) -> usize {
    HEADER_BYTES
        + world * (std::mem::size_of::<Slot>() + std::mem::size_of::<DataDesc>())
        + world * member_words(world) * 8
}

/// Words of a rank's membership area: the epoch and attempt it is present at (`epoch << 32 |
/// attempt + 1`; 0 = none), then its proposals for even and odd epochs
/// ([`super::membership`]).
fn member_words(world: usize) -> usize {
    1 + 2 * proposal_words(world)
}

/// Where rank `r`'s membership area is, in a group of `world` ranks.
fn member_offset(world: usize, r: usize) -> usize {
    HEADER_BYTES
        + world * (std::mem::size_of::<Slot>() + std::mem::size_of::<DataDesc>())
        + r * member_words(world) * 8
}

/// Where rank `r`'s presence word is.
pub(super) fn presence_offset(world: usize, r: usize) -> usize {
    member_offset(world, r)
}

/// Words of one membership proposal of a group of `world` ranks: its epoch, then one bit per
/// rank.
pub(super) fn proposal_words(world: usize) -> usize {
    1 + world.div_ceil(64)
}

/// Where rank `r`'s proposal for epochs of parity `parity` is, in a group of `world` ranks.
pub(super) fn proposal_offset(world: usize, r: usize, parity: usize) -> usize {
    member_offset(world, r) + (1 + parity * proposal_words(world)) * 8
}

/// Where rank `r`'s slot is in the control segment.
pub(super) fn slot_offset(r: usize) -> usize {
    HEADER_BYTES + r * std::mem::size_of::<Slot>()
}

/// Where rank `r`'s data descriptor is in the control segment of a group of `world` ranks.
pub(super) fn desc_offset(world: usize, r: usize) -> usize {
    HEADER_BYTES + world * std::mem::size_of::<Slot>() + r * std::mem::size_of::<DataDesc>()
}

/// Tells peers where segment `seg` (generation `gen`) is.
pub(super) fn publish_desc(d: &DataDesc, seg: &Segment, gen: u64) {
    d.fd.store(seg.fd().unwrap_or(0), Ordering::Relaxed);
    d.dev.store(seg.key().0, Ordering::Relaxed);
    d.ino.store(seg.key().1, Ordering::Relaxed);
    d.bytes.store(seg.len() as u64, Ordering::Relaxed);
    d.gen.store(gen, Ordering::Release);
}

/// The op header at the start of a rank's data segment: what the rank published for op `n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct OpHead {
    /// The primitive ([`Op`](crate::group::Op) code).
    pub(super) kind: u32,
    /// 1 if the payload is a table of the rank's buffers (direct mode), else 0.
    pub(super) direct: u32,
    pub(super) n: u64,
    pub(super) payload_len: u64,
    pub(super) meta_len: u64,
    /// How many buffers the payload is made of.
    pub(super) pieces: u64,
}

impl OpHead {
    /// Bytes of the encoded header (within the [`OP_HEADER_BYTES`] reserved for it).
    pub(super) const BYTES: usize = 40;

    pub(super) fn encode(&self) -> [u8; OpHead::BYTES] {
        let mut b = [0u8; OpHead::BYTES];
        b[..8].copy_from_slice(bytes::as_bytes(&[self.kind, self.direct]));
        b[8..].copy_from_slice(bytes::as_bytes(&[
            self.n,
            self.payload_len,
            self.meta_len,
            self.pieces,
        ]));
        b
    }

    pub(super) fn decode(b: &[u8; OpHead::BYTES]) -> OpHead {
        // Every offset lies within the array, so no word is missing.
        let w32 = |i| bytes::word_at::<u32>(b, i).unwrap_or(0);
        let w64 = |i| bytes::word_at::<u64>(b, i).unwrap_or(0);
        OpHead {
            kind: w32(0),
            direct: w32(4),
            n: w64(8),
            payload_len: w64(16),
            meta_len: w64(24),
            pieces: w64(32),
        }
    }
}

pub(super) fn align64(x: usize) -> usize {
    (x + 63) & !63
}

impl ShmGroup {
    pub(super) fn header(&self) -> &Header {
        self.control.at(0)
    }

    pub(super) fn slot(&self, r: usize) -> &Slot {
        self.control.at(slot_offset(r))
    }

    /// The data descriptor of rank `r`.
    pub(super) fn desc(&self, r: usize) -> &DataDesc {
        self.control.at(desc_offset(self.world, r))
    }

    pub(super) fn mark(&self, state: u32) {
        let slot = self.slot(self.rank);
        slot.state.store(state, Ordering::Release);
        slot.wake.notify();
    }

    /// Wakes the ranks sleeping on any slot: after a change of the decision word, which every
    /// waiter of an op waits for whichever peer's slot it sleeps on.
    pub(super) fn notify_all(&self) {
        for r in 0..self.world {
            self.slot(r).wake.notify();
        }
    }
}

// The slot keeps its size (the futex word took the last free bytes), so the decision word and
// every offset before it stay where layout 4 had them.
const _: () =
    assert!(std::mem::size_of::<Slot>() == 128 && std::mem::offset_of!(Slot, wake) == 120);
