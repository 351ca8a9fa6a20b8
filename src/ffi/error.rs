//! Error, status and version queries.

use std::ffi::c_char;

use super::guard;
use crate::error::Status;

/// The message of the last failed call on this thread, or NULL if none failed yet.
///
/// Where vLLM raises an error for the same condition, this is exactly vLLM's text, with one
/// difference: element types are named as C code writes an epcomm_dtype, their name, DLPack
/// type code and bits ("float32 (kDLFloat, 32 bits)", "bfloat16 (kDLBfloat, 16 bits)") where
/// vLLM prints PyTorch's ("torch.float32"); epcomm_last_error_message_torch has PyTorch's. The
/// pointer stays valid until the next failing call on this thread. Successful calls leave it
/// unchanged.
#[no_mangle]
pub extern "C" fn epcomm_last_error_message() -> *const c_char {
    guard::call_or(std::ptr::null(), guard::last_error_message)
}

/// epcomm_last_error_message with element types named as PyTorch names them ("torch.float32"),
/// as vLLM's own messages do: the text the Python package raises. NULL if no call failed yet
/// on this thread; valid as long as epcomm_last_error_message.
#[no_mangle]
pub extern "C" fn epcomm_last_error_message_torch() -> *const c_char {
    guard::call_or(std::ptr::null(), guard::last_error_message_torch)
}

/// A remediation hint for the last failure on this thread (e.g. "did you mean
/// 'flashinfer_nvlink_two_sided'?"), or NULL if it has none. Never part of the message.
/// Valid until the next failing call on this thread.
#[no_mangle]
pub extern "C" fn epcomm_last_error_hint() -> *const c_char {
    guard::call_or(std::ptr::null(), guard::last_error_hint)
}

/// Forgets this thread's last error (message and hint become NULL).
#[no_mangle]
pub extern "C" fn epcomm_clear_last_error() {
    guard::call_or((), guard::clear_last_error)
}

/// Static description of a status code; never NULL ("unknown status" for unknown codes).
#[no_mangle]
pub extern "C" fn epcomm_status_string(status: i32) -> *const c_char {
    guard::call_or(c"unknown status".as_ptr(), || {
        match Status::from_code(status) {
            Some(s) => guard::static_cstr(s.description()),
            None => c"unknown status".as_ptr(),
        }
    })
}

/// The Python exception class vLLM raises for a status: "ValueError", "RuntimeError",
/// "NotImplementedError", "AssertionError" or "TimeoutError". NULL for EPCOMM_OK; "RuntimeError"
/// for unknown codes.
#[no_mangle]
pub extern "C" fn epcomm_status_exception(status: i32) -> *const c_char {
    guard::call_or(std::ptr::null(), || match Status::from_code(status) {
        Some(s) => s.exception().map_or(std::ptr::null(), guard::static_cstr),
        None => guard::static_cstr("RuntimeError"),
    })
}

/// The library version, "MAJOR.MINOR.PATCH" (static string).
#[no_mangle]
pub extern "C" fn epcomm_version() -> *const c_char {
    guard::call_or(std::ptr::null(), || {
        guard::static_cstr(env!("CARGO_PKG_VERSION"))
    })
}

/// The ABI version this library implements; equals EPCOMM_ABI_VERSION of the header it was
/// built with.
#[no_mangle]
pub extern "C" fn epcomm_abi_version() -> i32 {
    super::EPCOMM_ABI_VERSION
}

/// For bindings' own tests: panics inside epcomm with `message` (NULL = a fixed text) and shows
/// that the panic is caught. Always returns EPCOMM_ERROR_INTERNAL with the panic text as the
/// last error message.
///
/// Only in debug builds (what the test suites load) and not in the header: the release library
/// that `make install` and the packages ship exports no test-only symbol. Callers declare
/// `int32_t epcomm_test_panic(const char *message);` themselves.
///
/// # Safety
/// `message` is NULL or a NUL-terminated string.
#[cfg(debug_assertions)]
#[no_mangle]
pub unsafe extern "C" fn epcomm_test_panic(message: *const c_char) -> i32 {
    use crate::error::Error;
    guard::call(|| {
        // SAFETY: caller contract.
        let text = unsafe { guard::str_arg(message, "message") }
            .unwrap_or("epcomm_test_panic")
            .to_owned();
        if text.is_empty() {
            return Err(Error::Internal(String::new()));
        }
        panic!("{text}");
    })
}
