//! Process groups: the primitives the MoE and EPLB layers need, over shared memory (the embedded
//! default), host callbacks (torch.distributed, MPI, ...) or NCCL (feature `nccl`).
//!
//! Every primitive is collective: all ranks call it, in the same order. Buffers are bytes; the
//! caller converts rows to bytes. Reductions sum in f32 in rank order (deterministic).

mod agree;
mod frame;
pub mod host;
pub mod masked;
pub mod rows;
pub mod shm;
pub mod survivors;

pub use shm::SharedBuf;

use std::time::Duration;

use crate::error::{Error, Result};
use crate::num::FloatKind;

pub use crate::env::DEFAULT_TIMEOUT;

/// Options shared by all transports.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupOptions {
    /// Bound on every wait; a peer that does not arrive in time is a timeout error naming it.
    pub timeout: Duration,
    /// Initial bytes of each rank's shared region (shm); it grows on demand.
    pub initial_capacity: usize,
    /// Upper bound for a rank's region (0 = only the memory available); a request beyond it is
    /// an error naming both sizes.
    pub max_capacity: usize,
    /// The group is an elastic (stateless) EP group.
    pub elastic: bool,
    /// shm: let peers copy straight from this rank's buffers where the kernel allows it (one
    /// copy per byte); `false` (or `EPCOMM_SHM_DIRECT=0`) stages through the shared region.
    pub direct_reads: bool,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            timeout: timeout_from_env().unwrap_or(DEFAULT_TIMEOUT),
            initial_capacity: 4 << 20,
            max_capacity: 0,
            elastic: false,
            direct_reads: true,
        }
    }
}

/// `EPCOMM_TIMEOUT_S` (seconds, fractional allowed) if set and valid; an invalid value is
/// warned about once (see [`crate::env`]).
pub fn timeout_from_env() -> Option<Duration> {
    crate::env::timeout()
}

