//! All2all backend names as vLLM accepts them (`ParallelConfig.all2all_backend`), resolved with
//! vLLM's rules and warnings (the name table: docs/design.md, section 2).

use crate::error::{Error, Result};
use crate::log;

/// A canonical all2all backend (what a name resolves to). Declaration order is the C code
/// (`EPCOMM_ALL2ALL_*`, asserted in ffi/mod.rs's tests): only append.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    AllgatherReducescatter,
    DeepepHighThroughput,
    DeepepLowLatency,
    DeepepV2,
    MoriHighThroughput,
    MoriLowLatency,
    NixlEp,
    FlashinferNvlinkTwoSided,
    FlashinferNvlinkOneSided,
    Moonep,
    /// vLLM 0.34.0's `mori` with MoRI EPv1 (`MoriAll2AllManager`, which picks the inter-node
    /// kernel from the token budget); also the `mori` of vLLM 0.15.0 to 0.22.1. MoRI EPv2
    /// (`mori_ep_v2`) is not implemented ([`MORI_EPV2_MANAGER_CLASS`]).
    Mori,
}

/// Dispatch/combine buffer contract a backend name stands for (docs/design.md, section 3).
/// Declaration order is the C code (`EPCOMM_LAYOUT_*`, asserted in ffi/mod.rs's tests): only
/// append.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// all_gatherv of every rank's tokens; reduce_scatterv back (AgRs).
    Replicated,
    /// Each token once per rank holding one of its experts (DeepEP HT, MoRI EPv1).
    TokenMajor,
    /// Fixed-capacity per-local-expert buckets (DeepEP LL, NIXL EP).
    ExpertMajor,
    /// One row per (token, local expert), grouped by expert, exact size (DeepEP v2 prefill).
    ExpertPacked,
    /// Per-source-rank regions of fixed capacity (FlashInfer NVLink one/two-sided).
    RankMajor,
    /// MoonEP's balanced expert slots (not implemented yet).
    MoonepSlots,
}

/// How a name relates to its backend. Declaration order is the C code (`EPCOMM_NAME_*`,
/// asserted in ffi/mod.rs's tests): only append.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NameKind {
    /// The backend's own name.
    Canonical,
    /// A deprecated alias: resolves with a warning (W1).
    Alias,
    /// A removed backend: falls back to `allgather_reducescatter` with a warning (W2).
    Removed,
}

impl NameKind {
    pub const ALL: [NameKind; 3] = [NameKind::Canonical, NameKind::Alias, NameKind::Removed];

    pub fn name(self) -> &'static str {
        match self {
            NameKind::Canonical => "canonical",
            NameKind::Alias => "alias",
            NameKind::Removed => "removed",
        }
    }
}

/// One accepted name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptedName {
    pub name: &'static str,
    pub backend: Backend,
    pub kind: NameKind,
}

const fn accepted(name: &'static str, backend: Backend, kind: NameKind) -> AcceptedName {
    AcceptedName {
        name,
        backend,
        kind,
    }
}

/// Every name vLLM's `All2AllBackend` literal accepts, in vLLM's order (v0.34.0).
pub const ACCEPTED_NAMES: [AcceptedName; 14] = [
    accepted("naive", Backend::AllgatherReducescatter, NameKind::Removed),
    accepted("pplx", Backend::AllgatherReducescatter, NameKind::Removed),
    accepted(
        "deepep_high_throughput",
        Backend::DeepepHighThroughput,
        NameKind::Canonical,
    ),
    accepted(
        "deepep_low_latency",
        Backend::DeepepLowLatency,
        NameKind::Canonical,
    ),
    accepted("deepep_v2", Backend::DeepepV2, NameKind::Canonical),
    // Deprecated in v0.34.0 for `mori`, but still run with their own kernel.
    accepted(
        "mori_high_throughput",
        Backend::MoriHighThroughput,
        NameKind::Alias,
    ),
    accepted("mori_low_latency", Backend::MoriLowLatency, NameKind::Alias),
    accepted("moonep", Backend::Moonep, NameKind::Canonical),
    accepted("mori", Backend::Mori, NameKind::Canonical),
    accepted("nixl_ep", Backend::NixlEp, NameKind::Canonical),
    accepted(
        "allgather_reducescatter",
        Backend::AllgatherReducescatter,
        NameKind::Canonical,
    ),
    accepted(
        "flashinfer_all2allv",
        Backend::FlashinferNvlinkTwoSided,
        NameKind::Alias,
    ),
    accepted(
        "flashinfer_nvlink_two_sided",
        Backend::FlashinferNvlinkTwoSided,
        NameKind::Canonical,
    ),
    accepted(
        "flashinfer_nvlink_one_sided",
        Backend::FlashinferNvlinkOneSided,
        NameKind::Canonical,
    ),
];

/// vLLM's `passthrough` name (`PassThroughAll2AllManager`, last in vLLM's literal): the MoE
/// backend dispatches and combines itself. epcomm builds no exchange for it, so it has no
/// [`Backend`] value, no [`Layout`] and no C ABI code; it is not in [`ACCEPTED_NAMES`] (whose
/// entries each resolve to an exchange). The configuration check accepts it.
pub const PASSTHROUGH: &str = "passthrough";

