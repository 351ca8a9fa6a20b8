//! Every all2all backend name, and every selection, EPLB-factory and EPLB-config message, in full,
//! with its status and Python exception class.

use epcomm::dtype::{Code, DType};
use epcomm::select::all2all::{self, Backend, Layout, NameKind};
use epcomm::select::config::{self, EplbConfig};
use epcomm::select::eplb::{self, Communicator, DeviceKind, SelectRequest};
use epcomm::select::versions::{self, NameRule};
use epcomm::select::Hint;
use epcomm::{Error, Status};

fn assert_err(e: &Error, status: Status, exception: &str, message: &str) {
    assert_eq!(e.to_string(), message);
    assert_eq!(e.status(), status, "status of {message}");
    assert_eq!(e.exception(), exception, "exception of {message}");
}

// ---- all2all names ------------------------------------------------------------------------------

#[test]
fn every_accepted_name_resolves_as_in_the_table() {
    use Backend::*;
    use Layout::*;
    let table: [(&str, Backend, NameKind, Layout, &str); 14] = [
        (
            "allgather_reducescatter",
            AllgatherReducescatter,
            NameKind::Canonical,
            Replicated,
            "AgRsAll2AllManager",
        ),
        (
            "naive",
            AllgatherReducescatter,
            NameKind::Removed,
            Replicated,
            "AgRsAll2AllManager",
        ),
        (
            "pplx",
            AllgatherReducescatter,
            NameKind::Removed,
            Replicated,
            "AgRsAll2AllManager",
        ),
        (
            "deepep_high_throughput",
            DeepepHighThroughput,
            NameKind::Canonical,
            TokenMajor,
            "DeepEPHTAll2AllManager",
        ),
        (
            "deepep_low_latency",
            DeepepLowLatency,
            NameKind::Canonical,
            ExpertMajor,
            "DeepEPLLAll2AllManager",
        ),
        (
            "deepep_v2",
            DeepepV2,
            NameKind::Canonical,
            ExpertPacked,
            "DeepEPV2All2AllManager",
        ),
        (
            "mori_high_throughput",
            MoriHighThroughput,
            NameKind::Alias,
            TokenMajor,
            "MoriAll2AllManager",
        ),
        (
            "mori_low_latency",
            MoriLowLatency,
            NameKind::Alias,
            TokenMajor,
            "MoriAll2AllManager",
        ),
        (
            "nixl_ep",
            NixlEp,
            NameKind::Canonical,
            ExpertMajor,
            "NixlEPAll2AllManager",
        ),
        (
            "flashinfer_nvlink_two_sided",
            FlashinferNvlinkTwoSided,
            NameKind::Canonical,
            RankMajor,
            "FlashInferNVLinkTwoSidedManager",
        ),
        (
            "flashinfer_all2allv",
            FlashinferNvlinkTwoSided,
            NameKind::Alias,
            RankMajor,
            "FlashInferNVLinkTwoSidedManager",
        ),
        (
            "flashinfer_nvlink_one_sided",
            FlashinferNvlinkOneSided,
            NameKind::Canonical,
            RankMajor,
            "FlashInferNVLinkOneSidedManager",
        ),
        (
            "moonep",
            Moonep,
            NameKind::Canonical,
            MoonepSlots,
            "MoonEPAll2AllManager",
        ),
        (
            "mori",
            Mori,
            NameKind::Canonical,
            TokenMajor,
            "MoriAll2AllManager",
        ),
    ];
    assert_eq!(all2all::ACCEPTED_NAMES.len(), table.len());
    for (name, backend, kind, layout, class) in table {
        let r = all2all::resolve_quiet(name).unwrap();
        assert_eq!((r.backend, r.kind), (backend, kind), "{name}");
        assert_eq!(backend.layout(), layout, "{name}");
        assert_eq!(backend.manager_class(), class, "{name}");
        assert_eq!(all2all::resolve(name).unwrap(), backend);
    }
    assert_eq!(all2all::DEFAULT_BACKEND.name(), "allgather_reducescatter");
    for b in Backend::ALL {
        let entry = all2all::lookup(b.name()).unwrap();
        assert_eq!(entry.backend, b);
        // v0.34.0 deprecates the two MoRI names for `mori`; they keep their own kernels.
        let deprecated = matches!(b, MoriHighThroughput | MoriLowLatency);
        let kind = if deprecated {
            NameKind::Alias
        } else {
            NameKind::Canonical
        };
        assert_eq!(entry.kind, kind, "{}", b.name());
        assert_eq!(Backend::from_code(b as i32), Some(b));
    }
}

#[test]
fn unknown_names_are_value_errors_with_the_name_unquoted() {
    for name in [
        "mori_ep",
        "flashinfer-nvlink-2s",
        "one_sided",
        "",
        "Naive",
        "DEEPEP_LOW_LATENCY",
        " naive",
    ] {
        let e = all2all::resolve(name).unwrap_err();
        assert_err(
            &e,
            Status::InvalidArgument,
            "ValueError",
            &format!("Unknown all2all backend: {name}"),
        );
    }
}

#[test]
fn unknown_name_hints_suggest_the_closest_names() {
    let hint = |n: &str| all2all::resolve_quiet(n).unwrap_err().hint().unwrap();
    assert_eq!(
        hint("flashinfer-nvlink-2s"),
        "did you mean 'flashinfer_nvlink_two_sided'?"
    );
    assert_eq!(hint("Naive"), "did you mean 'naive'?");
    assert!(hint("mori_ht").contains("'mori'"), "{}", hint("mori_ht"));
    assert!(hint("deepep_ll").contains("'deepep_low_latency'"));
    // Nothing close: the full list.
    assert!(hint("zzzzzzzzzzzz").starts_with("valid all2all backends: 'naive', 'pplx'"));
}

#[test]
fn w1_alias_warning_is_vllms_text() {
    let r = all2all::resolve_quiet("flashinfer_all2allv").unwrap();
    assert_eq!(
        r.warning.as_deref(),
        Some("'flashinfer_all2allv' is deprecated and has been renamed to'flashinfer_nvlink_two_sided'. It will be removed in a futurerelease.")
    );
}

#[test]
fn w2_removed_backend_warning_is_vllms_text() {
    for name in ["naive", "pplx"] {
        let r = all2all::resolve_quiet(name).unwrap();
        assert_eq!(
            r.warning.unwrap(),
            format!("The '{name}' all2all backend has been removed. Falling back to 'allgather_reducescatter'.")
        );
    }
    assert_eq!(all2all::resolve_quiet("deepep_v2").unwrap().warning, None);
}

#[test]
fn i1_using_manager_info() {
    assert_eq!(
        all2all::using_manager_info(Backend::DeepepLowLatency),
        "Using DeepEPLLAll2AllManager all2all manager."
    );
}

#[test]
fn one_sided_heterogeneous_assertions() {
    let e = Error::OneSidedHeterogeneous {
        field: "top_k",
        got: 6,
        built: 8,
    };
    assert_err(&e, Status::Assertion, "AssertionError", "FlashInfer one-sided communication does not support heterogeneous top_k (got 6, was built with 8)");
    let e = Error::OneSidedHeterogeneous {
        field: "num_experts",
        got: 64,
        built: 256,
    };
    assert_err(&e, Status::Assertion, "AssertionError", "FlashInfer one-sided communication does not support heterogeneous num_experts (got 64, was built with 256)");
}

#[test]
fn moonep_unavailable_message() {
    assert_err(
        &Error::MoonEpUnavailable,
        Status::Runtime,
        "RuntimeError",
        "MoonEP not available. Install it from https://github.com/MoonshotAI/MoonEP.",
    );
}