/// One point-to-point operation of a batch.
#[derive(Debug)]
pub enum P2p<'a> {
    Send { peer: usize, data: &'a [u8] },
    Recv { peer: usize, data: &'a mut [u8] },
}

/// The ranks a fault-tolerant shrink left out (of the old group's numbering) and the
/// survivors' group ([`Group::shrink_lost`]).
pub type Shrunk = (Vec<usize>, Box<dyn Group>);

/// A group of ranks. One thread uses a group at a time.
pub trait Group: Send {
    /// This rank's place in the group: what [`Group::rank`], [`Group::size`], [`Group::name`]
    /// and [`Group::elastic`] read.
    fn identity(&self) -> Identity<'_>;

    fn rank(&self) -> usize {
        self.identity().rank
    }

    fn size(&self) -> usize {
        self.identity().size
    }

    fn name(&self) -> &str {
        self.identity().name
    }

    /// An elastic (stateless) EP group.
    fn elastic(&self) -> bool {
        self.identity().elastic
    }

    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<()>;

    /// Concatenates every rank's `input` in rank order into `output`. `sizes[r]` is rank r's
    /// byte count (may be 0); `input.len() == sizes[rank]`, `output.len() == sum(sizes)`.
    fn all_gatherv(&mut self, input: &[u8], sizes: &[usize], output: &mut [u8]) -> Result<()>;

    /// Sums every rank's `input` (`sum(rows)` rows of `row_elems` elements of `kind`) and
    /// writes this rank's slice (`rows[rank]` rows, after the rows of lower ranks) to `output`.
    /// Accumulates in f32, in rank order.
    fn reduce_scatterv(&mut self, r: ReduceScatterv<'_>) -> Result<()>;

    /// Sends `send_sizes[p]` bytes (consecutive chunks of `send`, in peer order) to each peer p
    /// and receives `recv_sizes[p]` bytes from each peer into consecutive chunks of `recv`.
    fn all_to_allv(&mut self, a: AllToAllv<'_>) -> Result<()>;

    /// The room (bytes before, bytes after) this transport frames every chunk of
    /// [`Group::all_to_allv_framed`] with; (0, 0) where it frames nothing.
    fn chunk_frame(&self) -> (usize, usize) {
        (0, 0)
    }

    /// [`Group::all_to_allv`] over buffers that keep [`Group::chunk_frame`]'s room around every
    /// peer's chunk ([`chunk_starts`] lays them out; the sizes count payload bytes only). The
    /// transport writes and checks the frames in that room, so a caller that packs rows
    /// straight into place moves each byte without a copy into or out of a frame.
    fn all_to_allv_framed(&mut self, a: AllToAllv<'_, &mut [u8]>) -> Result<()> {
        self.all_to_allv(a.unframed())
    }

    /// A batch of sends and receives, matched per peer pair in issue order (the j-th send from
    /// a to b fills the j-th receive on b from a; sizes must agree). Collective: every rank
    /// calls it, possibly with no operations.
    fn send_recv(&mut self, ops: &mut [P2p<'_>]) -> Result<()>;

    /// Copies `data` of rank `root` into `data` on every rank (same length everywhere).
    fn broadcast(&mut self, root: usize, data: &mut [u8]) -> Result<()>;

    /// Takes part in collective `op` as a rank whose arguments failed its own checks (`e`,
    /// returned): transports that can tell the peers do (they fail at once, naming this rank,
    /// and the group stays usable); others return `e` and the peers see a missing rank.
    fn reject(&mut self, op: Op, e: Error) -> Error {
        let _ = op;
        e
    }

    /// Opens the collectives of one user call (a dispatch, a combine). A transport whose ops
    /// each end with an exchange of every rank's verdict may leave it to
    /// [`Group::close_call`]: a rank whose op of the call failed says so in the next header
    /// every rank gathers, so the call still ends alike on every rank. Ops outside a call keep
    /// their own verdicts.
    fn open_call(&mut self) {}

    /// Closes the call [`Group::open_call`] opened, with this rank's `outcome`; returns the
    /// call's outcome, the same on every rank (a rank's failure fails every rank).
    fn close_call(&mut self, outcome: Result<()>) -> Result<()> {
        outcome
    }

    /// Symmetric memory: `len` zeroed bytes of shared memory that every peer of this group maps
    /// ([`SharedBuf`]), so that `exchange_rows` into it and `reduce_rows` from it move each byte
    /// once with plain stores and loads (no system call per transfer). `None` where the
    /// transport has none. With another group the buffer is ordinary memory.
    fn alloc_shared(&mut self, len: usize) -> Result<Option<SharedBuf>> {
        let _ = len;
        Ok(None)
    }

    /// Whether `buf` came from [`Group::alloc_shared`] on this rank of this group.
    fn owns_shared(&self, buf: &SharedBuf) -> bool {
        let _ = buf;
        false
    }

    /// Fault tolerance: the ranks this rank holds as lost after an op failed — the rank the
    /// failure was blamed on (dead, stalled, failed or gone), plus every peer whose process is
    /// gone — sorted, never this rank. Empty while nothing failed, or where the transport
    /// cannot tell. [`Group::shrink`] checks that every survivor passes the same list.
    fn lost_ranks(&self) -> Vec<usize> {
        Vec::new()
    }

    /// Fault tolerance (like `ncclCommShrink`, MPI ULFM's `MPI_Comm_shrink`): the ranks not in
    /// `excluded` (sorted, distinct, not this rank) form a new group of
    /// `size() - excluded.len()` ranks, renumbered in the old order. Collective over the
    /// survivors only; every survivor must pass the same list (a disagreement is an error on
    /// every survivor, and no group forms); an excluded rank never joins. This group is left
    /// as it is (usually broken by the failure); drop it when done.
    fn shrink(&mut self, excluded: &[usize]) -> Result<Box<dyn Group>> {
        let _ = excluded;
        Err(Error::NotImplemented(format!(
            "group '{}' cannot shrink: its transport has no shrink",
            self.name()
        )))
    }

    /// Fault tolerance: after an op failed by a peer's loss, the survivors' group and the ranks
    /// (of this group) it leaves out; None while nothing is lost. Every survivor ends with the
    /// same set: by default the [`Group::lost_ranks`] every survivor must agree on
    /// ([`Group::shrink`] checks it); the shared-memory transport agrees on it itself, adding a
    /// rank that does not meet the survivors within the timeout (a second fault).
    fn shrink_lost(&mut self) -> Result<Option<Shrunk>> {
        let lost = self.lost_ranks();
        if lost.is_empty() {
            return Ok(None);
        }
        let g = self.shrink(&lost)?;
        Ok(Some((lost, g)))
    }

    /// Where this group keeps its survivors' group after a failure ([`survivors::current`]),
    /// so every user of the group shares one. `None` where the transport keeps none.
    fn survivors_slot(&mut self) -> Option<&mut Option<survivors::Survivors>> {
        None
    }

    /// Gathers equal-sized small objects: `out` (`size() * mine.len()` bytes) in rank order.
    fn all_gather(&mut self, mine: &[u8], out: &mut [u8]) -> Result<()> {
        let sizes = vec![mine.len(); self.size()];
        self.all_gatherv(mine, &sizes, out)
    }

    /// [`Group::all_gather`] of a caller's header, with `check` run on every rank's (rank
    /// order, `mine.len()` bytes each) before the call returns: its error is the call's. A
    /// transport with op headers ([`Group::rides`]) carries `mine` in the header itself and runs
    /// `check` before its own agreement (so ranks in different calls of the caller, each with
    /// such a header, get the caller's error alike).
    fn all_gather_checked(&mut self, mine: &[u8], out: &mut [u8], check: Checker) -> Result<()> {
        self.all_gather(mine, out)?;
        check(out)
    }

    /// Whether [`Group::ride`] defers the caller's header to the header of this rank's next op
    /// (one engine call fewer) instead of gathering it at once.
    fn rides(&self) -> bool {
        false
    }

    /// Agreement on a caller's header (at most 256 bytes, the same length on every rank):
    /// every rank's `mine` checked by `check`, whose error fails every rank before any data
    /// moves. Here an [`Group::all_gather_checked`] now; a transport that [`Group::rides`] sends
    /// `mine` in the header of this rank's next op and runs `check` there (its error is that
    /// op's), so the caller must start that op next (or close its call).
    fn ride(&mut self, mine: &[u8], check: Checker) -> Result<()> {
        let mut all = vec![0u8; mine.len() * self.size()];
        self.all_gather_checked(mine, &mut all, check)
    }

    /// Moves rows between ranks: peer p receives rows `give[p]` of `src` (in that order), and
    /// the rows this rank receives from peer p land at rows `take[p]` of `dst` (in p's order).
    /// Rows are `row_bytes` long. `give[p].len()` on rank r must equal `take[r].len()` on p.
    ///
    /// This default packs, exchanges with all_to_allv and unpacks; transports that can read
    /// peers' memory move each row once, straight into place.
    fn exchange_rows(&mut self, r: RowExchange<'_>) -> Result<()> {
        rows::exchange_packed(self, r)
    }

    /// Weighted reduction of peers' rows: peer p wants rows `give[p]` of `src` (elements of
    /// `kind`, `row_elems` per row), and each row received from peer p is added, times its
    /// weight, to row `take[p][i].0` of the output. Sums are f32, in rank order, then in each
    /// peer's order (deterministic on every transport), and stored as `out_kind` in `out`;
    /// rows nobody contributes to are zero. Works in cache-sized blocks of output rows.
    fn reduce_rows(&mut self, r: RowReduce<'_>) -> Result<()> {
        rows::reduce_packed(self, r)
    }
}

/// A caller's check of every rank's header ([`Group::ride`], [`Group::all_gather_checked`]):
/// the headers in rank order. It must give the same outcome on every rank for the same headers.
pub type Checker = Box<dyn Fn(&[u8]) -> Result<()> + Send>;

/// Who this rank is in a group ([`Group::identity`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity<'a> {
    pub rank: usize,
    pub size: usize,
    pub name: &'a str,
    /// An elastic (stateless) EP group.
    pub elastic: bool,
}

/// The buffers of a [`Group::reduce_scatterv`]: every rank's `input` holds `sum(rows)` rows of
/// `row_elems` elements of `kind`; `output` takes this rank's `rows[rank]` rows of the sum.
#[derive(Debug)]
pub struct ReduceScatterv<'a> {
    pub input: &'a [u8],
    pub rows: &'a [usize],
    pub row_elems: usize,
    pub kind: FloatKind,
    pub output: &'a mut [u8],
}

/// The buffers of an all-to-all with a size per peer ([`Group::all_to_allv`],
/// [`host::HostTransport::all_to_allv`]): `send_sizes[p]` bytes of `send` (consecutive chunks,
/// peer order) go to peer p, and `recv_sizes[p]` bytes from peer p land in consecutive chunks
/// of `recv`. `Send` is `&mut [u8]` where the transport writes frames into the send buffer
/// ([`Group::all_to_allv_framed`]).
#[derive(Debug)]
pub struct AllToAllv<'a, Send = &'a [u8]> {
    pub send: Send,
    pub send_sizes: &'a [usize],
    pub recv: &'a mut [u8],
    pub recv_sizes: &'a [usize],
}

impl<'a> AllToAllv<'a, &'a mut [u8]> {
    /// The same buffers, the send buffer read only.
    pub fn unframed(self) -> AllToAllv<'a> {
        AllToAllv {
            send: self.send,
            send_sizes: self.send_sizes,
            recv: self.recv,
            recv_sizes: self.recv_sizes,
        }
    }
}

/// Rows to move ([`Group::exchange_rows`]): peer p gets rows `give[p]` of `src`, and the rows
/// from peer p land at rows `take[p]` of `dst`, in order; rows are `row_bytes` long.
#[derive(Debug)]
pub struct RowExchange<'a> {
    pub src: &'a [u8],
    pub row_bytes: usize,
    pub give: &'a [Vec<u32>],
    pub dst: &'a mut [u8],
    pub take: &'a [Vec<u32>],
}

