//! RLIMIT_FSIZE (`ulimit -f`) never kills a rank with SIGXFSZ: a memfd counts as a file, so a
//! shared-memory region larger than the limit is an `EPCOMM_ERROR_SYSTEM` error naming the limit,
//! on every rank, and nothing is left in /dev/shm. Ranks are child processes (this test binary
//! run again as `limited_rank`) that lower their own limit before they join.

mod ranks;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions};
use ranks::{shm_leftovers, wait_all, Finished};

const CHILD_TEST: &str = "limited_rank";
const MIB: usize = 1 << 20;

fn set_file_size_limit(bytes: u64) {
    let r = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: bytes,
    };
    // SAFETY: r is a valid rlimit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &r) }, 0);
}

/// Child side: lowers its RLIMIT_FSIZE (if asked), joins, runs the case and prints one
/// `LIM_RESULT` line per step: "ok" or the error's status and message.
#[test]
fn limited_rank() {
    let Ok(group) = std::env::var("EPCOMM_LIM_GROUP") else {
        return;
    };
    let get = |k: &str| std::env::var(k).unwrap();
    let rank: usize = get("EPCOMM_LIM_RANK").parse().unwrap();
    let world: usize = get("EPCOMM_LIM_WORLD").parse().unwrap();
    let case = get("EPCOMM_LIM_CASE");
    if let Ok(limit) = std::env::var("EPCOMM_LIM_FSIZE") {
        set_file_size_limit(limit.parse().unwrap());
    }
    let report = |what: &str, r: &epcomm::Result<()>| match r {
        Ok(()) => println!("\nLIM_RESULT {what} ok"),
        Err(e) => println!("\nLIM_RESULT {what} {:?}: {e}", e.status()),
    };
    let opts = GroupOptions {
        timeout: Duration::from_secs(2),
        direct_reads: get("EPCOMM_LIM_DIRECT") == "1",
        ..GroupOptions::default()
    };
    let mut g = match ShmGroup::join(&group, rank, world, opts) {
        Ok(g) => g,
        Err(e) => return report("join", &Err(e)),
    };
    report("join", &Ok(()));
    match case.as_str() {
        "gather" => {
            // 16 MiB gathered: each rank stages its 16 / world MiB in its region.
            let part = 16 * MIB / world;
            let mine = vec![rank as u8; part];
            let mut out = vec![0u8; part * world];
            let r = g.all_gatherv(&mine, &vec![part; world], &mut out);
            if r.is_ok() {
                let right = out
                    .chunks(part)
                    .enumerate()
                    .all(|(p, c)| c.iter().all(|&b| b == p as u8));
                assert!(right, "all_gatherv returned OK with wrong bytes");
            }
            report("all_gatherv", &r);
            report("barrier", &g.barrier());
        }
        "window" => {
            let r = g.alloc_shared(16 * MIB).map(|_| ());
            report("alloc_shared", &r);
            report("barrier", &g.barrier());
        }
        other => panic!("unknown case {other}"),
    }
}

/// Runs `world` ranks of `case`, rank r with RLIMIT_FSIZE `limits[r]` (None: unchanged); every
/// rank must end normally (no signal) within the deadline. Returns their LIM_RESULT lines.
fn run(
    case: &str,
    world: usize,
    limits: &[Option<usize>],
    direct: bool,
) -> (String, Vec<Vec<String>>) {
    let group = ranks::unique("lim", case);
    let children = ranks::spawn_ranks(CHILD_TEST, 0..world, |rank| {
        let mut env = vec![
            ("EPCOMM_LIM_GROUP", group.clone()),
            ("EPCOMM_LIM_RANK", rank.to_string()),
            ("EPCOMM_LIM_WORLD", world.to_string()),
            ("EPCOMM_LIM_CASE", case.to_owned()),
            ("EPCOMM_LIM_DIRECT", u8::from(direct).to_string()),
        ];
        if let Some(l) = limits[rank] {
            env.push(("EPCOMM_LIM_FSIZE", l.to_string()));
        }
        env
    });
    let results = wait_all(children, Duration::from_secs(60));
    let all: Vec<String> = results.iter().map(Finished::output).collect();
    for r in &results {
        assert!(
            r.status.success() && r.status.signal().is_none(),
            "rank {} did not end normally ({:?}; SIGXFSZ is 25):\n{}",
            r.rank,
            r.status,
            all.join("\n")
        );
    }
    let left = shm_leftovers(&group);
    assert!(
        left.is_empty(),
        "left in /dev/shm: {left:?}\n{}",
        all.join("\n")
    );
    let lines = results
        .iter()
        .map(|r| {
            r.stdout
                .lines()
                .filter_map(|l| l.strip_prefix("LIM_RESULT ").map(str::to_owned))
                .collect()
        })
        .collect();
    (group, lines)
}

