//! A group driven by the host's own transport (torch.distributed, MPI, ...): the host supplies
//! blocking point-to-point send/recv (and optionally all_gather and barrier), and epcomm builds
//! every primitive from them.
//!
//! Pairwise exchanges follow a round-robin tournament: in each round every rank has at most one
//! partner, and the lower rank of a pair sends first while the higher one receives first. That
//! is deadlock-free even when the host's send blocks until the matching receive is posted.
//!
//! Every op starts with an all_gather of a fixed-size header from every rank (its verdict on
//! its own arguments, the op, the parameters all ranks must pass alike); all_to_allv and
//! send_recv then gather the size lists. Every rank checks the same headers in the same
//! order, so a rank's bad arguments, a disagreement or a rank calling another collective is
//! the same error on every rank before any data moves, and the group stays usable.
//!
//! Every message is framed ([`super::frame`]: op, step, op number, sender, receiver, message
//! number, length) and checked on receipt. A rank whose host call fails or delivers a bad
//! frame after the headers goes on with the op (no peer is left waiting for it), and every op
//! that passed its agreement ends with an all_gather of each rank's verdict: one failure fails
//! every rank with the same status, never OK with wrong data on the others. Only a failure of
//! that last all_gather itself is seen by its rank alone (by then every rank's data is whole).

use super::agree::{self, Param, MAX_PARAMS};
use super::frame::{Frame, Step, HEAD, TAIL, TO_ALL};
use super::shm::{check_excluded, verify_views, ShrinkView};
use super::{
    check_len, check_p2p, check_sizes, grown, AllToAllv, Checker, Group, Identity, Op, P2p,
    ReduceScatterv,
};
use crate::bytes;
use crate::error::{Error, Result, Status};
use crate::num;

/// What a host transport provides. Calls are blocking; an `Err` carries the host's reason.
pub trait HostTransport: Send {
    /// Sends `data` to `peer` (returns once the buffer may be reused).
    fn send(&mut self, peer: usize, data: &[u8]) -> std::result::Result<(), String>;
    /// Receives exactly `data.len()` bytes from `peer`.
    fn recv(&mut self, peer: usize, data: &mut [u8]) -> std::result::Result<(), String>;
    /// Gathers `mine` from every rank into `out` (rank order). `None` = not provided.
    fn all_gather(
        &mut self,
        _mine: &[u8],
        _out: &mut [u8],
    ) -> Option<std::result::Result<(), String>> {
        None
    }
    /// An all-to-all with a size per peer (MPI_Alltoallv; torch.distributed's
    /// all_to_all_single with split sizes; grouped ncclSend/ncclRecv): `send_sizes[p]` bytes
    /// of `send` (consecutive chunks, rank order) to peer p, and `recv_sizes[p]` bytes from
    /// peer p into consecutive chunks of `recv`. epcomm has agreed on every size with every
    /// rank before it calls this. `None` = not provided (built from send/recv).
    fn all_to_allv(&mut self, _a: AllToAllv<'_>) -> Option<std::result::Result<(), String>> {
        None
    }
    /// A barrier. `None` = not provided. Not called: every collective, the barrier included,
    /// starts with an all_gather of the ranks' op headers, which synchronizes them and finds a
    /// rank that called another collective. Kept so existing transports still compile.
    fn barrier(&mut self) -> Option<std::result::Result<(), String>> {
        None
    }
    /// How the last failed call failed, where the host says so: the op then fails with that
    /// status (PEER_FAILURE, TIMEOUT) instead of RUNTIME. `None` = not said.
    fn failure_kind(&self) -> Option<HostFailure> {
        None
    }
    /// Fault tolerance: the ranks the host's transport holds as lost (a peer it saw fail).
    /// `None` = not provided (no rank is reported lost).
    fn lost_ranks(&self) -> Option<std::result::Result<Vec<usize>, String>> {
        None
    }
    /// Fault tolerance: a transport over the ranks not in `excluded` (sorted, distinct, not
    /// this rank), renumbered in order; collective over the survivors. `None` = not provided
    /// (the group cannot shrink).
    fn shrink(
        &mut self,
        _excluded: &[usize],
    ) -> Option<std::result::Result<Box<dyn HostTransport>, String>> {
        None
    }
}

/// How a host call failed, where the host tells: the op fails with the matching status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostFailure {
    /// A peer failed or is gone (EPCOMM_ERROR_PEER_FAILURE).
    PeerFailure,
    /// A peer did not answer in time (EPCOMM_ERROR_TIMEOUT).
    Timeout,
}

/// A group over a host transport.
pub struct HostGroup {
    transport: Box<dyn HostTransport>,
    name: String,
    rank: usize,
    world: usize,
    elastic: bool,
    broken: Option<String>,
    /// reduce_scatterv's accumulation buffer, kept between calls: a fresh allocation per
    /// call costs a page fault per page.
    acc: Vec<f32>,
    /// After a failure: the survivors' group every user of this one shares.
    survivors: Option<super::survivors::Survivors>,
    /// Ops started on this group (every rank counts alike): each message carries it.
    seq: u64,
    /// The step of the op in progress, which each message carries.
    step: Step,
    /// Messages of the op in progress sent to and received from each peer, and host
    /// all_gathers: the message numbers.
    sent: Vec<u64>,
    got: Vec<u64>,
    gathers: u64,
    /// The first failure of the op in progress (a host call's, or a bad frame): the op goes
    /// on, so no peer waits for this rank, and fails on every rank at its close.
    fault: Option<Error>,
    /// Whether that failure is the host's own (a callback returned an error).
    host_fault: bool,
    /// Whether the host has an all_gather, an all_to_allv (known after the first call).
    host_all_gather: Option<bool>,
    host_all_to_allv: Option<bool>,
    /// Framed messages out and in, kept between calls.
    out_frame: Vec<u8>,
    in_frame: Vec<u8>,
    /// The user call in progress ([`Group::open_call`]), if any.
    call: Option<Call>,
    /// A caller's header and its check for the header of the next op ([`Group::ride`]).
    rider: Option<(Vec<u8>, Checker)>,
}

/// A user call in progress: its ops leave their verdicts to the next op's header or to
/// [`Group::close_call`].
#[derive(Debug, Clone, Copy)]
struct Call {
    /// Every rank already knows how the call ends (a header showed it to all of them), so
    /// the close gathers nothing.
    settled: bool,
    /// The call's last op, for messages.
    last: Op,
}

impl std::fmt::Debug for HostGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostGroup")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

