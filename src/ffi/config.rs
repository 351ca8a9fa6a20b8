//! Configuration checking ("validate before launch").

use std::ffi::c_char;

use super::guard;
use crate::error::Error;
use crate::probe;
use crate::select::config;

/// Checks a vLLM-style configuration (JSON object with ParallelConfig/EPLBConfig field names:
/// all2all_backend, enable_expert_parallel, enable_eplb, eplb_config{...}, enable_elastic_ep,
/// enable_dbo, enable_fault_tolerance, enable_lora, tensor_parallel_size, data_parallel_size,
/// pipeline_parallel_size, prefill_context_parallel_size, data_parallel_external_lb,
/// data_parallel_hybrid_lb, platform (cuda|rocm|cpu|xpu), num_experts, nixl_available,
/// nccl_available, vllm_version, vllm_release; vLLM 0.34.0's mori_ep_v2 and
/// expert_placement_strategy; draft_model_is_moe) with vLLM's rules in vLLM's order. Returns the
/// first error's status with vLLM's exact message (and a hint); logs every warning vLLM would
/// log. Field errors are pydantic's `str(ValidationError)` as vLLM's pinned pydantic 2.13
/// prints it (every field error); `vllm_version` (default "0.34.0") selects the release whose
/// all2all and EPLB communicator names are accepted; `vllm_release` gives that release as data
/// instead (the JSON object python/epcomm/vllm_release.py prints for a vLLM source tree or
/// installed package: version, source, rule, error, default, names, status, resolves, eplb), so
/// a release newer than epcomm's table is checked exactly.
///
/// # Safety
/// `config_json` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn epcomm_config_check(config_json: *const c_char) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let json = unsafe { guard::str_arg(config_json, "config_json") }?;
        config::check_json(json, probe::nccl_usable(), probe::nixl_usable())
            .result
            .map(|_| ())
    })
}

/// Checks a configuration like epcomm_config_check (without logging) and writes a JSON report:
/// {"ok": true, "all2all_backend", "manager_class", "layout", "eplb_communicator", ...,
/// "warnings": [...], "infos": [...]} or {"ok": false, "status", "exception", "message",
/// "hint", "warnings", "infos"}. For `passthrough` "layout" is null (no exchange); on XPU with
/// EPLB "eplb_communicator" is "torch_xccl" (host-staged in epcomm). Returns EPCOMM_OK whenever
/// a report was produced (the verdict is inside it). Call with `buffer` NULL and `buffer_len` 0 to learn the size: `*report_len_out`
/// is the report's length without the terminating NUL; a non-NULL buffer must hold that plus 1.
///
/// # Safety
/// `config_json` is NULL or a NUL-terminated string; `buffer` is NULL or writable for
/// `buffer_len` bytes; `report_len_out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn epcomm_config_check_report(
    config_json: *const c_char,
    buffer: *mut c_char,
    buffer_len: usize,
    report_len_out: *mut usize,
) -> i32 {
    guard::call(|| {
        // SAFETY: caller contract.
        let json = unsafe { guard::str_arg(config_json, "config_json") }?;
        let len_out = unsafe { guard::out_arg(report_len_out, "report_len_out") }?;
        let outcome = match config::parse(json) {
            Ok(c) => config::check(&c, probe::nccl_usable(), probe::nixl_usable()),
            Err(e) => config::CheckOutcome {
                result: Err(e),
                warnings: Vec::new(),
                infos: Vec::new(),
            },
        };
        let report = outcome.to_json().to_string();
        if !buffer.is_null() {
            if buffer_len < report.len() + 1 {
                return Err(Error::InvalidArgument(format!(
                    "buffer_len is {buffer_len}: the report needs {} bytes (call with buffer NULL to query the size)",
                    report.len() + 1
                )));
            }
            // SAFETY: buffer holds at least report.len() + 1 bytes (checked above).
            unsafe {
                std::ptr::copy_nonoverlapping(report.as_ptr(), buffer.cast::<u8>(), report.len());
                *buffer.add(report.len()) = 0;
            }
        } else if buffer_len != 0 {
            return Err(Error::NullPointer("buffer"));
        }
        *len_out = report.len();
        Ok(())
    })
}
