//! "Validate before launch": checks a whole vLLM-style configuration with vLLM's rules, in
//! vLLM's order, and reports the first error with vLLM's exact message plus every warning vLLM
//! would log (docs/design.md, sections 4 and 7).
//!
//! Order (as vLLM runs it): field parsing and bounds (pydantic), `EPLBConfig` validators,
//! `ParallelConfig.__post_init__` (elastic EP, communicator auto-selection),
//! `ParallelConfig._validate_parallel_config` (EPLB requirements, removed backends),
//! `VllmConfig` (microbatching), the LoRA and fault-tolerance checks, then what happens when the
//! engine builds its communicators (EPLB communicator factory, all2all manager).

use serde_json::{Map, Value};

use super::all2all::{self, Backend, Layout};
use super::eplb::{self, Choice, DeviceKind, SelectRequest};
use super::suggest;
use super::Hint;
use crate::error::{Error, Result};
use crate::log;

/// vLLM's `EPLBConfig`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EplbConfig {
    pub window_size: i64,
    pub step_interval: i64,
    pub num_redundant_experts: i64,
    pub log_balancedness: bool,
    pub log_balancedness_interval: i64,
    pub use_async: bool,
    pub policy: String,
    /// `None` = automatic selection.
    pub communicator: Option<String>,
    /// vLLM v0.33.0: batch async migrations so each rank talks to one peer at a time. Accepted
    /// and validated here; ordering transfers by it is the rearrangement's job, not selection's.
    pub enable_migration_batching: bool,
}

impl Default for EplbConfig {
    fn default() -> Self {
        EplbConfig {
            window_size: 1000,
            step_interval: 3000,
            num_redundant_experts: 0,
            log_balancedness: false,
            log_balancedness_interval: 1,
            use_async: true,
            policy: "default".into(),
            communicator: None,
            enable_migration_batching: false,
        }
    }
}

impl EplbConfig {
    /// vLLM's `migration_batching_enabled`: batching applies to async EPLB only.
    pub fn migration_batching_enabled(&self) -> bool {
        self.use_async && self.enable_migration_batching
    }
}

impl EplbConfig {
    /// vLLM's `EPLBConfig._validate_eplb_config` (after the field bounds), in order.
    pub fn validate(&self) -> Result<()> {
        if self.use_async && self.policy != "default" {
            return Err(Error::AsyncEplbPolicy);
        }
        if let Some(c) = self.communicator.as_deref() {
            if self.use_async && (c == "torch_nccl" || c == "pynccl") {
                return Err(Error::AsyncEplbCommunicator {
                    communicator: c.to_owned(),
                });
            }
        }
        if self.log_balancedness && self.log_balancedness_interval <= 0 {
            return Err(Error::LogBalancednessInterval);
        }
        Ok(())
    }
}

/// The parts of vLLM's `ParallelConfig` (and a few engine facts) that EP depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmConfig {
    pub all2all_backend: String,
    pub enable_expert_parallel: bool,
    pub enable_eplb: bool,
    pub eplb_config: EplbConfig,
    pub enable_elastic_ep: bool,
    pub enable_dbo: bool,
    pub enable_fault_tolerance: bool,
    pub enable_lora: bool,
    pub tensor_parallel_size: i64,
    pub data_parallel_size: i64,
    pub pipeline_parallel_size: i64,
    pub prefill_context_parallel_size: i64,
    pub data_parallel_external_lb: bool,
    pub data_parallel_hybrid_lb: bool,
    /// `cuda`, `rocm`, `cpu` or `xpu`.
    pub platform: String,
    /// Total (logical) experts of the model, when known.
    pub num_experts: Option<i64>,
    /// `None` = probe this process.
    pub nixl_available: Option<bool>,
    /// `None` = probe this process.
    pub nccl_available: Option<bool>,
}

impl Default for VllmConfig {
    fn default() -> Self {
        VllmConfig {
            all2all_backend: all2all::DEFAULT_BACKEND.name().into(),
            enable_expert_parallel: false,
            enable_eplb: false,
            eplb_config: EplbConfig::default(),
            enable_elastic_ep: false,
            enable_dbo: false,
            enable_fault_tolerance: false,
            enable_lora: false,
            tensor_parallel_size: 1,
            data_parallel_size: 1,
            pipeline_parallel_size: 1,
            prefill_context_parallel_size: 1,
            data_parallel_external_lb: false,
            data_parallel_hybrid_lb: false,
            platform: "cuda".into(),
            num_experts: None,
            nixl_available: None,
            nccl_available: None,
        }
    }
}