/// The partner of `rank` in round `round` of a round-robin tournament over `world` ranks, or
/// `None` when it sits the round out (odd world sizes).
pub fn tournament_partner(rank: usize, world: usize, round: usize) -> Option<usize> {
    let m = world + world % 2; // even number of players (one dummy when odd)
    let k = m - 1;
    let partner = if rank == m - 1 {
        (0..k).find(|&i| (2 * i) % k == round % k)?
    } else {
        let j = (round + k - rank % k) % k;
        if j == rank {
            m - 1
        } else {
            j
        }
    };
    (partner < world).then_some(partner)
}

impl HostGroup {
    pub fn new(
        transport: Box<dyn HostTransport>,
        name: &str,
        rank: usize,
        world: usize,
        elastic: bool,
    ) -> Result<HostGroup> {
        if world == 0 {
            return Err(Error::InvalidArgument(
                "world_size is 0; expected at least 1".into(),
            ));
        }
        if rank >= world {
            return Err(Error::InvalidArgument(format!(
                "rank is {rank}; expected 0 <= rank < world_size ({world})"
            )));
        }
        crate::log::set_thread_rank(Some(rank));
        Ok(HostGroup {
            transport,
            name: name.to_owned(),
            rank,
            world,
            elastic,
            broken: None,
            acc: Vec::new(),
            survivors: None,
            seq: 0,
            step: Step::Header,
            sent: vec![0; world],
            got: vec![0; world],
            gathers: 0,
            fault: None,
            host_fault: false,
            host_all_gather: None,
            host_all_to_allv: None,
            out_frame: Vec::new(),
            in_frame: Vec::new(),
            call: None,
            rider: None,
        })
    }

    fn host_err(&self, op: Op, what: &str, why: String) -> Error {
        self.host_error(format!(
            "host transport {what} failed during {} of group '{}' on rank {}: {why}",
            crate::call::name_or(op.name()),
            self.name,
            self.rank
        ))
    }

    /// `msg` with the status the host gave its failed call (RUNTIME where it gave none).
    fn host_error(&self, msg: String) -> Error {
        match self.transport.failure_kind() {
            Some(HostFailure::PeerFailure) => Error::PeerFailure(msg),
            Some(HostFailure::Timeout) => Error::Timeout(msg),
            None => Error::Runtime(msg),
        }
    }

    /// The group of the survivors without `excluded` (see [`Group::shrink`]).
    fn shrunk(&mut self, excluded: &[usize]) -> Result<HostGroup> {
        check_excluded(&self.name, self.rank, self.world, excluded)?;
        let (name, me) = (&self.name, self.rank);
        let transport = match self.transport.shrink(excluded) {
            None => {
                return Err(Error::NotImplemented(format!(
                    "group '{name}' cannot shrink: its host transport has no shrink (the shrink callback of epcomm_host_callbacks is NULL)"
                )))
            }
            Some(Err(why)) => {
                return Err(self.host_error(format!(
                    "host transport shrink failed for group '{name}' on rank {me}: {why}"
                )))
            }
            Some(Ok(t)) => t,
        };
        let rank = me - excluded.iter().filter(|&&r| r < me).count();
        let world = self.world - excluded.len();
        let mut g = HostGroup::new(transport, name, rank, world, self.elastic)?;
        let view = ShrinkView {
            name: name.clone(),
            session: 0,
            world: self.world,
            rank: me,
            excluded: excluded.to_vec(),
        };
        verify_views(&mut g, &view)?;
        Ok(g)
    }

    /// Starts an op: the next op number, no message yet, no failure.
    fn begin(&mut self) {
        self.seq += 1;
        self.step = Step::Header;
        self.sent.fill(0);
        self.got.fill(0);
        self.gathers = 0;
        self.fault = None;
        self.host_fault = false;
    }

    /// Records a failure of the op in progress (the first one counts); the op goes on.
    fn fail(&mut self, e: Error, host: bool) {
        if self.fault.is_none() {
            self.fault = Some(e);
            self.host_fault = host;
        }
    }

    /// The frame of a message of the op in progress.
    fn frame(&self, op: Op, from: usize, to: u64, index: u64, len: usize) -> Frame {
        Frame {
            op,
            step: self.step,
            seq: self.seq,
            from,
            to,
            index,
            len,
        }
    }

    /// The error of a message whose frame is not the expected one.
    fn bad_frame(&self, op: Op, what: &str, why: String) -> Error {
        Error::Runtime(format!(
            "host transport {what} delivered a bad message during {} of group '{}' on rank {}: {why}; a host transport must deliver every message whole, once, in order, from the rank that sent it",
            crate::call::name_or(op.name()),
            self.name,
            self.rank
        ))
    }

    /// Sends `data` to `peer`, framed; a failure is recorded ([`HostGroup::fail`]).
    fn send(&mut self, op: Op, peer: usize, data: &[u8]) {
        let f = self.frame(op, self.rank, peer as u64, self.sent[peer], data.len());
        self.sent[peer] += 1;
        let mut framed = std::mem::take(&mut self.out_frame);
        f.wrap(data, &mut framed);
        self.send_framed(op, peer, &framed);
        self.out_frame = framed;
    }

    /// Hands an already framed message to the host's send; a failure is recorded.
    fn send_framed(&mut self, op: Op, peer: usize, framed: &[u8]) {
        if let Err(e) = self.transport.send(peer, framed) {
            let e = self.host_err(op, &format!("send to rank {peer}"), e);
            self.fail(e, true);
        }
    }

    /// Fills `framed` (blanked) from the host's receive; a failure is recorded.
    fn recv_framed(&mut self, op: Op, peer: usize, framed: &mut [u8]) {
        if let Err(e) = self.transport.recv(peer, framed) {
            let e = self.host_err(op, &format!("recv from rank {peer}"), e);
            self.fail(e, true);
        }
    }

    /// Receives `data` from `peer` and checks its frame; a failure is recorded
    /// ([`HostGroup::fail`]) and leaves `data` as it was.
    fn recv(&mut self, op: Op, peer: usize, data: &mut [u8]) {
        let f = self.frame(op, peer, self.rank as u64, self.got[peer], data.len());
        self.got[peer] += 1;
        self.in_frame.resize(f.size(), 0);
        f.blank(&mut self.in_frame);
        let what = || format!("recv from rank {peer}");
        match self.transport.recv(peer, &mut self.in_frame) {
            Err(e) => {
                let e = self.host_err(op, &what(), e);
                self.fail(e, true);
            }
            Ok(()) => match f.check(&self.in_frame) {
                Ok(payload) => data.copy_from_slice(payload),
                Err(why) => {
                    let e = self.bad_frame(op, &what(), why);
                    self.fail(e, false);
                }
            },
        }
    }

    /// Sends `out` to and receives `inp` from `peer`, lower rank first.
    fn exchange(&mut self, op: Op, peer: usize, out: &[u8], inp: &mut [u8]) {
        if self.rank < peer {
            self.send(op, peer, out);
            self.recv(op, peer, inp);
        } else {
            self.recv(op, peer, inp);
            self.send(op, peer, out);
        }
    }

