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

use super::all2all::{self, Backend, Layout, NameKind};
use super::eplb::{self, Communicator, DeviceKind, SelectRequest};
use super::pydantic::{self, Fail, Json, LineError};
use super::suggest;
use super::versions::{self, NameRule, Release};
use super::Hint;
use crate::error::{Error, Result};
use crate::log;

/// vLLM's `EPLBConfig`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EplbConfig {
    pub window_size: i64,
    pub step_interval: i64,
    /// `None` (vLLM v0.34.0's default): the minimum valid value, `(ep - E % ep) % ep`, once the
    /// model's expert count is known, when EPLB is on; 0 when it is off.
    pub num_redundant_experts: Option<i64>,
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
            num_redundant_experts: None,
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
    /// vLLM's `ParallelConfig.expert_placement_strategy` (`linear` or `round_robin`).
    pub expert_placement_strategy: String,
    /// vLLM v0.34.0's `ParallelConfig.mori_ep_v2`: whether `mori` runs MoRI EPv2 (`None`: vLLM
    /// decides at startup from `VLLM_MORI_EP_V2` and the deployment).
    pub mori_ep_v2: Option<bool>,
    /// vLLM v0.34.0's `numa_bind` (`None`: vLLM binds where the environment supports it).
    pub numa_bind: Option<bool>,
    /// `numa_bind_nodes` (validated: not empty, non-negative).
    pub numa_bind_nodes: Option<Vec<i64>>,
    /// `numa_bind_cpus` (validated: numactl CPU lists, ascending ranges).
    pub numa_bind_cpus: Option<Vec<String>>,
    /// Whether the speculative decoding draft model is an MoE model (epcomm's key; vLLM reads
    /// `speculative_config.draft_model_config.is_moe`).
    pub draft_model_is_moe: bool,
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
    /// The vLLM release whose names are checked (epcomm's `vllm_version` key).
    pub vllm_version: String,
    /// The release as described by the deployed vLLM's own source (epcomm's `vllm_release`
    /// key, [`versions::described`]); when set it is the release checked against, whatever
    /// the table holds.
    pub vllm_release: Option<&'static Release>,
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
            expert_placement_strategy: "linear".into(),
            mori_ep_v2: None,
            numa_bind: None,
            numa_bind_nodes: None,
            numa_bind_cpus: None,
            draft_model_is_moe: false,
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
            vllm_version: versions::DEFAULT_VERSION.into(),
            vllm_release: None,
        }
    }
}

