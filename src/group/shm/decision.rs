//! The decision word and blame: every op ends committed or aborted as the first rank to decide
//! says, and an abort names the first failure (the rank and how it failed), the same on every
//! rank.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::layout::{SLOT_ACTIVE, SLOT_FAILED, SLOT_LEFT};
use super::segment::{memory_gone, pid_alive, Segment};
use super::wait::LIVENESS_PERIOD;
use super::ShmGroup;
use crate::error::{Error, Result};
use crate::group::Op;

// The decision word: outcome (2 bits) | cause (6 bits) | blamed rank + 1 (12 bits) | op (44).
// 0 is "op 0 (the join) committed". A rank takes part in op n only after it saw op n - 1
// committed, so a word for a later op implies that every earlier op was committed.
pub(super) const OUTCOME_COMMIT: u64 = 1;
const OUTCOME_ABORT: u64 = 2;
const OP_BITS: u64 = 44;
const OP_MASK: u64 = (1 << OP_BITS) - 1;

/// Why an op was aborted: the first failure, which every rank reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cause {
    /// The blamed rank's process is gone.
    Died = 1,
    /// The blamed rank did not arrive within the timeout.
    Stalled = 2,
    /// An error on the blamed rank aborted the op.
    Failed = 3,
    /// The blamed rank destroyed its handle.
    Left = 4,
    /// The blamed rank found that the ranks called different collectives.
    Mismatch = 5,
}

impl Cause {
    pub(super) fn from_code(c: u64) -> Cause {
        [Cause::Died, Cause::Stalled, Cause::Left, Cause::Mismatch]
            .into_iter()
            .find(|x| *x as u64 == c)
            .unwrap_or(Cause::Failed)
    }
}

impl Cause {
    /// Whether a failure of this cause loses the blamed rank (fault tolerance masks it).
    pub(super) fn loses_rank(self) -> bool {
        match self {
            Cause::Died | Cause::Stalled | Cause::Left => true,
            Cause::Failed | Cause::Mismatch => false,
        }
    }
}

/// The outcome of one op, as the decision word says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Decision {
    Pending,
    Commit,
    Abort { rank: usize, cause: Cause },
}

pub(super) fn abort_word(n: u64, rank: usize, cause: Cause) -> u64 {
    OUTCOME_ABORT << 62 | (cause as u64) << 56 | ((rank as u64 + 1) & 0xfff) << OP_BITS | n
}

/// The first failure decision word `d` records — the aborted op, the rank blamed for it and
/// how it failed — or None while every op so far was committed. The word keeps it: no rank
/// takes part in a later op of a group whose op was aborted.
pub(super) fn first_failure(d: u64) -> Option<(u64, usize, Cause)> {
    match decoded(d, d & OP_MASK) {
        Decision::Abort { rank, cause } => Some((d & OP_MASK, rank, cause)),
        Decision::Pending | Decision::Commit => None,
    }
}

/// What decision word `d` says about op `n`.
pub(super) fn decoded(d: u64, n: u64) -> Decision {
    let op = d & OP_MASK;
    let aborted = d >> 62 == OUTCOME_ABORT;
    if op > n || (op == n && !aborted) {
        return Decision::Commit;
    }
    if !aborted {
        return Decision::Pending;
    }
    Decision::Abort {
        rank: (((d >> OP_BITS) & 0xfff) as usize).saturating_sub(1),
        cause: Cause::from_code((d >> 56) & 0x3f),
    }
}