    /// Sends, in issue order, every message of `ops` addressed to `p`.
    fn send_all_to(&mut self, ops: &[P2p<'_>], p: usize) {
        for o in ops {
            if let P2p::Send { peer, data } = o {
                if *peer == p {
                    self.send(Op::SendRecv, p, data);
                }
            }
        }
    }

    /// Runs `f(partner)` for each round of the tournament.
    fn rounds(&mut self, mut f: impl FnMut(&mut Self, usize)) {
        let rounds = self.world + self.world % 2 - 1;
        for round in 0..rounds {
            if let Some(p) = tournament_partner(self.rank, self.world, round) {
                f(self, p);
            }
        }
    }

    fn guarded<T>(&mut self, op: Op, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if let Some(why) = self.broken.clone() {
            // Every rank that uses the group after the failure fails here, without a message.
            self.settle();
            return Err(Error::InvalidState(format!(
                "{}: group '{}' is unusable after an earlier failure ({why}); destroy it and create a new one",
                op.name(),
                self.name
            )));
        }
        f(self).map_err(|e| self.broke(e))
    }
}

/// Words of the fixed-size header every rank contributes to the all_gather that starts every
/// op: tag and verdict, op code, two op-specific counts, the agreed parameters, then
/// [`INLINE_BYTES`] of the op's own data.
const HEADER_WORDS: usize = 4 + MAX_PARAMS + INLINE_BYTES / 8;
/// Data an all_gather(v) of at most this many bytes per rank travels in the op header itself:
/// the op is then the header and the verdicts, two host calls (a dispatch's or combine's own
/// header, a dispatch's routing at one or two tokens per rank).
const INLINE_BYTES: usize = 256;
/// Where the inline data starts in a header.
const INLINE_AT: usize = 4 + MAX_PARAMS;
/// High bits of word 0 ("ephd"): a header from anything else is a broken host transport.
const HEADER_TAG: u64 = 0x6570_6864 << 32;
const VERDICT_OK: u64 = 1;
const VERDICT_REJECTED: u64 = 2;
/// The header of a rank whose op of the user call in progress failed (word 2: its status,
/// word 3: the op's number): in place of the next op's header, or at the call's close.
const CALL_FAILED: u64 = 3;
/// The header of a rank that closes its user call with every op done.
const CALL_DONE: u64 = 4;
/// Word 0's flag of an op header whose inline data is a caller's header ([`Group::ride`]).
const RIDER: u64 = 1 << 8;

/// Whether word 0 of a header is an op header's (tag, verdict, maybe the rider flag).
fn op_header_word(w0: u64) -> bool {
    w0 & !(0xff | RIDER) == HEADER_TAG && matches!(w0 & 0xff, VERDICT_OK | VERDICT_REJECTED)
}

/// A header of `kind` for `op` with its two op-specific words; parameters and inline data zero.
fn header(kind: u64, op: Op, counts: [u64; 2]) -> [u64; HEADER_WORDS] {
    let mut h = [0u64; HEADER_WORDS];
    h[0] = HEADER_TAG | kind;
    h[1] = op as u64;
    h[2..4].copy_from_slice(&counts);
    h
}

/// Every rank's header of one op, in rank order.
struct Headers(Vec<u64>);

impl Headers {
    fn word(&self, p: usize, i: usize) -> u64 {
        self.0[p * HEADER_WORDS + i]
    }
    /// Rank p's op-specific count `i` (0 or 1).
    fn count(&self, p: usize, i: usize) -> usize {
        self.word(p, 2 + i) as usize
    }
    /// Rank p's inline data (the first `n` of its [`INLINE_BYTES`]).
    fn inline(&self, p: usize, n: usize) -> &[u8] {
        let at = p * HEADER_WORDS + INLINE_AT;
        &bytes::as_bytes(&self.0[at..at + INLINE_BYTES / 8])[..n]
    }
    /// The wrapping sum over every rank of op-specific word `i`.
    fn sum(&self, world: usize, i: usize) -> u64 {
        (0..world).fold(0u64, |a, p| a.wrapping_add(self.word(p, 2 + i)))
    }
}

impl HostGroup {
    /// Gathers `mine` (the same length on every rank) from every rank into `out`: the host's
    /// all_gather when it has one (each part framed and checked), else the tournament. A
    /// failure is recorded ([`HostGroup::fail`]).
    fn gather(&mut self, op: Op, mine: &[u8], out: &mut [u8]) {
        if self.host_all_gather != Some(false) {
            let n = mine.len();
            let f = self.frame(op, self.rank, TO_ALL, self.gathers, n);
            self.gathers += 1;
            f.wrap(mine, &mut self.out_frame);
            self.in_frame.resize(f.size() * self.world, 0);
            for (p, part) in self.in_frame.chunks_exact_mut(f.size()).enumerate() {
                Frame { from: p, ..f }.blank(part);
            }
            let got = self
                .transport
                .all_gather(&self.out_frame, &mut self.in_frame);
            self.host_all_gather = Some(got.is_some());
            match got {
                None => {}
                Some(Err(e)) => {
                    let e = self.host_err(op, "all_gather", e);
                    return self.fail(e, true);
                }
                Some(Ok(())) => {
                    for p in 0..self.world {
                        let part = &self.in_frame[p * f.size()..(p + 1) * f.size()];
                        match (Frame { from: p, ..f }).check(part) {
                            Ok(payload) => out[p * n..(p + 1) * n].copy_from_slice(payload),
                            Err(why) => {
                                let e = self.bad_frame(
                                    op,
                                    &format!("all_gather (rank {p}'s part)"),
                                    why,
                                );
                                return self.fail(e, false);
                            }
                        }
                    }
                    return;
                }
            }
        }
        self.gather_v(op, mine, &vec![mine.len(); self.world], out)
    }

    /// Concatenates every rank's `mine` (`sizes[p]` bytes on rank p) into `out`, rank order.
    fn gather_v(&mut self, op: Op, mine: &[u8], sizes: &[usize], out: &mut [u8]) {
        let offsets = bytes_before(sizes);
        let me = self.rank;
        out[offsets[me]..offsets[me] + sizes[me]].copy_from_slice(mine);
        self.rounds(|g, p| g.exchange(op, p, mine, &mut out[offsets[p]..offsets[p] + sizes[p]]))
    }