/// The top-level keys `epcomm check` has a flag for: [`PARALLEL_FIELDS`] and [`EPCOMM_KEYS`]
/// but `vllm_version` and `vllm_release` (which have their own options, `--vllm-version` and
/// `--vllm-src`).
pub const CONFIG_KEYS: [&str; 22] = [
    "all2all_backend",
    "mori_ep_v2",
    "numa_bind",
    "expert_placement_strategy",
    "draft_model_is_moe",
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

/// vLLM's `ExpertPlacementStrategy` literal.
pub const EXPERT_PLACEMENT_STRATEGIES: [&str; 2] = ["linear", "round_robin"];

/// vLLM's `EPLBPolicyOption` literal.
pub const EPLB_POLICIES: [&str; 1] = ["default"];

/// The `ParallelConfig` fields epcomm models, in vLLM v0.34.0's declaration order
/// (vllm/config/parallel.py): pydantic reports field errors in this order, then unexpected
/// keywords in the order given.
pub const PARALLEL_FIELDS: [&str; 18] = [
    "pipeline_parallel_size",
    "tensor_parallel_size",
    "prefill_context_parallel_size",
    "data_parallel_size",
    "data_parallel_external_lb",
    "data_parallel_hybrid_lb",
    "enable_expert_parallel",
    "enable_eplb",
    "eplb_config",
    "expert_placement_strategy",
    "all2all_backend",
    "mori_ep_v2",
    "enable_elastic_ep",
    "enable_dbo",
    "numa_bind",
    "numa_bind_nodes",
    "numa_bind_cpus",
    "enable_fault_tolerance",
];

/// epcomm's own keys, none of them a `ParallelConfig` field: `vllm_version` (the release whose
/// names are checked), `vllm_release` (that release described as data, from the deployed
/// vLLM's source: python/epcomm/vllm_release.py's output), `platform`, `num_experts`, `nixl_available` and `nccl_available` (facts
/// vLLM finds at run time), and `enable_lora` (vLLM's `EngineArgs.enable_lora`, which makes a
/// `LoRAConfig`), `draft_model_is_moe` (whether the speculative config's draft model is an
/// MoE model). They are validated first, with pydantic's rules, as the dataclass
/// [`EPCOMM_OPTIONS_CLASS`] (the release decides the literals of the rest).
pub const EPCOMM_KEYS: [&str; 8] = [
    "vllm_version",
    "vllm_release",
    "platform",
    "num_experts",
    "nixl_available",
    "nccl_available",
    "enable_lora",
    "draft_model_is_moe",
];

/// The class name in the `ValidationError` text of [`EPCOMM_KEYS`].
pub const EPCOMM_OPTIONS_CLASS: &str = "EpcommOptions";

/// vLLM v0.34.0's other `ParallelConfig` fields: vLLM accepts them, epcomm does not check them,
/// so a configuration naming one is refused with epcomm's own text rather than a pydantic
/// `unexpected_keyword_argument` vLLM would not raise.
pub const UNMODELLED_PARALLEL_FIELDS: [&str; 48] = [
    "data_parallel_size_local",
    "data_parallel_rank",
    "data_parallel_rank_local",
    "data_parallel_master_ip",
    "data_parallel_rpc_port",
    "dp_sync_interval",
    "data_parallel_master_port",
    "data_parallel_backend",
    "is_moe_model",
    "enable_hc_sp",
    "enable_batch_sharded_sampling",
    "enable_ep_weight_filter",
    "max_parallel_loading_workers",
    "disable_custom_all_reduce",
    "enable_shm_tensor_arena",
    "elastic_ep_max_dp_size",
    "ubatch_size",
    "dbo_decode_token_threshold",
    "dbo_prefill_token_threshold",
    "disable_nccl_for_dp_synchronization",
    "ray_workers_use_nsight",
    "ray_runtime_env",
    "placement_group",
    "distributed_executor_backend",
    "worker_cls",
    "worker_extension_cls",
    "master_addr",
    "master_port",
    "node_rank",
    "nnodes",
    "_numa_bind_auto",
    "assigned_physical_gpu_ids",
    "distributed_timeout_seconds",
    "cpu_distributed_timeout_seconds",
    "world_size",
    "rank",
    "_data_parallel_master_port_list",
    "_coord_store_port",
    "decode_context_parallel_size",
    "dcp_kv_cache_interleave_size",
    "dcp_comm_backend",
    "dcp_q_replicate",
    "cp_kv_cache_interleave_size",
    "_allow_auto_resolve_cp_interleave_size",
    "data_parallel_index",
    "_api_process_count",
    "_api_process_rank",
    "fault_tolerance_config",
];

/// One dataclass's keyword arguments being validated: each field is taken in declaration order,
/// its error (if any) recorded; what is left are unexpected keywords.
struct Fields<'e> {
    items: Vec<(String, Json)>,
    prefix: &'static str,
    errors: &'e mut Vec<LineError>,
    hints: &'e mut Vec<String>,
}

