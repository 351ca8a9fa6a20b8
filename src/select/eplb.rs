//! EPLB communicator names and vLLM's `create_eplb_communicator` decision logic, as a
//! pure function of what the caller asked for and what this process has.

use crate::dtype::DType;
use crate::error::{Error, Result};

/// An EPLB communicator. Declaration order is the C code (`EPCOMM_EPLB_*`, asserted in
/// ffi/mod.rs's tests): only append.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Communicator {
    TorchNccl,
    TorchGloo,
    Pynccl,
    Nixl,
    /// vLLM v0.33.0's `TorchDistXCCLStagedEplbCommunicator`: P2P on the EP group, which vLLM
    /// takes as the CPU group for host tensors and the XCCL device group for XPU tensors. epcomm
    /// moves host memory only (XPU weights staged in host memory by the caller).
    TorchXccl,
    /// vLLM v0.34.0's `SymmMemEplbCommunicator`, a push backend: senders write each expert's
    /// rows into the receiver's buffer. epcomm moves host memory: senders store the rows into
    /// the receivers' next buffers when those are shared memory (`next_shared`: buffers from
    /// the group's allocator), else the group moves them by its row exchange (the same bytes).
    SymmMem,
}

/// The names of [`Communicator`], in its (C ABI) order.
pub const COMMUNICATOR_NAMES: [&str; 6] = [
    "torch_nccl",
    "torch_gloo",
    "pynccl",
    "nixl",
    TORCH_XCCL,
    SYMM_MEM,
];

/// vLLM v0.33.0's `torch_xccl` name.
pub const TORCH_XCCL: &str = "torch_xccl";

/// The names vLLM's `EPLBCommunicatorBackend` literal accepts, in vLLM's order (v0.34.0).
pub const VLLM_COMMUNICATOR_NAMES: [&str; 6] = [
    "torch_nccl",
    "torch_gloo",
    TORCH_XCCL,
    "nixl",
    "pynccl",
    SYMM_MEM,
];

/// vLLM v0.34.0's `symm_mem` name (`SymmMemEplbCommunicator`: senders push expert rows into
/// the receiver's buffer over CUDA symmetric memory).
pub const SYMM_MEM: &str = "symm_mem";

/// vLLM's class for [`SYMM_MEM`].
pub const SYMM_MEM_CLASS: &str = "SymmMemEplbCommunicator";

/// The error for `symm_mem` on device (CUDA) tensors: epcomm pushes into host memory only.
pub fn symm_mem_not_implemented() -> Error {
    Error::NotImplemented(format!(
        "EPLB communicator '{SYMM_MEM}' on cuda tensors ({SYMM_MEM_CLASS}: a push into the receivers' buffers over CUDA symmetric memory) is not implemented in epcomm; stage the expert weights in host memory (kDLCPU), where epcomm pushes into next buffers in shared memory, or use 'nixl' or 'torch_gloo'"
    ))
}

/// Whether `name` is in vLLM's `EPLBCommunicatorBackend` literal.
pub fn is_vllm_name(name: &str) -> bool {
    VLLM_COMMUNICATOR_NAMES.contains(&name)
}

/// The error for `torch_xccl` on device memory: epcomm has no XCCL transport.
pub fn xccl_device_unavailable(device: DeviceKind) -> Error {
    Error::NotImplemented(format!(
        "EPLB communicator '{TORCH_XCCL}' on {} tensors needs XCCL device P2P, which epcomm does not have; stage the expert weights in host memory (kDLCPU) and epcomm moves them over the group",
        device.torch_name()
    ))
}

impl Communicator {
    pub const ALL: [Communicator; 6] = [
        Communicator::TorchNccl,
        Communicator::TorchGloo,
        Communicator::Pynccl,
        Communicator::Nixl,
        Communicator::TorchXccl,
        Communicator::SymmMem,
    ];

    pub fn from_code(code: i32) -> Option<Communicator> {
        Communicator::ALL
            .iter()
            .copied()
            .find(|c| *c as i32 == code)
    }

    pub fn from_name(name: &str) -> Option<Communicator> {
        Communicator::ALL.iter().copied().find(|c| c.name() == name)
    }

    pub fn name(self) -> &'static str {
        COMMUNICATOR_NAMES[self as usize]
    }

    /// vLLM's class for this communicator.
    pub fn class_name(self) -> &'static str {
        match self {
            Communicator::TorchNccl => "TorchDistNcclEplbCommunicator",
            Communicator::TorchGloo => "TorchDistGlooStagedEplbCommunicator",
            Communicator::Pynccl => "PyNcclEplbCommunicator",
            Communicator::Nixl => "NixlEplbCommunicator",
            Communicator::TorchXccl => "TorchDistXCCLStagedEplbCommunicator",
            Communicator::SymmMem => SYMM_MEM_CLASS,
        }
    }
}