/// The class vLLM builds for [`PASSTHROUGH`].
pub const PASSTHROUGH_MANAGER_CLASS: &str = "PassThroughAll2AllManager";

/// Every name vLLM's `All2AllBackend` literal accepts, in vLLM's order: [`ACCEPTED_NAMES`],
/// then [`PASSTHROUGH`].
pub fn vllm_names() -> impl Iterator<Item = &'static str> + Clone {
    ACCEPTED_NAMES
        .iter()
        .map(|n| n.name)
        .chain(std::iter::once(PASSTHROUGH))
}

/// vLLM's default (`ParallelConfig.all2all_backend`).
pub const DEFAULT_BACKEND: Backend = Backend::AllgatherReducescatter;

impl Backend {
    pub const ALL: [Backend; 11] = [
        Backend::AllgatherReducescatter,
        Backend::DeepepHighThroughput,
        Backend::DeepepLowLatency,
        Backend::DeepepV2,
        Backend::MoriHighThroughput,
        Backend::MoriLowLatency,
        Backend::NixlEp,
        Backend::FlashinferNvlinkTwoSided,
        Backend::FlashinferNvlinkOneSided,
        Backend::Moonep,
        Backend::Mori,
    ];

    pub fn from_code(code: i32) -> Option<Backend> {
        Backend::ALL.iter().copied().find(|b| *b as i32 == code)
    }

    /// The canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Backend::AllgatherReducescatter => "allgather_reducescatter",
            Backend::DeepepHighThroughput => "deepep_high_throughput",
            Backend::DeepepLowLatency => "deepep_low_latency",
            Backend::DeepepV2 => "deepep_v2",
            Backend::MoriHighThroughput => "mori_high_throughput",
            Backend::MoriLowLatency => "mori_low_latency",
            Backend::NixlEp => "nixl_ep",
            Backend::FlashinferNvlinkTwoSided => "flashinfer_nvlink_two_sided",
            Backend::FlashinferNvlinkOneSided => "flashinfer_nvlink_one_sided",
            Backend::Moonep => "moonep",
            Backend::Mori => "mori",
        }
    }

    /// The layout contract of this backend.
    pub fn layout(self) -> Layout {
        match self {
            Backend::AllgatherReducescatter => Layout::Replicated,
            Backend::DeepepHighThroughput
            | Backend::MoriHighThroughput
            | Backend::MoriLowLatency
            | Backend::Mori => Layout::TokenMajor,
            Backend::DeepepLowLatency | Backend::NixlEp => Layout::ExpertMajor,
            Backend::DeepepV2 => Layout::ExpertPacked,
            Backend::FlashinferNvlinkTwoSided | Backend::FlashinferNvlinkOneSided => {
                Layout::RankMajor
            }
            Backend::Moonep => Layout::MoonepSlots,
        }
    }

    /// The vLLM manager class this backend builds (used in `Using {class} all2all manager.`).
    pub fn manager_class(self) -> &'static str {
        match self {
            Backend::AllgatherReducescatter => "AgRsAll2AllManager",
            Backend::DeepepHighThroughput => "DeepEPHTAll2AllManager",
            Backend::DeepepLowLatency => "DeepEPLLAll2AllManager",
            Backend::DeepepV2 => "DeepEPV2All2AllManager",
            Backend::MoriHighThroughput | Backend::MoriLowLatency | Backend::Mori => {
                "MoriAll2AllManager"
            }
            Backend::NixlEp => "NixlEPAll2AllManager",
            Backend::FlashinferNvlinkTwoSided => "FlashInferNVLinkTwoSidedManager",
            Backend::FlashinferNvlinkOneSided => "FlashInferNVLinkOneSidedManager",
            Backend::Moonep => "MoonEPAll2AllManager",
        }
    }

    /// vLLM's `FT_BACKEND_SET`.
    pub fn supports_fault_tolerance(self) -> bool {
        matches!(self, Backend::DeepepLowLatency | Backend::NixlEp)
    }
}

impl Layout {
    pub const ALL: [Layout; 6] = [
        Layout::Replicated,
        Layout::TokenMajor,
        Layout::ExpertMajor,
        Layout::ExpertPacked,
        Layout::RankMajor,
        Layout::MoonepSlots,
    ];

    pub fn from_code(code: i32) -> Option<Layout> {
        Layout::ALL.iter().copied().find(|l| *l as i32 == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            Layout::Replicated => "REPLICATED",
            Layout::TokenMajor => "TOKEN_MAJOR",
            Layout::ExpertMajor => "EXPERT_MAJOR",
            Layout::ExpertPacked => "EXPERT_PACKED",
            Layout::RankMajor => "RANK_MAJOR",
            Layout::MoonepSlots => "MOONEP_SLOTS",
        }
    }
}