/// Top-level keys accepted in a configuration.
pub const CONFIG_KEYS: [&str; 18] = [
    "all2all_backend",
    "enable_expert_parallel",
    "enable_eplb",
    "eplb_config",
    "enable_elastic_ep",
    "enable_dbo",
    "enable_fault_tolerance",
    "enable_lora",
    "tensor_parallel_size",
    "data_parallel_size",
    "pipeline_parallel_size",
    "prefill_context_parallel_size",
    "data_parallel_external_lb",
    "data_parallel_hybrid_lb",
    "platform",
    "num_experts",
    "nixl_available",
    "nccl_available",
];

/// Keys accepted inside `eplb_config`.
pub const EPLB_CONFIG_KEYS: [&str; 9] = [
    "window_size",
    "step_interval",
    "num_redundant_experts",
    "log_balancedness",
    "log_balancedness_interval",
    "use_async",
    "policy",
    "communicator",
    "enable_migration_batching",
];

/// Platforms a configuration may name.
pub const PLATFORMS: [&str; 4] = ["cuda", "rocm", "cpu", "xpu"];

fn field_error(field: &str, message: impl Into<String>) -> Error {
    Error::ConfigField {
        field: field.to_owned(),
        message: message.into(),
    }
}

fn unknown_key(key: &str, prefix: &str, valid: &'static [&'static str]) -> Error {
    let nearest = suggest::closest(key, valid.iter().copied());
    let shown = match nearest.first() {
        Some(n) => format!("nearest valid key: '{prefix}{n}'"),
        None => format!("valid keys: {}", valid.join(", ")),
    };
    Error::UnknownConfigKey {
        key: format!("{prefix}{key}"),
        valid: shown,
        candidates: valid.to_vec(),
    }
}

fn get_bool(v: &Value, field: &str) -> Result<bool> {
    v.as_bool()
        .ok_or_else(|| field_error(field, "Input should be a valid boolean"))
}

fn get_int(v: &Value, field: &str) -> Result<i64> {
    v.as_i64()
        .ok_or_else(|| field_error(field, "Input should be a valid integer"))
}

fn get_str(v: &Value, field: &str) -> Result<String> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| field_error(field, "Input should be a valid string"))
}

/// pydantic's `Field(ge=1)`, as `ParallelConfig` declares its sizes.
fn at_least_one(v: i64, field: &str) -> Result<i64> {
    if v >= 1 {
        Ok(v)
    } else {
        Err(field_error(
            field,
            "Input should be greater than or equal to 1",
        ))
    }
}

fn greater_than_zero(v: i64, field: &str) -> Result<i64> {
    if v > 0 {
        Ok(v)
    } else {
        Err(field_error(field, "Input should be greater than 0"))
    }
}

fn parse_eplb_config(map: &Map<String, Value>) -> Result<EplbConfig> {
    let mut c = EplbConfig::default();
    for (key, v) in map {
        let field = format!("eplb_config.{key}");
        let f = field.as_str();
        match key.as_str() {
            "window_size" => c.window_size = greater_than_zero(get_int(v, f)?, f)?,
            "step_interval" => c.step_interval = greater_than_zero(get_int(v, f)?, f)?,
            "num_redundant_experts" => {
                let n = get_int(v, f)?;
                if n < 0 {
                    return Err(field_error(f, "Input should be greater than or equal to 0"));
                }
                c.num_redundant_experts = n;
            }
            "log_balancedness" => c.log_balancedness = get_bool(v, f)?,
            "log_balancedness_interval" => {
                c.log_balancedness_interval = greater_than_zero(get_int(v, f)?, f)?
            }
            "use_async" => c.use_async = get_bool(v, f)?,
            "enable_migration_batching" => c.enable_migration_batching = get_bool(v, f)?,
            "policy" => c.policy = get_str(v, f)?,
            "communicator" => {
                c.communicator = if v.is_null() {
                    None
                } else {
                    let name = get_str(v, f)?;
                    if !eplb::is_vllm_name(&name) {
                        return Err(Error::UnknownEplbCommunicator { backend: name });
                    }
                    Some(name)
                }
            }
            other => return Err(unknown_key(other, "eplb_config.", &EPLB_CONFIG_KEYS)),
        }
    }
    Ok(c)
}

