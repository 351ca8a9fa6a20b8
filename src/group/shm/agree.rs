//! Agreement before any data moves, the shm side (the parameters and the wording are
//! `group::agree`'s, shared with the host transport). With its op header every rank publishes its verdict on its
//! own arguments and the parameters all ranks must pass alike (root, dtype, row size, a digest
//! of a size list); every rank checks all of them in the same order, so every rank reaches the
//! same verdict. A rejected or disagreeing op moves no data, still completes on every rank, and
//! leaves the group usable; the rank whose arguments failed its checks gets its own error, the
//! others an error naming it at once (no waiting for the timeout).

use std::sync::atomic::Ordering;

use super::layout::{PARAMS, VERDICT_OK, VERDICT_REJECTED};
use super::ShmGroup;
use crate::error::{Error, Result};
use crate::group::agree::{self, Param, MAX_PARAMS};
use crate::group::Op;

// Every parameter an op agrees on has its word in the slot.
const _: () = assert!(MAX_PARAMS <= PARAMS);

impl ShmGroup {
    // run_agreed and run_checked take the same arguments: run_agreed is the common case, the ops
    // with no check across ranks' metadata, spelled as one call of run_checked.
    /// Runs one op whose arguments this rank checked (`local`) and whose `params` every rank
    /// must pass alike: begin, publish (nothing but the verdict when `local` failed), wait for
    /// the peers, agree, `read` (only when every rank accepted and agreed), finish.
    pub(super) fn run_agreed(
        &mut self,
        op: Op,
        local: Result<()>,
        params: &[Param],
        meta: &[u64],
        payload: &[&[u8]],
        read: impl FnOnce(&Self) -> Result<()>,
    ) -> Result<()> {
        self.run_checked(op, local, params, meta, payload, |_| Ok(()), read)
    }

    /// [`ShmGroup::run_agreed`] with one more check every rank makes alike once all accepted
    /// and agreed (`check`, over every rank's published metadata, e.g. that each pair's sizes
    /// match); when it fails, no data is read, the op still completes on every rank and the
    /// group stays usable.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_checked(
        &mut self,
        op: Op,
        local: Result<()>,
        params: &[Param],
        meta: &[u64],
        payload: &[&[u8]],
        check: impl FnOnce(&Self) -> Result<()>,
        read: impl FnOnce(&Self) -> Result<()>,
    ) -> Result<()> {
        self.check_usable(op)?;
        debug_assert!(params.len() <= PARAMS);
        let values: Vec<u64> = params.iter().map(|p| p.value).collect();
        let rejected = local.is_err();
        let verdict = self.guarded(op, |g| {
            let n = g.begin(op)?;
            if rejected {
                g.publish_as(op, n, VERDICT_REJECTED, &values, &[], &[])?;
            } else {
                g.publish_as(op, n, VERDICT_OK, &values, meta, payload)?;
            }
            g.gather_published(op, n)?;
            let verdict =
                g.verdict(op, n, params)
                    .and_then(|()| if rejected { Ok(()) } else { check(g) });
            if verdict.is_ok() && !rejected {
                read(g)?;
            }
            g.finish(op, n)?;
            Ok(verdict)
        })?;
        local?;
        verdict
    }

    /// Takes part in `op` as a rank that rejected its own arguments (`e`, returned): the peers
    /// fail at once naming this rank, and the group stays usable.
    pub(super) fn reject_op(&mut self, op: Op, e: Error) -> Error {
        if self.broken.is_some() {
            return e;
        }
        match self.run_agreed(op, Err(e), &[], &[], &[], |_| Ok(())) {
            Err(e) => e,
            Ok(()) => Error::Internal(format!("{}: a rejected op succeeded", op.name())),
        }
    }

    /// The verdict of op `n`, the same on every rank: a peer rejected its arguments, or the
    /// ranks disagree on a parameter (rank 0's value against the first rank passing another).
    pub(super) fn verdict(&self, op: Op, n: u64, params: &[Param]) -> Result<()> {
        let rejected =
            |p: usize| self.slot(p).verdict.load(Ordering::Acquire) == n << 8 | VERDICT_REJECTED;
        let value = |p: usize, i: usize| self.slot(p).params[i].load(Ordering::Acquire);
        let seen = agree::Seen {
            world: self.world,
            rejected: &rejected,
            value: &value,
        };
        agree::verdict(op, &self.name, self.rank, params, &seen)
    }
}
