//! EPLB communicators (vLLM's `create_eplb_communicator`): the factory's rules and messages come
//! from [`crate::select::eplb`]; this module builds what was chosen.
//!
//! `torch_gloo` (and `torch_nccl` / `torch_xccl` for host tensors, which vLLM runs on the CPU
//! group too) move expert rows with the group's batched send/recv: over shared memory that is one
//! copy per row. XPU weights go through `torch_xccl` once the caller stages them in host memory.
//! The NCCL- and NIXL-backed communicators need the GPU path and report that honestly.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::{Group, P2p};
use crate::log;
use crate::select::eplb::{self, Communicator, DeviceKind, SelectRequest};

/// Moves expert rows for one layer: sends and receives, executed together.
pub trait EplbCommunicator: Send + std::fmt::Debug {
    /// Which communicator this is.
    fn kind(&self) -> Communicator;
    /// Executes a batch (sends and receives, matched per peer pair in order). Collective.
    fn execute(&mut self, g: &mut dyn Group, ops: &mut [P2p<'_>]) -> Result<()>;
}

/// Host-memory transfers over the group (vLLM's `TorchDistGlooStagedEplbCommunicator`, and
/// `TorchDistNcclEplbCommunicator` / `TorchDistXCCLStagedEplbCommunicator` on host tensors).
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
