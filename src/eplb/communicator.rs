//! EPLB communicators (vLLM's `create_eplb_communicator`): the factory's rules and messages come
//! from [`crate::select::eplb`]; this module builds what was chosen.
//!
//! `torch_gloo` (and `torch_nccl` / `torch_xccl` for host tensors, which vLLM runs on the CPU
//! group too) move expert rows with the group's batched send/recv: over shared memory that is one
//! copy per row. XPU weights go through `torch_xccl` once the caller stages them in host memory.
//! The NCCL- and NIXL-backed communicators need the GPU path and report that honestly.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::{Group, P2p, RowExchange};
use crate::log;
use crate::select::eplb::{self, Communicator, DeviceKind, SelectRequest};

/// Moves expert rows for one layer: sends and receives, executed together.
pub trait EplbCommunicator: Send + std::fmt::Debug {
    /// Which communicator this is.
    fn kind(&self) -> Communicator;
    /// Executes a batch (sends and receives, matched per peer pair in order). Collective.
    fn execute(&mut self, g: &mut dyn Group, ops: &mut [P2p<'_>]) -> Result<()>;

    /// Moves rows of one weight tensor ([`Group::exchange_rows`]'s contract): peer p gets
    /// rows `give[p]` of `src`, and the rows from peer p land at rows `take[p]` of `dst`, in
    /// order. Collective. This default runs them as one [`EplbCommunicator::execute`] of the
    /// equivalent sends and receives; the group communicator hands them to the group, which
    /// stores each row straight into a destination in shared memory.
    fn exchange_rows(&mut self, g: &mut dyn Group, rows: RowExchange<'_>) -> Result<()> {
        let mut ops = row_ops(rows)?;
        self.execute(g, &mut ops)
    }
}

/// The sends and receives that move rows as [`EplbCommunicator::exchange_rows`] says: every
/// send (peers in order), then every receive.
fn row_ops(ex: RowExchange<'_>) -> Result<Vec<P2p<'_>>> {
    let RowExchange {
        src,
        row_bytes,
        give,
        dst,
        take,
    } = ex;
    let bad = |what: &str, r: u32| {
        Error::InvalidArgument(format!(
            "exchange_rows: {what} row {r} is out of range or taken twice"
        ))
    };
    let mut ops = Vec::new();
    if row_bytes == 0 {
        return Ok(ops);
    }
    for (peer, rows) in give.iter().enumerate() {
        for &r in rows {
            let at = r as usize * row_bytes;
            let data = src
                .get(at..at + row_bytes)
                .ok_or_else(|| bad("source", r))?;
            ops.push(P2p::Send { peer, data });
        }
    }
    let mut slots: Vec<Option<&mut [u8]>> = dst.chunks_mut(row_bytes).map(Some).collect();
    for (peer, rows) in take.iter().enumerate() {
        for &r in rows {
            let data = slots
                .get_mut(r as usize)
                .and_then(Option::take)
                .filter(|d| d.len() == row_bytes)
                .ok_or_else(|| bad("destination", r))?;
            ops.push(P2p::Recv { peer, data });
        }
    }
    Ok(ops)
}

/// Host-memory transfers over the group (vLLM's `TorchDistGlooStagedEplbCommunicator`, and
/// `TorchDistNcclEplbCommunicator` / `TorchDistXCCLStagedEplbCommunicator` on host tensors;
/// v0.34.0's `SymmMemEplbCommunicator`, whose push is the group's store into a receiver's
/// shared next buffer).
#[derive(Debug)]
pub struct GroupCommunicator {
    kind: Communicator,
}

impl EplbCommunicator for GroupCommunicator {
    fn kind(&self) -> Communicator {
        self.kind
    }

    fn execute(&mut self, g: &mut dyn Group, ops: &mut [P2p<'_>]) -> Result<()> {
        g.send_recv(ops)
    }

    fn exchange_rows(&mut self, g: &mut dyn Group, r: RowExchange<'_>) -> Result<()> {
        g.exchange_rows(r)
    }
}

/// Builds the communicator vLLM's factory would choose for this request, and logs
/// `Initialized EPLB communicator: {Class}.`.
pub fn create(
    requested: Option<&str>,
    elastic: bool,
    device: DeviceKind,
    weight_dtypes: &[DType],
    nccl_available: bool,
    nixl_available: bool,
) -> Result<Box<dyn EplbCommunicator>> {
    let (sel, warnings) = eplb::select_outcome(&SelectRequest {
        requested,
        elastic,
        device,
        weight_dtypes,
        nccl_available,
        nixl_available,
    });
    for w in &warnings {
        log::warn(w);
    }
    let sel = sel?;
    let built: Box<dyn EplbCommunicator> = match sel.communicator {
        Communicator::TorchGloo => Box::new(GroupCommunicator {
            kind: Communicator::TorchGloo,
        }),
        // vLLM runs both on the CPU group when the weights are host tensors.
        c @ (Communicator::TorchNccl | Communicator::TorchXccl) if device == DeviceKind::Cpu => {
            Box::new(GroupCommunicator { kind: c })
        }
        Communicator::TorchXccl => return Err(eplb::xccl_device_unavailable(device)),
        // Selected for host tensors only: the rows are pushed into shared next buffers.
        Communicator::SymmMem => Box::new(GroupCommunicator {
            kind: Communicator::SymmMem,
        }),
        Communicator::TorchNccl => {
            return Err(Error::NotImplemented(format!(
                "EPLB communicator 'torch_nccl' on {} tensors needs epcomm's NCCL transport, which is not implemented yet; use 'torch_gloo' (host-staged)",
                device.torch_name()
            )))
        }
        Communicator::Pynccl => {
            return Err(Error::PyncclInit {
                cause: "epcomm's NCCL transport is not implemented yet".into(),
            })
        }
        Communicator::Nixl => {
            return Err(Error::NixlInit {
                cause: "epcomm's NIXL transport is not implemented yet".into(),
            })
        }
    };
    log::info(&eplb::initialized_info(built.kind()));
    Ok(built)
}
