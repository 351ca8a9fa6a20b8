//! A group that waits for ranks says so: once at warn level after 5 s (when its timeout is
//! longer), and in its timeout error, which ranks have joined, which have not, and what to
//! check. Two waits at once, 6 s each: rank 0 of a group whose rank 1 never comes, and rank 1
//! of a group whose rank 0 never creates it.

mod ranks;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use epcomm::group::shm::ShmGroup;
use epcomm::group::GroupOptions;
use epcomm::log::{self, Level};
use epcomm::Status;

const REMEDY: &str = "(a rank that failed first reports its own error there; two jobs that use one name at the same time are refused, saying so), or raise the timeout (EPCOMM_TIMEOUT_S, or the group's timeout_s)";

#[test]
fn a_join_that_waits_warns_once_then_times_out_saying_what_to_check() {
    let (lonely, headless) = (ranks::unique("jw", "r0"), ranks::unique("jw", "r1"));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    log::set_sink(Some(Arc::new(move |l, m: &str| {
        s.lock().unwrap().push((l, m.to_owned()))
    })));
    let opts = || GroupOptions {
        timeout: Duration::from_secs(6),
        ..GroupOptions::default()
    };
    let waits: Vec<_> = [(lonely.clone(), 0), (headless.clone(), 1)]
        .into_iter()
        .map(|(name, rank)| {
            let o = opts();
            std::thread::spawn(move || ShmGroup::join(&name, rank, 2, o).map(drop))
        })
        .collect();
    let errors: Vec<epcomm::Error> = waits
        .into_iter()
        .map(|w| w.join().unwrap().unwrap_err())
        .collect();
    log::set_sink(None);
    assert_eq!(errors[0].status(), Status::Timeout);
    assert_eq!(
        errors[0].to_string(),
        format!("timed out after 6.0 s waiting for rank(s) 1 to join group '{lonely}' (rank(s) 1 of 2 missing; joined: rank(s) 0); check that those ranks were started and create the group with the name '{lonely}' and world_size 2 {REMEDY}")
    );
    assert_eq!(errors[1].status(), Status::Timeout);
    assert_eq!(
        errors[1].to_string(),
        format!("timed out after 6.0 s waiting for rank 0 to create group '{headless}' (rank 1 of 2); no rank 0 created it (until it does, the other ranks cannot see each other): check that rank 0 was started and creates the group with the name '{headless}' and world_size 2 {REMEDY}")
    );
    let seen = seen.lock().unwrap();
    let about = |name: &str| -> Vec<(Level, String)> {
        seen.iter()
            .filter(|(_, m)| m.contains(&format!("'{name}'")))
            .cloned()
            .collect()
    };
    assert_eq!(
        about(&lonely),
        [(
            Level::Warn,
            format!("group '{lonely}': rank 0 has waited 5 s for rank(s) 1 to join (rank(s) 1 of 2 missing; joined: rank(s) 0); it gives up after 6.0 s. To fix: check that those ranks were started and create the group with the name '{lonely}' and world_size 2 {REMEDY}")
        )]
    );
    assert_eq!(
        about(&headless),
        [(
            Level::Warn,
            format!("group '{headless}': rank 1 of 2 has waited 5 s for rank 0 to create the group; it gives up after 6.0 s. To fix: check that rank 0 was started and creates the group with the name '{headless}' and world_size 2 {REMEDY}")
        )]
    );
    for name in [&lonely, &headless] {
        assert!(
            ranks::shm_leftovers(name).is_empty(),
            "{:?}",
            ranks::shm_leftovers(name)
        );
    }
}
