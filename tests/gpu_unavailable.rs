//! On a machine without CUDA/NCCL (any build; the first tests need `--features cuda,nccl`):
//! every GPU entry point checks its arguments, then reports unavailability as a status with a
//! clear message, never a panic; outputs stay untouched on failure.

use std::ffi::{c_void, CStr};

use epcomm::ffi::all2all::{
    epcomm_all2all, epcomm_all2all_create, epcomm_all2all_destroy, epcomm_all2all_dispatch,
    epcomm_dispatch_output, epcomm_moe_config, epcomm_moe_config_init,
};
#[cfg(feature = "nccl")]
use epcomm::ffi::config::epcomm_config_check;
use epcomm::ffi::error::epcomm_last_error_message;
use epcomm::ffi::gpu::*;
use epcomm::ffi::group::{epcomm_group, epcomm_group_create_shm, epcomm_group_destroy};
#[cfg(feature = "nccl")]
use epcomm::ffi::runtime::{epcomm_cuda_check, epcomm_nccl_version};
use epcomm::ffi::tensor::{epcomm_device, epcomm_tensor};
use epcomm::ffi::{
    epcomm_dtype, EPCOMM_ERROR_INVALID_ARGUMENT, EPCOMM_ERROR_NULL_POINTER,
    EPCOMM_ERROR_UNAVAILABLE, EPCOMM_OK,
};

