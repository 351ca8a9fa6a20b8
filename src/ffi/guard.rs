//! The boundary every C entry point goes through: catch_unwind, thread-local last error,
//! argument conversion.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, OnceLock};

use crate::error::{Error, Result, Status};
use crate::select::Hint;

struct LastError {
    /// Element types in C terms (`dtype_names`), for C and C++ callers.
    message: CString,
    /// The core's text: element types as PyTorch names them, for the Python package.
    torch_message: CString,
    hint: Option<CString>,
}

thread_local! {
    static LAST_ERROR: RefCell<Option<LastError>> = const { RefCell::new(None) };
}

fn to_cstring(s: &str) -> CString {
    CString::new(s.replace('\0', "\\0")).unwrap_or_default()
}

/// Records `e` as this thread's last error.
fn set_last_error(e: &Error) {
    let text = e.to_string();
    let last = LastError {
        message: to_cstring(&super::dtype_names::with_c_dtype_names(&text)),
        torch_message: to_cstring(&text),
        hint: e.hint().map(|h| to_cstring(&h)),
    };
    LAST_ERROR.with(|l| *l.borrow_mut() = Some(last));
}

/// Pointer to one text of this thread's last error (NULL if none failed yet or it has none).
fn last_error_text(text: impl FnOnce(&LastError) -> Option<&CString>) -> *const c_char {
    LAST_ERROR.with(|l| {
        l.borrow()
            .as_ref()
            .and_then(text)
            .map_or(std::ptr::null(), |t| t.as_ptr())
    })
}

/// Pointer to this thread's last error message, element types in C terms (NULL if none).
pub(crate) fn last_error_message() -> *const c_char {
    last_error_text(|e| Some(&e.message))
}

/// Pointer to this thread's last error message with PyTorch's dtype names (NULL if none).
pub(crate) fn last_error_message_torch() -> *const c_char {
    last_error_text(|e| Some(&e.torch_message))
}

/// Pointer to this thread's last error hint (NULL if none).
pub(crate) fn last_error_hint() -> *const c_char {
    last_error_text(|e| e.hint.as_ref())
}

pub(crate) fn clear_last_error() {
    LAST_ERROR.with(|l| *l.borrow_mut() = None);
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_owned()
    }
}

/// Runs a fallible entry point: status 0 on success; otherwise the error's status, with the
/// message and hint stored for `epcomm_last_error_*`. A panic becomes `EPCOMM_ERROR_INTERNAL`
/// with the panic text as the message.
pub(crate) fn call(f: impl FnOnce() -> Result<()>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => Status::Ok as i32,
        Ok(Err(e)) => {
            set_last_error(&e);
            e.status() as i32
        }
        Err(payload) => {
            let e = Error::Internal(panic_text(payload));
            set_last_error(&e);
            Status::Internal as i32
        }
    }
}

/// Runs an infallible entry point (a getter); a panic returns `default`.
pub(crate) fn call_or<T>(default: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(payload) => {
            set_last_error(&Error::Internal(panic_text(payload)));
            default
        }
    }
}

/// A borrowed UTF-8 string argument; NULL and invalid UTF-8 are errors naming the argument.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that outlives the call.
pub(crate) unsafe fn str_arg<'a>(p: *const c_char, what: &'static str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::NullPointer(what));
    }
    // SAFETY: non-NULL and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Error::InvalidArgument(format!("argument '{what}' is not valid UTF-8")))
}

/// A static name as a C string for a name getter: NULL when there is none (an unknown code)
/// and after a caught panic.
pub(crate) fn name_or_null(name: impl FnOnce() -> Option<&'static str>) -> *const c_char {
    call_or(std::ptr::null(), || {
        name().map_or(std::ptr::null(), static_cstr)
    })
}

/// The most entries of `T` one array argument can have: no object in memory is larger than
/// `isize::MAX` bytes (a longer slice would be undefined behaviour, and a copy of it a panic).
pub(crate) fn max_entries<T>() -> usize {
    isize::MAX as usize / std::mem::size_of::<T>().max(1)
}