/// Parses vLLM's EPLBConfig given as a JSON object (field types, bounds and validators).
pub fn parse_eplb_config_json(json: &str) -> Result<EplbConfig> {
    let value: Value = serde_json::from_str(json)
        .map_err(|e| Error::InvalidArgument(format!("eplb_config is not valid JSON: {e}")))?;
    let map = value
        .as_object()
        .ok_or_else(|| field_error("eplb_config", "Input should be a valid dictionary"))?;
    let c = parse_eplb_config(map)?;
    c.validate()?;
    if c.policy != "default" {
        return Err(field_error(
            "eplb_config.policy",
            "Input should be 'default'",
        ));
    }
    Ok(c)
}

/// Parses a vLLM-style JSON configuration (field types and bounds only; rules come in [`check`]).
pub fn parse(json: &str) -> Result<VllmConfig> {
    let value: Value = serde_json::from_str(json)
        .map_err(|e| Error::InvalidArgument(format!("configuration is not valid JSON: {e}")))?;
    let map = value.as_object().ok_or_else(|| {
        Error::InvalidArgument(
            "configuration must be a JSON object like {\"all2all_backend\": \"deepep_low_latency\"}"
                .into(),
        )
    })?;
    let mut c = VllmConfig::default();
    for (key, v) in map {
        let f = key.as_str();
        match f {
            "all2all_backend" => {
                let name = get_str(v, f)?;
                all2all::resolve_config(&name)?;
                c.all2all_backend = name;
            }
            "enable_expert_parallel" => c.enable_expert_parallel = get_bool(v, f)?,
            "enable_eplb" => c.enable_eplb = get_bool(v, f)?,
            "eplb_config" => {
                let m = v
                    .as_object()
                    .ok_or_else(|| field_error(f, "Input should be a valid dictionary"))?;
                c.eplb_config = parse_eplb_config(m)?;
            }
            "enable_elastic_ep" => c.enable_elastic_ep = get_bool(v, f)?,
            "enable_dbo" => c.enable_dbo = get_bool(v, f)?,
            "enable_fault_tolerance" => c.enable_fault_tolerance = get_bool(v, f)?,
            "enable_lora" => c.enable_lora = get_bool(v, f)?,
            "tensor_parallel_size" => c.tensor_parallel_size = at_least_one(get_int(v, f)?, f)?,
            "data_parallel_size" => c.data_parallel_size = at_least_one(get_int(v, f)?, f)?,
            "pipeline_parallel_size" => c.pipeline_parallel_size = at_least_one(get_int(v, f)?, f)?,
            "prefill_context_parallel_size" => {
                c.prefill_context_parallel_size = at_least_one(get_int(v, f)?, f)?
            }
            "data_parallel_external_lb" => c.data_parallel_external_lb = get_bool(v, f)?,
            "data_parallel_hybrid_lb" => c.data_parallel_hybrid_lb = get_bool(v, f)?,
            "platform" => {
                let p = get_str(v, f)?;
                if !PLATFORMS.contains(&p.as_str()) {
                    return Err(field_error(
                        f,
                        "Input should be 'cuda', 'rocm', 'cpu' or 'xpu'",
                    ));
                }
                c.platform = p;
            }
            "num_experts" => c.num_experts = Some(greater_than_zero(get_int(v, f)?, f)?),
            "nixl_available" => c.nixl_available = Some(get_bool(v, f)?),
            "nccl_available" => c.nccl_available = Some(get_bool(v, f)?),
            other => return Err(unknown_key(other, "", &CONFIG_KEYS)),
        }
    }
    Ok(c)
}

/// What a valid configuration resolves to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolution {
    /// The all2all backend the name resolves to; `None` for `passthrough` (no exchange).
    pub backend: Option<Backend>,
    /// The name after vLLM's rewrites (removed names become `allgather_reducescatter`).
    pub effective_name: &'static str,
    /// The manager class the engine builds on this platform.
    pub manager_class: &'static str,
    /// The layout contract; `None` for `passthrough`.
    pub layout: Option<Layout>,
    /// The EPLB communicator (when EPLB is enabled).
    pub eplb_communicator: Option<Choice>,
    pub eplb_communicator_auto: bool,
}

/// The result of [`check`]: the first error (or the resolution) plus the warnings and infos vLLM
/// logs up to that point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckOutcome {
    pub result: Result<Resolution>,
    pub warnings: Vec<String>,
    pub infos: Vec<String>,
}

/// Runs every rule on a parsed configuration. `nccl_probe` / `nixl_probe` answer availability
/// when the configuration does not say.
pub fn check(c: &VllmConfig, nccl_probe: bool, nixl_probe: bool) -> CheckOutcome {
    let mut warnings = Vec::new();
    let mut infos = Vec::new();
    let result = check_inner(c, nccl_probe, nixl_probe, &mut warnings, &mut infos);
    CheckOutcome {
        result,
        warnings,
        infos,
    }
}

