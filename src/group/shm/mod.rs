//! The shared-memory transport: ranks on one host (processes or threads).
//!
//! Layout: a control segment (a header, one slot of counters per rank and one data descriptor per
//! rank) and one data segment per rank, which that rank writes and every peer maps. Segments are
//! sealed memfds without a name in /dev/shm (see segment.rs): peers open them through
//! `/proc/{pid}/fd/{fd}` while their creator still holds the descriptor, and the creator closes
//! it once every peer has mapped them, so nothing of a formed group can be reached by name or
//! left behind by a crash. A primitive is a numbered *op*: each rank writes what it shares
//! once into its own region and sets `published = n`; peers wait for that, read straight from
//! the region into their outputs (reductions sum there too), and set `consumed = n`. A rank
//! reuses its region only after every peer consumed its previous op, so there are no full
//! barriers between ops. Regions grow on demand (a new generation; peers remap lazily).
//!
//! Direct mode (the default where the kernel allows it): instead of copying its contribution
//! into its region, a rank publishes the addresses of its own buffers, and peers copy straight
//! from them (`process_vm_readv`, or a plain copy between threads): one copy per byte, as MPI's
//! CMA path. The rank then waits until every peer consumed the op before returning, since the
//! buffers are the caller's. Ranks agree on the mode when they join (`EPCOMM_SHM_DIRECT=0`
//! forces the region mode).
//!
//! Symmetric memory (direct mode): a rank may allocate *windows* from its group, shared memory
//! every peer maps (window.rs). Rows exchanged into a window are written by their sources with
//! plain stores straight into their final place, and rows reduced from a window are read with
//! plain loads: no system call per transfer. The MoE manager keeps its dispatch receive buffer
//! in one.
//!
//! Joining: rank 0 creates the control segment and a rendezvous record `/dev/shm/epcomm.{name}`
//! naming it (replacing a stale record of a crashed run), every rank claims its slot and maps
//! every peer's data segment, and once all did, rank 0 removes the record and every rank closes
//! its descriptors. A process of another job that meets the record or a taken slot marks the
//! group conflicted, so neither job forms a group with the other's ranks. Every wait is
//! bounded by the timeout and checks peers' liveness (pid gone or zombie, or the peer marked
//! itself failed/left) about every 50 ms. A wait spins, then sleeps on a futex word in the slot
//! of a peer it waits for; every change it can wait for wakes it, with a system call only when
//! someone sleeps.
//!
//! Files, one idea each (this file holds the handle and the wiring):
//!
//! | file | holds |
//! |---|---|
//! | `segment.rs` | sealed memfd segments, the rendezvous file, `pid_alive`, cross-process copies: the transport's `unsafe` |
//! | `layout.rs` | the control segment's layout (header, slots, data descriptors, slot states) and the op header |
//! | `rendezvous.rs` | group names, unique ids, the rendezvous record, creating or opening rank 0's control segment |
//! | `join.rs` | joining (claim a slot, wait for every rank, settle, agree on direct reads) and leaving (drop) |
//! | `wait.rs` | deadlines, the liveness period, spin-then-futex waits (a futex word per slot), the join's backoff |
//! | `protocol.rs` | the per-op protocol: begin, publish, wait for peers, finish; growing a region |
//! | `decision.rs` | the decision word and blame: the first failure, named the same on every rank |
//! | `agree.rs` | the verdict on the ranks' arguments before any data moves (through `group::agree`) |
//! | `payload.rs` | reading a rank's published op (every word checked), copying and summing payloads |
//! | `ops.rs` | the collectives: the `Group` trait over the protocol |
//! | `window.rs` | symmetric memory: windows every peer maps; rows stored into and loaded from them |
//! | `shrink.rs` | fault tolerance: the ranks a failure lost; the survivors forming a smaller group |
//! | `fork.rs` | a forked child's copy of a group: refused, and its drop leaves the parent's slot alone |

mod agree;
mod decision;
mod fork;
mod join;
mod layout;
mod membership;
mod ops;
mod payload;
mod protocol;
mod rendezvous;
mod segment;
mod shrink;
mod wait;
mod waiting;
mod window;

pub(crate) use self::fork::{current_pid, fork_error};
pub use self::join::MAX_WORLD;
pub use self::rendezvous::{UniqueId, UNIQUE_ID_BYTES};
pub use self::segment::pin_current_thread;
pub(crate) use self::shrink::{check_excluded, verify_views, ShrinkView};
pub use self::window::SharedBuf;

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use self::payload::LocalTables;
use self::segment::Segment;
use super::GroupOptions;

/// A rank's membership in a shared-memory group.
pub struct ShmGroup {
    name: String,
    rank: usize,
    world: usize,
    opts: GroupOptions,
    control: Segment,
    control_name: String,
    control_unlinked: bool,
    session: u64,
    data: Segment,
    gen: u64,
    peers: Vec<Option<(u64, Segment)>>,
    seq: u64,
    broken: Option<String>,
    pid: u32,
    /// Peers read this rank's buffers directly (agreed by all ranks at join).
    direct: bool,
    /// A private word peers read at join to test direct reads (kept alive for that).
    _probe: Box<u64>,
    /// The op whose buffers peers may still be reading (direct mode), until it finishes.
    exposed: Option<u64>,
    /// The op that first published a grown region: its descriptor stays open for peers to map
    /// it until that op is committed.
    grown_at: u64,
    /// Buffer tables of this process's thread ranks of this group (direct mode).
    tables: Arc<LocalTables>,
    /// The windows (symmetric memory) this rank handed out, while their buffers live.
    windows: Vec<Weak<window::WinInfo>>,
    /// Peers' windows mapped here.
    peer_windows: RefCell<Vec<window::PeerWindow>>,
    /// After a failure: the survivors' group every user of this one shares.
    survivors: Option<super::survivors::Survivors>,
}

impl std::fmt::Debug for ShmGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmGroup")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("seq", &self.seq)
            .finish()
    }
}

impl ShmGroup {
    /// Whether peers read this group's contributions directly (one copy per byte).
    pub fn direct(&self) -> bool {
        self.direct
    }
}
