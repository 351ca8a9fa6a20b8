//! Fault injection for the reliability tests: `EPCOMM_FAULT_POINT=<name>` makes the process kill
//! itself (SIGKILL, no cleanup) when it reaches that point, so tests can interrupt a rank at an
//! exact phase of a collective. Unset (the normal case), a point costs two cached loads (the
//! variable and the hook). A name not in [`POINTS`] is warned about once (see [`crate::env`])
//! and injects nothing.
//!
//! A test that must act at the n-th pass of a point, or do something other than die there
//! (stop itself with SIGSTOP, as a stalled rank does), sets a [`set_hook`] in its own process.

use std::sync::OnceLock;

/// Every fault point, in the order a rank reaches them.
pub const POINTS: [&str; 7] = [
    "join",
    "dispatch:before_counts",
    "dispatch:after_counts",
    "combine",
    "eplb:before_staging",
    "eplb:between_batches",
    "eplb:after_staging",
];

fn armed() -> Option<&'static str> {
    static POINT: OnceLock<Option<&'static str>> = OnceLock::new();
    *POINT.get_or_init(|| crate::env::fault_point(&POINTS))
}

static HOOK: OnceLock<fn(&str)> = OnceLock::new();

/// Test use: makes every fault point call `hook` with its name (one of [`POINTS`]) before it
/// checks `EPCOMM_FAULT_POINT`. Set once per process; returns false (and changes nothing) when
/// a hook was already set.
pub fn set_hook(hook: fn(&str)) -> bool {
    HOOK.set(hook).is_ok()
}

/// Kills this process if `EPCOMM_FAULT_POINT` names `name` (one of [`POINTS`]), after calling
/// the [`set_hook`] hook if one is set.
pub fn point(name: &str) {
    debug_assert!(POINTS.contains(&name), "unknown fault point {name}");
    if let Some(hook) = HOOK.get() {
        hook(name);
    }
    if armed() == Some(name) {
        crate::probe::kill_self();
    }
}
