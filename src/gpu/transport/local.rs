//! [`LocalFabric`]: ranks as threads of one process on one GPU (one context, one stream per
//! rank), exchanging through `cuMemcpyDtoDAsync` between their device buffers, ordered with
//! CUDA events and host barriers. NCCL refuses two ranks on one device, so this is how the
//! multi-rank logic of every layout is checked on a single-GPU machine
//! (`scripts/gpu-check.sh` phases 1 and 3). Not a production transport: every exchange costs
//! three host barriers.
//!
//! Exchange protocol, per call on every rank: record `ready` after the sends were produced;
//! publish (plans, buffers, ready); barrier; for every peer p: wait on p's `ready`, copy p's
//! rows for this rank into the receive buffer; record `done`; publish; barrier; wait on every
//! peer's `done` (so a send buffer is reused only after all peers read it); barrier.
//!
//! Status: compiled only; never run on a GPU yet.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::gpu::driver::{memcpy_dtod_async, Event, Stream};
use crate::gpu::nccl::plan::ExchangePlan;
use crate::gpu::transport::gate::Gate;
use crate::gpu::transport::plan::broadcast_plan;
use crate::gpu::transport::Fabric;

#[derive(Default, Clone)]
struct Slot {
    items: Vec<(ExchangePlan, u64, u64)>,
    ready: Option<Arc<Event>>,
    done: Option<Arc<Event>>,
}

struct Shared {
    world: usize,
    gate: Gate,
    slots: Mutex<Vec<Slot>>,
}

/// Bound on one barrier wait of the local fabric.
const LOCAL_TIMEOUT: Duration = Duration::from_secs(120);

/// One rank of an in-process group (see the module doc).
pub struct LocalFabric {
    rank: usize,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for LocalFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalFabric")
            .field("rank", &self.rank)
            .field("world", &self.shared.world)
            .finish()
    }
}

/// `world` connected ranks; hand one to each thread.
pub fn local_group(world: usize) -> Vec<LocalFabric> {
    let shared = Arc::new(Shared {
        world,
        gate: Gate::new(),
        slots: Mutex::new(vec![Slot::default(); world]),
    });
    (0..world)
        .map(|rank| LocalFabric {
            rank,
            shared: shared.clone(),
        })
        .collect()
}

impl Drop for LocalFabric {
    fn drop(&mut self) {
        // Peers still waiting for this rank fail instead of hanging.
        self.shared.gate.poison();
    }
}

impl LocalFabric {
    fn barrier(&self) -> Result<()> {
        self.shared
            .gate
            .wait(self.shared.world, self.rank, LOCAL_TIMEOUT)
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<Slot>> {
        self.shared.slots.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The plans' self slots as `cuMemcpyDtoDAsync`.
///
/// # Safety
/// Each plan's buffers hold its `send_bytes` / `recv_bytes`.
pub(crate) unsafe fn local_copies(items: &[(ExchangePlan, u64, u64)], s: &Stream) -> Result<()> {
    for (plan, send, recv) in items {
        if let Some(l) = plan.local {
            // SAFETY: both ranges lie in buffers sized from the plan (caller contract).
            unsafe { copy_at((*recv, l.recv_offset), (*send, l.send_offset), l.bytes, s) }?;
        }
    }
    Ok(())
}

/// Enqueues a device copy of `bytes` from (buffer, offset) `src` to `dst`.
///
/// # Safety
/// Both ranges lie in device buffers.
unsafe fn copy_at(dst: (u64, usize), src: (u64, usize), bytes: usize, s: &Stream) -> Result<()> {
    // SAFETY: caller contract.
    unsafe { memcpy_dtod_async(dst.0 + dst.1 as u64, src.0 + src.1 as u64, bytes, s) }
}

impl LocalFabric {
    /// Enqueues the copies of peer `p`'s rows for this rank (its `slot`, ready) into this
    /// rank's receive buffers of `items`; the first mismatch or failure is the error.
    ///
    /// # Safety
    /// As [`Fabric::exchange`]: every buffer holds what its plan says, on every rank.
    unsafe fn copy_from(
        &self,
        p: usize,
        slot: &Slot,
        items: &[(ExchangePlan, u64, u64)],
        s: &Stream,
    ) -> Result<()> {
        for ((mine, _, recv), (theirs, send, _)) in items.iter().zip(&slot.items) {
            let Some(rv) = mine.recvs.iter().find(|t| t.peer == p) else {
                continue;
            };
            let Some(sd) = theirs.sends.iter().find(|t| t.peer == self.rank) else {
                return Err(Error::Internal(format!(
                    "local fabric: rank {p} sends nothing to rank {} but a receive was planned",
                    self.rank
                )));
            };
            if sd.bytes != rv.bytes {
                return Err(Error::Internal(format!(
                    "local fabric: rank {p} sends {} bytes to rank {}, which expects {}",
                    sd.bytes, self.rank, rv.bytes
                )));
            }
            if rv.bytes == 0 {
                continue;
            }
            // SAFETY: both buffers were sized from the plans (caller contract of every rank);
            // the peer's rows are ready (the caller waited on its event).
            unsafe { copy_at((*recv, rv.offset), (*send, sd.offset), rv.bytes, s) }?;
        }
        Ok(())
    }
}

impl Fabric for LocalFabric {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn zero_size_p2p(&self) -> bool {
        true
    }

    unsafe fn all_gather_i32(&self, send: u64, recv: u64, count: usize, s: &Stream) -> Result<()> {
        let plan = broadcast_plan(&vec![1; self.shared.world], self.rank, 4 * count, true);
        // SAFETY: caller contract: send holds count int32, recv count * world.
        unsafe { self.exchange(&[(plan, send, recv)], s) }
    }

    unsafe fn exchange(&self, items: &[(ExchangePlan, u64, u64)], s: &Stream) -> Result<()> {
        let ready = Arc::new(Event::new(false)?);
        ready.record(s)?;
        {
            let mut slots = self.slots();
            slots[self.rank] = Slot {
                items: items.to_vec(),
                ready: Some(ready),
                done: None,
            };
        }
        self.barrier()?;
        let snapshot = self.slots().clone();
        let mut result = Ok(());
        for (p, slot) in snapshot.iter().enumerate() {
            if p == self.rank {
                continue;
            }
            if slot.items.len() != items.len() {
                result = Err(Error::Internal(format!(
                    "local fabric: rank {p} issued {} exchanges, rank {} issued {}",
                    slot.items.len(),
                    self.rank,
                    items.len()
                )));
                break;
            }
            if let Some(ev) = &slot.ready {
                if let Err(e) = s.wait_event(ev) {
                    result = Err(e);
                    break;
                }
            }
            // SAFETY: caller contract (Fabric::exchange), on every rank.
            if let Err(e) = unsafe { self.copy_from(p, slot, items, s) } {
                result = Err(e);
            }
        }
        if result.is_ok() {
            // SAFETY: caller contract.
            result = unsafe { local_copies(items, s) };
        }
        let done = Arc::new(Event::new(false)?);
        done.record(s)?;
        self.slots()[self.rank].done = Some(done);
        self.barrier()?;
        let snapshot = self.slots().clone();
        for (p, slot) in snapshot.iter().enumerate() {
            if p != self.rank {
                if let Some(ev) = &slot.done {
                    s.wait_event(ev)?;
                }
            }
        }
        self.barrier()?;
        result
    }

    fn poll(&self) -> Result<()> {
        Ok(())
    }

    fn abort(&self) -> Result<()> {
        // The peers' barriers fail at once instead of after their timeout.
        self.shared.gate.poison();
        Ok(())
    }
}