    /// Starts `op` on every rank: gathers the headers, then checks that every rank called `op`
    /// and (when this rank's own checks passed) that no peer rejected its arguments and all
    /// agree on `params`. Every rank sees the same headers, so every rank reaches the same
    /// verdict before any data moves; a rejection or a disagreement leaves the group usable.
    fn agree(
        &mut self,
        op: Op,
        local: &Result<()>,
        params: &[Param],
        counts: [u64; 2],
        inline: &[u8],
    ) -> Result<Headers> {
        // A caller's header rides in this op's inline data (the op's own is then empty, or
        // the same bytes: an all_gather_checked).
        let rider = self.rider.take();
        let inline = rider.as_ref().map_or(inline, |r| &r.0);
        debug_assert!(params.len() <= MAX_PARAMS && inline.len() <= INLINE_BYTES);
        let kind = if local.is_ok() {
            VERDICT_OK
        } else {
            VERDICT_REJECTED
        };
        let flag = if rider.is_some() { RIDER } else { 0 };
        let mut mine = header(kind | flag, op, counts);
        for (w, p) in mine[4..].iter_mut().zip(params) {
            *w = p.value;
        }
        for (w, c) in mine[INLINE_AT..].iter_mut().zip(inline.chunks(8)) {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            *w = u64::from_ne_bytes(b);
        }
        let check = rider.as_ref().map(|(b, c)| (b.len(), c));
        let got = self.gather_headers(op, mine, local, params, check);
        if got.is_err() {
            // Every rank saw the same headers (or the host failed the gather on every rank).
            self.settle();
        }
        got
    }

    /// [`HostGroup::agree`]'s gather of `mine` and its checks.
    fn gather_headers(
        &mut self,
        op: Op,
        mine: [u64; HEADER_WORDS],
        local: &Result<()>,
        params: &[Param],
        rider: Option<(usize, &Checker)>,
    ) -> Result<Headers> {
        let mut all = vec![0u8; HEADER_WORDS * 8 * self.world];
        self.gather(op, bytes::as_bytes(&mine), &mut all);
        if self.host_fault {
            // The host's own failure: it tells every rank (as a failed all_gather does).
            return Err(self.fault.take().unwrap_or_else(|| {
                Error::Internal(format!("{}: a host failure without an error", op.name()))
            }));
        }
        let heads = Headers(bytes::to_vec(&all));
        if self.fault.is_some() {
            // This rank cannot read the headers: it goes on as its peers do when all agree
            // (they stop when one rejected), and fails the op on every rank at its close.
            local.clone()?;
            return Ok(heads);
        }
        self.check_call(op, &heads)?;
        if let Some((n, check)) = rider {
            self.check_riders(&heads, n, check)?;
        }
        self.check_ops(op, &heads)?;
        if let Err(e) = local {
            return Err(e.clone());
        }
        let rejected = |p: usize| heads.word(p, 0) & 0xff == VERDICT_REJECTED;
        let value = |p: usize, i: usize| heads.word(p, 4 + i);
        let seen = agree::Seen {
            world: self.world,
            rejected: &rejected,
            value: &value,
        };
        agree::verdict(op, &self.name, self.rank, params, &seen)?;
        Ok(heads)
    }

    /// The caller's check of every rank's header riding in `heads` ([`Group::ride`]), before
    /// the ops are compared: ranks in different calls of one caller get its error alike. Only
    /// when every rank's op header carries one (else [`HostGroup::check_ops`] tells).
    fn check_riders(&self, heads: &Headers, n: usize, check: &Checker) -> Result<()> {
        let riding = |p: usize| {
            let w0 = heads.word(p, 0);
            op_header_word(w0) && w0 & RIDER != 0
        };
        if !(0..self.world).all(riding) {
            return Ok(());
        }
        let all: Vec<u8> = (0..self.world)
            .flat_map(|p| heads.inline(p, n).iter().copied())
            .collect();
        check(&all)
    }

    /// Every header is well formed and names the same op as rank 0's.
    fn check_ops(&self, op: Op, heads: &Headers) -> Result<()> {
        let ops: Vec<Option<Op>> = (0..self.world)
            .map(|p| {
                op_header_word(heads.word(p, 0))
                    .then(|| u32::try_from(heads.word(p, 1)).ok().and_then(Op::from_code))
                    .flatten()
            })
            .collect();
        if let Some(p) = ops.iter().position(Option::is_none) {
            return Err(self.host_err(
                op,
                "all_gather",
                format!("rank {p} delivered a malformed op header (the host transport garbled the bytes, or rank {p} runs another library)"),
            ));
        }
        let first = ops[0];
        if let Some(p) = ops.iter().position(|o| *o != first) {
            let name = |o: Option<Op>| o.map_or("?", Op::name);
            return Err(Error::InvalidArgument(format!(
                "{}: ranks of group '{}' called different collectives: rank 0 calls {} but rank {p} calls {}; every rank must call the same collectives in the same order (no data was exchanged)",
                op.name(),
                self.name,
                name(first),
                name(ops[p])
            )));
        }
        Ok(())
    }

    /// Marks the user call in progress as ending alike on every rank without a close.
    fn settle(&mut self) {
        if let Some(call) = &mut self.call {
            call.settled = true;
        }
    }

    /// The verdicts of the user call in progress that `heads` carry: a rank whose earlier op
    /// of the call failed (its header says so in place of this op's) fails this op on every
    /// rank; a rank that closed its call while the others call `op` called another collective.
    fn check_call(&self, op: Op, heads: &Headers) -> Result<()> {
        let kind = |p: usize| heads.word(p, 0) & 0xff;
        if let Some(p) = (0..self.world).find(|&p| kind(p) == CALL_FAILED) {
            return Err(self.peer_failed(op, p, heads.word(p, 2), heads.word(p, 3)));
        }
        match (0..self.world).find(|&p| kind(p) == CALL_DONE) {
            Some(p) => Err(Error::InvalidArgument(format!(
                "{}: ranks of group '{}' called different collectives: rank {p} ended its call but rank {} calls {}; every rank must call the same collectives in the same order",
                crate::call::name_or(op.name()),
                self.name,
                self.rank,
                op.name()
            ))),
            None => Ok(()),
        }
    }