fn last_message() -> String {
    let p = epcomm_last_error_message();
    assert!(!p.is_null());
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn nccl_present() -> bool {
    epcomm::probe::nccl().is_ok()
}

#[cfg(feature = "nccl")]
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

#[cfg(feature = "nccl")]
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

#[cfg(feature = "nccl")]
#[test]
fn pynccl_config_reports_vllms_message() {
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

/// The exact message of a missing NCCL library (what `epcomm_nccl_version` reports).
fn nccl_missing_message() -> String {
    if !cfg!(feature = "nccl") {
        return "NCCL is unavailable: epcomm was built without the 'nccl' feature".into();
    }
    match std::env::var("VLLM_NCCL_SO_PATH") {
        Ok(p) if !p.is_empty() => {
            format!("NCCL is unavailable: NCCL not found (tried {p}, libnccl.so.2, libnccl.so)")
        }
        _ => "NCCL is unavailable: NCCL not found (tried libnccl.so.2, libnccl.so)".to_owned(),
    }
}

/// True when the GPU entry points could get past "unavailable" here (then skip).
fn gpu_present() -> bool {
    cfg!(feature = "nccl") && epcomm::probe::cuda().is_ok() && nccl_present()
}

/// The message a create reports on this machine: the missing feature, then CUDA, then NCCL.
fn assert_create_unavailable(rc: i32) {
    assert_eq!(rc, EPCOMM_ERROR_UNAVAILABLE);
    let msg = last_message();
    if !cfg!(feature = "nccl") {
        assert_eq!(msg, nccl_missing_message());
    } else if epcomm::probe::cuda().is_err() {
        assert!(msg.starts_with("CUDA is unavailable: "), "{msg}");
    } else {
        assert_eq!(msg, nccl_missing_message());
    }
}

fn config() -> epcomm_moe_config {
    let mut c = std::mem::MaybeUninit::<epcomm_moe_config>::uninit();
    assert_eq!(unsafe { epcomm_moe_config_init(c.as_mut_ptr()) }, EPCOMM_OK);
    let mut c = unsafe { c.assume_init() };
    c.num_experts = 8;
    c.top_k = 2;
    c.hidden_size = 16;
    c.max_tokens_per_rank = 4;
    c
}

#[test]
fn cuda_caps_json_in_every_build() {
    let mut needed = 0usize;
    // NULL `needed`.
    assert_eq!(
        unsafe { epcomm_cuda_caps(std::ptr::null_mut(), 0, std::ptr::null_mut()) },
        EPCOMM_ERROR_NULL_POINTER
    );
    // Size query.
    assert_eq!(
        unsafe { epcomm_cuda_caps(std::ptr::null_mut(), 0, &mut needed) },
        EPCOMM_OK
    );
    assert!(needed > 2);
    // NULL buffer with a length.
    assert_eq!(
        unsafe { epcomm_cuda_caps(std::ptr::null_mut(), 8, &mut needed) },
        EPCOMM_ERROR_NULL_POINTER
    );
    // Too small: an error, the buffer untouched, `needed` told.
    let mut small = vec![0x55u8; needed - 1];
    let mut n2 = 0usize;
    let rc = unsafe { epcomm_cuda_caps(small.as_mut_ptr().cast(), small.len(), &mut n2) };
    assert_eq!(rc, EPCOMM_ERROR_INVALID_ARGUMENT);
    assert_eq!(n2, needed);
    assert!(small.iter().all(|&b| b == 0x55));
    assert!(
        last_message().contains("too small for the caps JSON"),
        "{}",
        last_message()
    );
    // Exact size.
    let mut buf = vec![0u8; needed];
    let rc = unsafe { epcomm_cuda_caps(buf.as_mut_ptr().cast(), buf.len(), &mut n2) };
    assert_eq!(rc, EPCOMM_OK);
    let text = CStr::from_bytes_with_nul(&buf).unwrap().to_str().unwrap();
    let j: serde_json::Value = serde_json::from_str(text).unwrap();
    assert!(j["cuda"]["available"].is_boolean());
    assert!(j["nccl"]["available"].is_boolean());
    assert!(j["nvrtc"]["available"].is_boolean());
    if epcomm::probe::cuda().is_err() {
        assert_eq!(j["cuda"]["available"], false);
        assert!(j["cuda"]["reason"].is_string());
    }
}

#[test]
fn nccl_unique_id_unavailable() {
    assert_eq!(
        unsafe { epcomm_nccl_unique_id(std::ptr::null_mut()) },
        EPCOMM_ERROR_NULL_POINTER
    );
    if cfg!(feature = "nccl") && nccl_present() {
        return;
    }
    let mut id = [7u8; 128];
    let rc = unsafe { epcomm_nccl_unique_id(id.as_mut_ptr()) };
    assert_eq!(rc, EPCOMM_ERROR_UNAVAILABLE);
    assert_eq!(last_message(), nccl_missing_message());
    assert!(id.iter().all(|&b| b == 7), "output written on failure");
}

#[test]
fn gpu_create_checks_arguments_then_reports_unavailable() {
    let cfg = config();
    let id = [0u8; 128];
    let be = c"deepep_low_latency";
    let mut out: *mut epcomm_gpu_all2all = std::ptr::null_mut();
    let create = |backend: *const std::ffi::c_char,
                  cfg: *const epcomm_moe_config,
                  id: *const u8,
                  rank: i32,
                  world: i32,
                  device: i32,
                  mode: i32,
                  out: *mut *mut epcomm_gpu_all2all| unsafe {
        epcomm_gpu_all2all_create(backend, cfg, id, rank, world, device, mode, out)
    };
    assert_eq!(
        create(std::ptr::null(), &cfg, id.as_ptr(), 0, 1, 0, 0, &mut out),
        EPCOMM_ERROR_NULL_POINTER
    );
    assert_eq!(last_message(), "argument 'backend' must not be NULL");
    assert_eq!(
        create(
            be.as_ptr(),
            std::ptr::null(),
            id.as_ptr(),
            0,
            1,
            0,
            0,
            &mut out
        ),
        EPCOMM_ERROR_NULL_POINTER
    );
    assert_eq!(
        create(be.as_ptr(), &cfg, std::ptr::null(), 0, 1, 0, 0, &mut out),
        EPCOMM_ERROR_NULL_POINTER
    );
    assert_eq!(
        create(
            be.as_ptr(),
            &cfg,
            id.as_ptr(),
            0,
            1,
            0,
            0,
            std::ptr::null_mut()
        ),
        EPCOMM_ERROR_NULL_POINTER
    );
    assert_eq!(
        create(be.as_ptr(), &cfg, id.as_ptr(), 2, 2, 0, 0, &mut out),
        EPCOMM_ERROR_INVALID_ARGUMENT
    );
    assert_eq!(last_message(), "rank 2 is not in a group of 2 ranks");
    assert_eq!(
        create(be.as_ptr(), &cfg, id.as_ptr(), 0, 0, 0, 0, &mut out),
        EPCOMM_ERROR_INVALID_ARGUMENT
    );
    assert_eq!(
        create(be.as_ptr(), &cfg, id.as_ptr(), 0, 1, 0, 2, &mut out),
        EPCOMM_ERROR_INVALID_ARGUMENT
    );
    assert_eq!(
        last_message(),
        "mode is 2; expected EPCOMM_GPU_MODE_COUNTS (0) or EPCOMM_GPU_MODE_CAPACITY (1)"
    );
    assert_eq!(
        create(be.as_ptr(), &cfg, id.as_ptr(), 0, 1, -1, 0, &mut out),
        EPCOMM_ERROR_INVALID_ARGUMENT
    );
    let mut small = cfg;
    small.struct_size = 4;
    assert_eq!(
        create(be.as_ptr(), &small, id.as_ptr(), 0, 1, 0, 0, &mut out),
        EPCOMM_ERROR_INVALID_ARGUMENT
    );
    assert!(out.is_null());
    if gpu_present() {
        return;
    }
    let rc = create(
        be.as_ptr(),
        &cfg,
        id.as_ptr(),
        0,
        1,
        0,
        EPCOMM_GPU_MODE_CAPACITY,
        &mut out,
    );
    assert_create_unavailable(rc);
    assert!(out.is_null(), "output written on failure");
}

#[test]
fn gpu_create_from_comm_unavailable() {
    let cfg = config();
    let be = c"deepep_high_throughput";
    let mut out: *mut epcomm_gpu_all2all = std::ptr::null_mut();
    let rc = unsafe {
        epcomm_gpu_all2all_create_from_comm(be.as_ptr(), &cfg, std::ptr::null_mut(), 0, 0, &mut out)
    };
    assert_eq!(rc, EPCOMM_ERROR_NULL_POINTER);
    assert_eq!(last_message(), "argument 'nccl_comm' must not be NULL");
    let rc = unsafe {
        epcomm_gpu_all2all_create_from_comm(be.as_ptr(), &cfg, 8 as *mut c_void, 0, 5, &mut out)
    };
    assert_eq!(rc, EPCOMM_ERROR_INVALID_ARGUMENT);
    if gpu_present() {
        return;
    }
    // A bogus (never dereferenced) communicator: the library checks come first.
    let rc = unsafe {
        epcomm_gpu_all2all_create_from_comm(be.as_ptr(), &cfg, 8 as *mut c_void, 0, 0, &mut out)
    };
    assert_create_unavailable(rc);
    assert!(out.is_null());
}

#[test]
fn gpu_calls_on_null_handles() {
    let mut o = std::mem::MaybeUninit::<epcomm_dispatch_output>::zeroed();
    let null: *const epcomm_tensor = std::ptr::null();
    let nm: *mut epcomm_gpu_all2all = std::ptr::null_mut();
    let st: *mut c_void = std::ptr::null_mut();
    unsafe {
        epcomm_gpu_all2all_destroy(nm);
        assert_eq!(
            epcomm_gpu_all2all_dispatch(nm, st, null, null, null, null, 0, o.as_mut_ptr()),
            EPCOMM_ERROR_NULL_POINTER
        );
        assert_eq!(last_message(), "argument 'a2a' must not be NULL");
        assert_eq!(
            epcomm_gpu_all2all_dispatch(nm, st, null, null, null, null, 0, std::ptr::null_mut()),
            EPCOMM_ERROR_NULL_POINTER
        );
        assert_eq!(last_message(), "argument 'out' must not be NULL");
        assert_eq!(
            epcomm_gpu_all2all_dispatch(nm, st, null, null, null, null, 2, o.as_mut_ptr()),
            EPCOMM_ERROR_NULL_POINTER
        );
        assert_eq!(last_message(), "argument 'extras' must not be NULL");
        assert_eq!(
            epcomm_gpu_all2all_combine(nm, st, null, null),
            EPCOMM_ERROR_NULL_POINTER
        );
        assert_eq!(
            epcomm_gpu_all2all_check_error(nm, st),
            EPCOMM_ERROR_NULL_POINTER
        );
        let size = std::mem::size_of::<epcomm_gpu_all2all_stats>();
        assert_eq!(size, 40);
        let mut stats = epcomm_gpu_all2all_stats {
            struct_size: size as u32,
            ..Default::default()
        };
        assert_eq!(
            epcomm_gpu_all2all_get_stats(nm, &mut stats),
            EPCOMM_ERROR_NULL_POINTER
        );
        assert_eq!(last_message(), "argument 'a2a' must not be NULL");
        assert_eq!(
            epcomm_gpu_all2all_get_stats(nm, std::ptr::null_mut()),
            EPCOMM_ERROR_NULL_POINTER
        );
        assert_eq!(last_message(), "argument 'stats_out' must not be NULL");
        stats.struct_size = 8;
        assert_eq!(
            epcomm_gpu_all2all_get_stats(nm, &mut stats),
            EPCOMM_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            last_message(),
            "stats_out->struct_size is 8: set it to sizeof(epcomm_gpu_all2all_stats) = 40"
        );
        assert_eq!(
            stats,
            epcomm_gpu_all2all_stats {
                struct_size: 8,
                ..Default::default()
            }
        );
    }
}

/// CUDA tensors given to the host-tensor functions: an error naming the GPU functions.
#[test]
fn cuda_tensors_to_host_dispatch_name_the_gpu_function() {
    let name = format!("epcomm-gpu-unavail-{}", std::process::id());
    let cname = std::ffi::CString::new(name).unwrap();
    let mut g: *mut epcomm_group = std::ptr::null_mut();
    let rc = unsafe { epcomm_group_create_shm(cname.as_ptr(), 0, 1, std::ptr::null(), &mut g) };
    assert_eq!(rc, EPCOMM_OK, "{}", last_message());
    let cfg = config();
    let mut a: *mut epcomm_all2all = std::ptr::null_mut();
    let rc = unsafe { epcomm_all2all_create(g, c"deepep_high_throughput".as_ptr(), &cfg, &mut a) };
    assert_eq!(rc, EPCOMM_OK, "{}", last_message());
    let mut x = vec![0u16; 16];
    let mut ids = vec![0i32; 2];
    let mut w = vec![0f32; 2];
    let mut xs = [1i64, 16];
    let mut ks = [1i64, 2];
    let t = |data: *mut c_void, device_type: i32, shape: &mut [i64], code: u8, bits: u8| {
        epcomm_tensor {
            data,
            device: epcomm_device {
                device_type,
                device_id: 0,
            },
            ndim: 2,
            dtype: epcomm_dtype {
                code,
                bits,
                lanes: 1,
            },
            shape: shape.as_mut_ptr(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        }
    };
    let hx = t(x.as_mut_ptr().cast(), 2, &mut xs, 4, 16);
    let hi = t(ids.as_mut_ptr().cast(), 1, &mut ks, 0, 32);
    let hw = t(w.as_mut_ptr().cast(), 1, &mut ks.clone(), 2, 32);
    let mut o = std::mem::MaybeUninit::<epcomm_dispatch_output>::zeroed();
    let rc =
        unsafe { epcomm_all2all_dispatch(a, &hx, &hi, &hw, std::ptr::null(), 0, o.as_mut_ptr()) };
    assert_eq!(rc, EPCOMM_ERROR_INVALID_ARGUMENT);
    let msg = last_message();
    assert!(
        msg.starts_with("tensor 'hidden' is on device type CUDA (2)")
            && msg.contains("epcomm_gpu_all2all_dispatch"),
        "{msg}"
    );
    unsafe {
        epcomm_all2all_destroy(a);
        epcomm_group_destroy(g);
    }
}
