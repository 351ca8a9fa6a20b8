//! Fault injection for the reliability tests: `EPCOMM_FAULT_POINT=<name>` makes the process kill
//! itself (SIGKILL, no cleanup) when it reaches that point, so tests can interrupt a rank at an
//! exact phase of a collective. Unset (the normal case), a point costs one cached load. A name
//! not in [`POINTS`] is warned about once (see [`crate::env`]) and injects nothing.

use std::sync::OnceLock;

/// Every fault point, in the order a rank reaches them.
pub const POINTS: [&str; 6] = [
    "join",
    "dispatch:before_counts",
    "dispatch:after_counts",
    "combine",
    "eplb:before_staging",
    "eplb:after_staging",
];

fn armed() -> Option<&'static str> {
    static POINT: OnceLock<Option<&'static str>> = OnceLock::new();
    *POINT.get_or_init(|| crate::env::fault_point(&POINTS))
}

/// Kills this process if `EPCOMM_FAULT_POINT` names `name` (one of [`POINTS`]).
pub fn point(name: &str) {
    debug_assert!(POINTS.contains(&name), "unknown fault point {name}");
    if armed() == Some(name) {
        crate::probe::kill_self();
    }
}