/// The info line vLLM logs once a communicator is built.
pub fn initialized_info(c: Communicator) -> String {
    format!("Initialized EPLB communicator: {}.", c.class_name())
}

/// The forced-to-pynccl warning under elastic EP.
pub const W_ELASTIC_FORCES_PYNCCL: &str =
    "Stateless elastic EP requires PyNCCL backend. Forcing EPLB communicator to 'pynccl'.";

/// Where the expert weights live, in PyTorch's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    Cpu,
    Cuda,
    /// ROCm: PyTorch calls it `cuda` too.
    Rocm,
    Xpu,
    /// Another DLPack device type (its code).
    Other(i32),
}

impl DeviceKind {
    /// From a DLPack device type code (1 CPU, 2 CUDA, 3 CUDA host, 10 ROCm, 11 ROCm host,
    /// 13 CUDA managed, 14 oneAPI).
    pub fn from_dlpack(code: i32) -> DeviceKind {
        match code {
            1 | 3 | 11 => DeviceKind::Cpu,
            2 | 13 => DeviceKind::Cuda,
            10 => DeviceKind::Rocm,
            14 => DeviceKind::Xpu,
            other => DeviceKind::Other(other),
        }
    }

    /// From a platform name as vLLM configs use it (cuda, rocm, cpu, xpu).
    pub fn from_platform(platform: &str) -> Option<DeviceKind> {
        match platform {
            "cuda" => Some(DeviceKind::Cuda),
            "rocm" => Some(DeviceKind::Rocm),
            "cpu" => Some(DeviceKind::Cpu),
            "xpu" => Some(DeviceKind::Xpu),
            _ => None,
        }
    }

    /// PyTorch's `device.type` string.
    pub fn torch_name(self) -> String {
        match self {
            DeviceKind::Cpu => "cpu".into(),
            DeviceKind::Cuda | DeviceKind::Rocm => "cuda".into(),
            DeviceKind::Xpu => "xpu".into(),
            DeviceKind::Other(8) => "mps".into(),
            DeviceKind::Other(code) => format!("dlpack_device_{code}"),
        }
    }

    pub fn is_cuda_alike(self) -> bool {
        matches!(self, DeviceKind::Cuda | DeviceKind::Rocm)
    }

    /// Whether NCCL (vLLM's `ncclDataTypeEnum`) can move this dtype on this device: the eight
    /// standard types plus the platform's fp8 type.
    pub fn nccl_supports(self, dtype: DType) -> bool {
        use crate::dtype::Code;
        match (dtype.code(), dtype.bits, dtype.lanes) {
            (_, _, l) if l != 1 => false,
            (Some(Code::Int), 8 | 32 | 64, _) => true,
            (Some(Code::UInt), 8, _) => true,
            (Some(Code::Float), 16 | 32 | 64, _) => true,
            (Some(Code::Bfloat), 16, _) => true,
            (Some(Code::Float8E4m3fn), 8, _) => true,
            (Some(Code::Float8E4m3fnuz), 8, _) => self == DeviceKind::Rocm,
            _ => false,
        }
    }
}

/// What the factory needs to decide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelectRequest<'a> {
    /// The configured name; `None` = automatic selection.
    pub requested: Option<&'a str>,
    /// The EP group is a stateless (elastic EP) group.
    pub elastic: bool,
    /// Where the expert weights live.
    pub device: DeviceKind,
    /// The dtypes of the first layer's expert weight tensors.
    pub weight_dtypes: &'a [DType],
    /// A usable NCCL is present in this process.
    pub nccl_available: bool,
    /// NIXL is present in this process.
    pub nixl_available: bool,
}

/// The factory's decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    pub communicator: Communicator,
    /// Chosen automatically (no name was configured).
    pub auto_selected: bool,
    /// Warnings vLLM logs on the way (e.g. the forced-to-pynccl warning).
    pub warnings: Vec<String>,
}

/// vLLM's automatic choice when no communicator is configured off XPU: NIXL if importable,
/// else `pynccl` for elastic EP, else `torch_gloo`.
pub fn auto_select(elastic: bool, nixl_available: bool) -> Communicator {
    if nixl_available {
        Communicator::Nixl
    } else if elastic {
        Communicator::Pynccl
    } else {
        Communicator::TorchGloo
    }
}

