//! Fault tolerance for the backends vLLM allows it for (`deepep_low_latency`, `nixl_ep`;
//! vLLM v0.33.0 `vllm/v1/worker/sentinel/gpu_worker_sentinel.py`, `FT_BACKEND_SET`).
//!
//! When a peer dies or stalls past the timeout, the call in progress fails on every survivor
//! as without fault tolerance (PEER_FAILURE or TIMEOUT naming the rank, one outcome on every
//! rank: the group's decision protocol), and the ranks the group holds as lost
//! ([`Group::lost_ranks`]) are masked. The next call forms the survivors' group
//! ([`Group::shrink`], which checks that every survivor masks the same ranks) and runs over
//! it under the original numbering ([`MaskedGroup`]): a masked rank sends and receives
//! nothing, tokens routed to its experts go nowhere (the (token, expert) pairs are dropped,
//! counted in [`super::Stats`]), and combine sums without them (their weight contributes
//! zero). A masked rank is never unmasked: rejoining means a new group.
//!
//! The mask follows vLLM's `All2AllManagerBase` (`vllm/distributed/device_communicators/`
//! `base_device_communicator.py`): `query_active_mask` (int32 per rank, 0 live, 1 masked),
//! `query_fault` (the mask differs from the one at the last recovery point) and
//! `clean_buffers` (the recovery point: receive buffers zeroed, rank-local).

use super::plan::Routing;
use super::Manager;
use crate::error::{Error, Result, Status};
use crate::group::masked::MaskedGroup;
use crate::group::{survivors, Group};

/// The fault-tolerance state of a manager.
#[derive(Debug, Default)]
pub(super) struct Ft {
    on: bool,
    /// One entry per rank: true = masked.
    mask: Vec<bool>,
    /// The mask at the last recovery point.
    baseline: Vec<bool>,
    /// A dispatch was forgotten because the group in use changed (a rank was masked after it):
    /// combine says so instead of "without a successful dispatch".
    dispatch_lost: bool,
}

impl Ft {
    pub(super) fn new(world: usize) -> Ft {
        Ft {
            on: false,
            mask: vec![false; world],
            baseline: vec![false; world],
            dispatch_lost: false,
        }
    }

    pub(super) fn masked(&self, r: usize) -> bool {
        self.mask.get(r).copied().unwrap_or(false)
    }

    pub(super) fn any(&self) -> bool {
        self.mask.iter().any(|&m| m)
    }

    /// Masks the ranks in `lost`; returns whether anything changed. Never unmasks.
    fn absorb(&mut self, lost: impl IntoIterator<Item = usize>) -> bool {
        let mut changed = false;
        for r in lost {
            if let Some(m) = self.mask.get_mut(r) {
                changed |= !*m;
                *m = true;
            }
        }
        changed
    }
}

/// A failure that fault tolerance answers by masking: a peer died or did not arrive.
fn peer_lost(e: &Error) -> bool {
    matches!(e.status(), Status::PeerFailure | Status::Timeout)
}

impl Manager {
    /// Turns fault tolerance on or off (vLLM's `enable_fault_tolerance`); allowed for the
    /// backends vLLM allows (`deepep_low_latency`, `nixl_ep`), else vLLM's ValueError. Every
    /// rank must set the same (checked at each dispatch).
    pub fn set_fault_tolerance(&mut self, on: bool) -> Result<()> {
        if on && !self.backend.supports_fault_tolerance() {
            return Err(Error::FaultToleranceBackend {
                backend: self.backend.name().to_owned(),
            });
        }
        self.ft.on = on;
        Ok(())
    }

    /// Whether fault tolerance is on.
    pub fn fault_tolerance(&self) -> bool {
        self.ft.on
    }

    /// vLLM's `query_active_mask`: one int32 per rank, 0 = live, 1 = masked (dead or
    /// unreachable). All zero without fault tolerance.
    pub fn active_mask(&self) -> Vec<i32> {
        self.ft.mask.iter().map(|&m| i32::from(m)).collect()
    }

    /// vLLM's `query_fault`: whether the mask changed since the last [`Manager::clean_buffers`].
    pub fn query_fault(&self) -> bool {
        self.ft.mask != self.ft.baseline
    }

    /// vLLM's `clean_buffers`, the recovery point (rank-local): the receive buffers are zeroed,
    /// so nothing of a call that failed can be read as data, the last dispatch is forgotten
    /// (combine needs a new one), and the current mask becomes the baseline of
    /// [`Manager::query_fault`]. Masked ranks stay masked.
    pub fn clean_buffers(&mut self) {
        self.hidden.fill(0);
        self.extras.iter_mut().for_each(|b| b.fill(0));
        self.fp8_scales.fill(0);
        self.plan = None;
        self.tokens = 0;
        self.ft.baseline = self.ft.mask.clone();
    }

