//! Built with `--features cuda,nccl` on a machine without CUDA/NCCL: every GPU entry point
//! reports unavailability as a status with a clear message, never a panic.
#![cfg(feature = "nccl")]

use std::ffi::CStr;

use epcomm::ffi::config::epcomm_config_check;
use epcomm::ffi::error::epcomm_last_error_message;
use epcomm::ffi::runtime::{epcomm_cuda_check, epcomm_nccl_version};
use epcomm::ffi::{EPCOMM_ERROR_UNAVAILABLE, EPCOMM_OK};

fn last_message() -> String {
    let p = epcomm_last_error_message();
    assert!(!p.is_null());
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn nccl_present() -> bool {
    epcomm::probe::nccl().is_ok()
}

#[test]
fn nccl_version_reports_unavailable() {
    let mut v = -7;
    let rc = unsafe { epcomm_nccl_version(&mut v) };
    if nccl_present() {
        assert_eq!(rc, EPCOMM_OK);
        assert!(v > 0);
        return;
    }
    assert_eq!(rc, EPCOMM_ERROR_UNAVAILABLE);
    assert_eq!(v, -7, "output must not be written on failure");
    let expect = match std::env::var("VLLM_NCCL_SO_PATH") {
        Ok(p) if !p.is_empty() => {
            format!("NCCL is unavailable: NCCL not found (tried {p}, libnccl.so.2, libnccl.so)")
        }
        _ => "NCCL is unavailable: NCCL not found (tried libnccl.so.2, libnccl.so)".to_owned(),
    };
    assert_eq!(last_message(), expect);
}

#[test]
fn cuda_check_reports_unavailable() {
    let rc = epcomm_cuda_check();
    if epcomm::probe::cuda().is_ok() {
        assert_eq!(rc, EPCOMM_OK);
        return;
    }
    assert_eq!(rc, EPCOMM_ERROR_UNAVAILABLE);
    let msg = last_message();
    assert!(msg.starts_with("CUDA is unavailable: "), "{msg}");
}

#[test]
fn pynccl_config_reports_the_spec_message() {
    if nccl_present() {
        return;
    }
    let cfg = c"{\"enable_eplb\": true, \"enable_expert_parallel\": true, \"data_parallel_size\": 2, \"eplb_config\": {\"use_async\": false, \"communicator\": \"pynccl\"}}";
    let rc = unsafe { epcomm_config_check(cfg.as_ptr()) };
    assert_eq!(rc, EPCOMM_ERROR_UNAVAILABLE);
    assert_eq!(
        last_message(),
        "EPLB communicator 'pynccl' requested but unavailable."
    );
}