    /// Closes the user call in progress: every rank gathers one header saying how its call
    /// went, unless a header already showed every rank how it ends.
    fn close_user_call(&mut self, outcome: Result<()>) -> Result<()> {
        let Some(call) = self.call.take() else {
            return outcome;
        };
        if call.settled {
            return outcome;
        }
        let op = call.last;
        self.begin();
        let status = outcome.as_ref().err().map(|e| e.status() as u64);
        let kind = status.map_or(CALL_DONE, |_| CALL_FAILED);
        let mine = header(kind, op, [status.unwrap_or(0), self.seq.wrapping_sub(1)]);
        let mut all = vec![0u8; HEADER_WORDS * 8 * self.world];
        self.gather(op, bytes::as_bytes(&mine), &mut all);
        let fault = self.fault.take();
        // This rank's failure ends the group here as its peers' reading of it does there (an
        // argument error leaves it usable on every rank).
        outcome.map_err(|e| self.broke(e))?;
        if let Some(e) = fault {
            return Err(self.broke(e));
        }
        let heads = Headers(bytes::to_vec(&all));
        let done = |p: usize| heads.word(p, 0) == HEADER_TAG | CALL_DONE;
        match (0..self.world).find(|&p| !done(p)) {
            None => Ok(()),
            Some(p) if heads.word(p, 0) == HEADER_TAG | CALL_FAILED => {
                let e = self.peer_failed(op, p, heads.word(p, 2), heads.word(p, 3));
                Err(self.broke(e))
            }
            Some(p) => Err(self.broke(self.host_err(
                op,
                "all_gather",
                format!("rank {p} delivered a header that does not close its call (the host transport garbled the bytes, or rank {p} called another collective)"),
            ))),
        }
    }

    /// `e`, after marking the group unusable unless `e` is an argument error (an argument
    /// error leaves the group usable).
    fn broke(&mut self, e: Error) -> Error {
        if !matches!(e, Error::InvalidArgument(_)) {
            self.broken = Some(e.to_string());
        }
        e
    }

    /// Runs `op`: its agreement (`local` = this rank's own checks), then `f` with the headers
    /// when every rank accepted and agreed, then the verdicts ([`HostGroup::close`]).
    fn run<T>(
        &mut self,
        op: Op,
        local: Result<()>,
        params: &[Param],
        counts: [u64; 2],
        f: impl FnOnce(&mut Self, &Headers) -> Result<T>,
    ) -> Result<T> {
        self.run_inline(op, local, params, counts, &[], f)
    }

    /// [`HostGroup::run`] with `inline` (at most [`INLINE_BYTES`]) in this rank's op header.
    fn run_inline<T>(
        &mut self,
        op: Op,
        local: Result<()>,
        params: &[Param],
        counts: [u64; 2],
        inline: &[u8],
        f: impl FnOnce(&mut Self, &Headers) -> Result<T>,
    ) -> Result<T> {
        self.guarded(op, |g| {
            g.begin();
            let heads = g.agree(op, &local, params, counts, inline)?;
            g.step = Step::Data;
            let out = f(g, &heads);
            g.close(op, out)
        })
    }

    /// Ends an op every rank took part in: gathers every rank's verdict (0, or the status it
    /// failed with). This rank's own failure is its error; else the lowest failed rank's
    /// status fails this rank too, so every rank has the same outcome.
    fn close<T>(&mut self, op: Op, out: Result<T>) -> Result<T> {
        if let Some(call) = &mut self.call {
            // In a user call the verdict waits for the next header or the call's close.
            call.last = op;
            return match self.fault.take() {
                Some(e) => Err(e),
                None => out,
            };
        }
        self.step = Step::Verdict;
        let failed = self.fault.as_ref().or(out.as_ref().err());
        let mine = failed.map_or(0, |e| e.status() as u64);
        let mut all = vec![0u8; 8 * self.world];
        self.gather(op, &mine.to_le_bytes(), &mut all);
        if let Some(e) = self.fault.take() {
            return Err(e);
        }
        let out = out?;
        let verdicts: Vec<u64> = all
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect();
        match verdicts.iter().position(|&v| v != 0) {
            None => Ok(out),
            Some(p) => Err(self.peer_failed(op, p, verdicts[p], self.seq)),
        }
    }

    /// The error of a rank whose op went well when rank `p` failed it with status `code`.
    fn peer_failed(&self, op: Op, p: usize, code: u64, seq: u64) -> Error {
        let status = i32::try_from(code)
            .ok()
            .and_then(Status::from_code)
            .unwrap_or(Status::Runtime);
        // An argument error leaves the group usable ([`HostGroup::guarded`]); others end it.
        let after = if status == Status::InvalidArgument {
            ""
        } else {
            "; the group is unusable"
        };
        let msg = format!(
            "{}: rank {p} of group '{}' failed op #{} ({}; see rank {p}'s error), so it fails on every rank (rank {} too){after}",
            crate::call::name_or(op.name()),
            self.name,
            seq,
            status.description(),
            self.rank
        );
        match status {
            Status::Timeout => Error::Timeout(msg),
            Status::PeerFailure => Error::PeerFailure(msg),
            Status::InvalidArgument | Status::NullPointer => Error::InvalidArgument(msg),
            Status::InvalidState => Error::InvalidState(msg),
            Status::System => Error::System(msg),
            Status::Internal => Error::Internal(msg),
            Status::Assertion => Error::Assertion(msg),
            Status::NotImplemented => Error::NotImplemented(msg),
            Status::Unavailable => Error::Unavailable(msg),
            Status::Ok | Status::Runtime => Error::Runtime(msg),
        }
    }
}

/// The byte offset of each rank's chunk in a concatenation of `sizes`.
fn bytes_before(sizes: &[usize]) -> Vec<usize> {
    sizes
        .iter()
        .scan(0, |acc, &s| {
            let o = *acc;
            *acc += s;
            Some(o)
        })
        .collect()
}

/// The byte range of each chunk in a concatenation of `sizes`, in order.
fn chunks(sizes: &[usize]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    sizes.iter().scan(0, |at, &n| {
        let r = *at..*at + n;
        *at += n;
        Some(r)
    })
}

/// Where each framed chunk of `sizes` payload bytes starts (and, last, the buffer's length).
fn framed_starts(sizes: &[usize]) -> Vec<usize> {
    super::chunk_starts(sizes, (HEAD, TAIL))
}

impl Group for HostGroup {
    fn survivors_slot(&mut self) -> Option<&mut Option<super::survivors::Survivors>> {
        Some(&mut self.survivors)
    }

    // Each transport reads its own fields (the protocol code uses them directly).
    fn identity(&self) -> Identity<'_> {
        Identity {
            rank: self.rank,
            size: self.world,
            name: &self.name,
            elastic: self.elastic,
        }
    }

    /// The ranks the host's transport reports lost, sorted, never this rank; none where it
    /// cannot tell (or its callback failed: logged).
    fn lost_ranks(&self) -> Vec<usize> {
        match self.transport.lost_ranks() {
            None => Vec::new(),
            Some(Ok(mut lost)) => {
                lost.retain(|&p| p != self.rank && p < self.world);
                lost.sort_unstable();
                lost.dedup();
                lost
            }
            Some(Err(why)) => {
                crate::log::warn(&format!(
                    "host transport lost_ranks failed for group '{}' on rank {}: {why}; no rank is reported lost",
                    self.name, self.rank
                ));
                Vec::new()
            }
        }
    }