    /// vLLM v0.34.0's `update_mask(rank, masked)` (DeepEP-LL, NIXL-EP), which the sentinel
    /// calls after `clean_buffers` to replay the cumulative dead set of a scale-down: sets
    /// rank `rank`'s entry of the mask and of [`Manager::query_fault`]'s baseline. vLLM's
    /// `clean_buffers` wipes its mask, epcomm's keeps it (a masked rank is not in the
    /// survivors' group), so replaying a masked rank is a no-op here. epcomm masks a rank when
    /// the group loses it: masking a live rank, or unmasking a masked one (rejoining means a
    /// new group), is an error saying so. Without fault tolerance, vLLM's base class's
    /// NotImplementedError.
    pub fn update_mask(&mut self, rank: usize, masked: bool) -> Result<()> {
        if !self.ft.on {
            return Err(Error::NotImplemented(
                "update_mask: this all2all manager has no fault tolerance (enable_fault_tolerance is off)".into(),
            ));
        }
        let world = self.ft.mask.len();
        if rank >= world {
            return Err(Error::InvalidArgument(format!(
                "update_mask: rank {rank} is out of range: the group has {world} ranks"
            )));
        }
        match (masked, self.ft.masked(rank)) {
            (true, false) => Err(Error::InvalidState(format!(
                "update_mask: rank {rank} is live in this group; epcomm masks a rank when the group loses it (it then leaves the survivors' group), not by hand"
            ))),
            (false, true) => Err(Error::InvalidState(format!(
                "update_mask: rank {rank} is masked and cannot be unmasked: a masked rank is not in the survivors' group; rejoining means a new group"
            ))),
            (true, true) | (false, false) => {
                self.ft.baseline[rank] = masked;
                Ok(())
            }
        }
    }

    /// Whether rank `r` is masked.
    pub(super) fn is_masked(&self, r: usize) -> bool {
        self.ft.masked(r)
    }

    /// Runs `f` over the group the manager uses now: `g`, or after a failure the survivors'
    /// group `g` keeps (formed first when this is the first call since; see
    /// [`survivors::current`]) under the original numbering. With fault tolerance on, a
    /// peer's failure during `f` masks the ranks the group holds as lost, at once (so
    /// [`Manager::active_mask`] names them right after the failed call).
    pub(super) fn over_group<T>(
        &mut self,
        g: &mut dyn Group,
        f: impl FnOnce(&mut Manager, &mut dyn Group) -> Result<T>,
    ) -> Result<T> {
        if !self.ft.on {
            return f(self, g);
        }
        let (mask, cur) = survivors::current(g)?;
        let masked = mask.contains(&true);
        if masked && self.ft.absorb((0..mask.len()).filter(|&r| mask[r])) {
            self.forget_group_buffers();
        }
        let failed = |r: &Result<T>| r.as_ref().is_err_and(peer_lost);
        let (r, lost) = if masked {
            let mut masked = MaskedGroup::new(cur, self.rank, &mask)?;
            let r = f(self, &mut masked);
            let lost = if failed(&r) {
                masked.lost_ranks()
            } else {
                Vec::new()
            };
            (r, lost)
        } else {
            let r = f(self, cur);
            let lost = if failed(&r) {
                cur.lost_ranks()
            } else {
                Vec::new()
            };
            (r, lost)
        };
        // A dispatch planned with the rank alive must not be combined without it.
        if self.ft.absorb(lost) {
            self.forget_group_buffers();
        }
        r
    }

    /// After the group in use changed: buffers in the old group's shared memory are not the
    /// survivors', and a dispatch made over the old group cannot be combined over the new.
    fn forget_group_buffers(&mut self) {
        self.ft.dispatch_lost |= self.plan.is_some();
        self.hidden = Default::default();
        self.extras.clear();
        self.fp8_scales = Default::default();
        self.zero_copy = Default::default();
        self.plan = None;
    }

    /// Forgets that a dispatch was lost to a change of the group (a new dispatch starts).
    pub(super) fn dispatch_started(&mut self) {
        self.ft.dispatch_lost = false;
    }

    /// Combine's error when no dispatch is there to combine: it names the masking that made
    /// the last dispatch unusable, if that is what happened.
    pub(super) fn no_dispatch_error(&self) -> Error {
        if !self.ft.dispatch_lost {
            return Error::InvalidState(
                "combine called without a successful dispatch: call dispatch first".into(),
            );
        }
        let masked: Vec<String> = (0..self.ft.mask.len())
            .filter(|&r| self.ft.masked(r))
            .map(|r| r.to_string())
            .collect();
        Error::InvalidState(format!(
            "combine: the last dispatch was made before rank(s) {} were masked, and its rows cannot be combined over the survivors; dispatch again (clean_buffers, then retry the step)",
            masked.join(", ")
        ))
    }

    /// Drops the (token, expert) pairs routed to masked ranks' experts from every rank's
    /// routing (the same on every rank); returns this rank's dropped pairs.
    pub(super) fn drop_masked(&self, all: &mut [Routing]) -> u64 {
        if !self.ft.any() {
            return 0;
        }
        let per_rank = self.geo.experts_per_rank.max(1);
        let mut mine = 0;
        for (r, routing) in all.iter_mut().enumerate() {
            for id in routing.ids.iter_mut() {
                if *id >= 0 && self.ft.masked(*id as usize / per_rank) {
                    *id = -1;
                    if r == self.rank {
                        mine += 1;
                    }
                }
            }
        }
        mine
    }
}
