//! The per-op protocol: begin, publish, wait for the peers (`wait_op`), finish; a failure
//! aborts the op through the decision word (decision.rs) and breaks the handle.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::decision::{abort_word, decoded, Cause, Decision, OUTCOME_COMMIT};
use super::layout::{
    align64, publish_desc, OpHead, Slot, OP_HEADER_BYTES, SLOT_ACTIVE, SLOT_FAILED, SLOT_LEFT,
};
use super::rendezvous::sys_err;
use super::segment::Segment;
use super::wait::{list, Deadline, Waiter, LIVENESS_PERIOD};
use super::ShmGroup;
use crate::error::{Error, Result};
use crate::group::Op;

impl ShmGroup {
    pub(super) fn check_usable(&self, op: Op) -> Result<()> {
        self.check_not_forked()?;
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(Error::InvalidState(format!(
                "{}: group '{}' is unusable after an earlier failure ({why}); destroy it and create a new one",
                crate::call::name_or(op.name()),
                self.name
            ))),
        }
    }

    /// Records a failure: this handle is unusable and peers see this rank as failed. If peers
    /// that are threads of this process may still be copying from the caller's buffers (direct
    /// mode), waits (bounded) until each has consumed the op or stopped, so the buffers can be
    /// released safely. (Other processes read through the kernel, which fails cleanly, and they
    /// then see this rank as failed before their op completes.)
    pub(super) fn fail(&mut self, e: Error) -> Error {
        if self.broken.is_none() && self.seq > 0 {
            // Abort the op in progress unless it was decided already, so no peer commits it.
            let _ = self.decide(self.seq, abort_word(self.seq, self.rank, Cause::Failed));
        }
        if self.broken.is_none() {
            self.broken = Some(e.to_string());
            self.mark(SLOT_FAILED);
        }
        if let Some(n) = self.exposed.take() {
            self.wait_thread_readers(n);
        }
        e
    }

    /// Waits (bounded by the timeout) until no thread rank of this process still reads this
    /// rank's buffers for op `n`: each consumed it or stopped.
    fn wait_thread_readers(&self, n: u64) {
        let deadline = Deadline::new(self.opts.timeout);
        let mut waiter = Waiter::new(&self.header().polling);
        let reading = |p: usize| {
            let s = self.slot(p);
            p != self.rank
                && s.pid.load(Ordering::Acquire) == self.pid
                && s.consumed.load(Ordering::Acquire) < n
                && s.state.load(Ordering::Acquire) == SLOT_ACTIVE
        };
        while let Some(p) = (0..self.world).find(|&p| reading(p)) {
            if deadline.expired() {
                break;
            }
            let done = || !(0..self.world).any(reading);
            waiter.pause(&self.slot(p).wake, || LIVENESS_PERIOD, done);
        }
    }

    /// The peers for which `ready(peer slot)` does not hold yet.
    fn pending_peers(&self, ready: &impl Fn(&Slot) -> bool) -> Vec<usize> {
        (0..self.world)
            .filter(|&p| p != self.rank && !ready(self.slot(p)))
            .collect()
    }

    /// The first peer for which `ready(peer slot)` does not hold yet (allocates nothing).
    fn first_pending(&self, ready: &impl Fn(&Slot) -> bool) -> Option<usize> {
        (0..self.world).find(|&p| p != self.rank && !ready(self.slot(p)))
    }

    /// Whether rank `p` marked itself failed or left: a waiter checks it at once instead of
    /// at the next liveness check (its mark woke the waiter).
    fn stopped(&self, p: usize) -> bool {
        matches!(
            self.slot(p).state.load(Ordering::Acquire),
            SLOT_LEFT | SLOT_FAILED
        )
    }

    /// Waits until `ready(peer slot)` holds for every peer.
    pub(super) fn wait_peers(
        &mut self,
        op: Op,
        n: u64,
        ready: impl Fn(&Slot) -> bool,
    ) -> Result<()> {
        let deadline = Deadline::new(self.opts.timeout);
        let mut waiter = Waiter::new(&self.header().polling);
        let mut last_check = Instant::now();
        while let Some(p) = self.first_pending(&ready) {
            if (waiter.spun() && last_check.elapsed() >= LIVENESS_PERIOD) || self.stopped(p) {
                last_check = Instant::now();
                let pending = self.pending_peers(&ready);
                self.check_peers(op, n, &pending)?;
                if deadline.expired() && !pending.is_empty() {
                    return Err(Error::Timeout(format!(
                        "timed out after {:.1} s in {} of group '{}' (op #{n}) waiting for rank(s) {}",
                        deadline.timeout.as_secs_f64(),
                        crate::call::name_or(op.name()),
                        self.name,
                        list(&pending)
                    )));
                }
            }
            let until_check = || LIVENESS_PERIOD.saturating_sub(last_check.elapsed());
            let done = || self.stopped(p) || self.first_pending(&ready).is_none();
            waiter.pause(&self.slot(p).wake, until_check, done);
        }
        Ok(())
    }

    fn check_peers(&self, op: Op, n: u64, pending: &[usize]) -> Result<()> {
        match self.failed_peer(pending) {
            Some((p, cause)) => Err(self.failure_error(op, n, p, cause)),
            None => Ok(()),
        }
    }

    /// Waits until `ready(peer slot)` holds for every peer or op `n` is committed. A failed,
    /// dead or stalled peer aborts op `n` (unless it was decided first); the error then names
    /// the first failure, the same on every rank. The rank sleeps on the slot of a peer it
    /// waits for: that peer's change or any decision wakes it.
    fn wait_op(&mut self, op: Op, n: u64, ready: impl Fn(&Slot) -> bool) -> Result<()> {
        let deadline = Deadline::new(self.opts.timeout);
        let mut waiter = Waiter::new(&self.header().polling);
        let mut last_check = Instant::now();
        let decision = || decoded(self.decision_word().load(Ordering::Acquire), n);
        loop {
            let mut decided = decision();
            if decided == Decision::Pending {
                let Some(p) = self.first_pending(&ready) else {
                    return Ok(());
                };
                if (waiter.spun() && last_check.elapsed() >= LIVENESS_PERIOD) || self.stopped(p) {
                    last_check = Instant::now();
                    decided = self.check_op(n, &ready, &deadline);
                } else {
                    let until_check = || LIVENESS_PERIOD.saturating_sub(last_check.elapsed());
                    let done = || {
                        decision() != Decision::Pending
                            || self.stopped(p)
                            || self.first_pending(&ready).is_none()
                    };
                    waiter.pause(&self.slot(p).wake, until_check, done);
                }
            }
            match decided {
                Decision::Pending => {}
                Decision::Commit => return Ok(()),
                Decision::Abort { rank, cause } => {
                    return Err(self.failure_error(op, n, rank, cause))
                }
            }
        }
    }

    /// The liveness check of a wait for op `n`: aborts it for a failed, dead or (past the
    /// deadline) stalled peer, unless it was decided first.
    fn check_op(&self, n: u64, ready: &impl Fn(&Slot) -> bool, deadline: &Deadline) -> Decision {
        let pending = self.pending_peers(ready);
        if pending.is_empty() {
            // Every peer is ready: the caller's next round returns.
            return Decision::Pending;
        }
        if let Some((p, cause)) = self.failed_peer(&pending) {
            self.decide(n, abort_word(n, p, cause))
        } else if deadline.expired() {
            self.decide(n, abort_word(n, pending[0], Cause::Stalled))
        } else {
            Decision::Pending
        }
    }

    /// Makes this rank's region at least `bytes` long (a new generation if needed).
    fn reserve(&mut self, bytes: usize) -> Result<()> {
        // The op that published the last growth was committed, so every peer mapped it.
        if self.grown_at != 0 && self.seq > self.grown_at {
            self.data.close_fd();
            self.grown_at = 0;
        }
        if bytes <= self.data.len() {
            return Ok(());
        }
        let max = self.opts.max_capacity;
        if max != 0 && bytes > max {
            return Err(Error::InvalidArgument(format!(
                "group '{}' needs {bytes} bytes of shared memory on rank {} for this call, more than the maximum capacity of {max} bytes (set a larger max_capacity_bytes)",
                self.name, self.rank
            )));
        }
        let mut new_len = (self.data.len() * 2).max(bytes);
        new_len = (new_len + (2 << 20) - 1) & !((2 << 20) - 1);
        if max != 0 {
            new_len = new_len.min(max);
        }
        let gen = self.gen + 1;
        let name = Self::data_name(&self.name, self.session, self.rank, gen, self.pid);
        let seg = Segment::create(&name, new_len).map_err(|e| {
            sys_err(
                format!(
                    "cannot grow the shared-memory region of rank {} of group '{}' to {new_len} bytes",
                    self.rank, self.name
                ),
                e,
            )
        })?;
        // Every peer consumed the previous op, so none reads the old region any more; peers
        // map the new one when they gather this op, through its descriptor, which closes once
        // this op is committed.
        self.data = seg;
        self.gen = gen;
        self.grown_at = self.seq;
        publish_desc(self.desc(self.rank), &self.data, gen);
        let slot = self.slot(self.rank);
        slot.data_bytes.store(new_len as u64, Ordering::Relaxed);
        slot.data_gen.store(gen, Ordering::Release);
        Ok(())
    }

    /// Starts op `n`. Op n-1 was committed, so every peer consumed it and this rank's region
    /// is free; a peer may have aborted op n already.
    pub(super) fn begin(&mut self, op: Op) -> Result<u64> {
        self.check_usable(op)?;
        let n = self.seq + 1;
        self.seq = n;
        match decoded(self.decision_word().load(Ordering::Acquire), n) {
            Decision::Abort { rank, cause } => Err(self.failure_error(op, n, rank, cause)),
            Decision::Pending | Decision::Commit => Ok(n),
        }
    }

    /// Publishes op `n`: this rank's verdict on its own arguments, the parameters every rank
    /// must agree on (zero-padded to [`PARAMS`](super::layout::PARAMS) words), metadata words,
    /// then the payload (copied into this rank's region) or, in direct mode, a table of
    /// (address, length) of the caller's buffers.
    pub(super) fn publish_as(
        &mut self,
        op: Op,
        n: u64,
        verdict: u64,
        params: &[u64],
        meta: &[u64],
        payload: &[&[u8]],
    ) -> Result<()> {
        {
            let slot = self.slot(self.rank);
            for (i, w) in slot.params.iter().enumerate() {
                w.store(params.get(i).copied().unwrap_or(0), Ordering::Relaxed);
            }
            slot.verdict.store(n << 8 | verdict, Ordering::Relaxed);
        }
        let payload_len: usize = payload.iter().map(|p| p.len()).sum();
        let meta_off = OP_HEADER_BYTES;
        let payload_off = align64(meta_off + meta.len() * 8);
        let region_bytes = if self.direct {
            payload.len() * 16
        } else {
            payload_len
        };
        self.reserve(payload_off + region_bytes)?;
        let head = OpHead {
            kind: op as u32,
            direct: u32::from(self.direct),
            n,
            payload_len: payload_len as u64,
            meta_len: meta.len() as u64,
            pieces: payload.len() as u64,
        };
        self.data.write(0, &head.encode());
        let meta_bytes: Vec<u8> = meta.iter().flat_map(|m| m.to_ne_bytes()).collect();
        self.data.write(meta_off, &meta_bytes);
        if self.direct {
            let table: Vec<u8> = payload
                .iter()
                .flat_map(|p| [p.as_ptr() as u64, p.len() as u64])
                .flat_map(|w| w.to_ne_bytes())
                .collect();
            self.note_table(n, payload);
            self.data.write(payload_off, &table);
        } else {
            let mut off = payload_off;
            for part in payload {
                self.data.write(off, part);
                off += part.len();
            }
        }
        if self.direct {
            self.exposed = Some(n);
        }
        let slot = self.slot(self.rank);
        slot.op_kind.store(op as u32, Ordering::Relaxed);
        slot.published.store(n, Ordering::Release);
        slot.wake.notify();
        Ok(())
    }

    /// Waits for every peer's op `n`, checks they are in the same primitive, and maps regions.
    pub(super) fn gather_published(&mut self, op: Op, n: u64) -> Result<()> {
        self.wait_op(op, n, |s| s.published.load(Ordering::Acquire) >= n)?;
        for p in 0..self.world {
            if p == self.rank {
                continue;
            }
            let s = self.slot(p);
            let kind = s.op_kind.load(Ordering::Acquire);
            if kind != op as u32 {
                // Every rank reports the mismatch (INVALID_STATE), whichever saw it first.
                return Err(
                    match self.decide(n, abort_word(n, self.rank, Cause::Mismatch)) {
                        Decision::Abort { rank, cause } => self.failure_error(op, n, rank, cause),
                        Decision::Commit | Decision::Pending => {
                            self.mismatch_error(op, n, self.rank)
                        }
                    },
                );
            }
            self.map_peer(p)?;
        }
        Ok(())
    }

    /// Ends op `n`: this rank is prepared (it read all it needs; `consumed = n`); the op commits
    /// once every rank is prepared, or aborts on a failure or timeout, whichever rank decides
    /// first, and every rank obeys that decision. So a late rank never commits what the others
    /// aborted, and a rank that dies right after the commit does not undo it for the others
    /// (they see the death at the next op). On commit no peer reads the caller's buffers any
    /// more (direct mode).
    pub(super) fn finish(&mut self, op: Op, n: u64) -> Result<()> {
        let slot = self.slot(self.rank);
        slot.consumed.store(n, Ordering::Release);
        slot.wake.notify();
        self.wait_op(op, n, |s| s.consumed.load(Ordering::Acquire) >= n)?;
        match self.decide(n, OUTCOME_COMMIT << 62 | n) {
            Decision::Commit => {
                self.exposed = None;
                Ok(())
            }
            Decision::Abort { rank, cause } => Err(self.failure_error(op, n, rank, cause)),
            Decision::Pending => Err(Error::Internal(format!(
                "{}: op #{n} of group '{}' is undecided after its decision",
                op.name(),
                self.name
            ))),
        }
    }
}