/// Rows to reduce ([`Group::reduce_rows`]): peer p wants rows `give[p]` of `src`
/// (`row_elems` elements of `kind` each), and each row from peer p is added, times its weight,
/// to row `take[p][i].0` of `out`, stored as `out_kind`.
#[derive(Debug)]
pub struct RowReduce<'a> {
    pub src: &'a [u8],
    pub kind: FloatKind,
    pub row_elems: usize,
    pub give: &'a [Vec<u32>],
    pub out: &'a mut [u8],
    pub out_kind: FloatKind,
    pub take: &'a [Vec<(u32, f32)>],
}

/// The name of a primitive, for messages. Declaration order, from 1, is the wire code in each
/// host frame (pinned code by code in frame.rs's tests): only append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Join = 1,
    Barrier,
    AllGatherv,
    ReduceScatterv,
    AllToAllv,
    SendRecv,
    Broadcast,
    Leave,
    ExchangeRows,
    ReduceRows,
}

impl Op {
    pub const ALL: [Op; 10] = [
        Op::Join,
        Op::Barrier,
        Op::AllGatherv,
        Op::ReduceScatterv,
        Op::AllToAllv,
        Op::SendRecv,
        Op::Broadcast,
        Op::Leave,
        Op::ExchangeRows,
        Op::ReduceRows,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Join => "join",
            Op::Barrier => "barrier",
            Op::AllGatherv => "all_gatherv",
            Op::ReduceScatterv => "reduce_scatterv",
            Op::AllToAllv => "all_to_allv",
            Op::SendRecv => "send_recv",
            Op::Broadcast => "broadcast",
            Op::Leave => "destroy",
            Op::ExchangeRows => "exchange_rows",
            Op::ReduceRows => "reduce_rows",
        }
    }

    pub fn from_code(c: u32) -> Option<Op> {
        Op::ALL.into_iter().find(|o| *o as u32 == c)
    }
}

