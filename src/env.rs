//! Every `EPCOMM_*` environment variable the library reads, parsed in this one place, except
//! `EPCOMM_LOG_LEVEL`: the logger reads that one itself ([`crate::log`]), since this module logs
//! its warnings through the logger (the name is re-exported here).
//!
//! | Variable | Accepted values | Unset or empty | Invalid value |
//! |---|---|---|---|
//! | `EPCOMM_LOG_LEVEL` | `error`, `warn` (or `warning`), `info`, `debug`, any case | `warn` | `warn` |
//! | `EPCOMM_TIMEOUT_S` | seconds, `0 < s <= 86400` (one day), fractions allowed (`2.5`) | 60 s | 60 s |
//! | `EPCOMM_SHM_DIRECT` | `1` (peers read buffers directly where the kernel allows), `0` (stage through shared memory) | `1` | `1` |
//! | `EPCOMM_NO_SIMD` | `1` (scalar kernels only), `0` (AVX2 kernels where the CPU has them) | `0` | `1` |
//! | `EPCOMM_FAULT_POINT` | one of [`crate::fault::POINTS`] (test use: the process kills itself there) | no fault | no fault |
//! | `EPCOMM_NVRTC_PATH` | a UTF-8 path: `libnvrtc.so.*` or a directory holding it | default search | default search (non-UTF-8); a path that does not hold NVRTC is an error of the first NVRTC use, naming it |
//! | `EPCOMM_CACHE_DIR` | any path (created on first use) | `$XDG_CACHE_HOME/epcomm`, else `~/.cache/epcomm` | — |
//! | `EPCOMM_NVRTC_LINEINFO` | `1` (compile the CUDA kernels with `-lineinfo`: source lines in compute-sanitizer and profiler reports), `0` | `0` | `0` |
//!
//! Values other than paths are trimmed of surrounding whitespace; an empty value counts as unset. A value
//! outside what is accepted logs one warning per process and variable that names the variable,
//! the value, what is accepted and what is used instead, for example
//! `invalid EPCOMM_TIMEOUT_S='abc' (expected seconds > 0, at most 86400 (one day)); using the default 60 s`.
//! An invalid `EPCOMM_NO_SIMD` turns the AVX2 kernels off, as any value did before `0` and `1`
//! were told apart: whoever sets it means to turn them off.
//!
//! Other `EPCOMM_*` names are not the library's: the test suite reads `EPCOMM_REQUIRE_*` and
//! `EPCOMM_TEST_*`, the `epcomm` tool passes `EPCOMM_CLI_*` to its own rank processes.
//!
//! Variables read once per process: `EPCOMM_LOG_LEVEL`, `EPCOMM_NO_SIMD`, `EPCOMM_FAULT_POINT`,
//! `EPCOMM_NVRTC_PATH`, `EPCOMM_CACHE_DIR`, `EPCOMM_NVRTC_LINEINFO`. `EPCOMM_TIMEOUT_S` and `EPCOMM_SHM_DIRECT` are read
//! again by every group created, so a host may change them between groups.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use crate::log;
pub use crate::log::{log_level, LOG_LEVEL};
pub use crate::var::invalid_message;
use crate::var::{lossy, read};

/// Default bound on every wait of a group, in seconds.
pub const TIMEOUT_S: &str = "EPCOMM_TIMEOUT_S";
/// Shared-memory groups: `0` turns direct reads of peers' buffers off.
pub const SHM_DIRECT: &str = "EPCOMM_SHM_DIRECT";
/// `1` turns the AVX2 reduction kernels off.
pub const NO_SIMD: &str = "EPCOMM_NO_SIMD";
/// Fault injection for the reliability tests.
pub const FAULT_POINT: &str = "EPCOMM_FAULT_POINT";
/// Where NVRTC is loaded from.
pub const NVRTC_PATH: &str = "EPCOMM_NVRTC_PATH";
/// The on-disk cache of compiled GPU kernels.
pub const CACHE_DIR: &str = "EPCOMM_CACHE_DIR";
/// Compile the CUDA kernels with line information.
pub const NVRTC_LINEINFO: &str = "EPCOMM_NVRTC_LINEINFO";

/// The largest `EPCOMM_TIMEOUT_S` (the bound `epcomm_group_options.timeout_s` has too): one
/// day. A longer bound is no bound in practice (a hung peer would never be reported), and far
/// larger values would overflow the deadline arithmetic.
pub const MAX_TIMEOUT_S: f64 = 86400.0;