fn check_inner(
    c: &VllmConfig,
    nccl_probe: bool,
    nixl_probe: bool,
    warnings: &mut Vec<String>,
    infos: &mut Vec<String>,
) -> Result<Resolution> {
    let nixl = c.nixl_available.unwrap_or(nixl_probe);
    let nccl = c.nccl_available.unwrap_or(nccl_probe);
    let resolved = all2all::resolve_config(&c.all2all_backend)?;
    let backend = resolved.as_ref().map(|r| r.backend);
    check_parallel(c, nixl)?;
    let effective_name = effective_name(c, resolved.as_ref(), warnings);
    check_features(c, backend, effective_name)?;

    // Engine start: EPLB communicator factory.
    let (eplb_communicator, eplb_communicator_auto) = if c.enable_eplb {
        let device = DeviceKind::from_platform(&c.platform).unwrap_or(DeviceKind::Cuda);
        let (sel, forced) = eplb::choose_outcome(&SelectRequest {
            requested: c.eplb_config.communicator.as_deref(),
            elastic: c.enable_elastic_ep,
            device,
            weight_dtypes: &[],
            nccl_available: nccl,
            nixl_available: nixl,
        });
        warnings.extend(forced);
        let sel = sel?;
        infos.push(eplb::choice_initialized_info(sel.communicator));
        (Some(sel.communicator), sel.auto_selected)
    } else {
        (None, false)
    };

    let manager_class = all2all_manager(c, resolved.as_ref(), effective_name, warnings, infos);
    Ok(Resolution {
        backend,
        effective_name,
        manager_class,
        layout: backend.map(Backend::layout),
        eplb_communicator,
        eplb_communicator_auto,
    })
}

/// `EPLBConfig`'s validators and `ParallelConfig`'s checks (elastic EP, EPLB), in vLLM's order.
fn check_parallel(c: &VllmConfig, nixl: bool) -> Result<()> {
    let e = &c.eplb_config;
    let (tp, dp, pp, pcp) = (
        c.tensor_parallel_size,
        c.data_parallel_size,
        c.pipeline_parallel_size,
        c.prefill_context_parallel_size,
    );

    // EPLBConfig validators.
    e.validate()?;
    if e.policy != "default" {
        return Err(field_error(
            "eplb_config.policy",
            "Input should be 'default'",
        ));
    }

    // ParallelConfig.__post_init__: elastic EP.
    if c.enable_elastic_ep {
        if !c.enable_eplb {
            return Err(Error::ElasticNeedsEplb);
        }
        if pp > 1 {
            return Err(Error::ElasticPipeline { pp });
        }
        // vLLM v0.33.0 allows data_parallel_external_lb with elastic EP.
        if c.data_parallel_hybrid_lb {
            return Err(Error::ElasticHybridLb);
        }
        if e.use_async && !nixl {
            return Err(Error::ElasticAsyncNeedsNixl);
        }
    }

    // ParallelConfig._validate_parallel_config.
    if dp <= 1 && c.data_parallel_external_lb {
        return Err(Error::ExternalLbNeedsDp);
    }
    if c.enable_eplb {
        if !matches!(c.platform.as_str(), "cuda" | "rocm" | "xpu") {
            return Err(Error::EplbPlatform);
        }
        if !c.enable_expert_parallel {
            return Err(Error::EplbNeedsExpertParallel);
        }
        // Python integers do not overflow: saturate.
        if tp.saturating_mul(pcp).saturating_mul(dp) <= 1 {
            return Err(Error::EplbNeedsParallelism { tp, pcp, dp });
        }
    } else if e.num_redundant_experts != 0 {
        return Err(Error::RedundantWithoutEplb {
            n: e.num_redundant_experts,
        });
    }
    Ok(())
}

/// The name vLLM's messages use: a removed name's fallback (logging W2), else the name given.
fn effective_name(
    c: &VllmConfig,
    resolved: Option<&all2all::Resolved>,
    warnings: &mut Vec<String>,
) -> &'static str {
    let Some(resolved) = resolved else {
        return all2all::PASSTHROUGH;
    };
    match resolved.kind {
        all2all::NameKind::Removed => {
            warnings.extend(resolved.warning.clone());
            Backend::AllgatherReducescatter.name()
        }
        all2all::NameKind::Canonical | all2all::NameKind::Alias => {
            all2all::lookup(&c.all2all_backend)
                .map(|n| n.name)
                .unwrap_or(resolved.backend.name())
        }
    }
}