impl ShmGroup {
    /// The first failure among `pending`: a rank that died (its region is then removed, so
    /// the crash leaves nothing in /dev/shm), else one that left or failed. A pending rank that
    /// failed may have failed because another rank died: then the dead one is named.
    pub(super) fn failed_peer(&self, pending: &[usize]) -> Option<(usize, Cause)> {
        let dead = |p: usize| {
            let s = self.slot(p);
            let pid = s.pid.load(Ordering::Acquire);
            // A rank that failed or left and then exited did not die: it said so first.
            let gone = s.state.load(Ordering::Acquire) == SLOT_ACTIVE
                && pid != 0
                && (!pid_alive(pid) || self.exiting(p));
            if gone {
                let gen = s.data_gen.load(Ordering::Acquire);
                Segment::unlink(&Self::data_name(&self.name, self.session, p, gen, pid));
            }
            gone
        };
        if let Some(&p) = pending.iter().find(|&&p| dead(p)) {
            return Some((p, Cause::Died));
        }
        let (p, cause) =
            pending
                .iter()
                .find_map(|&p| match self.slot(p).state.load(Ordering::Acquire) {
                    SLOT_LEFT => Some((p, Cause::Left)),
                    SLOT_FAILED => Some((p, Cause::Failed)),
                    _ => None,
                })?;
        let me = self.rank;
        match (0..self.world).find(|&d| d != me && d != p && dead(d)) {
            Some(d) if cause == Cause::Failed => Some((d, Cause::Died)),
            Some(_) | None => Some((p, cause)),
        }
    }

    /// Whether rank `p`, still marked active, is a process that is exiting: its memory is gone
    /// though its pid does not show dead yet (a killed process loses its memory first).
    fn exiting(&self, p: usize) -> bool {
        let s = self.slot(p);
        s.state.load(Ordering::Acquire) == SLOT_ACTIVE
            && memory_gone(
                s.pid.load(Ordering::Acquire),
                s.probe_addr.load(Ordering::Acquire),
            )
    }

    /// The error every rank reports for a failure of rank `p` (the first failure of op `n`).
    pub(super) fn failure_error(&self, op: Op, n: u64, p: usize, cause: Cause) -> Error {
        // The user's call (dispatch, combine, rearrange, ...) where one is in progress.
        let (name, me, what) = (&self.name, self.rank, crate::call::name_or(op.name()));
        let timeout = self.opts.timeout.as_secs_f64();
        if p >= self.world {
            // Only a process that wrote into the control segment can name a rank out of range.
            return Error::PeerFailure(format!(
                "{what} (op #{n}) of group '{name}' was aborted by a decision word naming rank {p}, outside the group of {} ranks (the control segment was altered; seen from rank {me})",
                self.world
            ));
        }
        match cause {
            Cause::Stalled if p == me => Error::PeerFailure(format!(
                "rank {me} of group '{name}' (this rank) was late for {what} (op #{n}): the other ranks timed out after {timeout:.1} s waiting for it and aborted the op"
            )),
            Cause::Stalled => Error::Timeout(format!(
                "timed out after {timeout:.1} s in {what} of group '{name}' (op #{n}) waiting for rank(s) {p}"
            )),
            Cause::Died => Error::PeerFailure(format!(
                "rank {p} of group '{name}' died (pid {} is gone) during {what} (op #{n}, seen from rank {me})",
                self.slot(p).pid.load(Ordering::Acquire)
            )),
            Cause::Failed => Error::PeerFailure(format!(
                "rank {p} of group '{name}' failed (an error on that rank aborted its group) during {what} (op #{n}, seen from rank {me})"
            )),
            Cause::Left => Error::PeerFailure(format!(
                "rank {p} of group '{name}' left (destroyed its group handle) during {what} (op #{n}, seen from rank {me})"
            )),
            Cause::Mismatch => self.mismatch_error(op, n, p),
        }
    }

    /// The error of op `n` on every rank when rank `p` found that the ranks called different
    /// collectives: INVALID_STATE, naming a peer whose published op differs from this rank's
    /// where one is seen (every rank had published when `p` looked).
    pub(super) fn mismatch_error(&self, op: Op, n: u64, p: usize) -> Error {
        let me = self.rank;
        let theirs = (0..self.world).find_map(|q| {
            let s = self.slot(q);
            let kind = s.op_kind.load(Ordering::Acquire);
            (q != me && s.published.load(Ordering::Acquire) >= n && kind != op as u32).then(|| {
                (
                    q,
                    Op::from_code(kind).map_or("an unknown operation", |o| o.name()),
                )
            })
        });
        match theirs {
            Some((q, theirs)) => Error::InvalidState(format!(
                "rank {q} of group '{}' called {theirs} while rank {me} called {} (op #{n}); every rank must call the same collectives in the same order",
                self.name,
                op.name()
            )),
            None => Error::InvalidState(format!(
                "the ranks of group '{}' called different collectives at op #{n} (rank {p} found it; rank {me} called {}); every rank must call the same collectives in the same order",
                self.name,
                op.name()
            )),
        }
    }