/// Logs [`invalid_message`] the first time `var` is found invalid in this process.
fn warn_invalid(var: &'static str, value: &str, expected: &str, instead: &str) {
    static WARNED: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
    let first = WARNED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashSet::new)
        .insert(var);
    if first {
        log::warn(&invalid_message(var, value, expected, instead));
    }
}

/// The bound on every wait of a group unless `EPCOMM_TIMEOUT_S` or the group's options say
/// otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// `EPCOMM_TIMEOUT_S` as a duration; `None` when unset or invalid (the caller's default,
/// [`DEFAULT_TIMEOUT`], applies).
pub fn timeout() -> Option<Duration> {
    let bad = |v: &str| {
        let instead = format!("the default {} s", DEFAULT_TIMEOUT.as_secs_f64());
        warn_invalid(
            TIMEOUT_S,
            v,
            "seconds > 0, at most 86400 (one day)",
            &instead,
        );
        None
    };
    match read(TIMEOUT_S)? {
        Ok(v) => match v.parse::<f64>() {
            Ok(s) if s > 0.0 && s <= MAX_TIMEOUT_S => Some(Duration::from_secs_f64(s)),
            _ => bad(&v),
        },
        Err(raw) => bad(&lossy(&raw)),
    }
}

/// A `0`/`1` variable: `None` when unset, else the value, `invalid` (with a warning naming it)
/// when it is neither.
fn flag(var: &'static str, invalid: bool) -> Option<bool> {
    let instead = if invalid { "1" } else { "0" };
    match read(var)? {
        Ok(v) if v == "1" => Some(true),
        Ok(v) if v == "0" => Some(false),
        Ok(v) => {
            warn_invalid(var, &v, "0 or 1", instead);
            Some(invalid)
        }
        Err(raw) => {
            warn_invalid(var, &lossy(&raw), "0 or 1", instead);
            Some(invalid)
        }
    }
}

/// `EPCOMM_SHM_DIRECT`: whether shared-memory groups may read peers' buffers directly (default
/// and invalid: yes).
pub fn shm_direct() -> bool {
    flag(SHM_DIRECT, true).unwrap_or(true)
}

/// `EPCOMM_NO_SIMD`: whether the AVX2 kernels are turned off (default: no; invalid: yes).
pub fn no_simd() -> bool {
    flag(NO_SIMD, true).unwrap_or(false)
}

/// `EPCOMM_FAULT_POINT`: the point where this process is to kill itself, if it names one of
/// `points` (the fault module's list, passed in so that this leaf imports nothing above it).
pub fn fault_point(points: &[&'static str]) -> Option<&'static str> {
    let expected = || format!("one of {}", points.join(", "));
    match read(FAULT_POINT)? {
        Ok(v) => {
            let point = points.iter().copied().find(|p| *p == v);
            if point.is_none() {
                warn_invalid(FAULT_POINT, &v, &expected(), "no fault point");
            }
            point
        }
        Err(raw) => {
            warn_invalid(FAULT_POINT, &lossy(&raw), &expected(), "no fault point");
            None
        }
    }
}

/// `EPCOMM_NVRTC_PATH`, if set to a UTF-8 path. Whether it holds NVRTC is for the loader to
/// say: an explicit path that does not is an error there, not a silent fallback.
pub fn nvrtc_path() -> Option<String> {
    // Not trimmed: a path may begin or end with a space.
    match std::env::var_os(NVRTC_PATH)
        .filter(|v| !v.is_empty())?
        .into_string()
    {
        Ok(v) => Some(v),
        Err(raw) => {
            warn_invalid(
                NVRTC_PATH,
                &lossy(&raw),
                "a UTF-8 path to libnvrtc.so.* or its directory",
                "the default search",
            );
            None
        }
    }
}

/// `EPCOMM_NVRTC_LINEINFO`: whether kernels are compiled with `-lineinfo` (default and
/// invalid: no; it only adds debug information, so a value that is not `1` keeps the default).
/// Read once per process.
pub fn nvrtc_lineinfo() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| flag(NVRTC_LINEINFO, false).unwrap_or(false))
}

/// `EPCOMM_CACHE_DIR`, if set (any path).
pub fn cache_dir() -> Option<PathBuf> {
    std::env::var_os(CACHE_DIR)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_message_escapes_the_value_onto_one_line() {
        assert_eq!(
            invalid_message(TIMEOUT_S, "1\n2'", "seconds > 0", "the default 60 s"),
            "invalid EPCOMM_TIMEOUT_S='1\\n2\\'' (expected seconds > 0); using the default 60 s"
        );
    }
}