/// vLLM's automatic choice (`ParallelConfig.__post_init__`): `torch_xccl` on XPU, else
/// [`auto_select`].
pub fn auto_choice(device: DeviceKind, elastic: bool, nixl_available: bool) -> Communicator {
    match device {
        DeviceKind::Xpu => Communicator::TorchXccl,
        DeviceKind::Cpu | DeviceKind::Cuda | DeviceKind::Rocm | DeviceKind::Other(_) => {
            auto_select(elastic, nixl_available)
        }
    }
}

/// vLLM's `create_eplb_communicator` decision, in its order (listed in docs/design.md, section 7).
/// Construction failures (`Failed to initialize ...`) happen when the communicator is built, not
/// here.
pub fn select(req: &SelectRequest<'_>) -> Result<Selection> {
    select_outcome(req).0
}

/// Like [`select`], plus the warnings vLLM logs on the way even when the decision then fails
/// (the forced-to-pynccl warning precedes pynccl's own checks).
pub fn select_outcome(req: &SelectRequest<'_>) -> (Result<Selection>, Vec<String>) {
    let forced = req.elastic
        && req
            .requested
            .unwrap_or(auto_choice(req.device, req.elastic, req.nixl_available).name())
            == "torch_nccl";
    let warnings = if forced {
        vec![W_ELASTIC_FORCES_PYNCCL.to_owned()]
    } else {
        Vec::new()
    };
    (decide(req), warnings)
}

fn decide(req: &SelectRequest<'_>) -> Result<Selection> {
    let auto_selected = req.requested.is_none();
    let name: &str = match req.requested {
        Some(n) => n,
        None => auto_choice(req.device, req.elastic, req.nixl_available).name(),
    };
    let mut warnings = Vec::new();
    let done = |c: Communicator, warnings: Vec<String>| {
        Ok(Selection {
            communicator: c,
            auto_selected,
            warnings,
        })
    };

    if req.elastic && name != "nixl" {
        return match name {
            "torch_nccl" => {
                warnings.push(W_ELASTIC_FORCES_PYNCCL.to_owned());
                check_pynccl(req)?;
                done(Communicator::Pynccl, warnings)
            }
            "pynccl" => {
                check_pynccl(req)?;
                done(Communicator::Pynccl, warnings)
            }
            other => Err(Error::ElasticEpCommunicator {
                backend: other.to_owned(),
            }),
        };
    }
    match name {
        "nixl" => {
            if !req.nixl_available {
                return Err(Error::NixlUnavailable);
            }
            if !req.device.is_cuda_alike() {
                return Err(Error::NixlDeviceType {
                    device_type: req.device.torch_name(),
                });
            }
            done(Communicator::Nixl, warnings)
        }
        // vLLM checks the platform (`current_platform.is_cuda()`), then the NVLink domain at
        // construction. epcomm pushes host-staged weights (one host is one memory domain);
        // CUDA tensors would need CUDA symmetric memory, which it does not have.
        SYMM_MEM => match req.device {
            DeviceKind::Cpu => done(Communicator::SymmMem, warnings),
            DeviceKind::Cuda => Err(symm_mem_not_implemented()),
            DeviceKind::Rocm | DeviceKind::Xpu | DeviceKind::Other(_) => {
                Err(Error::SymmMemNeedsCuda)
            }
        },
        "torch_gloo" => done(Communicator::TorchGloo, warnings),
        TORCH_XCCL => done(Communicator::TorchXccl, warnings),
        "torch_nccl" => done(Communicator::TorchNccl, warnings),
        "pynccl" => {
            check_pynccl(req)?;
            done(Communicator::Pynccl, warnings)
        }
        other => Err(Error::UnknownEplbCommunicator {
            backend: other.to_owned(),
        }),
    }
}

/// vLLM's `_create_pynccl` checks, before construction.
fn check_pynccl(req: &SelectRequest<'_>) -> Result<()> {
    if req.device == DeviceKind::Cpu {
        return Err(Error::PyncclDeviceType {
            device_type: req.device.torch_name(),
        });
    }
    let mut bad: Vec<String> = req
        .weight_dtypes
        .iter()
        .filter(|d| !req.device.nccl_supports(**d))
        .map(|d| d.torch_name())
        .collect();
    bad.sort();
    bad.dedup();
    if !bad.is_empty() {
        return Err(Error::PyncclDtypes {
            dtypes: bad.join(", "),
        });
    }
    if !req.nccl_available {
        return Err(Error::PyncclUnavailable);
    }
    Ok(())
}