/// `ulimit -f` of 1 MiB for the whole job: every rank's first region (4 MiB by default) is
/// beyond it, so every rank fails at once with its own error naming the limit; on the library
/// before the check, SIGXFSZ killed the ranks (exit 153 from a shell) and the record stayed.
#[test]
fn a_file_size_limit_below_the_first_region_is_an_error_on_every_rank() {
    let world = 3;
    let (group, lines) = run("create", world, &[Some(MIB); 3], true);
    for (rank, l) in lines.iter().enumerate() {
        assert_eq!(
            l,
            &[format!(
                "join System: group '{group}' needs a shared-memory region of 4194304 bytes on rank {rank}, but the file size limit RLIMIT_FSIZE (ulimit -f) is 1048576 bytes; raise it (ulimit -f unlimited)"
            )],
            "rank {rank}"
        );
    }
}

/// The limit on one rank only (rank 1): it fails at once with its error; the others cannot
/// form the group and time out naming it.
#[test]
fn a_file_size_limit_on_one_rank_fails_it_and_times_out_the_others() {
    let (group, lines) = run("create", 3, &[None, Some(MIB), None], true);
    assert_eq!(
        lines[1],
        [format!(
            "join System: group '{group}' needs a shared-memory region of 4194304 bytes on rank 1, but the file size limit RLIMIT_FSIZE (ulimit -f) is 1048576 bytes; raise it (ulimit -f unlimited)"
        )]
    );
    for rank in [0, 2] {
        assert_eq!(
            lines[rank],
            [format!(
                "join Timeout: timed out after 2.0 s waiting for rank(s) 1 to join group '{group}' (rank(s) 1 of 3 missing; joined: rank(s) 0, 2); check that those ranks were started and create the group with the name '{group}' and world_size 3 (a rank that failed first reports its own error there; two jobs that use one name at the same time are refused, saying so), or raise the timeout (EPCOMM_TIMEOUT_S, or the group's timeout_s)"
            )],
            "rank {rank}"
        );
    }
}

fn grow_error(group: &str, rank: usize) -> String {
    format!(
        "cannot grow the shared-memory region of rank {rank} of group '{group}' to 10485760 bytes: the file size limit RLIMIT_FSIZE (ulimit -f) is 8388608 bytes, below the 10485760 bytes needed; raise it (ulimit -f unlimited)"
    )
}

fn peer_failed(group: &str, failed: usize, seen_from: usize) -> String {
    format!(
        "rank {failed} of group '{group}' failed (an error on that rank aborted its group) during all_gatherv (op #1, seen from rank {seen_from})"
    )
}

/// Checks one rank's lines of a failed all_gatherv: `first` is its error (status and text),
/// which the broken group's next call repeats.
fn assert_failed_gather(group: &str, rank: usize, lines: &[String], first: &str) {
    let (status, text) = first.split_once(": ").unwrap();
    assert_eq!(
        lines,
        [
            "join ok".to_owned(),
            format!("all_gatherv {first}"),
            format!(
                "barrier InvalidState: barrier: group '{group}' is unusable after an earlier failure ({text}); destroy it and create a new one"
            ),
        ],
        "rank {rank} ({status})"
    );
}

