//! Agreement before any data moves. With its op header every rank publishes its verdict on its
//! own arguments and the parameters all ranks must pass alike (root, dtype, row size, a digest
//! of a size list); every rank checks all of them in the same order, so every rank reaches the
//! same verdict. A rejected or disagreeing op moves no data, still completes on every rank, and
//! leaves the group usable; the rank whose arguments failed its checks gets its own error, the
//! others an error naming it at once (no waiting for the timeout).

use std::sync::atomic::Ordering;

use super::layout::{PARAMS, VERDICT_OK, VERDICT_REJECTED};
use super::ShmGroup;
use crate::error::{Error, Result};
use crate::group::Op;
use crate::num::FloatKind;

/// How a parameter is shown in a disagreement message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Show {
    Number,
    Dtype,
    /// A digest of a list: the message says the lists differ.
    List,
}

/// One parameter every rank must pass alike.
#[derive(Debug, Clone, Copy)]
pub(super) struct Param {
    pub name: &'static str,
    pub value: u64,
    pub show: Show,
}

pub(super) fn number(name: &'static str, v: usize) -> Param {
    Param {
        name,
        value: v as u64,
        show: Show::Number,
    }
}

pub(super) fn dtype(name: &'static str, k: FloatKind) -> Param {
    Param {
        name,
        value: k as u64 + 1,
        show: Show::Dtype,
    }
}

/// A list by its FNV-1a digest (length included).
pub(super) fn list(name: &'static str, v: &[usize]) -> Param {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in std::iter::once(v.len()).chain(v.iter().copied()) {
        for b in (x as u64).to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    Param {
        name,
        value: h,
        show: Show::List,
    }
}

fn dtype_name(v: u64) -> &'static str {
    [FloatKind::F32, FloatKind::Bf16, FloatKind::F16]
        .into_iter()
        .find(|k| *k as u64 + 1 == v)
        .map_or("an unknown dtype", FloatKind::name)
}

impl ShmGroup {
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
            let verdict = g.verdict(op, n, params);
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
        let (name, me, what) = (&self.name, self.rank, op.name());
        let rejected = n << 8 | VERDICT_REJECTED;
        if let Some(p) = (0..self.world)
            .find(|&p| p != me && self.slot(p).verdict.load(Ordering::Acquire) == rejected)
        {
            return Err(Error::InvalidArgument(format!(
                "{what}: rank {p} of group '{name}' rejected its arguments (see that rank's error); no data was exchanged"
            )));
        }
        for (i, param) in params.iter().enumerate() {
            let value = |p: usize| self.slot(p).params[i].load(Ordering::Acquire);
            let v0 = value(0);
            let Some(p) = (1..self.world).find(|&p| value(p) != v0) else {
                continue;
            };
            let pn = param.name;
            let detail = match param.show {
                Show::Number => format!("rank 0 passes {v0} but rank {p} passes {}", value(p)),
                Show::Dtype => format!(
                    "rank 0 passes {} but rank {p} passes {}",
                    dtype_name(v0),
                    dtype_name(value(p))
                ),
                Show::List => format!("rank 0 and rank {p} pass different lists"),
            };
            return Err(Error::InvalidArgument(format!(
                "{what}: ranks of group '{name}' disagree on {pn}: {detail}; every rank must pass the same {pn} (no data was exchanged)"
            )));
        }
        Ok(())
    }
}