impl Fields<'_> {
    fn take(&mut self, name: &str) -> Option<Json> {
        let i = self.items.iter().position(|(k, _)| k == name)?;
        Some(self.items.remove(i).1)
    }

    fn push(&mut self, name: &str, fail: Fail, input: Json) {
        self.errors.push(LineError {
            loc: format!("{}{name}", self.prefix),
            fail,
            input,
        });
    }

    /// The field's value, or `default` when absent or invalid (the error is recorded).
    fn get<T>(&mut self, name: &str, default: T, check: impl Fn(&Json) -> PyResult<T>) -> T {
        let Some(v) = self.take(name) else {
            return default;
        };
        match check(&v) {
            Ok(t) => t,
            Err(f) => {
                self.push(name, f, v);
                default
            }
        }
    }

    /// When `field` holds a string `members` lacks: the hint `across` gives (the releases that
    /// accept it), else the nearest of `members`.
    fn name_hint(
        &mut self,
        field: &str,
        members: &[&str],
        what: &str,
        across: impl Fn(&str) -> Option<String>,
    ) {
        let Some((_, Json::Str(name))) = self.items.iter().find(|(k, _)| k == field) else {
            return;
        };
        if !members.contains(&name.as_str()) {
            let hint = across(name)
                .unwrap_or_else(|| suggest::did_you_mean(name, members.iter().copied(), what));
            self.hints.push(hint);
        }
    }

    /// A `list[T] | None` field: `None` when absent or null; a non-list is pydantic's
    /// `list_type`, a bad item its error at `name.index`; a valid list then goes through
    /// `validate`, the field validator (its `ValueError` becomes pydantic's `value_error`).
    fn list<T>(
        &mut self,
        name: &str,
        item: impl Fn(&Json) -> PyResult<T>,
        validate: impl Fn(&[T]) -> std::result::Result<(), String>,
    ) -> Option<Vec<T>> {
        let v = self.take(name)?;
        let Json::List(items) = &v else {
            if v != Json::Null {
                self.push(name, pydantic::list_type(), v);
            }
            return None;
        };
        let mut out = Vec::with_capacity(items.len());
        let mut ok = true;
        for (i, x) in items.iter().enumerate() {
            match item(x) {
                Ok(t) => out.push(t),
                Err(f) => {
                    self.push(&format!("{name}.{i}"), f, x.clone());
                    ok = false;
                }
            }
        }
        if !ok {
            return None;
        }
        if let Err(msg) = validate(&out) {
            self.push(name, pydantic::value_error(&msg), v);
            return None;
        }
        Some(out)
    }

    /// Records the keys left over as unexpected keywords (with the nearest valid key as hint).
    fn finish(self, valid: &[&str]) {
        let prefix = self.prefix;
        for (key, v) in self.items {
            let candidates: Vec<String> = valid.iter().map(|k| format!("{prefix}{k}")).collect();
            let given = format!("{prefix}{key}");
            if !suggest::closest(&given, candidates.iter().map(String::as_str)).is_empty() {
                self.hints.push(suggest::did_you_mean(
                    &given,
                    candidates.iter().map(String::as_str),
                    "valid keys",
                ));
            }
            self.errors.push(LineError {
                loc: given,
                fail: pydantic::unexpected_keyword(),
                input: v,
            });
        }
    }
}

type PyResult<T> = std::result::Result<T, Fail>;

fn int_gt(bound: i64) -> impl Fn(&Json) -> PyResult<i64> {
    move |v| pydantic::int(v).and_then(|n| pydantic::gt(n, bound))
}

fn int_ge(bound: i64) -> impl Fn(&Json) -> PyResult<i64> {
    move |v| pydantic::int(v).and_then(|n| pydantic::ge(n, bound))
}

/// `T | None`: `None` passes.
fn optional<T>(check: impl Fn(&Json) -> PyResult<T>) -> impl Fn(&Json) -> PyResult<Option<T>> {
    move |v| match v {
        Json::Null => Ok(None),
        other => check(other).map(Some),
    }
}

