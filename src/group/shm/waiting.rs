//! What a rank waiting for its group to form says: once, at warn level, after
//! [`WARN_AFTER`] of waiting, and in the timeout error: which ranks have joined, which have
//! not, and what to check.

use std::time::Duration;

use super::wait::list;

/// How long a join waits before it logs, once, which ranks it still waits for. Shorter
/// timeouts log nothing: their error comes soon enough.
pub(super) const WARN_AFTER: Duration = Duration::from_secs(5);

/// What to check when ranks do not arrive.
fn remedy(who: &str, name: &str, world: usize) -> String {
    format!(
        "check that {who} the group with the name '{name}' and world_size {world} (a rank that failed first reports its own error there; two jobs that use one name at the same time are refused, saying so), or raise the timeout (EPCOMM_TIMEOUT_S, or the group's timeout_s)"
    )
}

/// The ranks that have and have not joined.
fn roll(joined: &[usize], missing: &[usize], world: usize) -> String {
    let joined = if joined.is_empty() {
        "none".to_owned()
    } else {
        format!("rank(s) {}", list(joined))
    };
    format!(
        "rank(s) {} of {world} missing; joined: {joined}",
        list(missing)
    )
}

/// The timeout error's text when ranks `missing` never joined group `name`.
pub(super) fn join_timeout(
    timeout: Duration,
    name: &str,
    world: usize,
    joined: &[usize],
    missing: &[usize],
) -> String {
    format!(
        "timed out after {:.1} s waiting for rank(s) {} to join group '{name}' ({}); {}",
        timeout.as_secs_f64(),
        list(missing),
        roll(joined, missing, world),
        remedy("those ranks were started and create", name, world)
    )
}

/// The warn line of rank `me` still waiting after `waited` for ranks `missing`.
pub(super) fn join_warning(
    waited: Duration,
    timeout: Duration,
    name: &str,
    me: usize,
    world: usize,
    joined: &[usize],
    missing: &[usize],
) -> String {
    format!(
        "group '{name}': rank {me} has waited {:.0} s for rank(s) {} to join ({}); it gives up after {:.1} s. To fix: {}",
        waited.as_secs_f64(),
        list(missing),
        roll(joined, missing, world),
        timeout.as_secs_f64(),
        remedy("those ranks were started and create", name, world)
    )
}

/// The timeout error's text of rank `me` when rank 0 never created group `name`; `why` is what
/// went wrong with a segment this rank found, if anything.
pub(super) fn create_timeout(
    timeout: Duration,
    name: &str,
    me: usize,
    world: usize,
    why: Option<&str>,
) -> String {
    let why = why.map(|w| format!("; last: {w}")).unwrap_or_default();
    format!(
        "timed out after {:.1} s waiting for rank 0 to create group '{name}' (rank {me} of {world}){why}; no rank 0 created it (until it does, the other ranks cannot see each other): {}",
        timeout.as_secs_f64(),
        remedy("rank 0 was started and creates", name, world)
    )
}

/// The warn line of rank `me` still waiting after `waited` for rank 0 to create group `name`.
pub(super) fn create_warning(
    waited: Duration,
    timeout: Duration,
    name: &str,
    me: usize,
    world: usize,
) -> String {
    format!(
        "group '{name}': rank {me} of {world} has waited {:.0} s for rank 0 to create the group; it gives up after {:.1} s. To fix: {}",
        waited.as_secs_f64(),
        timeout.as_secs_f64(),
        remedy("rank 0 was started and creates", name, world)
    )
}

/// The warn line of rank 0 of group `name`, which pid `met` (another job's) met: it keeps the
/// group's record, marked, for `linger` before it fails.
pub(super) fn clash_linger(name: &str, met: u64, linger: Duration) -> String {
    format!(
        "group '{name}': pid {met} of another job tried to join this group under the same name, so it will not form; rank 0 keeps its record, marked, for {:.1} s (the timeout) so that every rank of either job that arrives meanwhile fails at once naming the clash, then fails itself. To fix: give jobs that run at the same time distinct group names",
        linger.as_secs_f64()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_texts_name_who_joined_who_did_not_and_what_to_check() {
        let t = Duration::from_secs(60);
        assert_eq!(
            join_timeout(t, "g", 3, &[0, 1], &[2]),
            "timed out after 60.0 s waiting for rank(s) 2 to join group 'g' (rank(s) 2 of 3 missing; joined: rank(s) 0, 1); check that those ranks were started and create the group with the name 'g' and world_size 3 (a rank that failed first reports its own error there; two jobs that use one name at the same time are refused, saying so), or raise the timeout (EPCOMM_TIMEOUT_S, or the group's timeout_s)"
        );
        assert_eq!(
            create_warning(Duration::from_secs(5), t, "g", 1, 2),
            "group 'g': rank 1 of 2 has waited 5 s for rank 0 to create the group; it gives up after 60.0 s. To fix: check that rank 0 was started and creates the group with the name 'g' and world_size 2 (a rank that failed first reports its own error there; two jobs that use one name at the same time are refused, saying so), or raise the timeout (EPCOMM_TIMEOUT_S, or the group's timeout_s)"
        );
        assert!(
            join_warning(Duration::from_secs(5), t, "g", 0, 2, &[], &[1])
                .contains("(rank(s) 1 of 2 missing; joined: none)")
        );
    }
}
