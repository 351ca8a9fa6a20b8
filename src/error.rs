//! The one error type of epcomm.
//!
//! `Display` is the message a caller sees: where vLLM raises an error for the same condition the
//! text is vLLM's, byte for byte (typos included). Each error maps to a [`Status`] (the C status
//! code) and to the Python exception class vLLM raises ([`Error::exception`]). Suggestions live with
//! the selection tables (`select::hint`) and are never part of the message.

use thiserror::Error;

/// Status codes returned by every fallible C function (`int32_t`, 0 = success).
///
/// Declaration order is the C code (`EPCOMM_OK`, `EPCOMM_ERROR_*`, asserted in ffi/mod.rs's
/// tests): only append.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    Ok,
    NullPointer,
    InvalidArgument,
    Assertion,
    NotImplemented,
    Runtime,
    Unavailable,
    Timeout,
    PeerFailure,
    InvalidState,
    System,
    Internal,
}

impl Status {
    /// Every status, in numeric order.
    pub const ALL: [Status; 12] = [
        Status::Ok,
        Status::NullPointer,
        Status::InvalidArgument,
        Status::Assertion,
        Status::NotImplemented,
        Status::Runtime,
        Status::Unavailable,
        Status::Timeout,
        Status::PeerFailure,
        Status::InvalidState,
        Status::System,
        Status::Internal,
    ];

    /// The status for a raw code, if it is one.
    pub fn from_code(code: i32) -> Option<Status> {
        Status::ALL.iter().copied().find(|s| *s as i32 == code)
    }

    /// Short static description.
    pub fn description(self) -> &'static str {
        match self {
            Status::Ok => "success",
            Status::NullPointer => "a required pointer argument was NULL",
            Status::InvalidArgument => "invalid argument",
            Status::Assertion => "a precondition (assertion) failed",
            Status::NotImplemented => "not implemented",
            Status::Runtime => "runtime error",
            Status::Unavailable => "a required library or device is unavailable",
            Status::Timeout => "timed out",
            Status::PeerFailure => "a peer rank failed or left",
            Status::InvalidState => "operation not valid in the current state",
            Status::System => "operating-system error",
            Status::Internal => "internal error (a bug in epcomm)",
        }
    }

    /// The Python exception class vLLM raises for errors of this status; `None` for `Ok`.
    pub fn exception(self) -> Option<&'static str> {
        match self {
            Status::Ok => None,
            Status::NullPointer | Status::InvalidArgument => Some("ValueError"),
            Status::Assertion => Some("AssertionError"),
            Status::NotImplemented => Some("NotImplementedError"),
            Status::Timeout => Some("TimeoutError"),
            Status::Runtime
            | Status::Unavailable
            | Status::PeerFailure
            | Status::InvalidState
            | Status::System
            | Status::Internal => Some("RuntimeError"),
        }
    }
}