/// Reads the top-level fields of `items` with `read`, the keys left over being unexpected
/// unless in `valid`: `read`'s result, or pydantic's ValidationError of `class` naming every
/// field that failed.
fn read_fields<T>(
    items: Vec<(String, Json)>,
    class: &str,
    valid: &[&str],
    read: impl FnOnce(&mut Fields<'_>) -> T,
) -> Result<T> {
    let (mut errors, mut hints) = (Vec::new(), Vec::new());
    let mut f = Fields {
        items,
        prefix: "",
        errors: &mut errors,
        hints: &mut hints,
    };
    let out = read(&mut f);
    f.finish(valid);
    if !errors.is_empty() {
        return Err(validation_error(class, &errors, hints));
    }
    Ok(out)
}

/// The error for failed field validation: pydantic's text for `class`, epcomm's hints apart.
fn validation_error(class: &str, errors: &[LineError], hints: Vec<String>) -> Error {
    Error::ConfigField {
        field: errors.first().map(|e| e.loc.clone()).unwrap_or_default(),
        message: pydantic::render(class, errors),
        hint: if hints.is_empty() {
            None
        } else {
            Some(hints.join("; "))
        },
    }
}

/// A single pydantic field error (for configurations built in code rather than parsed).
fn field_error(class: &str, loc: &str, fail: Fail, input: Json) -> Error {
    let errors = [LineError {
        loc: loc.to_owned(),
        fail,
        input,
    }];
    validation_error(class, &errors, Vec::new())
}

/// `EPLBConfig`'s fields (v0.33.0 declaration order); `communicator`'s literal is `release`'s.
fn eplb_fields(f: &mut Fields<'_>, release: &Release) -> EplbConfig {
    let d = EplbConfig::default();
    let communicators = release.eplb_communicators;
    let c = EplbConfig {
        window_size: f.get("window_size", d.window_size, int_gt(0)),
        step_interval: f.get("step_interval", d.step_interval, int_gt(0)),
        // `int = Field(default=None, ge=0)`: absent is None, an explicit None is refused.
        num_redundant_experts: f.get("num_redundant_experts", None, |v| int_ge(0)(v).map(Some)),
        log_balancedness: f.get("log_balancedness", false, pydantic::bool),
        log_balancedness_interval: f.get("log_balancedness_interval", 1, int_gt(0)),
        use_async: f.get("use_async", d.use_async, pydantic::bool),
        policy: f.get("policy", d.policy, |v| pydantic::literal(v, &EPLB_POLICIES)),
        // A release without the field: the key stays and is an unexpected keyword.
        communicator: if communicators.is_empty() {
            None
        } else {
            f.name_hint(
                "communicator",
                communicators,
                "valid EPLB communicators",
                |n| versions::eplb_hint(n, release),
            );
            f.get(
                "communicator",
                None,
                optional(|v| pydantic::literal(v, communicators)),
            )
        },
        enable_migration_batching: f.get("enable_migration_batching", false, pydantic::bool),
    };
    if communicators.is_empty() {
        if let Some((_, Json::Str(name))) = f.items.iter().find(|(k, _)| k == "communicator") {
            f.hints.extend(versions::eplb_hint(name, release));
        }
    }
    c
}

fn eplb_keys(release: &Release) -> Vec<&'static str> {
    EPLB_CONFIG_KEYS
        .iter()
        .copied()
        .filter(|k| *k != "communicator" || !release.eplb_communicators.is_empty())
        .collect()
}

/// Parses vLLM's `EPLBConfig` given as a JSON object (`EPLBConfig(**kwargs)`: field types,
/// bounds, literals, then its model validator), for vLLM's default release.
pub fn parse_eplb_config_json(json: &str) -> Result<EplbConfig> {
    let Json::Dict(items) = parse_document(json, "eplb_config")? else {
        return Err(Error::InvalidArgument(
            "eplb_config must be a JSON object like {\"window_size\": 1000}".into(),
        ));
    };
    let release = versions::release(versions::DEFAULT_VERSION)?;
    let c = read_fields(items, "EPLBConfig", &eplb_keys(release), |f| {
        eplb_fields(f, release)
    })?;
    c.validate()?;
    Ok(c)
}

/// serde_json reads the document (its message for bad JSON), keeping key order.
fn parse_document(json: &str, what: &str) -> Result<Json> {
    pydantic::parse_ordered(json)
        .map_err(|e| Error::InvalidArgument(format!("{what} is not valid JSON: {e}")))
}