#[test]
fn passthrough_is_accepted_but_has_no_handle() {
    // v0.33.0's All2AllBackend literal ends with "passthrough".
    let names: Vec<&str> = all2all::vllm_names().collect();
    assert_eq!(names.len(), all2all::ACCEPTED_NAMES.len() + 1);
    assert_eq!(names.last(), Some(&"passthrough"));
    let text =
        "passthrough has no all2all handle: dispatch and combine run inside the MoE backend.";
    let e = all2all::resolve_quiet("passthrough").unwrap_err();
    assert_err(&e, Status::Runtime, "RuntimeError", text);
    assert_eq!(all2all::resolve("passthrough").unwrap_err(), e);
    assert_eq!(all2all::resolve_config("passthrough"), Ok(None));
    let o = check(r#"{"all2all_backend": "passthrough"}"#);
    let r = o.result.unwrap();
    assert_eq!((r.backend, r.layout), (None, None));
    assert_eq!(r.effective_name, "passthrough");
    assert_eq!(r.manager_class, "PassThroughAll2AllManager");
    assert!(o.warnings.is_empty());
    assert_eq!(
        o.infos,
        vec!["Using PassThroughAll2AllManager all2all manager.".to_owned()]
    );
    // vLLM's CPU communicator builds AgRs for every name but naive/allgather_reducescatter.
    let o = check(r#"{"all2all_backend": "passthrough", "platform": "cpu"}"#);
    assert_eq!(o.result.unwrap().manager_class, "AgRsAll2AllManager");
    assert_eq!(o.warnings, vec!["`passthrough` all2all manager is not supported on CPU. Falling back to `allgather_reducescatter` manager.".to_owned()]);
    // Not in vLLM's fault-tolerance set.
    let e = check_err(r#"{"all2all_backend": "passthrough", "enable_fault_tolerance": true}"#);
    assert_err(&e, Status::InvalidArgument, "ValueError", "Fault tolerance requires an FT-capable all2all backend (one of ['deepep_low_latency', 'nixl_ep']), but got 'passthrough'.");
    // A typo suggests it like any other name.
    let e = all2all::resolve_quiet("passthru").unwrap_err();
    assert!(
        e.hint().unwrap().contains("'passthrough'"),
        "{:?}",
        e.hint()
    );
}

// ---- all2all feature gates through the config checker -------------------------------------------

fn check(json: &str) -> config::CheckOutcome {
    config::check_json(json, false, false)
}

fn check_ok(json: &str) -> config::Resolution {
    check(json).result.expect(json)
}

fn check_err(json: &str) -> Error {
    check(json).result.expect_err(json)
}

#[test]
fn dbo_requires_a_microbatching_backend() {
    let e = check_err(r#"{"enable_dbo": true, "all2all_backend": "deepep_v2"}"#);
    assert_err(&e, Status::Assertion, "AssertionError", "Microbatching currently only supports the deepep_low_latency, deepep_high_throughput, nixl_ep all2all backends on this platform. deepep_v2 is not supported. To fix use one of --all2all-backend=deepep_low_latency, --all2all-backend=deepep_high_throughput, --all2all-backend=nixl_ep and install the matching kernels.");
    // A removed name is rewritten first, so vLLM names the fallback.
    let e = check_err(r#"{"enable_dbo": true, "all2all_backend": "naive"}"#);
    assert!(
        e.to_string()
            .contains(" allgather_reducescatter is not supported."),
        "{e}"
    );
    for ok in ["deepep_low_latency", "deepep_high_throughput", "nixl_ep"] {
        check(&format!(
            r#"{{"enable_dbo": true, "all2all_backend": "{ok}"}}"#
        ))
        .result
        .unwrap();
    }
    // vLLM v0.33.0: on ROCm the naive all-gather / reduce-scatter also runs under DBO, and the
    // message lists ROCm's set.
    check(
        r#"{"enable_dbo": true, "all2all_backend": "allgather_reducescatter", "platform": "rocm"}"#,
    )
    .result
    .unwrap();
    let e =
        check_err(r#"{"enable_dbo": true, "all2all_backend": "deepep_v2", "platform": "rocm"}"#);
    assert_err(&e, Status::Assertion, "AssertionError", "Microbatching currently only supports the deepep_low_latency, deepep_high_throughput, nixl_ep, allgather_reducescatter all2all backends on this platform. deepep_v2 is not supported. To fix use one of --all2all-backend=deepep_low_latency, --all2all-backend=deepep_high_throughput, --all2all-backend=nixl_ep, --all2all-backend=allgather_reducescatter and install the matching kernels.");
}

#[test]
fn fault_tolerance_requires_an_ft_backend() {
    let e = check_err(
        r#"{"enable_fault_tolerance": true, "all2all_backend": "deepep_high_throughput"}"#,
    );
    assert_err(&e, Status::InvalidArgument, "ValueError", "Fault tolerance requires an FT-capable all2all backend (one of ['deepep_low_latency', 'nixl_ep']), but got 'deepep_high_throughput'.");
    check(r#"{"enable_fault_tolerance": true, "all2all_backend": "nixl_ep"}"#)
        .result
        .unwrap();
}

/// vLLM v0.34.0's `WorkerSentinel`: after the backend, MoE drafts, then PCP.
#[test]
fn fault_tolerance_refuses_moe_drafts_then_pcp() {
    let ft = r#""enable_fault_tolerance": true, "all2all_backend": "deepep_low_latency""#;
    let e = check_err(&format!(
        r#"{{{ft}, "draft_model_is_moe": true, "prefill_context_parallel_size": 2}}"#
    ));
    assert_err(
        &e,
        Status::InvalidArgument,
        "ValueError",
        "Fault tolerance does not support MoE draft models yet.",
    );
    let e = check_err(&format!(r#"{{{ft}, "prefill_context_parallel_size": 2}}"#));
    assert_err(
        &e,
        Status::InvalidArgument,
        "ValueError",
        "Fault tolerance does not support PCP yet.",
    );
    // The backend comes first.
    let e = check_err(
        r#"{"enable_fault_tolerance": true, "prefill_context_parallel_size": 2, "draft_model_is_moe": true}"#,
    );
    assert!(
        e.to_string()
            .starts_with("Fault tolerance requires an FT-capable"),
        "{e}"
    );
}

/// vLLM v0.34.0's `numa_bind: bool | None`: binding lists imply it; with an explicit False they
/// are vLLM's error (after the data-parallel checks, before EPLB's); the lists' own validators
/// are pydantic field errors.
#[test]
fn numa_bind_lists_need_numa_bind() {
    let e = check_err(r#"{"numa_bind": false, "numa_bind_nodes": [0, 1]}"#);
    assert_err(
        &e,
        Status::InvalidArgument,
        "ValueError",
        "NUMA binding lists cannot be combined with numa_bind=False.",
    );
    let e = check_err(r#"{"numa_bind": false, "numa_bind_cpus": ["0-3"], "enable_eplb": true}"#);
    assert_eq!(
        e.to_string(),
        "NUMA binding lists cannot be combined with numa_bind=False."
    );
    let e = check_err(
        r#"{"numa_bind": false, "numa_bind_cpus": ["0-3"], "data_parallel_external_lb": true}"#,
    );
    assert_eq!(e, Error::ExternalLbNeedsDp);
    check_ok(r#"{"numa_bind_nodes": [0], "numa_bind_cpus": ["0,2,4-7"]}"#);
    check_ok(r#"{"numa_bind": true, "numa_bind_nodes": [1]}"#);
    check_ok(r#"{"numa_bind": false}"#);
    let e = check_err(r#"{"numa_bind_cpus": ["0-3", "3-1"]}"#);
    assert_err(&e, Status::InvalidArgument, "ValueError", "1 validation error for ParallelConfig\nnuma_bind_cpus\n  Value error, numa_bind_cpus ranges must be ascending, but got '3-1'. [type=value_error, input_value=['0-3', '3-1'], input_type=list]\n    For further information visit https://errors.pydantic.dev/2.13/v/value_error");
}

/// vLLM v0.34.0's `FusedMoEWithLoRA._ep_check`: the placement before the backend.
#[test]
fn moe_lora_with_ep_requires_linear_placement() {
    let e = check_err(
        r#"{"enable_lora": true, "enable_expert_parallel": true, "expert_placement_strategy": "round_robin", "all2all_backend": "deepep_low_latency"}"#,
    );
    assert_err(&e, Status::InvalidArgument, "ValueError", "Fused MoE LoRA with EP requires linear expert placement: adapter loading assumes a contiguous range of experts on each rank, got 'round_robin'. Set expert_placement_strategy='linear' to use MoE LoRA with expert parallelism.");
    check_ok(
        r#"{"enable_lora": true, "enable_expert_parallel": true, "expert_placement_strategy": "linear"}"#,
    );
    check_ok(r#"{"expert_placement_strategy": "round_robin", "enable_expert_parallel": true}"#);
}

/// vLLM v0.34.0: `num_redundant_experts` defaults to None, the minimum valid value once the
/// expert count is known (`(ep - E % ep) % ep`) with EPLB on, 0 with it off.
#[test]
fn num_redundant_experts_defaults_to_the_minimum_valid_value() {
    let eplb = r#""enable_eplb": true, "enable_expert_parallel": true, "nixl_available": false"#;
    let o = check(&format!(
        r#"{{{eplb}, "data_parallel_size": 3, "tensor_parallel_size": 2, "num_experts": 64}}"#
    ));
    assert_eq!(o.result.unwrap().num_redundant_experts, Some(2));
    assert!(o.infos.contains(&"EPLB num_redundant_experts not specified, defaulting to minimum valid value: 2 (num_logical_experts=64, ep_size=6)".to_owned()), "{:?}", o.infos);
    let o = check(&format!(
        r#"{{{eplb}, "data_parallel_size": 4, "num_experts": 64}}"#
    ));
    assert_eq!(o.result.unwrap().num_redundant_experts, Some(0));
    // Configured: kept, no info line; unknown expert count: unknown.
    let o = check(&format!(
        r#"{{{eplb}, "data_parallel_size": 4, "num_experts": 64, "eplb_config": {{"num_redundant_experts": 4}}}}"#
    ));
    assert_eq!(o.result.unwrap().num_redundant_experts, Some(4));
    assert!(!o.infos.iter().any(|i| i.starts_with("EPLB num_redundant")));
    let r = check_ok(&format!(r#"{{{eplb}, "data_parallel_size": 4}}"#));
    assert_eq!(r.num_redundant_experts, None);
    assert_eq!(check_ok("{}").num_redundant_experts, Some(0));
    // Without EPLB an explicit 0 is fine, anything else is vLLM's error.
    check_ok(r#"{"eplb_config": {"num_redundant_experts": 0}}"#);
    let e = check_err(r#"{"eplb_config": {"num_redundant_experts": 2}}"#);
    assert_eq!(e.to_string(), "num_redundant_experts is set to 2 but EPLB is not enabled. Either enable EPLB or unset num_redundant_experts.");
}

/// vLLM v0.34.0's `mori`: MoRI EPv1 (token-major) unless `mori_ep_v2`; the two older MoRI names
/// still run their own kernels, with vLLM's deprecation warning when the manager is built.
#[test]
fn mori_and_its_deprecated_names() {
    let o = check(r#"{"all2all_backend": "mori_low_latency"}"#);
    let r = o.result.unwrap();
    assert_eq!(r.backend, Some(Backend::MoriLowLatency));
    assert_eq!(r.manager_class, "MoriAll2AllManager");
    assert_eq!(
        o.warnings,
        ["'mori_low_latency' is deprecated and will be removed in a future release. Use 'mori', which picks the MoRI kernels automatically."]
    );
    assert_eq!(
        all2all::resolve_quiet("mori_high_throughput").unwrap().warning.as_deref(),
        Some("'mori_high_throughput' is deprecated and will be removed in a future release. Use 'mori', which picks the MoRI kernels automatically.")
    );
    // v0.33.0: canonical there, no warning.
    let o = check(r#"{"vllm_version": "0.33.0", "all2all_backend": "mori_low_latency"}"#);
    assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    // `mori`: EPv1 when mori_ep_v2 is false; unset, vLLM decides at startup: a warning.
    let o = check(r#"{"all2all_backend": "mori", "mori_ep_v2": false}"#);
    assert_eq!(o.result.unwrap().layout, Some(Layout::TokenMajor));
    assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    let o = check(r#"{"all2all_backend": "mori"}"#);
    assert_eq!(o.result.unwrap().backend, Some(Backend::Mori));
    assert!(
        o.warnings[0]
            .starts_with("mori_ep_v2 is unset: vLLM picks MoRI EPv2 (MoriEPv2All2AllManager)"),
        "{:?}",
        o.warnings
    );
    let e = check_err(r#"{"all2all_backend": "mori", "mori_ep_v2": true}"#);
    assert_eq!(e.status(), Status::NotImplemented);
    assert!(e.to_string().contains("MoriEPv2All2AllManager"), "{e}");
}

#[test]
fn moe_lora_with_ep_requires_agrs() {
    let e = check_err(
        r#"{"enable_lora": true, "enable_expert_parallel": true, "all2all_backend": "deepep_low_latency"}"#,
    );
    assert_err(&e, Status::Assertion, "AssertionError", "Fused MoE LoRA with EP currently only supports all2all_backend='allgather_reducescatter', got 'deepep_low_latency'.");
    check(r#"{"enable_lora": true, "enable_expert_parallel": false, "all2all_backend": "deepep_low_latency"}"#).result.unwrap();
    check(r#"{"enable_lora": true, "enable_expert_parallel": true}"#)
        .result
        .unwrap();
}

#[test]
fn config_resolution_and_warnings() {
    let o = check(r#"{"all2all_backend": "pplx"}"#);
    let r = o.result.unwrap();
    assert_eq!(r.backend, Some(Backend::AllgatherReducescatter));
    assert_eq!(r.effective_name, "allgather_reducescatter");
    assert_eq!(o.warnings, vec!["The 'pplx' all2all backend has been removed. Falling back to 'allgather_reducescatter'.".to_owned()]);
    assert_eq!(
        o.infos,
        vec!["Using AgRsAll2AllManager all2all manager.".to_owned()]
    );

    let o = check(r#"{"all2all_backend": "flashinfer_all2allv"}"#);
    assert_eq!(
        o.result.unwrap().manager_class,
        "FlashInferNVLinkTwoSidedManager"
    );
    assert_eq!(o.warnings, vec![all2all::W1_FLASHINFER_ALL2ALLV.to_owned()]);

    // CPU communicators fall back to AgRs with vLLM's warning.
    let o = check(r#"{"all2all_backend": "deepep_low_latency", "platform": "cpu"}"#);
    assert_eq!(o.result.unwrap().manager_class, "AgRsAll2AllManager");
    assert_eq!(o.warnings, vec!["`deepep_low_latency` all2all manager is not supported on CPU. Falling back to `allgather_reducescatter` manager.".to_owned()]);
    assert_eq!(
        o.infos,
        vec!["Using allgather_reducescatter all2all manager.".to_owned()]
    );

    let o = check(r#"{"all2all_backend": "deepep_low_latency", "platform": "xpu"}"#);
    assert_eq!(o.warnings, vec!["`deepep_low_latency` all2all manager is not supported on XPU. Falling back to AgRs manager for XPU, which is the Default backend".to_owned()]);
}

// ---- EPLB communicator factory ------------------------------------------------------------------

fn req(requested: Option<&str>) -> SelectRequest<'_> {
    SelectRequest {
        requested,
        elastic: false,
        device: DeviceKind::Cuda,
        weight_dtypes: &[],
        nccl_available: true,
        nixl_available: true,
    }
}

#[test]
fn communicator_names_and_classes() {
    let expect = [
        ("torch_nccl", "TorchDistNcclEplbCommunicator"),
        ("torch_gloo", "TorchDistGlooStagedEplbCommunicator"),
        ("pynccl", "PyNcclEplbCommunicator"),
        ("nixl", "NixlEplbCommunicator"),
    ];
    for (name, class) in expect {
        let c = eplb::select(&req(Some(name))).unwrap().communicator;
        assert_eq!(c.name(), name);
        assert_eq!(c.class_name(), class);
        assert_eq!(
            eplb::initialized_info(c),
            format!("Initialized EPLB communicator: {class}.")
        );
    }
}

#[test]
fn unknown_communicator_is_a_value_error() {
    let e = eplb::select(&req(Some("symm_memory"))).unwrap_err();
    assert_err(
        &e,
        Status::InvalidArgument,
        "ValueError",
        "Unknown EPLB communicator backend: symm_memory",
    );
    let e = eplb::select(&req(Some("pyncl"))).unwrap_err();
    assert_eq!(e.hint().unwrap(), "did you mean 'pynccl'?");
}

/// vLLM v0.34.0's `symm_mem`: `SymmMemEplbCommunicator` refuses any platform but CUDA with its
/// own text; on CUDA tensors epcomm has no symmetric-memory communicator and says so; on
/// host-staged weights it is epcomm's push into shared next buffers.
#[test]
fn symm_mem_is_vllms_refusal_off_cuda_and_not_implemented_on_cuda() {
    let sel = eplb::select(&SelectRequest {
        device: DeviceKind::Cpu,
        ..req(Some("symm_mem"))
    })
    .unwrap();
    assert_eq!(sel.communicator, Communicator::SymmMem);
    assert_eq!(sel.communicator.class_name(), "SymmMemEplbCommunicator");
    assert_eq!(
        Communicator::from_name("symm_mem"),
        Some(Communicator::SymmMem)
    );
    for device in [DeviceKind::Rocm, DeviceKind::Xpu] {
        let e = eplb::select(&SelectRequest {
            device,
            ..req(Some("symm_mem"))
        })
        .unwrap_err();
        assert_err(
            &e,
            Status::InvalidArgument,
            "ValueError",
            "symm_mem EPLB requires CUDA",
        );
    }
    let e = eplb::select(&SelectRequest {
        device: DeviceKind::Cuda,
        ..req(Some("symm_mem"))
    })
    .unwrap_err();
    assert_err(
        &e,
        Status::NotImplemented,
        "NotImplementedError",
        "EPLB communicator 'symm_mem' on cuda tensors (SymmMemEplbCommunicator: a push into the receivers' buffers over CUDA symmetric memory) is not implemented in epcomm; stage the expert weights in host memory (kDLCPU), where epcomm pushes into next buffers in shared memory, or use 'nixl' or 'torch_gloo'",
    );
    // Through the configuration check: accepted by v0.34.0's literal (async too), refused
    // when the communicator is built; v0.33.0's literal lacks it.
    let e = eplb_err(r#""platform": "rocm", "eplb_config": {"communicator": "symm_mem"}"#);
    assert_eq!(e.to_string(), "symm_mem EPLB requires CUDA");
    let e = eplb_err(r#""vllm_version": "0.33.0", "eplb_config": {"communicator": "symm_mem"}"#);
    assert!(
        e.to_string()
            .contains("'nixl' or 'pynccl' [type=literal_error, input_value='symm_mem'"),
        "{e}"
    );
}

#[test]
fn elastic_rejects_other_communicators() {
    for name in ["torch_gloo", "symm_mem"] {
        let e = eplb::select(&SelectRequest {
            elastic: true,
            ..req(Some(name))
        })
        .unwrap_err();
        assert_err(&e, Status::InvalidArgument, "ValueError", &format!("Elastic EP requires 'torch_nccl', 'pynccl', or 'nixl' EPLB communicator (got '{name}')."));
    }
}

#[test]
fn elastic_forces_torch_nccl_to_pynccl_with_a_warning() {
    let s = eplb::select(&SelectRequest {
        elastic: true,
        ..req(Some("torch_nccl"))
    })
    .unwrap();
    assert_eq!(s.communicator, Communicator::Pynccl);
    assert_eq!(
        s.warnings,
        vec![
            "Stateless elastic EP requires PyNCCL backend. Forcing EPLB communicator to 'pynccl'."
                .to_owned()
        ]
    );
    let s = eplb::select(&SelectRequest {
        elastic: true,
        ..req(Some("nixl"))
    })
    .unwrap();
    assert_eq!(s.communicator, Communicator::Nixl);
    assert!(s.warnings.is_empty());
}

#[test]
fn pynccl_needs_cuda_like_devices() {
    let e = eplb::select(&SelectRequest {
        device: DeviceKind::Cpu,
        ..req(Some("pynccl"))
    })
    .unwrap_err();
    assert_err(
        &e,
        Status::Runtime,
        "RuntimeError",
        "EPLB communicator 'pynccl' supports only cuda-like devices (got cpu).",
    );
    // Elastic torch_nccl is forced to pynccl and then checked the same way.
    let e = eplb::select(&SelectRequest {
        device: DeviceKind::Cpu,
        elastic: true,
        ..req(Some("torch_nccl"))
    })
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "EPLB communicator 'pynccl' supports only cuda-like devices (got cpu)."
    );
    // ROCm tensors are `cuda` in PyTorch.
    eplb::select(&SelectRequest {
        device: DeviceKind::Rocm,
        ..req(Some("pynccl"))
    })
    .unwrap();
}

#[test]
fn pynccl_rejects_unsupported_dtypes_sorted() {
    let dtypes = [
        DType::BF16,
        DType::new(Code::Float8E5m2, 8),
        DType::new(Code::Bool, 8),
        DType::new(Code::Float8E5m2, 8),
    ];
    let e = eplb::select(&SelectRequest {
        weight_dtypes: &dtypes,
        ..req(Some("pynccl"))
    })
    .unwrap_err();
    assert_err(&e, Status::Runtime, "RuntimeError", "EPLB communicator 'pynccl' requested but expert weights contain unsupported dtypes: (torch.bool, torch.float8_e5m2).");
    let ok = [
        DType::BF16,
        DType::F32,
        DType::new(Code::Float8E4m3fn, 8),
        DType::new(Code::UInt, 8),
        DType::I64,
    ];
    eplb::select(&SelectRequest {
        weight_dtypes: &ok,
        ..req(Some("pynccl"))
    })
    .unwrap();
}

#[test]
fn pynccl_unavailable_without_nccl() {
    let e = eplb::select(&SelectRequest {
        nccl_available: false,
        ..req(Some("pynccl"))
    })
    .unwrap_err();
    assert_err(
        &e,
        Status::Unavailable,
        "RuntimeError",
        "EPLB communicator 'pynccl' requested but unavailable.",
    );
}

#[test]
fn construction_failures_wrap_the_cause() {
    assert_err(
        &Error::PyncclInit {
            cause: "ncclInvalidUsage".into(),
        },
        Status::Runtime,
        "RuntimeError",
        "Failed to initialize PyNcclEplbCommunicator (ncclInvalidUsage).",
    );
    assert_err(
        &Error::NixlInit {
            cause: "agent creation failed".into(),
        },
        Status::Runtime,
        "RuntimeError",
        "Failed to initialize NixlEplbCommunicator (agent creation failed).",
    );
}

#[test]
fn nixl_needs_the_library_then_cuda_like_devices() {
    let e = eplb::select(&SelectRequest {
        nixl_available: false,
        ..req(Some("nixl"))
    })
    .unwrap_err();
    assert_err(
        &e,
        Status::Unavailable,
        "RuntimeError",
        "EPLB communicator 'nixl' requested but NIXL is unavailable.",
    );
    let e = eplb::select(&SelectRequest {
        device: DeviceKind::Cpu,
        ..req(Some("nixl"))
    })
    .unwrap_err();
    assert_err(
        &e,
        Status::Runtime,
        "RuntimeError",
        "EPLB communicator 'nixl' supports only cuda-like devices (got cpu).",
    );
    let e = eplb::select(&SelectRequest {
        device: DeviceKind::Xpu,
        ..req(Some("nixl"))
    })
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "EPLB communicator 'nixl' supports only cuda-like devices (got xpu)."
    );
}

#[test]
fn auto_selection_order() {
    let auto = |elastic, nixl| {
        eplb::select(&SelectRequest {
            elastic,
            nixl_available: nixl,
            ..req(None)
        })
        .unwrap()
    };
    assert_eq!(auto(false, true).communicator, Communicator::Nixl);
    assert_eq!(auto(true, true).communicator, Communicator::Nixl);
    assert_eq!(auto(true, false).communicator, Communicator::Pynccl);
    assert_eq!(auto(false, false).communicator, Communicator::TorchGloo);
    assert!(auto(false, false).auto_selected);
    // torch_gloo works for host tensors.
    let s = eplb::select(&SelectRequest {
        device: DeviceKind::Cpu,
        nixl_available: false,
        ..req(None)
    })
    .unwrap();
    assert_eq!(s.communicator, Communicator::TorchGloo);
}

// ---- EPLB config validation ---------------------------------------------------------------------

const EPLB_BASE: &str =
    r#""enable_eplb": true, "enable_expert_parallel": true, "data_parallel_size": 2"#;

fn eplb_check(extra: &str) -> config::CheckOutcome {
    check(&format!(
        "{{{EPLB_BASE}{}{extra}}}",
        if extra.is_empty() { "" } else { ", " }
    ))
}

fn eplb_err(extra: &str) -> Error {
    eplb_check(extra).result.expect_err(extra)
}

#[test]
fn eplb_config_defaults() {
    let c = EplbConfig::default();
    assert_eq!(
        (c.window_size, c.step_interval, c.num_redundant_experts),
        (1000, 3000, None)
    );
    assert_eq!(
        (c.log_balancedness, c.log_balancedness_interval, c.use_async),
        (false, 1, true)
    );
    assert_eq!((c.policy.as_str(), c.communicator), ("default", None));
}

#[test]
fn async_eplb_policy_rule_and_the_policy_literal() {
    // From a configuration, EPLBPolicyOption's literal rejects any other policy before
    // EPLBConfig's validator runs, with or without async.
    let literal = "1 validation error for ParallelConfig\neplb_config.policy\n  Input should be 'default' [type=literal_error, input_value='custom', input_type=str]\n    For further information visit https://errors.pydantic.dev/2.13/v/literal_error";
    for extra in [
        r#""eplb_config": {"policy": "custom"}"#,
        r#""eplb_config": {"policy": "custom", "use_async": false}"#,
    ] {
        assert_err(
            &eplb_err(extra),
            Status::InvalidArgument,
            "ValueError",
            literal,
        );
    }
    // The validator itself (reachable from code only: the literal has one member).
    let c = EplbConfig {
        policy: "custom".into(),
        ..EplbConfig::default()
    };
    assert_err(
        &c.validate().unwrap_err(),
        Status::InvalidArgument,
        "ValueError",
        "Async EPLB is only supported with the default policy.",
    );
}

#[test]
fn async_eplb_rejects_nccl_communicators() {
    for c in ["torch_nccl", "pynccl"] {
        let e = eplb_check(&format!(r#""eplb_config": {{"communicator": "{c}"}}"#))
            .result
            .unwrap_err();
        assert_err(&e, Status::InvalidArgument, "ValueError", &format!("{c} communicator is incompatible with async EPLB due to NCCL multi-stream conflicts. Use 'torch_gloo' or 'nixl' instead, or leave communicator unset for automatic selection."));
    }
}

#[test]
fn log_balancedness_interval_rule() {
    let c = EplbConfig {
        log_balancedness: true,
        log_balancedness_interval: 0,
        ..EplbConfig::default()
    };
    assert_err(
        &c.validate().unwrap_err(),
        Status::InvalidArgument,
        "ValueError",
        "log_balancedness_interval must be greater than 0.",
    );
    // From JSON the field bound (pydantic gt=0) catches it first, as in vLLM.
    let e =
        eplb_check(r#""eplb_config": {"log_balancedness": true, "log_balancedness_interval": 0}"#)
            .result
            .unwrap_err();
    assert_eq!(
        e.to_string(),
        "1 validation error for ParallelConfig\neplb_config.log_balancedness_interval\n  Input should be greater than 0 [type=greater_than, input_value=0, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/greater_than"
    );
}

#[test]
fn field_bounds_use_pydantics_phrase() {
    let cases = [
        (
            r#"{"eplb_config": {"window_size": 0}}"#,
            "1 validation error for ParallelConfig\neplb_config.window_size\n  Input should be greater than 0 [type=greater_than, input_value=0, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/greater_than",
        ),
        (
            r#"{"eplb_config": {"step_interval": -3}}"#,
            "1 validation error for ParallelConfig\neplb_config.step_interval\n  Input should be greater than 0 [type=greater_than, input_value=-3, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/greater_than",
        ),
        (
            r#"{"eplb_config": {"num_redundant_experts": -1}}"#,
            "1 validation error for ParallelConfig\neplb_config.num_redundant_experts\n  Input should be greater than or equal to 0 [type=greater_than_equal, input_value=-1, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/greater_than_equal",
        ),
        (
            r#"{"tensor_parallel_size": 0}"#,
            "1 validation error for ParallelConfig\ntensor_parallel_size\n  Input should be greater than or equal to 1 [type=greater_than_equal, input_value=0, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/greater_than_equal",
        ),
        (
            r#"{"data_parallel_size": -1}"#,
            "1 validation error for ParallelConfig\ndata_parallel_size\n  Input should be greater than or equal to 1 [type=greater_than_equal, input_value=-1, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/greater_than_equal",
        ),
        (
            r#"{"pipeline_parallel_size": 0}"#,
            "1 validation error for ParallelConfig\npipeline_parallel_size\n  Input should be greater than or equal to 1 [type=greater_than_equal, input_value=0, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/greater_than_equal",
        ),
        (
            r#"{"prefill_context_parallel_size": 0}"#,
            "1 validation error for ParallelConfig\nprefill_context_parallel_size\n  Input should be greater than or equal to 1 [type=greater_than_equal, input_value=0, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/greater_than_equal",
        ),
        (
            r#"{"enable_eplb": "maybe"}"#,
            "1 validation error for ParallelConfig\nenable_eplb\n  Input should be a valid boolean, unable to interpret input [type=bool_parsing, input_value='maybe', input_type=str]\n    For further information visit https://errors.pydantic.dev/2.13/v/bool_parsing",
        ),
        (
            r#"{"data_parallel_size": 2.5}"#,
            "1 validation error for ParallelConfig\ndata_parallel_size\n  Input should be a valid integer, got a number with a fractional part [type=int_from_float, input_value=2.5, input_type=float]\n    For further information visit https://errors.pydantic.dev/2.13/v/int_from_float",
        ),
        (
            r#"{"all2all_backend": 3}"#,
            "1 validation error for ParallelConfig\nall2all_backend\n  Input should be 'naive', 'pplx', 'deepep_high_throughput', 'deepep_low_latency', 'deepep_v2', 'mori_high_throughput', 'mori_low_latency', 'moonep', 'mori', 'nixl_ep', 'allgather_reducescatter', 'flashinfer_all2allv', 'flashinfer_nvlink_two_sided', 'flashinfer_nvlink_one_sided' or 'passthrough' [type=literal_error, input_value=3, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/literal_error",
        ),
        (
            r#"{"eplb_config": []}"#,
            "1 validation error for ParallelConfig\neplb_config\n  Input should be a dictionary or an instance of EPLBConfig [type=dataclass_type, input_value=[], input_type=list]\n    For further information visit https://errors.pydantic.dev/2.13/v/dataclass_type",
        ),
        (
            r#"{"platform": "tpu"}"#,
            "1 validation error for EpcommOptions\nplatform\n  Input should be 'cuda', 'rocm', 'cpu' or 'xpu' [type=literal_error, input_value='tpu', input_type=str]\n    For further information visit https://errors.pydantic.dev/2.13/v/literal_error",
        ),
    ];
    for (json, msg) in cases {
        assert_err(&check_err(json), Status::InvalidArgument, "ValueError", msg);
    }
}

#[test]
fn lax_mode_coerces_as_pydantic_does() {
    let c = config::parse(
        r#"{"data_parallel_size": "4", "tensor_parallel_size": true, "pipeline_parallel_size": 2.0,
            "prefill_context_parallel_size": " 1_0 ", "enable_expert_parallel": "yes",
            "enable_eplb": 1, "eplb_config": {"use_async": "off", "window_size": "5.000"}}"#,
    )
    .unwrap();
    assert_eq!(
        (
            c.data_parallel_size,
            c.tensor_parallel_size,
            c.pipeline_parallel_size,
            c.prefill_context_parallel_size
        ),
        (4, 1, 2, 10)
    );
    assert!(c.enable_expert_parallel && c.enable_eplb && !c.eplb_config.use_async);
    assert_eq!(c.eplb_config.window_size, 5);
}

#[test]
fn every_field_error_in_declaration_order_then_unexpected_keywords() {
    let e = check_err(
        r#"{"foo": 1, "data_parallel_size": 0, "eplb_config": {"window_size": 0, "bar": 2}, "all2all_backend": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}"#,
    );
    assert_err(&e, Status::InvalidArgument, "ValueError", "5 validation errors for ParallelConfig\ndata_parallel_size\n  Input should be greater than or equal to 1 [type=greater_than_equal, input_value=0, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/greater_than_equal\neplb_config.window_size\n  Input should be greater than 0 [type=greater_than, input_value=0, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/greater_than\neplb_config.bar\n  Unexpected keyword argument [type=unexpected_keyword_argument, input_value=2, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/unexpected_keyword_argument\nall2all_backend\n  Input should be 'naive', 'pplx', 'deepep_high_throughput', 'deepep_low_latency', 'deepep_v2', 'mori_high_throughput', 'mori_low_latency', 'moonep', 'mori', 'nixl_ep', 'allgather_reducescatter', 'flashinfer_all2allv', 'flashinfer_nvlink_two_sided', 'flashinfer_nvlink_one_sided' or 'passthrough' [type=literal_error, input_value='xxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxx', input_type=str]\n    For further information visit https://errors.pydantic.dev/2.13/v/literal_error\nfoo\n  Unexpected keyword argument [type=unexpected_keyword_argument, input_value=1, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/unexpected_keyword_argument");
    let Error::ConfigField { field, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(field, "data_parallel_size");
}

/// The hint a field error carries; `Hint::hint` (what the C ABI and Python report) returns it.
fn field_hint(e: &Error) -> Option<&str> {
    match e {
        Error::ConfigField { hint, .. } => {
            assert_eq!(e.hint().as_deref(), hint.as_deref(), "Hint::hint of {e:?}");
            hint.as_deref()
        }
        other => panic!("not a field error: {other:?}"),
    }
}

#[test]
fn unknown_keys_are_unexpected_keywords_with_the_nearest_key_as_hint() {
    let e = check_err(r#"{"enable_epl": true}"#);
    assert_err(
        &e,
        Status::InvalidArgument,
        "ValueError",
        "1 validation error for ParallelConfig\nenable_epl\n  Unexpected keyword argument [type=unexpected_keyword_argument, input_value=True, input_type=bool]\n    For further information visit https://errors.pydantic.dev/2.13/v/unexpected_keyword_argument",
    );
    assert_eq!(field_hint(&e), Some("did you mean 'enable_eplb'?"));
    let e = check_err(r#"{"eplb_config": {"windowsize": 10}}"#);
    assert_eq!(e.to_string(), "1 validation error for ParallelConfig\neplb_config.windowsize\n  Unexpected keyword argument [type=unexpected_keyword_argument, input_value=10, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/unexpected_keyword_argument");
    assert_eq!(
        field_hint(&e),
        Some("did you mean 'eplb_config.window_size'?")
    );
    // A vLLM field epcomm does not model is not called unexpected: vLLM accepts it.
    let e = check_err(r#"{"decode_context_parallel_size": 2}"#);
    assert_err(&e, Status::InvalidArgument, "ValueError", "'decode_context_parallel_size' is a field of vLLM's ParallelConfig that epcomm's check does not model; remove it to check the rest");
}

#[test]
fn unknown_names_are_rejected_by_the_configs_literals() {
    let e = check_err(r#"{"eplb_config": {"communicator": "gloo"}}"#);
    assert_err(&e, Status::InvalidArgument, "ValueError", "1 validation error for ParallelConfig\neplb_config.communicator\n  Input should be 'torch_nccl', 'torch_gloo', 'torch_xccl', 'nixl', 'pynccl' or 'symm_mem' [type=literal_error, input_value='gloo', input_type=str]\n    For further information visit https://errors.pydantic.dev/2.13/v/literal_error");
    let e = check_err(r#"{"all2all_backend": "deepep"}"#);
    assert_err(&e, Status::InvalidArgument, "ValueError", "1 validation error for ParallelConfig\nall2all_backend\n  Input should be 'naive', 'pplx', 'deepep_high_throughput', 'deepep_low_latency', 'deepep_v2', 'mori_high_throughput', 'mori_low_latency', 'moonep', 'mori', 'nixl_ep', 'allgather_reducescatter', 'flashinfer_all2allv', 'flashinfer_nvlink_two_sided', 'flashinfer_nvlink_one_sided' or 'passthrough' [type=literal_error, input_value='deepep', input_type=str]\n    For further information visit https://errors.pydantic.dev/2.13/v/literal_error");
    // The hint: the nearest of the literal's members (no other release accepts these).
    assert_eq!(
        field_hint(&e),
        Some("did you mean 'deepep_high_throughput' or 'deepep_low_latency' or 'deepep_v2'?")
    );
    let e = check_err(r#"{"eplb_config": {"communicator": "gloo"}}"#);
    assert_eq!(field_hint(&e), Some("did you mean 'torch_gloo'?"));
}

#[test]
fn vllm_version_key_selects_the_release() {
    check_ok(r#"{"vllm_version": "0.33.0", "all2all_backend": "deepep_v2"}"#);
    // An unknown release: versions::release's error, as it is.
    let e = check_err(r#"{"vllm_version": "0.0.1"}"#);
    assert_eq!(e, versions::release("0.0.1").unwrap_err());
    let e = check_err(r#"{"vllm_version": 33}"#);
    assert_err(&e, Status::InvalidArgument, "ValueError", "1 validation error for EpcommOptions\nvllm_version\n  Input should be a valid string [type=string_type, input_value=33, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/string_type");
}

#[test]
fn an_older_release_rejects_newer_names_with_its_own_literals() {
    // vLLM 0.20.0's All2AllBackend and EPLBCommunicatorBackend (vllm/config/parallel.py there).
    let e = check_err(r#"{"vllm_version": "0.20.0", "all2all_backend": "deepep_v2"}"#);
    assert_err(&e, Status::InvalidArgument, "ValueError", "1 validation error for ParallelConfig\nall2all_backend\n  Input should be 'naive', 'pplx', 'deepep_high_throughput', 'deepep_low_latency', 'mori', 'nixl_ep', 'allgather_reducescatter', 'flashinfer_all2allv', 'flashinfer_nvlink_two_sided' or 'flashinfer_nvlink_one_sided' [type=literal_error, input_value='deepep_v2', input_type=str]\n    For further information visit https://errors.pydantic.dev/2.13/v/literal_error");
    let release = versions::release("0.20.0").unwrap();
    let hint = versions::all2all_hint("deepep_v2", release);
    assert!(hint.is_some());
    assert_eq!(field_hint(&e), hint.as_deref());
    let e =
        check_err(r#"{"vllm_version": "0.20.0", "eplb_config": {"communicator": "torch_xccl"}}"#);
    assert_err(&e, Status::InvalidArgument, "ValueError", "1 validation error for ParallelConfig\neplb_config.communicator\n  Input should be 'torch_nccl', 'torch_gloo', 'nixl' or 'pynccl' [type=literal_error, input_value='torch_xccl', input_type=str]\n    For further information visit https://errors.pydantic.dev/2.13/v/literal_error");
    assert_eq!(
        field_hint(&e),
        versions::eplb_hint("torch_xccl", release).as_deref()
    );
    // A release whose EPLBConfig has no communicator field: the key is an unexpected keyword.
    let old = versions::releases()
        .iter()
        .rev()
        .find(|r| r.eplb_communicators.is_empty() && r.all2all_rule == NameRule::Literal)
        .expect("a Literal-era release without EPLB communicators");
    let e = check_err(&format!(
        r#"{{"vllm_version": "{}", "eplb_config": {{"communicator": "nixl"}}}}"#,
        old.version
    ));
    assert_err(&e, Status::InvalidArgument, "ValueError", "1 validation error for ParallelConfig\neplb_config.communicator\n  Unexpected keyword argument [type=unexpected_keyword_argument, input_value='nixl', input_type=str]\n    For further information visit https://errors.pydantic.dev/2.13/v/unexpected_keyword_argument");
    assert_eq!(field_hint(&e), versions::eplb_hint("nixl", old).as_deref());
}

#[test]
fn eplb_config_alone_is_validated_as_eplb_config() {
    let e = config::parse_eplb_config_json(r#"{"window_size": 0}"#).unwrap_err();
    assert_err(&e, Status::InvalidArgument, "ValueError", "1 validation error for EPLBConfig\nwindow_size\n  Input should be greater than 0 [type=greater_than, input_value=0, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/greater_than");
    // Its model validator keeps vLLM's raised text (no pydantic "Value error, " wrapper).
    let e = config::parse_eplb_config_json(r#"{"communicator": "pynccl"}"#).unwrap_err();
    assert_err(&e, Status::InvalidArgument, "ValueError", "pynccl communicator is incompatible with async EPLB due to NCCL multi-stream conflicts. Use 'torch_gloo' or 'nixl' instead, or leave communicator unset for automatic selection.");
}

#[test]
fn malformed_json_is_a_clear_error() {
    let e = check_err("{not json");
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(
        e.to_string()
            .starts_with("configuration is not valid JSON: "),
        "{e}"
    );
    let e = check_err("[1, 2]");
    assert!(
        e.to_string()
            .starts_with("configuration must be a JSON object"),
        "{e}"
    );
}

#[test]
fn eplb_needs_cuda_rocm_or_xpu() {
    // vLLM v0.33.0 text.
    let e = eplb_check(r#""platform": "cpu""#).result.unwrap_err();
    assert_err(
        &e,
        Status::InvalidArgument,
        "ValueError",
        "Expert parallelism load balancing is only supported on CUDA devices or ROCm devices or XPU devices now.",
    );
    eplb_check(r#""platform": "rocm""#).result.unwrap();
    eplb_check(r#""platform": "xpu""#).result.unwrap();
}

#[test]
fn torch_xccl_is_auto_selected_on_xpu_and_built_host_staged() {
    assert_eq!(
        eplb::VLLM_COMMUNICATOR_NAMES,
        [
            "torch_nccl",
            "torch_gloo",
            "torch_xccl",
            "nixl",
            "pynccl",
            "symm_mem"
        ]
    );
    // The configuration: auto-selected on XPU even with NIXL present, announced as vLLM does.
    let o = eplb_check(r#""platform": "xpu", "nixl_available": true"#);
    let r = o.result.unwrap();
    assert_eq!(r.eplb_communicator, Some(Communicator::TorchXccl));
    assert!(r.eplb_communicator_auto);
    assert!(o.infos.contains(
        &"Initialized EPLB communicator: TorchDistXCCLStagedEplbCommunicator.".to_owned()
    ));
    // Named explicitly: accepted by EPLBConfig's literal, async included.
    let o = eplb_check(r#""eplb_config": {"communicator": "torch_xccl"}"#);
    assert_eq!(
        o.result.unwrap().eplb_communicator,
        Some(Communicator::TorchXccl)
    );
    // Elastic EP: vLLM's factory rejects it like any name but torch_nccl, pynccl, nixl.
    let e = eplb::select(&SelectRequest {
        elastic: true,
        ..req(Some("torch_xccl"))
    })
    .unwrap_err();
    assert_err(&e, Status::InvalidArgument, "ValueError", "Elastic EP requires 'torch_nccl', 'pynccl', or 'nixl' EPLB communicator (got 'torch_xccl').");
    // The factory: chosen and built (host-staged over the group; device memory is refused when
    // the communicator is created, src/eplb/communicator.rs).
    let xpu = SelectRequest {
        device: DeviceKind::Xpu,
        ..req(None)
    };
    let sel = eplb::select(&xpu).unwrap();
    assert_eq!(
        (sel.communicator, sel.auto_selected),
        (Communicator::TorchXccl, true)
    );
    let named = eplb::select(&req(Some("torch_xccl"))).unwrap();
    assert_eq!(
        (named.communicator, named.auto_selected),
        (Communicator::TorchXccl, false)
    );
    // A typo suggests it.
    let e = eplb::select(&req(Some("torch_xcc"))).unwrap_err();
    assert!(e.hint().unwrap().contains("'torch_xccl'"), "{:?}", e.hint());
}

#[test]
fn eplb_needs_expert_parallel() {
    let e = check_err(r#"{"enable_eplb": true, "data_parallel_size": 2}"#);
    assert_err(
        &e,
        Status::InvalidArgument,
        "ValueError",
        "enable_expert_parallel must be True to use EPLB.",
    );
}

#[test]
fn eplb_needs_some_parallelism() {
    let e = check_err(r#"{"enable_eplb": true, "enable_expert_parallel": true}"#);
    assert_err(
        &e,
        Status::InvalidArgument,
        "ValueError",
        "EPLB requires tensor, prefill-context, or data parallelism, but got TP=1, PCP=1, DP=1.",
    );
    check(r#"{"enable_eplb": true, "enable_expert_parallel": true, "prefill_context_parallel_size": 2}"#).result.unwrap();
}

#[test]
fn redundant_experts_need_eplb() {
    let e = check_err(r#"{"eplb_config": {"num_redundant_experts": 32}}"#);
    assert_err(&e, Status::InvalidArgument, "ValueError", "num_redundant_experts is set to 32 but EPLB is not enabled. Either enable EPLB or unset num_redundant_experts.");
}

#[test]
fn elastic_ep_needs_eplb() {
    let e = check_err(r#"{"enable_elastic_ep": true}"#);
    assert_err(
        &e,
        Status::InvalidArgument,
        "ValueError",
        "Elastic EP is only supported with enable_eplb=True.",
    );
}

#[test]
fn elastic_ep_rejects_pipeline_parallelism() {
    let e = eplb_check(r#""enable_elastic_ep": true, "pipeline_parallel_size": 2"#)
        .result
        .unwrap_err();
    assert_err(
        &e,
        Status::InvalidArgument,
        "ValueError",
        "Elastic EP is not supported with pipeline parallelism (pipeline_parallel_size=2).",
    );
}

#[test]
fn elastic_ep_rejects_hybrid_lb_only() {
    let e = eplb_err(r#""enable_elastic_ep": true, "data_parallel_hybrid_lb": true"#);
    assert_err(&e, Status::NotImplemented, "NotImplementedError", "Elastic EP is not compatible with data_parallel_hybrid_lb. Elastic EP supports a single API server/core client path or data_parallel_external_lb, but not hybrid load balancing.");
    // vLLM v0.33.0 allows data_parallel_external_lb with elastic EP.
    let r = eplb_check(
        r#""enable_elastic_ep": true, "data_parallel_external_lb": true, "nixl_available": true"#,
    )
    .result
    .unwrap();
    assert_eq!(r.eplb_communicator, Some(Communicator::Nixl));
}

#[test]
fn enable_migration_batching_is_accepted() {
    let c = config::parse_eplb_config_json(r#"{"enable_migration_batching": true}"#).unwrap();
    assert!(c.enable_migration_batching && c.migration_batching_enabled());
    // vLLM's property: batching applies to async EPLB only.
    let c = config::parse_eplb_config_json(
        r#"{"enable_migration_batching": true, "use_async": false}"#,
    )
    .unwrap();
    assert!(!c.migration_batching_enabled());
    assert!(!EplbConfig::default().enable_migration_batching);
    eplb_check(r#""eplb_config": {"enable_migration_batching": true}"#)
        .result
        .unwrap();
    // pydantic's lax bool takes 1; 3 is refused.
    eplb_check(r#""eplb_config": {"enable_migration_batching": 1}"#)
        .result
        .unwrap();
    let e = check_err(r#"{"eplb_config": {"enable_migration_batching": 3}}"#);
    assert_err(
        &e,
        Status::InvalidArgument,
        "ValueError",
        "1 validation error for ParallelConfig\neplb_config.enable_migration_batching\n  Input should be a valid boolean, unable to interpret input [type=bool_parsing, input_value=3, input_type=int]\n    For further information visit https://errors.pydantic.dev/2.13/v/bool_parsing",
    );
}

#[test]
fn num_redundant_experts_has_no_upper_bound() {
    for n in [1023i64, 1024, i64::MAX] {
        let json = format!(r#""eplb_config": {{"num_redundant_experts": {n}}}"#);
        eplb_check(&json).result.unwrap();
    }
}

#[test]
fn external_lb_needs_data_parallelism() {
    let e = check_err(r#"{"data_parallel_external_lb": true}"#);
    assert_err(
        &e,
        Status::InvalidArgument,
        "ValueError",
        "data_parallel_external_lb can only be set when data_parallel_size > 1",
    );
    assert_eq!(
        e.hint().as_deref(),
        Some("set data_parallel_size > 1 or data_parallel_external_lb=false")
    );
    check_ok(r#"{"data_parallel_external_lb": true, "data_parallel_size": 2}"#);
}

#[test]
fn moonep_does_not_support_eplb() {
    let e = eplb_err(r#""all2all_backend": "moonep""#);
    assert_err(&e, Status::InvalidArgument, "ValueError", "The moonep all2all backend does not support EPLB yet: EPLB rearranges expert parameters in a layout MoonEP's replicated [E+B] weights do not follow. Disable --enable-eplb or use a different --all2all-backend.");
    // Without EPLB the configuration passes; building the manager is what fails.
    check_ok(r#"{"all2all_backend": "moonep"}"#);
}

#[test]
fn elastic_async_eplb_needs_nixl() {
    let e = eplb_check(r#""enable_elastic_ep": true, "nixl_available": false"#)
        .result
        .unwrap_err();
    assert_err(&e, Status::InvalidArgument, "ValueError", "Elastic EP with async EPLB requires the NIXL package. Either install NIXL or set --eplb-config.use_async=false.");
    // With NIXL the communicator is auto-selected as nixl.
    let r = eplb_check(r#""enable_elastic_ep": true, "nixl_available": true"#)
        .result
        .unwrap();
    assert_eq!(r.eplb_communicator, Some(Communicator::Nixl));
    assert!(r.eplb_communicator_auto);
}

#[test]
fn config_applies_the_factory_rules() {
    // Elastic without NIXL, sync EPLB: auto picks pynccl, which needs NCCL.
    let o = eplb_check(
        r#""enable_elastic_ep": true, "nixl_available": false, "eplb_config": {"use_async": false}, "nccl_available": false"#,
    );
    assert_eq!(
        o.result.unwrap_err().to_string(),
        "EPLB communicator 'pynccl' requested but unavailable."
    );
    let o = eplb_check(
        r#""enable_elastic_ep": true, "nixl_available": false, "eplb_config": {"use_async": false}, "nccl_available": true"#,
    );
    assert_eq!(
        o.result.unwrap().eplb_communicator,
        Some(Communicator::Pynccl)
    );
    // Elastic + torch_nccl: forced to pynccl with the warning.
    let o = eplb_check(
        r#""enable_elastic_ep": true, "eplb_config": {"use_async": false, "communicator": "torch_nccl"}, "nccl_available": true"#,
    );
    assert_eq!(
        o.result.unwrap().eplb_communicator,
        Some(Communicator::Pynccl)
    );
    assert_eq!(o.warnings, vec![eplb::W_ELASTIC_FORCES_PYNCCL.to_owned()]);
    // Elastic + torch_gloo: rejected.
    let o = eplb_check(
        r#""enable_elastic_ep": true, "eplb_config": {"use_async": false, "communicator": "torch_gloo"}"#,
    );
    assert_eq!(o.result.unwrap_err().to_string(), "Elastic EP requires 'torch_nccl', 'pynccl', or 'nixl' EPLB communicator (got 'torch_gloo').");
    // Explicit nixl without the library.
    let o = eplb_check(r#""eplb_config": {"communicator": "nixl"}, "nixl_available": false"#);
    assert_eq!(
        o.result.unwrap_err().to_string(),
        "EPLB communicator 'nixl' requested but NIXL is unavailable."
    );
    // Default: torch_gloo, announced as vLLM does.
    let o = eplb_check(r#""nixl_available": false"#);
    assert_eq!(
        o.result.unwrap().eplb_communicator,
        Some(Communicator::TorchGloo)
    );
    assert!(o.infos.contains(
        &"Initialized EPLB communicator: TorchDistGlooStagedEplbCommunicator.".to_owned()
    ));
}

#[test]
fn rules_run_in_vllms_order() {
    // EPLBConfig validators run before ParallelConfig's checks.
    let o = check(r#"{"enable_elastic_ep": true, "eplb_config": {"communicator": "pynccl"}}"#);
    assert!(o
        .result
        .unwrap_err()
        .to_string()
        .starts_with("pynccl communicator is incompatible"));
    // __post_init__ (elastic) before _validate_parallel_config (platform).
    let o = check(
        r#"{"enable_eplb": true, "enable_elastic_ep": true, "pipeline_parallel_size": 2, "platform": "cpu"}"#,
    );
    assert_eq!(o.result.unwrap_err(), Error::ElasticPipeline { pp: 2 });
    // Parallel-config checks before the DBO check.
    let o = check(r#"{"enable_eplb": true, "enable_dbo": true}"#);
    assert_eq!(o.result.unwrap_err(), Error::EplbNeedsExpertParallel);
}

#[test]
fn every_status_has_a_description_and_exception() {
    for s in Status::ALL {
        assert!(!s.description().is_empty());
        assert_eq!(Status::from_code(s as i32), Some(s));
        if s == Status::Ok {
            assert_eq!(s.exception(), None);
        } else {
            let ex = s.exception().unwrap();
            assert!([
                "ValueError",
                "RuntimeError",
                "NotImplementedError",
                "AssertionError",
                "TimeoutError"
            ]
            .contains(&ex));
        }
    }
    assert_eq!(Status::Timeout.exception(), Some("TimeoutError"));
    assert_eq!(Status::from_code(999), None);
}

/// A name means what the targeted release means by it: a backend of that release epcomm lacks
/// is NOT_IMPLEMENTED (not "unknown"); a backend v0.33.0 removed but the release runs itself
/// falls back with a warning that says so; a name canonical then but an alias now does not warn.
#[test]
fn names_mean_what_the_targeted_release_means() {
    // 0.15.0 to 0.22.1's `mori` built MoriAll2AllManager (MoRI EPv1), as v0.34.0's does.
    let o = config::check_json(
        r#"{"vllm_version": "0.20.0", "all2all_backend": "mori"}"#,
        false,
        false,
    );
    let r = o.result.unwrap();
    assert_eq!(r.backend, Some(Backend::Mori));
    assert_eq!(r.manager_class, "MoriAll2AllManager");
    assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    let o = config::check_json(
        r#"{"vllm_version": "0.10.2", "all2all_backend": "pplx"}"#,
        false,
        false,
    );
    let r = o.result.unwrap();
    assert_eq!(r.backend, Some(Backend::AllgatherReducescatter));
    assert_eq!(
        o.warnings,
        ["vLLM 0.10.2 runs all2all backend 'pplx' as its own backend; epcomm has none and runs 'allgather_reducescatter' instead."]
    );
    // v0.34.0 itself: pplx is removed, with vLLM's own warning.
    let o = config::check_json(r#"{"all2all_backend": "pplx"}"#, false, false);
    assert_eq!(o.warnings.len(), 1);
    assert!(o.warnings[0].contains("pplx"), "{:?}", o.warnings);
    assert!(
        !o.warnings[0].starts_with("vLLM 0.34.0 runs"),
        "{:?}",
        o.warnings
    );
    // flashinfer_all2allv: canonical in 0.11.0, a deprecated alias in v0.34.0.
    let old = r#"{"vllm_version": "0.11.0", "all2all_backend": "flashinfer_all2allv"}"#;
    let o = config::check_json(old, false, false);
    assert_eq!(
        o.result.unwrap().backend,
        Some(Backend::FlashinferNvlinkTwoSided)
    );
    assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    let o = config::check_json(
        r#"{"all2all_backend": "flashinfer_all2allv"}"#,
        false,
        false,
    );
    assert!(
        o.warnings[0].starts_with("'flashinfer_all2allv' is deprecated"),
        "{:?}",
        o.warnings
    );
}
