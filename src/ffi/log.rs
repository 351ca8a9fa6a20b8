//! Log routing: a host callback receives the bare message; stderr (the default) gets one
//! prefixed line per message.

use std::ffi::{c_char, c_void, CString};
use std::sync::Arc;

use super::guard;
use crate::error::Error;
use crate::log::{self, Level};

/// Receives one log message: `level` is an EPCOMM_LOG_* value, `message` the bare text (vLLM's
/// wording, no prefix, no newline) valid only during the call, `user_data` what was passed to
/// epcomm_set_log_callback. May be called from any thread that calls into epcomm.
pub type epcomm_log_fn =
    Option<unsafe extern "C" fn(level: i32, message: *const c_char, user_data: *mut c_void)>;

struct UserData(*mut c_void);
// SAFETY: the pointer is only handed back to the host's callback; the host owns its thread
// safety (documented on epcomm_set_log_callback).
unsafe impl Send for UserData {}
unsafe impl Sync for UserData {}

/// Routes epcomm's log messages (vLLM's warnings and infos, with vLLM's wording) to `callback`,
/// which receives each bare message: errors, warnings and infos (and debug messages when the
/// level is EPCOMM_LOG_DEBUG); it filters itself. NULL restores the default: messages at or
/// above the level go to stderr, each as one line written at once, prefixed like NCCL's:
/// `{host}:{pid}:{tid} [{rank}] epcomm {LEVEL} {message}`, where `host` is the short host name,
/// `tid` the kernel thread id, LEVEL one of ERROR, WARNING, INFO, DEBUG, and ` [{rank}]` the
/// logging thread's rank where epcomm knows it (the rank of the last shared-memory group the
/// thread joined; absent otherwise). Process-wide; `user_data` must stay valid until replaced.
#[no_mangle]
pub extern "C" fn epcomm_set_log_callback(callback: epcomm_log_fn, user_data: *mut c_void) {
    let user = UserData(user_data);
    guard::call_or((), move || match callback {
        None => log::set_sink(None),
        Some(f) => {
            let sink: log::Sink = Arc::new(move |level: Level, msg: &str| {
                let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
                let user = &user;
                // SAFETY: the host gave us this function pointer and user data for this purpose.
                unsafe { f(level as i32, c.as_ptr(), user.0) };
            });
            log::set_sink(Some(sink));
        }
    })
}

/// Sets the log level (EPCOMM_LOG_ERROR..EPCOMM_LOG_DEBUG); the initial level comes from the
/// environment variable EPCOMM_LOG_LEVEL (error, warn, info or debug, any case), default warn;
/// another value logs one warning and uses warn.
#[no_mangle]
pub extern "C" fn epcomm_set_log_level(level: i32) -> i32 {
    guard::call(|| {
        let l = Level::from_code(level).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "log level {level} is not valid: expected EPCOMM_LOG_ERROR (1), EPCOMM_LOG_WARN (2), EPCOMM_LOG_INFO (3) or EPCOMM_LOG_DEBUG (4)"
            ))
        })?;
        log::set_level(l);
        Ok(())
    })
}