/// Where each peer's chunk (its room included) starts in a buffer of chunks of `sizes` payload
/// bytes, each framed by `room` = (before, after) bytes ([`Group::chunk_frame`]); the last
/// entry is the buffer's length.
pub(crate) fn chunk_starts(sizes: &[usize], room: (usize, usize)) -> Vec<usize> {
    let mut starts = Vec::with_capacity(sizes.len() + 1);
    let mut at = 0usize;
    starts.push(0);
    for &s in sizes {
        at = at.saturating_add(room.0 + s + room.1);
        starts.push(at);
    }
    starts
}

/// The first `n` bytes of `buf`, grown (never shrunk) to hold them: buffers kept between calls
/// and only grown, so steady state allocates nothing and faults in no page.
pub(crate) fn grown(buf: &mut Vec<u8>, n: usize) -> &mut [u8] {
    if buf.len() < n {
        buf.resize(n, 0);
    }
    &mut buf[..n]
}

/// Checks a per-rank size list: one entry per rank; returns the sum.
pub(crate) fn check_sizes(what: &str, op: Op, sizes: &[usize], world: usize) -> Result<usize> {
    if sizes.len() != world {
        return Err(Error::InvalidArgument(format!(
            "{}: {what} has {} entries; expected one per rank ({world})",
            op.name(),
            sizes.len()
        )));
    }
    sizes
        .iter()
        .try_fold(0usize, |a, &s| a.checked_add(s))
        .filter(|&t| t <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{}: {what} add up to more than {} bytes (the largest buffer); expected sizes that fit in memory",
                op.name(),
                isize::MAX
            ))
        })
}