/// `ulimit -f` of 8 MiB and a 16 MiB all_gatherv staged through the regions (two ranks, 8 MiB
/// each plus the op header): growing its region is beyond the limit on each rank. Every rank
/// fails the op: with the error naming the limit, or, if its peer failed first, naming that
/// peer (the group's decision); the group is broken alike. Before, SIGXFSZ killed them.
#[test]
fn growth_beyond_the_file_size_limit_is_an_error_on_every_rank() {
    let (group, lines) = run("gather", 2, &[Some(8 * MIB); 2], false);
    let mut own = 0;
    for (rank, l) in lines.iter().enumerate() {
        let mine = format!("System: {}", grow_error(&group, rank));
        let first = if l.get(1) == Some(&format!("all_gatherv {mine}")) {
            own += 1;
            mine
        } else {
            format!("PeerFailure: {}", peer_failed(&group, 1 - rank, rank))
        };
        assert_failed_gather(&group, rank, l, &first);
    }
    assert!(own >= 1, "no rank reported the limit: {lines:?}");
}

/// The limit on one rank only: it fails the all_gatherv with the error naming the limit, and
/// its peer fails the same op naming it, not with a hang or a signal.
#[test]
fn growth_beyond_the_limit_on_one_rank_fails_its_peer_too() {
    let (group, lines) = run("gather", 2, &[None, Some(8 * MIB)], false);
    assert_failed_gather(
        &group,
        1,
        &lines[1],
        &format!("System: {}", grow_error(&group, 1)),
    );
    assert_failed_gather(
        &group,
        0,
        &lines[0],
        &format!("PeerFailure: {}", peer_failed(&group, 1, 0)),
    );
}

/// A shared window beyond the limit is the same error for the rank that asked (windows are
/// not collective); the group stays usable.
#[test]
fn a_window_beyond_the_file_size_limit_is_an_error() {
    let (group, lines) = run("window", 2, &[Some(8 * MIB); 2], true);
    for (rank, l) in lines.iter().enumerate() {
        assert_eq!(
            l,
            &[
                "join ok".to_owned(),
                format!(
                    "alloc_shared System: cannot create 16777216 bytes of shared memory for rank {rank} of group '{group}': the file size limit RLIMIT_FSIZE (ulimit -f) is 8388608 bytes, below the 16777216 bytes needed; raise it (ulimit -f unlimited)"
                ),
                "barrier ok".to_owned(),
            ],
            "rank {rank}"
        );
    }
}

/// The limit on rank 0 only: it fails at once with its error and creates nothing; the others
/// wait for a rank 0 and time out saying so.
#[test]
fn a_file_size_limit_on_rank_0_only_times_out_the_others_waiting_for_it() {
    let (group, lines) = run("create", 2, &[Some(MIB), None], true);
    assert_eq!(
        lines,
        [
            vec![format!(
                "join System: group '{group}' needs a shared-memory region of 4194304 bytes on rank 0, but the file size limit RLIMIT_FSIZE (ulimit -f) is 1048576 bytes; raise it (ulimit -f unlimited)"
            )],
            vec![format!(
                "join Timeout: timed out after 2.0 s waiting for rank 0 to create group '{group}' (rank 1 of 2); no rank 0 created it (until it does, the other ranks cannot see each other): check that rank 0 was started and creates the group with the name '{group}' and world_size 2 (a rank that failed first reports its own error there; two jobs that use one name at the same time are refused, saying so), or raise the timeout (EPCOMM_TIMEOUT_S, or the group's timeout_s)"
            )],
        ]
    );
}

/// With direct reads the same all_gatherv publishes only a table of its buffers (no growth):
/// it works under the 8 MiB limit, bytes checked. (Where the ranks cannot read each other's
/// memory, the group is staged and the growth tests above apply.)
#[test]
fn a_direct_all_gatherv_needs_no_growth_under_the_limit() {
    let (group, lines) = run("gather", 2, &[Some(8 * MIB); 2], true);
    if lines[0][1].starts_with("all_gatherv System: cannot grow") {
        eprintln!("{group}: the ranks could not read each other directly (staged): {lines:?}");
        return;
    }
    for (rank, l) in lines.iter().enumerate() {
        assert_eq!(
            l,
            &["join ok", "all_gatherv ok", "barrier ok"],
            "rank {rank}"
        );
    }
}