/// Every error epcomm reports. Variants named after a vLLM condition carry vLLM's exact text.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Error {
    // ---- all2all selection -------------------------------------------------------------------
    #[error("Unknown all2all backend: {name}")]
    UnknownAll2AllBackend { name: String },
    /// vLLM v0.33.0's VllmConfig assertion; the supported set depends on the platform (ROCm
    /// also runs `allgather_reducescatter` under DBO).
    #[error("Microbatching currently only supports the {} all2all backends on this platform. {backend} is not supported. To fix use one of {} and install the matching kernels.", supported.join(", "), supported.iter().map(|b| format!("--all2all-backend={b}")).collect::<Vec<_>>().join(", "))]
    MicrobatchingBackend {
        backend: String,
        supported: &'static [&'static str],
    },
    #[error("Fault tolerance requires an FT-capable all2all backend (one of ['deepep_low_latency', 'nixl_ep']), but got '{backend}'.")]
    FaultToleranceBackend { backend: String },
    #[error("Fused MoE LoRA with EP currently only supports all2all_backend='allgather_reducescatter', got '{backend}'.")]
    LoraEpBackend { backend: String },
    /// vLLM v0.34.0's `FusedMoEWithLoRA._ep_check`, before the backend assertion.
    #[error("Fused MoE LoRA with EP requires linear expert placement: adapter loading assumes a contiguous range of experts on each rank, got '{placement}'. Set expert_placement_strategy='linear' to use MoE LoRA with expert parallelism.")]
    LoraEpPlacement { placement: String },
    /// vLLM v0.34.0's `WorkerSentinel`, after the backend check.
    #[error("Fault tolerance does not support MoE draft models yet.")]
    FaultToleranceMoeDraft,
    /// vLLM v0.34.0's `WorkerSentinel`, after the MoE draft check.
    #[error("Fault tolerance does not support PCP yet.")]
    FaultTolerancePcp,
    #[error("FlashInfer one-sided communication does not support heterogeneous {field} (got {got}, was built with {built})")]
    OneSidedHeterogeneous {
        field: &'static str,
        got: i64,
        built: i64,
    },
    #[error("MoonEP not available. Install it from https://github.com/MoonshotAI/MoonEP.")]
    MoonEpUnavailable,
    /// vLLM's `PassThroughAll2AllManager.get_handle`: `passthrough` has no exchange.
    #[error("passthrough has no all2all handle: dispatch and combine run inside the MoE backend.")]
    PassthroughNoHandle,

    // ---- EPLB communicator factory ------------------------------------------------------------
    #[error("Unknown EPLB communicator backend: {backend}")]
    UnknownEplbCommunicator { backend: String },
    #[error("Elastic EP requires 'torch_nccl', 'pynccl', or 'nixl' EPLB communicator (got '{backend}').")]
    ElasticEpCommunicator { backend: String },
    #[error("EPLB communicator 'pynccl' supports only cuda-like devices (got {device_type}).")]
    PyncclDeviceType { device_type: String },
    #[error("EPLB communicator 'pynccl' requested but expert weights contain unsupported dtypes: ({dtypes}).")]
    PyncclDtypes { dtypes: String },
    #[error("EPLB communicator 'pynccl' requested but unavailable.")]
    PyncclUnavailable,
    #[error("Failed to initialize PyNcclEplbCommunicator ({cause}).")]
    PyncclInit { cause: String },
    /// vLLM v0.34.0's `SymmMemEplbCommunicator` off CUDA.
    #[error("symm_mem EPLB requires CUDA")]
    SymmMemNeedsCuda,
    #[error("EPLB communicator 'nixl' requested but NIXL is unavailable.")]
    NixlUnavailable,
    #[error("EPLB communicator 'nixl' supports only cuda-like devices (got {device_type}).")]
    NixlDeviceType { device_type: String },
    #[error("Failed to initialize NixlEplbCommunicator ({cause}).")]
    NixlInit { cause: String },

    // ---- EPLB / parallel config validation ----------------------------------------------------
    #[error("Async EPLB is only supported with the default policy.")]
    AsyncEplbPolicy,
    #[error("{communicator} communicator is incompatible with async EPLB due to NCCL multi-stream conflicts. Use 'torch_gloo' or 'nixl' instead, or leave communicator unset for automatic selection.")]
    AsyncEplbCommunicator { communicator: String },
    #[error("log_balancedness_interval must be greater than 0.")]
    LogBalancednessInterval,
    #[error(
        "Expert parallelism load balancing is only supported on CUDA devices or ROCm devices or XPU devices now."
    )]
    EplbPlatform,
    #[error("enable_expert_parallel must be True to use EPLB.")]
    EplbNeedsExpertParallel,
    #[error("EPLB requires tensor, prefill-context, or data parallelism, but got TP={tp}, PCP={pcp}, DP={dp}.")]
    EplbNeedsParallelism { tp: i64, pcp: i64, dp: i64 },
    #[error("num_redundant_experts is set to {n} but EPLB is not enabled. Either enable EPLB or unset num_redundant_experts.")]
    RedundantWithoutEplb { n: i64 },
    #[error("Elastic EP is only supported with enable_eplb=True.")]
    ElasticNeedsEplb,
    #[error(
        "Elastic EP is not supported with pipeline parallelism (pipeline_parallel_size={pp})."
    )]
    ElasticPipeline { pp: i64 },
    #[error("Elastic EP is not compatible with data_parallel_hybrid_lb. Elastic EP supports a single API server/core client path or data_parallel_external_lb, but not hybrid load balancing.")]
    ElasticHybridLb,
    #[error("Elastic EP with async EPLB requires the NIXL package. Either install NIXL or set --eplb-config.use_async=false.")]
    ElasticAsyncNeedsNixl,
    /// Field validation failed the way pydantic fails it for vLLM's config dataclasses:
    /// `message` is `str(ValidationError)` as pydantic 2.13 prints it (every field error, in
    /// declaration order); `field` is the first error's location; `hint` is epcomm's advice
    /// (the nearest valid key, the releases that accept a name), never part of the message.
    #[error("{message}")]
    ConfigField {
        field: String,
        message: String,
        hint: Option<String>,
    },
    /// `ParallelConfig._validate_parallel_config`.
    #[error("data_parallel_external_lb can only be set when data_parallel_size > 1")]
    ExternalLbNeedsDp,
    /// vLLM v0.34.0's `ParallelConfig._validate_parallel_config` (`numa_bind: bool | None`).
    #[error("NUMA binding lists cannot be combined with numa_bind=False.")]
    NumaBindListsWithoutBinding,
    /// `VllmConfig.__post_init__` for `moonep`.
    #[error("The moonep all2all backend does not support EPLB yet: EPLB rearranges expert parameters in a layout MoonEP's replicated [E+B] weights do not follow. Disable --enable-eplb or use a different --all2all-backend.")]
    MoonepEplb,

    // ---- epcomm's own errors ---------------------------------------------------------------
    /// A required pointer was NULL; names the argument.
    #[error("argument '{0}' must not be NULL")]
    NullPointer(&'static str),
    /// Bad input with our own wording (names what was wrong and what was expected).
    #[error("{0}")]
    InvalidArgument(String),
    /// A precondition vLLM expresses as an `assert`.
    #[error("{0}")]
    Assertion(String),
    /// A feature that is not done yet; says so.
    #[error("{0}")]
    NotImplemented(String),
    /// A library or device this call needs is not present.
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Runtime(String),
    #[error("{0}")]
    Timeout(String),
    #[error("{0}")]
    PeerFailure(String),
    #[error("{0}")]
    InvalidState(String),
    #[error("{0}")]
    System(String),
    /// A bug: e.g. a caught panic, with the panic text.
    #[error("{0}")]
    Internal(String),
}

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The C status code for this error.
    pub fn status(&self) -> Status {
        use Error::*;
        match self {
            UnknownAll2AllBackend { .. }
            | FaultToleranceBackend { .. }
            | FaultToleranceMoeDraft
            | FaultTolerancePcp
            | LoraEpPlacement { .. }
            | SymmMemNeedsCuda
            | UnknownEplbCommunicator { .. }
            | ElasticEpCommunicator { .. }
            | AsyncEplbPolicy
            | AsyncEplbCommunicator { .. }
            | LogBalancednessInterval
            | EplbPlatform
            | EplbNeedsExpertParallel
            | EplbNeedsParallelism { .. }
            | RedundantWithoutEplb { .. }
            | ElasticNeedsEplb
            | ElasticPipeline { .. }
            | ElasticAsyncNeedsNixl
            | ConfigField { .. }
            | ExternalLbNeedsDp
            | NumaBindListsWithoutBinding
            | MoonepEplb
            | InvalidArgument(_) => Status::InvalidArgument,
            MicrobatchingBackend { .. }
            | LoraEpBackend { .. }
            | OneSidedHeterogeneous { .. }
            | Assertion(_) => Status::Assertion,
            PyncclDeviceType { .. }
            | PyncclDtypes { .. }
            | NixlDeviceType { .. }
            | MoonEpUnavailable
            | PassthroughNoHandle
            | Runtime(_) => Status::Runtime,
            PyncclUnavailable | NixlUnavailable | Unavailable(_) => Status::Unavailable,
            PyncclInit { .. } | NixlInit { .. } => Status::Runtime,
            ElasticHybridLb | NotImplemented(_) => Status::NotImplemented,
            NullPointer(_) => Status::NullPointer,
            Timeout(_) => Status::Timeout,
            PeerFailure(_) => Status::PeerFailure,
            InvalidState(_) => Status::InvalidState,
            System(_) => Status::System,
            Internal(_) => Status::Internal,
        }
    }

    /// The Python exception class vLLM raises for this error.
    pub fn exception(&self) -> &'static str {
        self.status().exception().unwrap_or("RuntimeError")
    }
}