/// The W1 warning for the deprecated `flashinfer_all2allv` alias (vLLM's text, sic).
pub const W1_FLASHINFER_ALL2ALLV: &str = "'flashinfer_all2allv' is deprecated and has been renamed to'flashinfer_nvlink_two_sided'. It will be removed in a futurerelease.";

/// vLLM v0.34.0's warning for the deprecated MoRI names (`'%s'` is the name).
pub fn mori_deprecated_warning(name: &str) -> String {
    format!(
        "'{name}' is deprecated and will be removed in a future release. Use 'mori', which picks the MoRI kernels automatically."
    )
}

/// The class vLLM v0.34.0 builds for `mori` when `mori_ep_v2` is true (MoRI EPv2): epcomm has
/// no exchange for it.
pub const MORI_EPV2_MANAGER_CLASS: &str = "MoriEPv2All2AllManager";

/// The warning vLLM logs for the deprecated alias `name` (once per process).
fn alias_warning(name: &str) -> String {
    if name == "flashinfer_all2allv" {
        W1_FLASHINFER_ALL2ALLV.to_owned()
    } else {
        mori_deprecated_warning(name)
    }
}

/// The W2 warning for a removed backend name.
fn removed_backend_warning(name: &str) -> String {
    format!(
        "The '{name}' all2all backend has been removed. Falling back to 'allgather_reducescatter'."
    )
}

/// The I1 info line logged when a manager is created.
pub fn using_manager_info(backend: Backend) -> String {
    format!("Using {} all2all manager.", backend.manager_class())
}

/// Looks a name up exactly (case-sensitive, as vLLM).
pub fn lookup(name: &str) -> Option<&'static AcceptedName> {
    ACCEPTED_NAMES.iter().find(|n| n.name == name)
}

/// The outcome of resolving a name: the backend and the warning vLLM would log, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub backend: Backend,
    pub kind: NameKind,
    pub warning: Option<String>,
}

/// Resolves a name to its exchange backend without logging. [`PASSTHROUGH`] has none: it gives
/// vLLM's `get_handle` RuntimeError ([`Error::PassthroughNoHandle`]); use [`resolve_config`]
/// where vLLM accepts it.
pub fn resolve_quiet(name: &str) -> Result<Resolved> {
    if name == PASSTHROUGH {
        return Err(Error::PassthroughNoHandle);
    }
    let entry = lookup(name).ok_or_else(|| Error::UnknownAll2AllBackend {
        name: name.to_owned(),
    })?;
    let warning = match entry.kind {
        NameKind::Canonical => None,
        NameKind::Alias => Some(alias_warning(name)),
        NameKind::Removed => Some(removed_backend_warning(name)),
    };
    Ok(Resolved {
        backend: entry.backend,
        kind: entry.kind,
        warning,
    })
}

/// Resolves a configured name as vLLM's config and communicator do: `None` for [`PASSTHROUGH`]
/// (accepted, no exchange), otherwise as [`resolve_quiet`].
pub fn resolve_config(name: &str) -> Result<Option<Resolved>> {
    if name == PASSTHROUGH {
        return Ok(None);
    }
    resolve_quiet(name).map(Some)
}

/// Resolves a name and logs vLLM's warning: W1 once per process (vLLM's `warning_once`), W2
/// every time (vLLM's `warning`).
pub fn resolve(name: &str) -> Result<Backend> {
    let r = resolve_quiet(name)?;
    if let Some(w) = &r.warning {
        match r.kind {
            NameKind::Alias => log::log_once(log::Level::Warn, w),
            // Only removed names warn besides the alias.
            NameKind::Canonical | NameKind::Removed => log::warn(w),
        }
    }
    Ok(r.backend)
}

/// What vLLM's CPU and XPU communicators log when asked for a backend they cannot build: they
/// warn and use the AgRs manager instead. `None` on CUDA/ROCm or for AgRs itself.
/// `name` is the configured name (as vLLM prints it); `backend` is `None` for [`PASSTHROUGH`].
pub fn platform_fallback_warning(
    name: &str,
    backend: Option<Backend>,
    platform: &str,
) -> Option<String> {
    if backend == Some(Backend::AllgatherReducescatter) {
        return None;
    }
    match platform {
        "cpu" => Some(format!(
            "`{name}` all2all manager is not supported on CPU. Falling back to `allgather_reducescatter` manager."
        )),
        "xpu" => Some(format!(
            "`{name}` all2all manager is not supported on XPU. Falling back to AgRs manager for XPU, which is the Default backend"
        )),
        _ => None,
    }
}

/// The backends vLLM v0.33.0 runs under microbatching (DBO) on `platform`, in vLLM's order:
/// ROCm also runs `allgather_reducescatter` (its all-gather / reduce-scatter on the comm stream).
pub fn microbatching_backends(platform: &str) -> &'static [&'static str] {
    const CUDA: &[&str] = &["deepep_low_latency", "deepep_high_throughput", "nixl_ep"];
    const ROCM: &[&str] = &[
        "deepep_low_latency",
        "deepep_high_throughput",
        "nixl_ep",
        "allgather_reducescatter",
    ];
    if platform == "rocm" {
        ROCM
    } else {
        CUDA
    }
}
