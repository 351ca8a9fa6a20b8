//! epcomm_config_check / epcomm_config_check_report on arbitrary bytes (cut at the first NUL,
//! as C sees them): never a panic (EPCOMM_ERROR_INTERNAL), a message on every failure, and a
//! report that is JSON and agrees with the check.
#![no_main]

use std::ffi::{c_char, CStr};

use epcomm::ffi::config::{epcomm_config_check, epcomm_config_check_report};
use epcomm::ffi::error::{epcomm_clear_last_error, epcomm_last_error_message};
use epcomm::ffi::log::epcomm_set_log_callback;
use epcomm::ffi::{EPCOMM_ERROR_INTERNAL, EPCOMM_OK};
use libfuzzer_sys::fuzz_target;

unsafe extern "C" fn drop_log(_level: i32, _message: *const c_char, _user: *mut std::ffi::c_void) {}

/// vLLM's warnings would flood stderr (and slow the fuzzer down).
fn quiet() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| epcomm_set_log_callback(Some(drop_log), std::ptr::null_mut()));
}

fn message() -> Option<String> {
    let p = epcomm_last_error_message();
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fuzz_target!(|data: &[u8]| {
    quiet();
    let mut c: Vec<u8> = data.iter().copied().take_while(|&b| b != 0).collect();
    c.push(0);
    let p = c.as_ptr().cast::<c_char>();

    epcomm_clear_last_error();
    let rc = unsafe { epcomm_config_check(p) };
    let msg = message();
    assert_ne!(rc, EPCOMM_ERROR_INTERNAL, "caught panic: {msg:?}");
    assert_eq!(
        rc == EPCOMM_OK,
        msg.is_none(),
        "status {rc} with message {msg:?}"
    );
    assert!(msg.as_deref() != Some(""), "empty message");

    let mut len = 0usize;
    let rc2 = unsafe { epcomm_config_check_report(p, std::ptr::null_mut(), 0, &mut len) };
    assert_ne!(rc2, EPCOMM_ERROR_INTERNAL, "caught panic: {:?}", message());
    if rc2 != EPCOMM_OK {
        // Only an argument that is not UTF-8 gets no report, and then the check failed alike.
        assert!(std::str::from_utf8(&c[..c.len() - 1]).is_err());
        assert_eq!(rc2, rc);
        return;
    }
    let mut buf = vec![0u8; len + 1];
    let rc3 =
        unsafe { epcomm_config_check_report(p, buf.as_mut_ptr().cast(), buf.len(), &mut len) };
    assert_eq!(rc3, EPCOMM_OK);
    let report: serde_json::Value =
        serde_json::from_slice(&buf[..len]).expect("the report is JSON");
    assert_eq!(report["ok"].as_bool(), Some(rc == EPCOMM_OK), "{report}");
    if rc != EPCOMM_OK {
        assert_eq!(report["status"].as_i64(), Some(rc as i64), "{report}");
    }
});