/// `n` as the entry count of array argument `what`: INVALID_ARGUMENT naming it and the limit
/// when no such array fits in memory. The one home of that check: every array argument goes
/// through it ([`slice_arg`], [`slice_mut_arg`], [`entries`]).
pub(crate) fn check_entries<T>(n: usize, what: &str) -> Result<usize> {
    let max = max_entries::<T>();
    if n > max {
        return Err(Error::InvalidArgument(format!(
            "'{what}' has {n} entries; expected at most {max} (entries of {} bytes; a larger array does not fit in memory)",
            std::mem::size_of::<T>()
        )));
    }
    Ok(n)
}

/// The entry count `a × b` of array argument `what` (e.g. num_layers × num_slots), checked as
/// [`check_entries`]: a product that overflows is INVALID_ARGUMENT too, never a panic or a
/// wrapped size.
pub(crate) fn entries<T>(a: usize, b: usize, what: &str) -> Result<usize> {
    match a.checked_mul(b) {
        Some(n) => check_entries::<T>(n, what),
        None => Err(Error::InvalidArgument(format!(
            "'{what}' has {a} x {b} entries, which overflows; expected at most {} (entries of {} bytes)",
            max_entries::<T>(),
            std::mem::size_of::<T>()
        ))),
    }
}

/// `n` entries at `p`; NULL is allowed only when `n` is 0 (else the NULL-pointer error naming
/// `what`); more entries than fit in memory is INVALID_ARGUMENT ([`check_entries`]).
///
/// # Safety
/// `p` is NULL or valid for reads of `n` entries that outlive the call.
pub(crate) unsafe fn slice_arg<'a, T>(
    p: *const T,
    n: usize,
    what: &'static str,
) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    check_entries::<T>(n, what)?;
    if p.is_null() {
        return Err(Error::NullPointer(what));
    }
    // SAFETY: non-NULL with n entries (caller contract), n * size_of::<T>() <= isize::MAX.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// [`slice_arg`] for an output array.
///
/// # Safety
/// `p` is NULL or valid for writes of `n` entries, overlaps no live slice and outlives the
/// call.
pub(crate) unsafe fn slice_mut_arg<'a, T>(
    p: *mut T,
    n: usize,
    what: &'static str,
) -> Result<&'a mut [T]> {
    if n == 0 {
        return Ok(&mut []);
    }
    check_entries::<T>(n, what)?;
    if p.is_null() {
        return Err(Error::NullPointer(what));
    }
    // SAFETY: non-NULL with n writable entries (caller contract), within isize::MAX bytes.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
}

/// A required output pointer.
///
/// # Safety
/// `p` is NULL or valid for writes of `T`.
pub(crate) unsafe fn out_arg<'a, T>(p: *mut T, what: &'static str) -> Result<&'a mut T> {
    // SAFETY: non-NULL is checked; validity is the caller's contract.
    unsafe { p.as_mut() }.ok_or(Error::NullPointer(what))
}

/// An options struct's `struct_size` at least `size_of::<T>()`, else INVALID_ARGUMENT naming
/// the argument `arg` and the type `ty`, whose `{ty}_init` fills it.
pub(crate) fn struct_size_arg<T>(struct_size: u32, arg: &str, ty: &str) -> Result<()> {
    let want = std::mem::size_of::<T>();
    if (struct_size as usize) < want {
        return Err(Error::InvalidArgument(format!(
            "{arg}->struct_size is {struct_size}: expected sizeof({ty}) = {want} (call {ty}_init)"
        )));
    }
    Ok(())
}

/// A NUL-terminated copy of a static string, made once and kept for the process.
pub(crate) fn static_cstr(s: &'static str) -> *const c_char {
    static CACHE: OnceLock<Mutex<HashMap<&'static str, &'static CStr>>> = OnceLock::new();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    cache
        .entry(s)
        .or_insert_with(|| Box::leak(to_cstring(s).into_boxed_c_str()))
        .as_ptr()
}