    fn shrink(&mut self, excluded: &[usize]) -> Result<Box<dyn Group>> {
        Ok(Box::new(self.shrunk(excluded)?))
    }

    /// The header all_gather alone: it returns once every rank has sent its header, and it
    /// finds a rank that called another collective.
    fn barrier(&mut self) -> Result<()> {
        self.run(Op::Barrier, Ok(()), &[], [0, 0], |_, _| Ok(()))
    }

    fn open_call(&mut self) {
        self.rider = None;
        self.call = Some(Call {
            settled: false,
            last: Op::Barrier,
        });
    }

    fn close_call(&mut self, outcome: Result<()>) -> Result<()> {
        // A header left riding (its op never started) rides no later op.
        self.rider = None;
        self.close_user_call(outcome)
    }

    fn rides(&self) -> bool {
        true
    }

    fn ride(&mut self, mine: &[u8], check: Checker) -> Result<()> {
        if mine.len() > INLINE_BYTES {
            let mut all = vec![0u8; mine.len() * self.world];
            return self.all_gather_checked(mine, &mut all, check);
        }
        self.rider = Some((mine.to_vec(), check));
        Ok(())
    }

    fn all_gather_checked(&mut self, mine: &[u8], out: &mut [u8], check: Checker) -> Result<()> {
        if mine.len() > INLINE_BYTES {
            self.all_gather(mine, out)?;
            return check(out);
        }
        // all_gather's inline path: the header is the op's inline data and rides with it.
        self.rider = Some((mine.to_vec(), check));
        let got = self.all_gather(mine, out);
        self.rider = None;
        got
    }

    fn reject(&mut self, op: Op, e: Error) -> Error {
        if self.broken.is_some() {
            return e;
        }
        match self.run(op, Err(e), &[], [0, 0], |_, _| Ok(())) {
            Err(e) => e,
            Ok(()) => Error::Internal(format!("{}: a rejected op succeeded", op.name())),
        }
    }

    fn all_gatherv(&mut self, input: &[u8], sizes: &[usize], output: &mut [u8]) -> Result<()> {
        let op = Op::AllGatherv;
        let (local, params) =
            agree::all_gatherv_args(self.rank, self.world, input.len(), sizes, output.len());
        let me = self.rank;
        if sizes.iter().all(|&n| n <= INLINE_BYTES) && input.len() <= INLINE_BYTES {
            // In the op header: every rank agreed on the sizes before they are read.
            return self.run_inline(op, local, &params, [0, 0], input, |g, heads| {
                for (p, c) in chunks(sizes).enumerate().take(g.world) {
                    let n = c.len();
                    output[c].copy_from_slice(heads.inline(p, n));
                }
                Ok(())
            });
        }
        let (mut send, mut recv) = self.take_frames();
        let got = self.run(op, local, &params, [0, 0], |g, _| {
            // Every peer gets this rank's input: one host all_to_allv (or the tournament).
            let mine = vec![input.len(); g.world];
            let (ss, rs) = (framed_starts(&mine), framed_starts(sizes));
            let send = grown(&mut send, ss[g.world]);
            for p in 0..g.world {
                send[ss[p] + HEAD..][..input.len()].copy_from_slice(input);
            }
            let recv = grown(&mut recv, rs[g.world]);
            g.move_chunks(op, send, &mine, recv, sizes);
            if g.fault.is_none() {
                let at = bytes_before(sizes);
                for p in (0..g.world).filter(|&p| p != me) {
                    output[at[p]..at[p] + sizes[p]]
                        .copy_from_slice(&recv[rs[p] + HEAD..][..sizes[p]]);
                }
                output[at[me]..at[me] + sizes[me]].copy_from_slice(input);
            }
            Ok(())
        });
        self.keep_frames(send, recv);
        got
    }

    fn reduce_scatterv(&mut self, r: ReduceScatterv<'_>) -> Result<()> {
        let op = Op::ReduceScatterv;
        let me = self.rank;
        let (local, params) = agree::reduce_scatterv_args(me, self.world, &r);
        let (input, rows, row_elems, kind, output) =
            (r.input, r.rows, r.row_elems, r.kind, r.output);
        let row_bytes = local.as_ref().map_or(0, |&(b, _)| b);
        let slice = |r: usize| {
            let start: usize = rows[..r].iter().sum::<usize>() * row_bytes;
            start..start + rows[r] * row_bytes
        };
        // Every rank's contribution to this rank's slice (one host all_to_allv, or the
        // tournament), then a sum in rank order. Nothing goes to this rank itself.
        let (mut send, mut recv) = self.take_frames();
        let mut starts = Vec::new();
        let got = self.run(op, local.map(drop), &params, [0, 0], |g, _| {
            let others = |n: usize| {
                (0..g.world)
                    .map(|p| if p == me { 0 } else { n })
                    .collect::<Vec<usize>>()
            };
            let send_sizes: Vec<usize> = (0..g.world)
                .map(|p| if p == me { 0 } else { rows[p] * row_bytes })
                .collect();
            let recv_sizes = others(rows[me] * row_bytes);
            let ss = framed_starts(&send_sizes);
            starts = framed_starts(&recv_sizes);
            let send = grown(&mut send, ss[g.world]);
            for p in (0..g.world).filter(|&p| p != me) {
                send[ss[p] + HEAD..][..send_sizes[p]].copy_from_slice(&input[slice(p)]);
            }
            let recv = grown(&mut recv, starts[g.world]);
            g.move_chunks(op, send, &send_sizes, recv, &recv_sizes);
            Ok(())
        });
        let mut acc = std::mem::take(&mut self.acc);
        if got.is_ok() {
            acc.clear();
            acc.resize(rows[me] * row_elems, 0.0);
            let part = rows[me] * row_bytes;
            for p in 0..self.world {
                let theirs = if p == me {
                    &input[slice(me)]
                } else {
                    &recv[starts[p] + HEAD..][..part]
                };
                num::accumulate(&mut acc, theirs, kind);
            }
            num::store(&acc, output, kind);
        }
        self.acc = acc;
        self.keep_frames(send, recv);
        got
    }

    /// Copies into frames kept by the group, then [`HostGroup::all_to_allv_framed`]'s exchange.
    fn all_to_allv(&mut self, a: AllToAllv<'_>) -> Result<()> {
        let (send, send_sizes, recv, recv_sizes) = (a.send, a.send_sizes, a.recv, a.recv_sizes);
        let local = self.all_to_allv_args(send.len(), send_sizes, recv.len(), recv_sizes, 0);
        let (mut s, mut r) = self.take_frames();
        let (ss, rs) = (framed_starts(send_sizes), framed_starts(recv_sizes));
        let got = match local {
            Ok(()) => {
                let framed_send = grown(&mut s, ss[self.world]);
                for (p, c) in chunks(send_sizes).enumerate() {
                    framed_send[ss[p] + HEAD..][..c.len()].copy_from_slice(&send[c]);
                }
                let framed_recv = grown(&mut r, rs[self.world]);
                self.framed(framed_send, send_sizes, framed_recv, recv_sizes, Ok(()))
                    .inspect(|()| {
                        for (p, c) in chunks(recv_sizes).enumerate() {
                            let n = c.len();
                            recv[c].copy_from_slice(&framed_recv[rs[p] + HEAD..][..n]);
                        }
                    })
            }
            Err(e) => self.framed(&mut [], send_sizes, &mut [], recv_sizes, Err(e)),
        };
        self.keep_frames(s, r);
        got
    }

