//! One `EPCOMM_*` variable read raw, and the one wording of an invalid value: below both
//! [`crate::log`] (which owns `EPCOMM_LOG_LEVEL`) and [`crate::env`] (every other variable,
//! whose warnings go through `log`), so neither imports the other's caller.

use std::ffi::OsString;

/// The value of `var`: `None` when unset or empty (after trimming), `Err` with the raw value
/// when it is not UTF-8.
pub(crate) fn read(var: &str) -> Option<Result<String, OsString>> {
    let raw = std::env::var_os(var)?;
    match raw.into_string() {
        Ok(s) => Some(s.trim().to_owned()).filter(|s| !s.is_empty()).map(Ok),
        Err(raw) => Some(Err(raw)),
    }
}

/// The warning for an invalid value: `invalid {var}='{value}' (expected {expected}); using
/// {instead}`. Control characters and quotes in the value are escaped, so it stays one line.
pub fn invalid_message(var: &str, value: &str, expected: &str, instead: &str) -> String {
    format!(
        "invalid {var}='{}' (expected {expected}); using {instead}",
        value.escape_debug()
    )
}

/// A non-UTF-8 value as text for a warning.
pub(crate) fn lossy(raw: &OsString) -> String {
    raw.to_string_lossy().into_owned()
}