    /// The group's decision word (in rank 0's slot).
    pub(super) fn decision_word(&self) -> &AtomicU64 {
        &self.slot(0).decision
    }

    /// Decides op `n` as `want` unless it is decided already (then wakes every sleeper);
    /// returns the decision.
    pub(super) fn decide(&self, n: u64, want: u64) -> Decision {
        let word = self.decision_word();
        loop {
            let d = word.load(Ordering::Acquire);
            match decoded(d, n) {
                Decision::Pending => {
                    if word
                        .compare_exchange(d, want, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        self.notify_all();
                        return decoded(want, n);
                    }
                }
                decided => return decided,
            }
        }
    }

    /// Runs `f`; an error aborts the op and breaks the group (peers see this rank as failed).
    /// Where a peer's failure decided the op first, or the error is a failed read of a peer
    /// that died, the error names that peer: every rank blames the first failure.
    pub(super) fn guarded<T>(
        &mut self,
        op: Op,
        f: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<T> {
        f(self).map_err(|e| {
            if self.broken.is_some() || self.seq == 0 {
                return self.fail(e);
            }
            let n = self.seq;
            let peer_error = matches!(e, Error::PeerFailure(_) | Error::Timeout(_));
            let find_dead = |g: &Self| {
                (0..g.world).find(|&p| {
                    p != g.rank
                        && (!pid_alive(g.slot(p).pid.load(Ordering::Acquire)) || g.exiting(p))
                })
            };
            let mut dead = find_dead(self);
            // A read of a peer that is being killed can fail before its death shows (its memory
            // goes first): wait a little for the death or another rank's decision, so this rank
            // does not blame itself for the peer's end.
            let since = Instant::now();
            while peer_error
                && dead.is_none()
                && since.elapsed() < 4 * LIVENESS_PERIOD
                && decoded(self.decision_word().load(Ordering::Acquire), n) == Decision::Pending
            {
                std::thread::sleep(Duration::from_millis(1));
                dead = find_dead(self);
            }
            let want = match dead {
                Some(p) if peer_error => abort_word(n, p, Cause::Died),
                _ => abort_word(n, self.rank, Cause::Failed),
            };
            // The first failure explains a failed read of a peer (it may have exited since) and
            // any error of a late rank (it may have read buffers its peers reused); an argument
            // error every rank detects alike keeps its own message.
            let e = match self.decide(n, want) {
                Decision::Abort { rank, cause }
                    if !(rank == self.rank && cause == Cause::Failed)
                        && (peer_error || cause != Cause::Failed) =>
                {
                    self.failure_error(op, n, rank, cause)
                }
                Decision::Abort { .. } | Decision::Commit | Decision::Pending => e,
            };
            self.fail(e)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::group::{Group, GroupOptions};

    /// A forged decision word naming a rank outside the group is an error, never a panic.
    #[test]
    fn a_decision_word_naming_a_rank_out_of_range_is_an_error() {
        let name = format!("unit-forged-decision-{}", std::process::id());
        let mut g = ShmGroup::join(&name, 0, 1, GroupOptions::default()).unwrap();
        g.barrier().unwrap();
        g.decision_word()
            .store(abort_word(2, 1000, Cause::Died), Ordering::Release);
        let e = g.barrier().unwrap_err();
        assert_eq!(e.status(), crate::Status::PeerFailure);
        assert_eq!(
            e.to_string(),
            format!("barrier (op #2) of group '{name}' was aborted by a decision word naming rank 1000, outside the group of 1 ranks (the control segment was altered; seen from rank 0)")
        );
    }
}
