//! Who survives a failure, agreed once for all survivors: the membership consensus behind the
//! fault-tolerant shrink ([`ShmGroup::survivors`]).
//!
//! After an op was aborted by a peer's loss, the ranks left out of the survivors' group are
//! decided in the old group's control segment, epoch by epoch: a survivor proposes the set it
//! holds as lost (in its own proposal words), then moves the membership word from the epoch it
//! read to the next with one compare-and-swap. The first proposal of an epoch wins and every
//! rank reads the winner's set, so no two survivors ever act on different sets; a rank already
//! in the set can no longer propose (its CAS names an epoch that is gone), so a stalled rank
//! that resumes never excludes the ranks that excluded it.
//!
//! The rule that decides who is left out (docs/reliability.md, "Two faults at once"):
//! - the rank the op's first failure blames when it died, stalled past the timeout or left,
//!   and every peer whose process is gone;
//! - a rank that is not present at the survivors' meeting within the timeout (a second stall):
//!   each survivor announces itself for the current epoch (its presence word) and waits for
//!   every rank not left out; a rank missing at the deadline is proposed for the next epoch.
//!
//! A rank that failed with an error of its own (bad input, a collective-order mismatch) is not
//! lost: nothing is masked, and the group stays broken as without fault tolerance. A healthy
//! rank is present at once, so it is never left out by ranks that are not failing themselves.

use std::sync::atomic::{fence, AtomicU64, Ordering};

use super::decision::{first_failure, Cause};
use super::layout::{presence_offset, proposal_offset, proposal_words};
use super::segment::{pid_alive, SharedAtomics};
use super::wait::{list, Backoff, Deadline};
use super::ShmGroup;
use crate::error::{Error, Result};

// SAFETY: an atomic; zeroed memory is a valid value.
unsafe impl SharedAtomics for AtomicU64 {}

/// How often the survivors' meeting is tried again after a join that failed at once (a rank
/// that died or stalled in the join itself), before the shrink reports its error.
const MAX_ATTEMPTS: u32 = 4;

/// What a wait for the survivors' meeting found.
enum Meeting {
    /// Every rank not left out is present.
    All,
    /// Another survivor moved the membership to a new epoch.
    Changed,
    /// These ranks did not show up (dead, or not within the timeout).
    Absent(Vec<usize>),
}

impl ShmGroup {
    /// Proposal word `i` of rank `r` for epochs of `parity`.
    fn proposal(&self, r: usize, parity: u64, i: usize) -> &AtomicU64 {
        self.control
            .at(proposal_offset(self.world, r, parity as usize) + i * 8)
    }

    /// Rank `r`'s presence word.
    fn presence(&self, r: usize) -> &AtomicU64 {
        self.control.at(presence_offset(self.world, r))
    }

    /// The agreed membership: its epoch and the ranks it leaves out (sorted); epoch 0 leaves
    /// none out. A seqlock read: the winner of an epoch may reuse its proposal words two epochs
    /// later, so the set counts only if neither its epoch tag nor the word moved meanwhile.
    pub(super) fn membership(&self) -> Result<(u64, Vec<usize>)> {
        let word = &self.header().members;
        // A consistent read takes a few tries at most while proposals race; only a word that
        // was altered (its decider's proposal never carries its epoch) keeps it from ending.
        let deadline = Deadline::new(self.opts.timeout);
        loop {
            let w = word.load(Ordering::Acquire);
            let (epoch, decider) = (w >> 16, (w & 0xffff) as usize);
            if epoch == 0 {
                return Ok((0, Vec::new()));
            }
            if decider == 0 || decider > self.world {
                return Err(Error::PeerFailure(format!(
                    "the membership word of group '{}' names rank {}, outside the group of {} ranks (the control segment was altered; seen from rank {})",
                    self.name,
                    decider as i64 - 1,
                    self.world,
                    self.rank
                )));
            }
            let d = decider - 1;
            let tag = self.proposal(d, epoch & 1, 0).load(Ordering::Acquire);
            let set: Vec<usize> = (0..self.world)
                .filter(|&r| {
                    self.proposal(d, epoch & 1, 1 + r / 64)
                        .load(Ordering::Relaxed)
                        >> (r % 64)
                        & 1
                        == 1
                })
                .collect();
            fence(Ordering::Acquire);
            let tag2 = self.proposal(d, epoch & 1, 0).load(Ordering::Relaxed);
            if tag == epoch && tag2 == epoch && word.load(Ordering::Relaxed) == w {
                return Ok((epoch, set));
            }
            if deadline.expired() {
                return Err(Error::PeerFailure(format!(
                    "the membership word of group '{}' names rank {d} for epoch {epoch}, but that rank's proposal is for epoch {tag} (the control segment was altered; seen from rank {})",
                    self.name, self.rank
                )));
            }
            std::thread::yield_now();
        }
    }

