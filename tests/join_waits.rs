//! A group that waits for ranks says so: once at warn level after 5 s (when its timeout is
//! longer), and in its timeout error, which ranks have joined, which have not, and what to
//! check. Two waits at once, 6 s each: rank 0 of a group whose rank 1 never comes, and rank 1
//! of a group whose rank 0 never creates it. And a group that cannot form because another job
//! used its name says so to every rank of both jobs, those that come 2 s late included.

mod ranks;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// The join timeout of the ranks of `every_rank_of_a_name_clash_names_it`.
const CLASH_TIMEOUT: Duration = Duration::from_secs(6);

/// Child side of `every_rank_of_a_name_clash_names_it`: joins rank EPCOMM_CLASH_RANK of the
/// 2-rank group EPCOMM_CLASH_GROUP; prints how long the join took and its outcome.
#[test]
fn clash_rank() {
    let Ok(group) = std::env::var("EPCOMM_CLASH_GROUP") else {
        return;
    };
    let rank: usize = std::env::var("EPCOMM_CLASH_RANK").unwrap().parse().unwrap();
    let opts = GroupOptions {
        timeout: CLASH_TIMEOUT,
        ..GroupOptions::default()
    };
    let start = Instant::now();
    let result = ShmGroup::join(&group, rank, 2, opts).map(drop);
    let ms = start.elapsed().as_millis();
    match result {
        Ok(()) => println!("\nCLASH_RESULT {ms} ok"),
        Err(e) => println!("\nCLASH_RESULT {ms} {} {e}", e.status() as i32),
    }
}

/// Job A's rank 0 creates group G; job B's rank 0 starts under the same name and is refused at
/// once. 2 s later job A's and job B's rank 1 arrive, and B's rank 0 once more (a rerun): each
/// fails at once naming the clash, because A's rank 0 keeps its record, marked, for one
/// timeout after the clash (it used to keep it 1 s: ranks 2 s late found no group, waited for
/// a rank 0, or met each other in a new group and clashed there); then A's rank 0 fails too,
/// naming the other job's pid, and leaves nothing behind.
#[test]
fn every_rank_of_a_name_clash_names_it() {
    let group = ranks::unique("jw", "clash");
    let spawn = |rank: usize| {
        ranks::spawn_test(
            "clash_rank",
            &[
                ("EPCOMM_CLASH_GROUP", group.clone()),
                ("EPCOMM_CLASH_RANK", rank.to_string()),
                ("EPCOMM_LOG_LEVEL", "warn".to_owned()),
            ],
        )
    };
    let outcome = |f: &ranks::Finished| -> (u128, String) {
        let line = f
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix("CLASH_RESULT "))
            .unwrap_or_else(|| panic!("no result:\n{}", f.output()))
            .to_owned();
        let (ms, rest) = line.split_once(' ').unwrap();
        (ms.parse().unwrap(), rest.to_owned())
    };
    let a0 = spawn(0);
    let a0_pid = a0.id();
    ranks::wait_for_record(&group, Duration::from_secs(20));
    let b0 = spawn(0);
    let b0_pid = b0.id();
    let refused = ranks::wait_all(vec![(0, b0)], Duration::from_secs(20));
    let (ms, b0_says) = outcome(&refused[0]);
    let state = Status::InvalidState as i32;
    assert_eq!(
        b0_says,
        format!("{state} group name '{group}' is in use by another job: its rank 0 (pid {a0_pid}) is still waiting for its ranks to join; jobs that run at the same time need distinct group names")
    );
    assert!(ms < 3000, "job B's rank 0 took {ms} ms");
    std::thread::sleep(Duration::from_secs(2));
    let late: Vec<(usize, std::process::Child)> = [1, 1, 0]
        .into_iter()
        .enumerate()
        .map(|(i, rank)| (i, spawn(rank)))
        .collect();
    let late = ranks::wait_all(late, Duration::from_secs(20));
    for (f, rank) in late.iter().zip([1, 1, 0]) {
        let (ms, says) = outcome(f);
        assert_eq!(
            says,
            format!("{state} group name '{group}' is in use by another job: pid {b0_pid} met the group that pid {a0_pid} created under this name, so neither forms (seen from rank {rank}); jobs that run at the same time need distinct group names"),
            "late rank {rank}"
        );
        assert!(ms < 3000, "late rank {rank} took {ms} ms");
    }
    let a0 = ranks::wait_all(vec![(0, a0)], Duration::from_secs(20));
    let (ms, a0_says) = outcome(&a0[0]);
    assert_eq!(
        a0_says,
        format!("{state} group name '{group}' is in use by another job: pid {b0_pid} tried to join this group under the same name, so rank 0 refuses to form it; jobs that run at the same time need distinct group names")
    );
    let timeout_ms = CLASH_TIMEOUT.as_millis();
    assert!(
        (timeout_ms..timeout_ms + 5000).contains(&ms),
        "job A's rank 0 failed after {ms} ms; expected one timeout after the clash"
    );
    assert!(
        a0[0].stderr.contains(&format!("epcomm WARNING group '{group}': pid {b0_pid} of another job tried to join this group under the same name, so it will not form; rank 0 keeps its record, marked, for 6.0 s (the timeout) so that every rank of either job that arrives meanwhile fails at once naming the clash, then fails itself. To fix: give jobs that run at the same time distinct group names\n")),
        "{}",
        a0[0].output()
    );
    assert!(
        ranks::shm_leftovers(&group).is_empty(),
        "{:?}",
        ranks::shm_leftovers(&group)
    );
}
