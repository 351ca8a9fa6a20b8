//! Remediation advice for an [`Error`] (never part of its message): "did you mean" for
//! mistyped names, read from the selection tables, and the fix for each configuration rule.
//! It lives with `select` so that `error` depends on nothing above it.

use super::all2all;
use super::eplb::VLLM_COMMUNICATOR_NAMES;
use super::suggest;
use crate::error::Error;

/// [`hint`] as a method: `use epcomm::select::Hint;` then `e.hint()`.
pub trait Hint {
    /// Optional remediation advice, never part of the message.
    fn hint(&self) -> Option<String>;
}

impl Hint for Error {
    fn hint(&self) -> Option<String> {
        hint(self)
    }
}

/// Optional remediation advice for `error`, never part of the message.
pub fn hint(error: &Error) -> Option<String> {
    match error {
        Error::UnknownAll2AllBackend { name } => Some(suggest::did_you_mean(
        name,
        all2all::vllm_names(),
        "valid all2all backends",
        )),
        Error::UnknownEplbCommunicator { backend } => Some(suggest::did_you_mean(
        backend,
        VLLM_COMMUNICATOR_NAMES.iter().copied(),
        "valid EPLB communicators",
        )),
        Error::ConfigField { hint, .. } => hint.clone(),
        Error::MicrobatchingBackend { .. } => Some(
        "use --all2all-backend=deepep_low_latency, deepep_high_throughput or nixl_ep, or disable DBO".into(),
        ),
        Error::FaultToleranceBackend { .. } => {
        Some("use --all2all-backend=deepep_low_latency or nixl_ep".into())
        }
        Error::LoraEpBackend { .. } => {
        Some("use --all2all-backend=allgather_reducescatter with LoRA".into())
        }
        Error::AsyncEplbCommunicator { .. } => Some(
        "set eplb_config.communicator to 'torch_gloo' or 'nixl', unset it, or set eplb_config.use_async=false".into(),
        ),
        Error::ElasticEpCommunicator { .. } => Some(
        "set eplb_config.communicator to 'pynccl' or 'nixl' (or unset it) with elastic EP".into(),
        ),
        Error::PyncclUnavailable => Some(
        "build epcomm with --features nccl and make libnccl.so.2 loadable (LD_LIBRARY_PATH or VLLM_NCCL_SO_PATH)".into(),
        ),
        Error::NixlUnavailable => {
        Some("install NIXL (libnixl.so on the library path) or pick another communicator".into())
        }
        Error::ElasticAsyncNeedsNixl => {
        Some("install NIXL or set eplb_config.use_async=false".into())
        }
        Error::EplbNeedsExpertParallel => Some("set enable_expert_parallel=true".into()),
        Error::RedundantWithoutEplb { .. } => Some(
        "set enable_eplb=true or eplb_config.num_redundant_experts=0".into(),
        ),
        Error::ElasticNeedsEplb => Some("set enable_eplb=true".into()),
        Error::ExternalLbNeedsDp => Some(
            "set data_parallel_size > 1 or data_parallel_external_lb=false".into(),
        ),
        Error::NumaBindListsWithoutBinding => Some(
            "unset numa_bind (or set it true), or drop numa_bind_nodes and numa_bind_cpus".into(),
        ),
        Error::MoonepEplb => Some("set enable_eplb=false or pick another all2all backend".into()),
        Error::LoraEpPlacement { .. } => Some("set expert_placement_strategy='linear'".into()),
        Error::FaultTolerancePcp => Some("set prefill_context_parallel_size=1".into()),
        Error::SymmMemNeedsCuda => {
            Some("use eplb_config.communicator 'nixl' or 'torch_gloo' off CUDA".into())
        }
        Error::OneSidedHeterogeneous { .. }
        | Error::FaultToleranceMoeDraft
        | Error::MoonEpUnavailable
        | Error::PassthroughNoHandle
        | Error::PyncclDeviceType { .. }
        | Error::PyncclDtypes { .. }
        | Error::PyncclInit { .. }
        | Error::NixlDeviceType { .. }
        | Error::NixlInit { .. }
        | Error::AsyncEplbPolicy
        | Error::LogBalancednessInterval
        | Error::EplbPlatform
        | Error::EplbNeedsParallelism { .. }
        | Error::ElasticPipeline { .. }
        | Error::ElasticHybridLb
        | Error::NullPointer(_)
        | Error::InvalidArgument(_)
        | Error::Assertion(_)
        | Error::NotImplemented(_)
        | Error::Unavailable(_)
        | Error::Runtime(_)
        | Error::Timeout(_)
        | Error::PeerFailure(_)
        | Error::InvalidState(_)
        | Error::System(_)
        | Error::Internal(_) => None,
    }
}