/// epcomm's own keys ([`EPCOMM_KEYS`]); returns the release named by `vllm_version`.
fn parse_options(c: &mut VllmConfig, mut items: Vec<(String, Json)>) -> Result<&'static Release> {
    let described = match items.iter().position(|(k, _)| k == "vllm_release") {
        Some(i) => Some(versions::described(&items.remove(i).1.to_value())?),
        None => None,
    };
    let version = read_fields(items, EPCOMM_OPTIONS_CLASS, &EPCOMM_KEYS, |f| {
        let version: Option<String> =
            f.get("vllm_version", None, |v| pydantic::string(v).map(Some));
        c.platform = f.get("platform", c.platform.clone(), |v| {
            pydantic::literal(v, &PLATFORMS)
        });
        c.num_experts = f.get("num_experts", None, optional(int_gt(0)));
        c.nixl_available = f.get("nixl_available", None, optional(pydantic::bool));
        c.nccl_available = f.get("nccl_available", None, optional(pydantic::bool));
        c.enable_lora = f.get("enable_lora", false, pydantic::bool);
        c.draft_model_is_moe = f.get("draft_model_is_moe", false, pydantic::bool);
        version
    })?;
    if let Some(r) = described {
        if let Some(version) = version.filter(|v| !versions::same_release(v, r.version)) {
            return Err(Error::InvalidArgument(format!(
                "vllm_version '{version}' and vllm_release (vLLM {}) name different releases; give one of them",
                r.version
            )));
        }
        c.vllm_version = r.version.to_owned();
        c.vllm_release = Some(r);
        return Ok(r);
    }
    let release = versions::release(version.as_deref().unwrap_or(versions::DEFAULT_VERSION))?;
    c.vllm_version = release.version.to_owned();
    Ok(release)
}

/// `all2all_backend` as `release` declares it: its `Literal`, or a string checked later.
fn all2all_field(f: &mut Fields<'_>, release: &Release) -> String {
    let default = all2all::DEFAULT_BACKEND.name().to_owned();
    match release.all2all_rule {
        NameRule::Literal => {
            f.name_hint(
                "all2all_backend",
                release.all2all_names,
                "valid all2all backends",
                |n| versions::all2all_hint(n, release),
            );
            f.get("all2all_backend", default, |v| {
                pydantic::literal(v, release.all2all_names)
            })
        }
        NameRule::EnvChoices | NameRule::Communicator => {
            f.get("all2all_backend", default, pydantic::string)
        }
    }
}

/// `ParallelConfig`'s fields epcomm models, in declaration order, with `release`'s literals.
fn parallel_fields(c: &mut VllmConfig, f: &mut Fields<'_>, release: &Release) {
    c.pipeline_parallel_size = f.get("pipeline_parallel_size", 1, int_ge(1));
    c.tensor_parallel_size = f.get("tensor_parallel_size", 1, int_ge(1));
    c.prefill_context_parallel_size = f.get("prefill_context_parallel_size", 1, int_ge(1));
    c.data_parallel_size = f.get("data_parallel_size", 1, int_ge(1));
    c.data_parallel_external_lb = f.get("data_parallel_external_lb", false, pydantic::bool);
    c.data_parallel_hybrid_lb = f.get("data_parallel_hybrid_lb", false, pydantic::bool);
    c.enable_expert_parallel = f.get("enable_expert_parallel", false, pydantic::bool);
    c.enable_eplb = f.get("enable_eplb", false, pydantic::bool);
    match f.take("eplb_config") {
        None => {}
        Some(Json::Dict(items)) => {
            let mut nested = Fields {
                items,
                prefix: "eplb_config.",
                errors: &mut *f.errors,
                hints: &mut *f.hints,
            };
            c.eplb_config = eplb_fields(&mut nested, release);
            nested.finish(&eplb_keys(release));
        }
        Some(other) => f.push("eplb_config", pydantic::dataclass_type("EPLBConfig"), other),
    }
    c.expert_placement_strategy = f.get(
        "expert_placement_strategy",
        c.expert_placement_strategy.clone(),
        |v| pydantic::literal(v, &EXPERT_PLACEMENT_STRATEGIES),
    );
    c.all2all_backend = all2all_field(f, release);
    c.mori_ep_v2 = f.get("mori_ep_v2", None, optional(pydantic::bool));
    c.enable_elastic_ep = f.get("enable_elastic_ep", false, pydantic::bool);
    c.enable_dbo = f.get("enable_dbo", false, pydantic::bool);
    c.numa_bind = f.get("numa_bind", None, optional(pydantic::bool));
    c.numa_bind_nodes = f.list("numa_bind_nodes", pydantic::int, numa_nodes_rule);
    c.numa_bind_cpus = f.list("numa_bind_cpus", pydantic::string, numa_cpus_rule);
    c.enable_fault_tolerance = f.get("enable_fault_tolerance", false, pydantic::bool);
}