    /// Proposes `set` as the membership after `epoch` (which this rank read); whoever moves the
    /// word first wins, and the caller reads the outcome again either way.
    fn propose(&self, epoch: u64, set: &[usize]) {
        let parity = (epoch + 1) & 1;
        let me = self.rank;
        // Tag first, then the bits: a reader that sees any new bit sees the new tag too.
        self.proposal(me, parity, 0)
            .store(epoch + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        for i in 0..proposal_words(self.world) - 1 {
            let bits = set
                .iter()
                .filter(|&&r| r / 64 == i)
                .fold(0u64, |b, &r| b | 1 << (r % 64));
            self.proposal(me, parity, 1 + i)
                .store(bits, Ordering::Relaxed);
        }
        let word = &self.header().members;
        let w = word.load(Ordering::Acquire);
        if w >> 16 == epoch {
            let _ = word.compare_exchange(
                w,
                (epoch + 1) << 16 | (me as u64 + 1),
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        self.notify_all();
    }

    /// The ranks this rank holds as lost now: the agreed membership's, the rank the first
    /// failure blamed (when that loses it) and every peer whose process is gone. Empty while no
    /// op was aborted by a loss.
    pub(super) fn lost(&self) -> Vec<usize> {
        let Some((_, blamed, cause)) = first_failure(self.decision_word().load(Ordering::Acquire))
        else {
            return Vec::new();
        };
        if !cause.loses_rank() {
            return Vec::new();
        }
        let agreed = self.membership().map(|(_, s)| s).unwrap_or_default();
        let mut lost: Vec<usize> = (0..self.world)
            .filter(|&p| p != self.rank)
            .filter(|&p| p == blamed || agreed.contains(&p) || self.lost_process(p))
            .collect();
        lost.sort_unstable();
        lost
    }

    /// Whether peer `p`'s process is gone (or exiting).
    fn lost_process(&self, p: usize) -> bool {
        let pid = self.slot(p).pid.load(Ordering::Acquire);
        pid != 0 && !pid_alive(pid)
    }

    /// The error of a rank its peers left out of the survivors' group.
    fn masked_error(&self) -> Error {
        let word = self.decision_word().load(Ordering::Acquire);
        let t = self.opts.timeout.as_secs_f64();
        let (n, how) = match first_failure(word) {
            Some((n, r, cause)) if r == self.rank => (
                n,
                match cause {
                    Cause::Stalled => {
                        format!("it stalled: they timed out after {t:.1} s waiting for it")
                    }
                    Cause::Died => "they saw its process die".to_owned(),
                    Cause::Failed | Cause::Mismatch => {
                        "it failed: an error on this rank aborted the op".to_owned()
                    }
                    Cause::Left => "it left the group".to_owned(),
                },
            ),
            Some((n, _, _)) => (
                n,
                format!("it did not meet the survivors within {t:.1} s after the failure"),
            ),
            None => (0, "no op had failed".to_owned()),
        };
        Error::PeerFailure(format!(
            "shrink: rank {} of group '{}' was masked by its peers at op #{n} ({how}); it cannot rejoin the survivors: create a new group to join again",
            self.rank, self.name
        ))
    }

    /// Refuses a shrink by a rank its peers left out: they formed (or are forming) a group
    /// without it.
    pub(super) fn check_not_masked(&self) -> Result<()> {
        let blamed = first_failure(self.decision_word().load(Ordering::Acquire))
            .is_some_and(|(_, r, c)| r == self.rank && c.loses_rank());
        if blamed || self.membership()?.1.contains(&self.rank) {
            return Err(self.masked_error());
        }
        Ok(())
    }

    /// Fault tolerance: the survivors' group after an op was aborted by a peer's loss, with the
    /// ranks it leaves out (agreed by every survivor, see the module doc); None while nothing
    /// was lost. Collective over the survivors; a rank left out gets the masked error.
    pub(super) fn survivors(&self) -> Result<Option<(Vec<usize>, ShmGroup)>> {
        let Some((_, blamed, cause)) = first_failure(self.decision_word().load(Ordering::Acquire))
        else {
            return Ok(None);
        };
        if !cause.loses_rank() || blamed >= self.world {
            return Ok(None);
        }
        let mut attempt = 0u32;
        loop {
            self.check_not_masked()?;
            let (epoch, out) = self.membership()?;
            // A proposal only adds to the agreed set.
            let mut want = self.lost();
            want.extend(
                out.iter()
                    .filter(|r| !want.contains(r))
                    .copied()
                    .collect::<Vec<_>>(),
            );
            want.sort_unstable();
            if want.len() != out.len() {
                self.propose(epoch, &want);
                continue;
            }
            self.announce(epoch, attempt);
            match self.meet(epoch, attempt, &out)? {
                Meeting::Changed => continue,
                Meeting::Absent(absent) => {
                    let mut want = out.clone();
                    want.extend(absent);
                    want.sort_unstable();
                    self.propose(epoch, &want);
                    continue;
                }
                Meeting::All => {}
            }
            match self.shrunk(&out) {
                Ok(g) => return Ok(Some((out, g))),
                // Left out meanwhile, or another member died or stalled in the join: meet again
                // (a member that does not come back is then left out), a bounded number of
                // times.
                Err(_) if self.membership()?.0 != epoch => continue,
                Err(e)
                    if matches!(e, Error::Timeout(_) | Error::PeerFailure(_))
                        && attempt + 1 < MAX_ATTEMPTS =>
                {
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Announces this rank at the survivors' meeting of `epoch` (try `attempt`).
    fn announce(&self, epoch: u64, attempt: u32) {
        self.presence(self.rank)
            .store(epoch << 32 | u64::from(attempt + 1), Ordering::Release);
        self.slot(self.rank).wake.notify();
    }

    /// Waits until every rank not in `out` is present at `epoch`'s meeting (this attempt or a
    /// later one), the membership moves on, a missing rank dies, or the timeout passes.
    fn meet(&self, epoch: u64, attempt: u32, out: &[usize]) -> Result<Meeting> {
        let want = epoch << 32 | u64::from(attempt + 1);
        let deadline = Deadline::new(self.opts.timeout);
        let mut backoff = Backoff::new();
        loop {
            if self.membership()?.0 != epoch {
                return Ok(Meeting::Changed);
            }
            let absent: Vec<usize> = (0..self.world)
                .filter(|&p| p != self.rank && !out.contains(&p))
                .filter(|&p| {
                    let at = self.presence(p).load(Ordering::Acquire);
                    at >> 32 != epoch || at < want
                })
                .collect();
            if absent.is_empty() {
                return Ok(Meeting::All);
            }
            let dead: Vec<usize> = absent
                .iter()
                .copied()
                .filter(|&p| self.lost_process(p))
                .collect();
            if !dead.is_empty() {
                return Ok(Meeting::Absent(dead));
            }
            if deadline.expired() {
                crate::log::info(&format!(
                    "group '{}': rank(s) {} did not meet the survivors within {:.1} s after the failure; they are left out",
                    self.name,
                    list(&absent),
                    self.opts.timeout.as_secs_f64()
                ));
                return Ok(Meeting::Absent(absent));
            }
            backoff.snooze();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    use super::*;
    use crate::group::GroupOptions;

    fn opts(ms: u64) -> GroupOptions {
        GroupOptions {
            timeout: Duration::from_millis(ms),
            ..GroupOptions::default()
        }
    }

    /// Two ranks that propose at once from the same epoch: one wins, and every rank reads the
    /// winner's set; the next proposal builds on it.
    #[test]
    fn racing_proposals_agree_on_one_winner() {
        let name = format!("unit-members-race-{}", std::process::id());
        let start = Arc::new(Barrier::new(4));
        let ranks: Vec<_> = (0..4)
            .map(|r| {
                let (name, start) = (name.clone(), start.clone());
                std::thread::spawn(move || {
                    let g = ShmGroup::join(&name, r, 4, opts(5000)).unwrap();
                    start.wait();
                    if r >= 2 {
                        g.propose(0, &[r - 2]);
                    }
                    start.wait();
                    let first = g.membership().unwrap();
                    start.wait();
                    if r == 3 {
                        let mut next = first.1.clone();
                        next.push(2);
                        next.sort_unstable();
                        g.propose(first.0, &next);
                    }
                    start.wait();
                    (first, g.membership().unwrap())
                })
            })
            .collect();
        let seen: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        let (first, second) = seen[0].clone();
        assert_eq!(first.0, 1);
        assert!(first.1 == vec![0] || first.1 == vec![1], "{first:?}");
        let mut want = first.1.clone();
        want.push(2);
        assert_eq!(second, (2, want));
        assert!(seen.iter().all(|s| *s == seen[0]), "{seen:?}");
    }

    /// A membership word whose decider's proposal never carries its epoch (only a process that
    /// wrote into the control segment can make one) is an error within the timeout, not a hang.
    #[test]
    fn an_altered_membership_word_is_an_error() {
        let name = format!("unit-members-forged-{}", std::process::id());
        let g = ShmGroup::join(&name, 0, 1, opts(200)).unwrap();
        g.header().members.store(5 << 16 | 1, Ordering::Release);
        let e = g.membership().unwrap_err();
        assert_eq!(e.status(), crate::Status::PeerFailure);
        assert_eq!(
            e.to_string(),
            format!("the membership word of group '{name}' names rank 0 for epoch 5, but that rank's proposal is for epoch 0 (the control segment was altered; seen from rank 0)")
        );
    }
}