/// The feature gates: microbatching (DBO), MoE LoRA with EP, fault tolerance.
/// `backend` is `None` for `passthrough`, which is in none of vLLM's backend sets.
fn check_features(c: &VllmConfig, backend: Option<Backend>, name: &str) -> Result<()> {
    // VllmConfig: MoonEP's own checks (the dtype and placement ones have no input here).
    if c.enable_eplb && backend == Some(Backend::Moonep) {
        return Err(Error::MoonepEplb);
    }
    // VllmConfig: microbatching (DBO).
    if c.enable_dbo {
        let supported = all2all::microbatching_backends(&c.platform);
        if !backend.is_some_and(|b| supported.contains(&b.name())) {
            return Err(Error::MicrobatchingBackend {
                backend: name.to_owned(),
                supported,
            });
        }
    }
    // Fused MoE LoRA with EP.
    if c.enable_lora && c.enable_expert_parallel && backend != Some(Backend::AllgatherReducescatter)
    {
        return Err(Error::LoraEpBackend {
            backend: name.to_owned(),
        });
    }
    // Fault tolerance (worker sentinel).
    if c.enable_fault_tolerance && !backend.is_some_and(Backend::supports_fault_tolerance) {
        return Err(Error::FaultToleranceBackend {
            backend: name.to_owned(),
        });
    }
    Ok(())
}

/// Engine start: the all2all manager the platform builds (its class), with the platform
/// fallback's or the alias's warning and the `Using ... manager` info.
fn all2all_manager(
    c: &VllmConfig,
    resolved: Option<&all2all::Resolved>,
    effective_name: &str,
    warnings: &mut Vec<String>,
    infos: &mut Vec<String>,
) -> &'static str {
    let backend = resolved.map(|r| r.backend);
    let manager_class =
        match all2all::platform_fallback_warning(effective_name, backend, &c.platform) {
            Some(w) => {
                warnings.push(w);
                Backend::AllgatherReducescatter.manager_class()
            }
            None => match resolved {
                Some(r) => {
                    if r.kind == all2all::NameKind::Alias {
                        warnings.extend(r.warning.clone());
                    }
                    r.backend.manager_class()
                }
                None => all2all::PASSTHROUGH_MANAGER_CLASS,
            },
        };
    infos.push(match c.platform.as_str() {
        "cpu" => "Using allgather_reducescatter all2all manager.".to_owned(),
        "xpu" => "Using AgRs manager on XPU device.".to_owned(),
        _ => format!("Using {manager_class} all2all manager."),
    });
    manager_class
}

/// Parses and checks a JSON configuration; logs the warnings (and infos) vLLM would log.
pub fn check_json(json: &str, nccl_probe: bool, nixl_probe: bool) -> CheckOutcome {
    let outcome = match parse(json) {
        Ok(c) => check(&c, nccl_probe, nixl_probe),
        Err(e) => CheckOutcome {
            result: Err(e),
            warnings: Vec::new(),
            infos: Vec::new(),
        },
    };
    for w in &outcome.warnings {
        log::warn(w);
    }
    for i in &outcome.infos {
        log::info(i);
    }
    outcome
}

impl CheckOutcome {
    /// The outcome as a JSON document (what `epcomm check --json` prints).
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        match &self.result {
            Ok(r) => {
                m.insert("ok".into(), true.into());
                m.insert(
                    "all2all_backend".into(),
                    r.backend.map_or(all2all::PASSTHROUGH, Backend::name).into(),
                );
                m.insert("effective_name".into(), r.effective_name.into());
                m.insert("manager_class".into(), r.manager_class.into());
                m.insert("layout".into(), r.layout.map(Layout::name).into());
                m.insert(
                    "eplb_communicator".into(),
                    r.eplb_communicator.map(|c| c.name()).into(),
                );
                m.insert(
                    "eplb_communicator_class".into(),
                    r.eplb_communicator.map(|c| c.class_name()).into(),
                );
                m.insert(
                    "eplb_communicator_auto".into(),
                    r.eplb_communicator_auto.into(),
                );
            }
            Err(e) => {
                m.insert("ok".into(), false.into());
                m.insert("status".into(), (e.status() as i32).into());
                m.insert("exception".into(), e.exception().into());
                m.insert("message".into(), e.to_string().into());
                m.insert("hint".into(), e.hint().into());
            }
        }
        m.insert("warnings".into(), self.warnings.clone().into());
        m.insert("infos".into(), self.infos.clone().into());
        Value::Object(m)
    }
}