    fn chunk_frame(&self) -> (usize, usize) {
        (HEAD, TAIL)
    }

    /// The frames are written and checked in place: the caller's packed rows are what the
    /// host sends and receives (no copy into or out of a frame).
    fn all_to_allv_framed(&mut self, a: AllToAllv<'_, &mut [u8]>) -> Result<()> {
        let (send, send_sizes, recv, recv_sizes) = (a.send, a.send_sizes, a.recv, a.recv_sizes);
        let room = HEAD + TAIL;
        let local = self.all_to_allv_args(send.len(), send_sizes, recv.len(), recv_sizes, room);
        self.framed(send, send_sizes, recv, recv_sizes, local)
    }

    fn send_recv(&mut self, ops: &mut [P2p<'_>]) -> Result<()> {
        let op = Op::SendRecv;
        let me = self.rank;
        let local = check_p2p(ops, me, self.world).and_then(|()| copy_self_sends(ops, me));
        let words = agree::p2p_words(ops);
        let counts = [words[0], words[1]];
        self.run(op, local, &[], counts, |g, heads| {
            g.agree_messages(heads, &words)?;
            g.rounds(|g, p| {
                if me < p {
                    g.send_all_to(ops, p);
                }
                for o in ops.iter_mut() {
                    if let P2p::Recv { peer, data } = o {
                        if *peer == p {
                            g.recv(op, p, data);
                        }
                    }
                }
                if me > p {
                    g.send_all_to(ops, p);
                }
            });
            Ok(())
        })
    }

    fn broadcast(&mut self, root: usize, data: &mut [u8]) -> Result<()> {
        let op = Op::Broadcast;
        let (local, params) = agree::broadcast_args(self.world, root, data.len());
        let me = self.rank;
        self.run(op, local, &params, [0, 0], |g, _| {
            if me == root {
                for p in (0..g.world).filter(|&p| p != root) {
                    g.send(op, p, data);
                }
            } else {
                g.recv(op, root, data);
            }
            Ok(())
        })
    }

    fn all_gather(&mut self, mine: &[u8], out: &mut [u8]) -> Result<()> {
        let op = Op::AllGatherv;
        let local = mine
            .len()
            .checked_mul(self.world)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "all_gatherv: {} bytes times world_size {} overflows",
                    mine.len(),
                    self.world
                ))
            })
            .and_then(|n| check_len("out", op, out.len(), n, "world_size * len(mine)"));
        let params = [agree::number("byte count", mine.len())];
        let n = mine.len();
        if n <= INLINE_BYTES {
            // In the op header: every rank agreed on the byte count before it is read.
            return self.run_inline(op, local, &params, [0, 0], mine, |g, heads| {
                for p in 0..g.world {
                    out[p * n..(p + 1) * n].copy_from_slice(heads.inline(p, n));
                }
                Ok(())
            });
        }
        self.run(op, local, &params, [0, 0], |g, _| {
            g.gather(op, mine, out);
            Ok(())
        })
    }
}

impl HostGroup {
    /// all_to_allv's own checks: one size per rank, and buffers of the sizes' sums plus `room`
    /// bytes of frame per chunk.
    fn all_to_allv_args(
        &self,
        send_len: usize,
        send_sizes: &[usize],
        recv_len: usize,
        recv_sizes: &[usize],
        room: usize,
    ) -> Result<()> {
        let (op, world) = (Op::AllToAllv, self.world);
        let framing = room * world;
        let what = if room == 0 {
            "sum(send_sizes)".to_owned()
        } else {
            format!("sum(send_sizes) + {room} bytes of frame per rank")
        };
        let st = check_sizes("send_sizes", op, send_sizes, world)?;
        let rt = check_sizes("recv_sizes", op, recv_sizes, world)?;
        check_len("send", op, send_len, st.saturating_add(framing), &what)?;
        check_len(
            "recv",
            op,
            recv_len,
            rt.saturating_add(framing),
            &what.replace("send_sizes", "recv_sizes"),
        )
    }

    /// all_to_allv over framed chunks: the sizes agree with the op header (each rank's hashes
    /// of its sends and receives: when their sums over every rank differ, every rank gathers
    /// the size lists and names the first pair that disagrees), then the chunks move in one
    /// host all_to_allv (or the tournament), then the verdicts.
    fn framed(
        &mut self,
        send: &mut [u8],
        send_sizes: &[usize],
        recv: &mut [u8],
        recv_sizes: &[usize],
        local: Result<()>,
    ) -> Result<()> {
        let op = Op::AllToAllv;
        let me = self.rank;
        let sent = (send_sizes.iter().enumerate()).fold(0u64, |a, (p, &n)| {
            a.wrapping_add(agree::pair_hash(me, p, n))
        });
        let expected = (recv_sizes.iter().enumerate()).fold(0u64, |a, (p, &n)| {
            a.wrapping_add(agree::pair_hash(p, me, n))
        });
        self.run(op, local, &[], [sent, expected], |g, heads| {
            if g.fault.is_none() && heads.sum(g.world, 0) != heads.sum(g.world, 1) {
                g.agree_size_matrix(send_sizes, recv_sizes)?;
            }
            g.move_chunks(op, send, send_sizes, recv, recv_sizes);
            Ok(())
        })
    }