/// Checks that a buffer has the expected byte length.
pub(crate) fn check_len(what: &str, op: Op, len: usize, expected: usize, why: &str) -> Result<()> {
    if len != expected {
        return Err(Error::InvalidArgument(format!(
            "{}: {what} has {len} bytes; expected {expected} ({why})",
            op.name()
        )));
    }
    Ok(())
}

/// Checks a rank argument.
pub(crate) fn check_rank(what: &str, op: Op, r: usize, world: usize) -> Result<()> {
    if r >= world {
        return Err(Error::InvalidArgument(format!(
            "{}: {what} is {r}; expected a rank in 0..{world}",
            op.name()
        )));
    }
    Ok(())
}

/// Validates reduce_scatterv arguments; returns (row bytes, offset of this rank's slice in rows).
pub(crate) fn check_reduce_scatterv(
    rank: usize,
    world: usize,
    r: &ReduceScatterv<'_>,
) -> Result<(usize, usize)> {
    let op = Op::ReduceScatterv;
    let (rows, row_elems, kind) = (r.rows, r.row_elems, r.kind);
    let total = check_sizes("rows", op, rows, world)?;
    let row_bytes = row_elems * kind.size();
    check_len(
        "input",
        op,
        r.input.len(),
        total * row_bytes,
        &format!(
            "sum(rows) = {total} rows of {row_elems} {} elements",
            kind.name()
        ),
    )?;
    check_len(
        "output",
        op,
        r.output.len(),
        rows[rank] * row_bytes,
        &format!(
            "rows[{rank}] = {} rows of {row_elems} {} elements",
            rows[rank],
            kind.name()
        ),
    )?;
    Ok((row_bytes, rows[..rank].iter().sum()))
}

/// Checks the peers of a send/recv batch, and the messages this rank sends itself against the
/// receives it posts from itself (in order, equal sizes) before anything is exchanged.
pub(crate) fn check_p2p(ops: &[P2p<'_>], rank: usize, world: usize) -> Result<()> {
    let mut self_sends = Vec::new();
    let mut self_recvs = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let (peer, len, send) = match op {
            P2p::Send { peer, data } => (*peer, data.len(), true),
            P2p::Recv { peer, data } => (*peer, data.len(), false),
        };
        check_rank(&format!("ops[{i}].peer"), Op::SendRecv, peer, world)?;
        if peer == rank {
            if send {
                self_sends.push(len)
            } else {
                self_recvs.push(len)
            }
        }
    }
    if self_sends != self_recvs {
        return Err(Error::InvalidArgument(format!(
            "send_recv: rank {rank} sends itself messages of {self_sends:?} bytes but posts receives from itself of {self_recvs:?} bytes"
        )));
    }
    Ok(())
}