/// vLLM v0.34.0's `_validate_numa_bind_nodes`.
fn numa_nodes_rule(nodes: &[i64]) -> std::result::Result<(), String> {
    if nodes.is_empty() {
        return Err("numa_bind_nodes must not be empty.".into());
    }
    if nodes.iter().any(|n| *n < 0) {
        return Err("numa_bind_nodes must contain non-negative integers.".into());
    }
    Ok(())
}

/// vLLM v0.34.0's `_validate_numa_bind_cpus` (`_NUMACTL_CPUSET_PATTERN`: `\d+(-\d+)?` parts
/// joined by commas; epcomm takes ASCII digits).
fn numa_cpus_rule(cpus: &[String]) -> std::result::Result<(), String> {
    if cpus.is_empty() {
        return Err("numa_bind_cpus must not be empty.".into());
    }
    let number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    for cpuset in cpus {
        if cpuset.is_empty() {
            return Err("numa_bind_cpus entries must not be empty.".into());
        }
        let parts: Vec<(&str, Option<&str>)> = cpuset
            .split(',')
            .map(|p| match p.split_once('-') {
                Some((a, b)) => (a, Some(b)),
                None => (p, None),
            })
            .collect();
        if !parts.iter().all(|(a, b)| number(a) && b.is_none_or(number)) {
            return Err("numa_bind_cpus entries must use numactl CPU list syntax, for example '0-3' or '0,2,4-7'.".into());
        }
        // Python's int() has no size limit: compare the digit strings as numbers.
        let value = |s: &str| {
            let s = s.trim_start_matches('0');
            (s.len(), s.to_owned())
        };
        if parts
            .iter()
            .any(|(a, b)| b.is_some_and(|b| value(a) > value(b)))
        {
            return Err(format!(
                "numa_bind_cpus ranges must be ascending, but got '{cpuset}'."
            ));
        }
    }
    Ok(())
}

