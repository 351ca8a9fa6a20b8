//! Rank processes asleep on the shared-memory group's futex words (direct and staged modes,
//! `EPCOMM_SHM_DIRECT=0`):
//!
//! - a peer killed while the others sleep waiting for it wakes nobody, and is still detected
//!   within the bound of a peer dying mid-op (1.5 s; the liveness checks run about every 50 ms
//!   whatever the sleep), every survivor naming it;
//! - a peer killed while it sleeps (its sleeper count stays behind in the slot it slept on)
//!   leaves nobody hanging: the survivors, the late one included, name it.
//!
//! The parent kills only once it sees each sleeper's thread blocked in the futex system call
//! (`/proc/PID/task/TID/syscall`).

mod ranks;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions};
use epcomm::Status;
use ranks::{shm_leftovers, wait_all, Finished};

const CHILD_TEST: &str = "futex_rank";
const WORLD: usize = 3;
/// The bound on seeing a dead peer, as for a peer dying mid-op (tests/group.rs).
const BOUND_MS: u64 = 1500;

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// The two cases: who waits, who gets killed.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Case {
    /// Ranks 0 and 1 sleep in all_gatherv waiting for rank 2, which idles and is killed.
    OthersSleep,
    /// Ranks 1 and 2 sleep in a barrier waiting for rank 0; rank 2 is killed asleep, then
    /// rank 0 arrives.
    SleeperKilled,
}

impl Case {
    fn tag(self) -> &'static str {
        match self {
            Case::OthersSleep => "others-sleep",
            Case::SleeperKilled => "sleeper-killed",
        }
    }

    /// The ranks that must be asleep before the kill.
    fn sleepers(self) -> [usize; 2] {
        match self {
            Case::OthersSleep => [0, 1],
            Case::SleeperKilled => [1, 2],
        }
    }

    fn op(self) -> &'static str {
        match self {
            Case::OthersSleep => "all_gatherv",
            Case::SleeperKilled => "barrier",
        }
    }
}

/// Waits (bounded) for `path` to exist.
fn wait_for_file(path: &Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "no {path:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Child side: joins, does a first barrier, records its thread id, then plays its part.
#[test]
fn futex_rank() {
    let Ok(group) = std::env::var("EPCOMM_FX_GROUP") else {
        return;
    };
    let rank: usize = std::env::var("EPCOMM_FX_RANK").unwrap().parse().unwrap();
    let dir = PathBuf::from(std::env::var("EPCOMM_FX_DIR").unwrap());
    let case = match std::env::var("EPCOMM_FX_CASE").unwrap().as_str() {
        "others-sleep" => Case::OthersSleep,
        "sleeper-killed" => Case::SleeperKilled,
        other => panic!("unknown case {other}"),
    };
    let opts = GroupOptions {
        timeout: Duration::from_secs(30),
        ..GroupOptions::default()
    };
    let mut g = ShmGroup::join(&group, rank, WORLD, opts).unwrap();
    g.barrier().unwrap();
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    std::fs::write(dir.join(format!("{rank}.tid")), tid.to_string()).unwrap();
    let r = match (case, rank) {
        (Case::OthersSleep, 2) => {
            std::thread::sleep(Duration::from_secs(60));
            return;
        }
        (Case::OthersSleep, _) => g.all_gatherv(&[rank as u8; 8], &[8; WORLD], &mut [0; 24]),
        (Case::SleeperKilled, 0) => {
            wait_for_file(&dir.join("go"));
            g.barrier()
        }
        (Case::SleeperKilled, _) => g.barrier(),
    };
    let done = now_ns();
    match r {
        Ok(()) => println!("\nFX_RESULT ok"),
        Err(e) => println!("\nFX_RESULT {} {e}", e.status() as i32),
    }
    println!("FX_DONE_NS {done}");
}

/// Whether thread `tid` of process `pid` is blocked in the futex system call now.
fn in_futex(pid: u32, tid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall"))
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .is_some_and(|nr| nr == libc::SYS_futex.to_string())
}

fn field<'a>(f: &'a Finished, key: &str) -> &'a str {
    f.stdout
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key}in {}", f.output()))
}

fn run(case: Case, direct: bool) {
    let group = ranks::unique("fx", case.tag());
    let dir = std::env::temp_dir().join(format!("epcomm-futex-{group}"));
    std::fs::create_dir_all(&dir).unwrap();
    let kids = ranks::spawn_ranks(CHILD_TEST, 0..WORLD, |rank| {
        let mut env = vec![
            ("EPCOMM_FX_GROUP", group.clone()),
            ("EPCOMM_FX_RANK", rank.to_string()),
            ("EPCOMM_FX_CASE", case.tag().to_owned()),
            ("EPCOMM_FX_DIR", dir.display().to_string()),
        ];
        if !direct {
            env.push(("EPCOMM_SHM_DIRECT", "0".to_owned()));
        }
        env
    });
    let pids: Vec<u32> = kids.iter().map(|(_, c)| c.id()).collect();
    let t = Instant::now();
    for r in case.sleepers() {
        let tid_file = dir.join(format!("{r}.tid"));
        wait_for_file(&tid_file);
        let tid = std::fs::read_to_string(&tid_file).unwrap();
        while !in_futex(pids[r], &tid) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "rank {r} never slept"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    // SAFETY: killing our own child.
    unsafe { libc::kill(pids[2] as libc::pid_t, libc::SIGKILL) };
    let killed = now_ns();
    if case == Case::SleeperKilled {
        std::fs::write(dir.join("go"), b"").unwrap();
    }
    let res = wait_all(kids, Duration::from_secs(60));
    for f in res.iter().filter(|f| f.rank != 2) {
        let want = format!(
            "{} rank 2 of group '{group}' died (pid {} is gone) during {} (op #2, seen from rank {})",
            Status::PeerFailure as i32,
            pids[2],
            case.op(),
            f.rank
        );
        assert_eq!(field(f, "FX_RESULT "), want, "{}", f.output());
        let done: u64 = field(f, "FX_DONE_NS ").parse().unwrap();
        let ms = done.saturating_sub(killed) / 1_000_000;
        assert!(ms < BOUND_MS, "rank {} took {ms} ms after the kill", f.rank);
    }
    assert!(
        shm_leftovers(&group).is_empty(),
        "{:?}",
        shm_leftovers(&group)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_peer_killed_while_the_others_sleep_is_detected_direct() {
    run(Case::OthersSleep, true);
}

#[test]
fn a_peer_killed_while_the_others_sleep_is_detected_staged() {
    run(Case::OthersSleep, false);
}

#[test]
fn a_peer_killed_asleep_leaves_nobody_hanging_direct() {
    run(Case::SleeperKilled, true);
}

#[test]
fn a_peer_killed_asleep_leaves_nobody_hanging_staged() {
    run(Case::SleeperKilled, false);
}
