//! Fault injection for the reliability tests: `EPCOMM_FAULT_POINT=<name>` makes the process kill
//! itself (SIGKILL, no cleanup) when it reaches that point, so tests can interrupt a rank at an
//! exact phase of a collective. Unset (the normal case), a point costs one cached load.
//!
//! Points: `join`, `dispatch:before_counts`, `dispatch:after_counts`, `combine`,
//! `eplb:before_staging`, `eplb:after_staging`.

use std::sync::OnceLock;

fn armed() -> Option<&'static str> {
    static POINT: OnceLock<Option<String>> = OnceLock::new();
    POINT
        .get_or_init(|| {
            std::env::var("EPCOMM_FAULT_POINT")
                .ok()
                .filter(|s| !s.is_empty())
        })
        .as_deref()
}

/// Kills this process if `EPCOMM_FAULT_POINT` names `name`.
pub fn point(name: &str) {
    if armed() == Some(name) {
        crate::probe::kill_self();
    }
}