/// Parses a vLLM-style JSON configuration: the object is `ParallelConfig`'s keyword arguments
/// (plus [`EPCOMM_KEYS`]), validated as pydantic validates vLLM's dataclasses. Every field error
/// is collected and the error's message is `str(ValidationError)` as vLLM's pinned pydantic
/// (2.13) prints it. Validators (`EPLBConfig._validate_eplb_config`, `ParallelConfig`'s
/// `__post_init__` and `_validate_parallel_config`) run later, in [`check`], and give the
/// message vLLM's code raises without pydantic's `Value error, ...` wrapper: at the top level
/// that wrapper's `input_value` is the `ArgsKwargs` of every keyword vLLM's `EngineArgs` passes,
/// which a configuration file does not determine. A validator therefore never shares an error
/// with field errors (pydantic would list a nested `EPLBConfig` validator's error beside them).
pub fn parse(json: &str) -> Result<VllmConfig> {
    let Json::Dict(items) = parse_document(json, "configuration")? else {
        return Err(Error::InvalidArgument(
            "configuration must be a JSON object like {\"all2all_backend\": \"deepep_low_latency\"}"
                .into(),
        ));
    };
    let (options, items): (Vec<_>, Vec<_>) = items
        .into_iter()
        .partition(|(k, _)| EPCOMM_KEYS.contains(&k.as_str()));
    let mut c = VllmConfig::default();
    let release = parse_options(&mut c, options)?;
    if let Some((key, _)) = items
        .iter()
        .find(|(k, _)| UNMODELLED_PARALLEL_FIELDS.contains(&k.as_str()))
    {
        return Err(Error::InvalidArgument(format!(
            "'{key}' is a field of vLLM's ParallelConfig that epcomm's check does not model; remove it to check the rest"
        )));
    }
    let valid: Vec<&str> = PARALLEL_FIELDS
        .iter()
        .chain(&EPCOMM_KEYS)
        .copied()
        .collect();
    read_fields(items, "ParallelConfig", &valid, |f| {
        parallel_fields(&mut c, f, release)
    })?;
    if release.all2all_rule != NameRule::Literal
        && !release.all2all_names.contains(&c.all2all_backend.as_str())
    {
        return Err(versions::name_error(release, &c.all2all_backend));
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
    pub eplb_communicator: Option<Communicator>,
    pub eplb_communicator_auto: bool,
    /// `eplb_config.num_redundant_experts` as vLLM settles it: 0 without EPLB, the configured
    /// value, or with EPLB and none configured the minimum valid one; `None` where that needs
    /// `num_experts`, which the configuration does not give.
    pub num_redundant_experts: Option<i64>,
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
    let release = match c.vllm_release {
        Some(r) => r,
        None => versions::release(&c.vllm_version)?,
    };
    let resolved = resolve_for_release(&c.all2all_backend, release)?;
    let backend = resolved.as_ref().map(|r| r.backend);
    check_parallel(c, nixl)?;
    let effective_name = effective_name(c, resolved.as_ref(), warnings);
    check_features(c, backend, effective_name)?;

    // Engine start: EPLB communicator factory.
    let (eplb_communicator, eplb_communicator_auto) = if c.enable_eplb {
        let device = DeviceKind::from_platform(&c.platform).unwrap_or(DeviceKind::Cuda);
        let (sel, forced) = eplb::select_outcome(&SelectRequest {
            requested: c.eplb_config.communicator.as_deref(),
            elastic: c.enable_elastic_ep,
            device,
            weight_dtypes: &[],
            nccl_available: nccl,
            nixl_available: nixl,
        });
        warnings.extend(forced);
        let sel = sel?;
        infos.push(eplb::initialized_info(sel.communicator));
        (Some(sel.communicator), sel.auto_selected)
    } else {
        (None, false)
    };

    let num_redundant_experts = redundant_experts(c, infos);
    check_mori(c, release, backend, warnings)?;
    let manager_class = all2all_manager(c, resolved.as_ref(), effective_name, warnings, infos);
    Ok(Resolution {
        backend,
        effective_name,
        manager_class,
        layout: backend.map(Backend::layout),
        eplb_communicator,
        eplb_communicator_auto,
        num_redundant_experts,
    })
}

/// vLLM v0.34.0's `ParallelConfig.compute_eplb_num_redundant_experts`: with EPLB on and no
/// value configured, the smallest that makes the physical expert count a multiple of the EP
/// size (logging vLLM's info line); 0 with EPLB off.
fn redundant_experts(c: &VllmConfig, infos: &mut Vec<String>) -> Option<i64> {
    if !c.enable_eplb {
        return Some(0);
    }
    if let Some(n) = c.eplb_config.num_redundant_experts {
        return Some(n);
    }
    let experts = c.num_experts?;
    // The EP group spans the TP x PCP x DP ranks; Python integers do not overflow.
    let ep = c
        .tensor_parallel_size
        .saturating_mul(c.prefill_context_parallel_size)
        .saturating_mul(c.data_parallel_size);
    let n = (ep - experts % ep) % ep;
    infos.push(format!(
        "EPLB num_redundant_experts not specified, defaulting to minimum valid value: {n} (num_logical_experts={experts}, ep_size={ep})"
    ));
    Some(n)
}

/// What `mori` runs from vLLM 0.34.0 on: MoRI EPv1 (`MoriAll2AllManager`, epcomm's token-major
/// exchange) unless `mori_ep_v2` selects MoRI EPv2, which epcomm does not have.
fn check_mori(
    c: &VllmConfig,
    release: &Release,
    backend: Option<Backend>,
    warnings: &mut Vec<String>,
) -> Result<()> {
    if backend != Some(Backend::Mori) || !versions::at_least(release, "0.34.0") {
        return Ok(());
    }
    match c.mori_ep_v2 {
        Some(false) => Ok(()),
        Some(true) => Err(Error::NotImplemented(format!(
            "all2all backend 'mori' with mori_ep_v2=True builds vLLM's {}, which epcomm does not implement; with mori_ep_v2=False (VLLM_MORI_EP_V2=0) 'mori' runs {} (MoRI EPv1), whose token-major exchange epcomm has",
            all2all::MORI_EPV2_MANAGER_CLASS,
            Backend::Mori.manager_class()
        ))),
        None => {
            warnings.push(format!(
                "mori_ep_v2 is unset: vLLM picks MoRI EPv2 ({}) at startup where the installed MoRI supports it; epcomm checks and runs MoRI EPv1 ({}). Set VLLM_MORI_EP_V2=0 (mori_ep_v2=False) so that vLLM runs what epcomm checked.",
                all2all::MORI_EPV2_MANAGER_CLASS,
                Backend::Mori.manager_class()
            ));
            Ok(())
        }
    }
}

/// Resolves an all2all name as `release` means it (the name sets and statuses vary by release;
/// epcomm's backends are v0.33.0's). A name the release accepts but epcomm has no backend for
/// (e.g. `mori`, 0.15.0–0.22.1) is NOT_IMPLEMENTED; a name the release runs as its own backend
/// but v0.33.0 removed (e.g. `pplx` before 0.17.0) falls back to `allgather_reducescatter` with
/// a warning saying so instead of v0.33.0's removal warning; a name canonical in the release but
/// an alias in v0.33.0 resolves without the deprecation warning.
fn resolve_for_release(name: &str, release: &Release) -> Result<Option<all2all::Resolved>> {
    if versions::same_names(release, versions::release(versions::DEFAULT_VERSION)?) {
        return all2all::resolve_config(name);
    }
    let status = release.all2all_status_of(name);
    if status.is_some() && name != all2all::PASSTHROUGH && all2all::lookup(name).is_none() {
        return Err(Error::NotImplemented(format!(
            "vLLM {} accepts all2all backend '{name}', but epcomm has no backend for it (epcomm's backends are vLLM {}'s; {})",
            release.version,
            versions::DEFAULT_VERSION,
            suggest::did_you_mean(name, all2all::vllm_names(), "its backends")
        )));
    }
    let Some(mut r) = all2all::resolve_config(name)? else {
        return Ok(None);
    };
    match (status, r.kind) {
        (Some(NameKind::Canonical), NameKind::Removed) => {
            r.warning = Some(format!(
                "vLLM {} runs all2all backend '{name}' as its own backend; epcomm has none and runs '{}' instead.",
                release.version,
                r.backend.name()
            ));
        }
        (Some(NameKind::Canonical), NameKind::Alias) => r.warning = None,
        (Some(_) | None, NameKind::Canonical | NameKind::Alias | NameKind::Removed) => {}
    }
    Ok(Some(r))
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
    // Parsed configurations hold a literal member already; built ones may not.
    if let Err(fail) = pydantic::literal(&Json::Str(e.policy.clone()), &EPLB_POLICIES) {
        return Err(field_error(
            "ParallelConfig",
            "eplb_config.policy",
            fail,
            Json::Str(e.policy.clone()),
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
    // vLLM v0.34.0: binding lists imply numa_bind=True; an explicit False is an error.
    if (c.numa_bind_nodes.is_some() || c.numa_bind_cpus.is_some()) && c.numa_bind == Some(false) {
        return Err(Error::NumaBindListsWithoutBinding);
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
    } else if let Some(n) = e.num_redundant_experts.filter(|n| *n != 0) {
        return Err(Error::RedundantWithoutEplb { n });
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
    // Fused MoE LoRA with EP (`FusedMoEWithLoRA._ep_check`): placement, then the backend.
    if c.enable_lora && c.enable_expert_parallel {
        if c.expert_placement_strategy != "linear" {
            return Err(Error::LoraEpPlacement {
                placement: c.expert_placement_strategy.clone(),
            });
        }
        if backend != Some(Backend::AllgatherReducescatter) {
            return Err(Error::LoraEpBackend {
                backend: name.to_owned(),
            });
        }
    }
    // Fault tolerance (`WorkerSentinel`): the backend, MoE drafts, PCP.
    if c.enable_fault_tolerance {
        if !backend.is_some_and(Backend::supports_fault_tolerance) {
            return Err(Error::FaultToleranceBackend {
                backend: name.to_owned(),
            });
        }
        if c.draft_model_is_moe {
            return Err(Error::FaultToleranceMoeDraft);
        }
        if c.prefill_context_parallel_size > 1 {
            return Err(Error::FaultTolerancePcp);
        }
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
                m.insert(
                    "num_redundant_experts".into(),
                    r.num_redundant_experts.into(),
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