    /// Moves framed chunks ([`framed_starts`]): chunk p of `send` (`send_sizes[p]` payload
    /// bytes in place) to rank p, and rank p's chunk for this rank into chunk p of `recv`,
    /// through one host all_to_allv where the host has one, else the tournament of
    /// send/recv. Writes the frames of `send` and checks those of `recv`; a failure is
    /// recorded ([`HostGroup::fail`]).
    fn move_chunks(
        &mut self,
        op: Op,
        send: &mut [u8],
        send_sizes: &[usize],
        recv: &mut [u8],
        recv_sizes: &[usize],
    ) {
        let (me, world) = (self.rank, self.world);
        let (ss, rs) = (framed_starts(send_sizes), framed_starts(recv_sizes));
        let mut incoming = Vec::with_capacity(world);
        for p in 0..world {
            let f = self.frame(op, me, p as u64, self.sent[p], send_sizes[p]);
            self.sent[p] += 1;
            f.seal(&mut send[ss[p]..ss[p + 1]]);
            let f = self.frame(op, p, me as u64, self.got[p], recv_sizes[p]);
            self.got[p] += 1;
            f.blank(&mut recv[rs[p]..rs[p + 1]]);
            incoming.push(f);
        }
        let framed = |s: &[usize]| s.windows(2).map(|w| w[1] - w[0]).collect::<Vec<usize>>();
        let host = if self.host_all_to_allv == Some(false) {
            None
        } else {
            let got = self.transport.all_to_allv(AllToAllv {
                send,
                send_sizes: &framed(&ss),
                recv,
                recv_sizes: &framed(&rs),
            });
            self.host_all_to_allv = Some(got.is_some());
            got
        };
        match host {
            Some(Err(e)) => {
                let e = self.host_err(op, "all_to_allv", e);
                return self.fail(e, true);
            }
            Some(Ok(())) => {}
            None => {
                let mine = &send[ss[me]..ss[me + 1]];
                if mine.len() == rs[me + 1] - rs[me] {
                    recv[rs[me]..rs[me + 1]].copy_from_slice(mine);
                }
                self.rounds(|g, p| {
                    let (out, inp) = (&send[ss[p]..ss[p + 1]], &mut recv[rs[p]..rs[p + 1]]);
                    if me < p {
                        g.send_framed(op, p, out);
                        g.recv_framed(op, p, inp);
                    } else {
                        g.recv_framed(op, p, inp);
                        g.send_framed(op, p, out);
                    }
                });
            }
        }
        for (p, f) in incoming.iter().enumerate() {
            if let Err(why) = f.check(&recv[rs[p]..rs[p + 1]]) {
                let what = if host.is_some() {
                    format!("all_to_allv (rank {p}'s chunk)")
                } else {
                    format!("recv from rank {p}")
                };
                let e = self.bad_frame(op, &what, why);
                return self.fail(e, false);
            }
        }
    }

    /// The group's kept frame buffers, taken out for an op (put back by
    /// [`HostGroup::keep_frames`]).
    fn take_frames(&mut self) -> (Vec<u8>, Vec<u8>) {
        (
            std::mem::take(&mut self.out_frame),
            std::mem::take(&mut self.in_frame),
        )
    }

    fn keep_frames(&mut self, send: Vec<u8>, recv: Vec<u8>) {
        (self.out_frame, self.in_frame) = (send, recv);
    }

    /// all_to_allv: gathers every rank's send and receive sizes and checks every pair in the
    /// same order on every rank (rank r's send_sizes[p] against rank p's recv_sizes[r]). A
    /// rank that could not read them goes on with its own (the op fails at its close).
    fn agree_size_matrix(&mut self, send_sizes: &[usize], recv_sizes: &[usize]) -> Result<()> {
        let world = self.world;
        let mine: Vec<u64> = send_sizes
            .iter()
            .chain(recv_sizes)
            .map(|&s| s as u64)
            .collect();
        let mut all = vec![0u8; mine.len() * 8 * world];
        self.step = Step::Agreement;
        self.gather(Op::AllToAllv, bytes::as_bytes(&mine), &mut all);
        self.step = Step::Data;
        if self.fault.is_some() {
            return Ok(());
        }
        let all: Vec<u64> = bytes::to_vec(&all);
        let sent = |r: usize, p: usize| all[r * 2 * world + p];
        let expected = |p: usize, r: usize| all[p * 2 * world + world + r];
        agree::check_size_matrix(world, &sent, &expected)
    }

    /// send_recv: gathers every rank's message lists (`agree::p2p_words`; their lengths came
    /// with the headers) and checks every ordered pair in the same order on every rank. A rank
    /// that could not read the headers does not know the lengths: it fails at once (its peers
    /// then fail too, when the host's receives from it time out). One that could not read the
    /// lists goes on with its own messages (the op fails at its close).
    fn agree_messages(&mut self, heads: &Headers, mine: &[u64]) -> Result<()> {
        if let Some(e) = self.fault.take() {
            return Err(e);
        }
        let sizes: Vec<usize> = (0..self.world)
            .map(|p| 8 * (2 + 2 * (heads.count(p, 0) + heads.count(p, 1))))
            .collect();
        let mut all = vec![0u8; sizes.iter().sum()];
        self.step = Step::Agreement;
        self.gather_v(Op::SendRecv, bytes::as_bytes(mine), &sizes, &mut all);
        self.step = Step::Data;
        if self.fault.is_some() {
            return Ok(());
        }
        let start = bytes_before(&sizes);
        let lists: Vec<Vec<u64>> = (0..self.world)
            .map(|p| bytes::to_vec(&all[start[p]..start[p] + sizes[p]]))
            .collect();
        agree::check_messages(&lists)
    }
}

/// Fills this rank's receives from itself with its sends to itself, in order (a local check:
/// the counts and sizes must match).
fn copy_self_sends(ops: &mut [P2p<'_>], me: usize) -> Result<()> {
    let self_sends: Vec<Vec<u8>> = ops
        .iter()
        .filter_map(|o| match o {
            P2p::Send { peer, data } => (*peer == me).then(|| data.to_vec()),
            P2p::Recv { .. } => None,
        })
        .collect();
    let mut k = 0;
    for o in ops.iter_mut() {
        if let P2p::Recv { peer, data } = o {
            if *peer == me {
                let src = self_sends.get(k).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "send_recv: rank {me} posted receive #{k} from itself but only {} send(s) to itself",
                        self_sends.len()
                    ))
                })?;
                if src.len() != data.len() {
                    return Err(Error::InvalidArgument(format!(
                        "send_recv: receive #{k} on rank {me} from rank {me} has {} bytes but the matching send has {} bytes",
                        data.len(),
                        src.len()
                    )));
                }
                data.copy_from_slice(src);
                k += 1;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::tournament_partner;

    #[test]
    fn tournament_is_a_perfect_schedule() {
        for world in 1..=9 {
            let rounds = world + world % 2 - 1;
            let mut met = vec![vec![0; world]; world];
            for round in 0..rounds {
                for (r, row) in met.iter_mut().enumerate() {
                    if let Some(p) = tournament_partner(r, world, round) {
                        assert_ne!(p, r);
                        assert_eq!(tournament_partner(p, world, round), Some(r));
                        row[p] += 1;
                    }
                }
            }
            for (r, row) in met.iter().enumerate() {
                for (p, &n) in row.iter().enumerate() {
                    assert_eq!(
                        n,
                        usize::from(r != p),
                        "world {world}: {r} met {p} {n} times"
                    );
                }
            }
        }
    }
}
