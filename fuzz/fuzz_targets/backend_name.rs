//! epcomm_all2all_backend_resolve / epcomm_all2all_backend_is_known on arbitrary bytes: a name
//! resolves exactly when it is one of vLLM's accepted names, is_known agrees, an unknown name
//! gets vLLM's message, and nothing panics.
#![no_main]

use std::ffi::{c_char, CStr};

use epcomm::ffi::error::{epcomm_clear_last_error, epcomm_last_error_message};
use epcomm::ffi::log::epcomm_set_log_callback;
use epcomm::ffi::select::{epcomm_all2all_backend_is_known, epcomm_all2all_backend_resolve};
use epcomm::ffi::{EPCOMM_ERROR_INVALID_ARGUMENT, EPCOMM_OK};
use epcomm::select::all2all::ACCEPTED_NAMES;
use libfuzzer_sys::fuzz_target;

unsafe extern "C" fn drop_log(_level: i32, _message: *const c_char, _user: *mut std::ffi::c_void) {}

/// vLLM's warnings would flood stderr (and slow the fuzzer down).
fn quiet() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| epcomm_set_log_callback(Some(drop_log), std::ptr::null_mut()));
}

fuzz_target!(|data: &[u8]| {
    quiet();
    let mut c: Vec<u8> = data.iter().copied().take_while(|&b| b != 0).collect();
    c.push(0);
    let p = c.as_ptr().cast::<c_char>();
    let text = std::str::from_utf8(&c[..c.len() - 1]).ok();
    let want = text.and_then(|t| ACCEPTED_NAMES.iter().find(|n| n.name == t));

    epcomm_clear_last_error();
    let mut out = -77;
    let rc = unsafe { epcomm_all2all_backend_resolve(p, &mut out) };
    let known = unsafe { epcomm_all2all_backend_is_known(p) };
    match want {
        Some(n) => {
            assert_eq!(rc, EPCOMM_OK);
            assert_eq!(out, n.backend as i32);
            assert!(known);
        }
        None => {
            assert_eq!(rc, EPCOMM_ERROR_INVALID_ARGUMENT);
            assert_eq!(out, -77, "output written by a failing call");
            assert!(!known);
            let m = epcomm_last_error_message();
            assert!(!m.is_null());
            let m = unsafe { CStr::from_ptr(m) }.to_string_lossy();
            if let Some(t) = text {
                assert_eq!(m, format!("Unknown all2all backend: {t}"));
            }
        }
    }
});
