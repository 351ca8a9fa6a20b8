//! A whole job killed at any moment of group creation leaves nothing in /dev/shm once the next
//! epcomm process of the user has created a group. The only named object of a group is its
//! rendezvous record (`/dev/shm/epcomm.{name}`), which exists while the group forms; a job
//! killed then cannot remove it (no library may install signal handlers), so any later group
//! creation sweeps records whose creator is gone (proved by pid and start time; a live
//! creator holds a lock on its record).
//!
//! Each run starts a job of 2-4 rank processes (this test binary run again as `creation_rank`)
//! in one process group, on a unique id or a group name, and signals the whole process group
//! (SIGKILL, SIGTERM, SIGINT or SIGHUP) at a random moment between its start and the end of a
//! clean job's creation; then one new process creates a 1-rank group (`next_process`) and
//! nothing of the killed job may be left. `epcomm demo` is killed the same way (SIGTERM,
//! SIGINT, SIGHUP to its process group). On the library before the sweep, 11 of 12 unique-id
//! and 10 of 15 named jobs left their record for good.
//!
//! `EPCOMM_CREATION_KILLS` (default 30), `EPCOMM_CREATION_DEMO_KILLS` (default 6) and
//! `EPCOMM_CREATION_SEED` set the runs; `scripts/shm-leftovers.sh` runs a long version.

mod ranks;

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use epcomm::group::shm::{ShmGroup, UniqueId};
use epcomm::group::{Group, GroupOptions};
use ranks::{shm_leftovers, wait_all, Finished};

const RANK_TEST: &str = "creation_rank";
const NEXT_TEST: &str = "next_process";

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn env_or(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn seed() -> u64 {
    env_or(
        "EPCOMM_CREATION_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
            | 1,
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Child side: one rank of a job; joins (by unique id or name), runs a barrier, destroys.
#[test]
fn creation_rank() {
    let Ok(world) = std::env::var("EPCOMM_CK_WORLD") else {
        return;
    };
    let world: usize = world.parse().unwrap();
    let rank: usize = std::env::var("EPCOMM_CK_RANK").unwrap().parse().unwrap();
    let opts = GroupOptions {
        timeout: Duration::from_secs(2),
        ..GroupOptions::default()
    };
    let joined = match std::env::var("EPCOMM_CK_UID") {
        Ok(id) => {
            let id = UniqueId(unhex(&id).try_into().unwrap());
            ShmGroup::join_unique(&id, rank, world, opts)
        }
        Err(_) => ShmGroup::join(&std::env::var("EPCOMM_CK_NAME").unwrap(), rank, world, opts),
    };
    let r = joined.and_then(|mut g| g.barrier());
    println!("\nCK_RESULT {r:?}");
}

/// Child side: the next epcomm process, which creates (and destroys) a 1-rank group.
#[test]
fn next_process() {
    let Ok(name) = std::env::var("EPCOMM_CK_NEXT") else {
        return;
    };
    let g = ShmGroup::join(&name, 0, 1, GroupOptions::default());
    println!("\nCK_NEXT {:?}", g.map(|_| ()));
}

/// Runs the next process and returns what it logged (info lines included).
fn run_next_process() -> String {
    let name = ranks::unique("ck", "next");
    let child = ranks::spawn_test(
        NEXT_TEST,
        &[
            ("EPCOMM_CK_NEXT", name.clone()),
            ("EPCOMM_LOG_LEVEL", "info".to_owned()),
        ],
    );
    let r = wait_all(vec![(0, child)], Duration::from_secs(30));
    assert!(
        r[0].success() && r[0].stdout.contains("CK_NEXT Ok(())"),
        "the next process failed:\n{}",
        r[0].output()
    );
    assert!(shm_leftovers(&name).is_empty());
    r[0].stderr.clone()
}

/// A job's group: a unique id (hex of its bytes) or a name, and the name its record has.
struct JobGroup {
    uid: Option<String>,
    name: String,
}

impl JobGroup {
    fn new(unique: bool) -> JobGroup {
        if unique {
            let id = UniqueId::new().unwrap();
            JobGroup {
                uid: Some(hex(&id.0)),
                name: id.group_name().unwrap(),
            }
        } else {
            JobGroup {
                uid: None,
                name: ranks::unique("ck", "job"),
            }
        }
    }
}

/// Starts the ranks of a job in one new process group (led by rank 0's process).
fn spawn_job(group: &JobGroup, world: usize) -> (libc::pid_t, Vec<(usize, Child)>) {
    let mut pgid = 0;
    let mut children = Vec::new();
    for rank in 0..world {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", RANK_TEST, "--nocapture", "--test-threads=1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("EPCOMM_CK_WORLD", world.to_string())
            .env("EPCOMM_CK_RANK", rank.to_string())
            .process_group(pgid);
        match &group.uid {
            Some(id) => cmd.env("EPCOMM_CK_UID", id),
            None => cmd.env("EPCOMM_CK_NAME", &group.name),
        };
        let child = cmd.spawn().unwrap();
        if rank == 0 {
            pgid = child.id() as libc::pid_t;
        }
        children.push((rank, child));
    }
    (pgid, children)
}

/// Whether a process of process group `pgid` is still running (a zombie is not).
fn group_running(pgid: libc::pid_t) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    dir.flatten().any(|e| {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            return false;
        };
        let Some((_, rest)) = stat.rsplit_once(')') else {
            return false;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        // Fields from the third: state, ppid, pgrp.
        f.len() > 2 && f[2] == pgid.to_string() && !matches!(f[0], "Z" | "X")
    })
}

/// Waits until nothing of process group `pgid` runs any more.
fn wait_group_gone(pgid: libc::pid_t, what: &str) {
    let start = Instant::now();
    while group_running(pgid) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what}: processes of group {pgid} still run"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

const SIGNALS: [(libc::c_int, &str); 4] = [
    (libc::SIGKILL, "SIGKILL"),
    (libc::SIGTERM, "SIGTERM"),
    (libc::SIGINT, "SIGINT"),
    (libc::SIGHUP, "SIGHUP"),
];

/// The tests of this file one at a time: each one's next process would sweep the other's
/// records.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// What kills left and what the next processes logged of it.
#[derive(Default)]
struct Tally {
    /// Runs whose kill left a record.
    left: usize,
    /// Records whose removal the next process logged (a process sweeping at the same moment,
    /// such as a test of another binary, may remove one first).
    logged: usize,
}

/// Checks that nothing named `name` is left after the next process; counts what the kill left
/// and which removals the next process logged.
fn check_after_next(name: &str, what: &str, outputs: &str, tally: &mut Tally) {
    let left = shm_leftovers(name);
    let log = run_next_process();
    let after = shm_leftovers(name);
    for f in &after {
        let _ = std::fs::remove_file(format!("/dev/shm/{f}"));
    }
    assert!(
        after.is_empty(),
        "{what}: left in /dev/shm after the next process: {after:?} (before it: {left:?})\nits log:\n{log}\n{outputs}"
    );
    tally.left += usize::from(!left.is_empty());
    for f in &left {
        let line = format!(
            "epcomm INFO removed the stale rendezvous record /dev/shm/{f} of group '{name}': its creator, pid "
        );
        tally.logged += usize::from(log.contains(&line));
    }
}

/// How long a clean job of `world` ranks takes from its start until every rank created the
/// group, ran a barrier and ended: the span the kills are drawn from.
fn creation_span(world: usize) -> Duration {
    let group = JobGroup::new(false);
    let start = Instant::now();
    let (_, children) = spawn_job(&group, world);
    let results = wait_all(children, Duration::from_secs(30));
    let span = start.elapsed();
    for r in &results {
        assert!(
            r.stdout.contains("CK_RESULT Ok(())"),
            "clean job: {}",
            r.output()
        );
    }
    assert!(shm_leftovers(&group.name).is_empty());
    span
}

/// Jobs of 2-4 rank processes, on unique ids and names, signalled as a whole at random
/// moments of their creation: after the next process, nothing of them is in /dev/shm.
#[test]
fn killed_jobs_leave_nothing_after_the_next_process() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let runs = env_or("EPCOMM_CREATION_KILLS", 30) as usize;
    let seed = seed();
    let mut rng = seed;
    let started = Instant::now();
    let span = creation_span(4);
    let mut tally = [Tally::default(), Tally::default()];
    let mut jobs = [0usize; 2];
    for run in 0..runs {
        let world = 2 + (xorshift(&mut rng) % 3) as usize;
        let unique = run % 2 == 0;
        let (sig, sig_name) = SIGNALS[(run / 2) % SIGNALS.len()];
        let delay = Duration::from_micros(xorshift(&mut rng) % span.as_micros() as u64);
        let group = JobGroup::new(unique);
        let (pgid, children) = spawn_job(&group, world);
        std::thread::sleep(delay);
        // SAFETY: signalling the process group of the job we started.
        unsafe { libc::kill(-pgid, sig) };
        let results = wait_all(children, Duration::from_secs(30));
        wait_group_gone(pgid, "job");
        let what = format!(
            "run {run} (seed {seed}): {sig_name} of a {world}-rank job on {} {} after {} us",
            if unique { "unique id" } else { "name" },
            group.name,
            delay.as_micros()
        );
        let outputs: Vec<String> = results.iter().map(Finished::output).collect();
        jobs[usize::from(unique)] += 1;
        let outputs = outputs.join("\n");
        check_after_next(
            &group.name,
            &what,
            &outputs,
            &mut tally[usize::from(unique)],
        );
    }
    let left = tally[0].left + tally[1].left;
    let logged = tally[0].logged + tally[1].logged;
    eprintln!(
        "shm_creation_kills: {runs} jobs killed during creation in {:.1} s (seed {seed}, creation span {} ms): records left by the kill: unique ids {}/{}, names {}/{}; after the next process: 0 ({logged} removals logged by it)",
        started.elapsed().as_secs_f64(),
        span.as_millis(),
        tally[1].left,
        jobs[1],
        tally[0].left,
        jobs[0]
    );
    assert!(
        left == 0 || logged > 0,
        "the next process never logged a removal ({left} runs left a record)"
    );
}

/// `epcomm demo` (4 rank processes; its group is named after its pid) signalled as a whole with
/// SIGTERM, SIGINT or SIGHUP (what a terminal or a job manager sends) at a random moment of its
/// first 200 ms, when its ranks create their group.
#[test]
fn killed_demo_leaves_nothing_after_the_next_process() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let runs = env_or("EPCOMM_CREATION_DEMO_KILLS", 6) as usize;
    let seed = seed();
    let mut rng = seed;
    let started = Instant::now();
    let mut tally = Tally::default();
    for run in 0..runs {
        let (sig, sig_name) = SIGNALS[1 + run % 3];
        let delay = Duration::from_micros(xorshift(&mut rng) % 200_000);
        let demo = Command::new(env!("CARGO_BIN_EXE_epcomm"))
            .args(["demo", "--ranks", "4", "--steps", "2"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let pgid = demo.id() as libc::pid_t;
        std::thread::sleep(delay);
        // SAFETY: signalling the process group of the demo we started.
        unsafe { libc::kill(-pgid, sig) };
        let out = demo.wait_with_output().unwrap();
        wait_group_gone(pgid, "demo");
        let name = format!("demo{pgid}");
        let what = format!(
            "demo run {run} (seed {seed}): {sig_name} after {} us ({:?})",
            delay.as_micros(),
            out.status
        );
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        check_after_next(&name, &what, &text, &mut tally);
    }
    eprintln!(
        "shm_creation_kills: {runs} demos killed in {:.1} s (seed {seed}): records left by the kill {}/{runs}; after the next process: 0 ({} removals logged by it)",
        started.elapsed().as_secs_f64(),
        tally.left,
        tally.logged
    );
}

/// The sweep never removes a live job's record: rank 0 of a 2-rank job waits for rank 1 (and
/// is even stopped meanwhile); the next process sweeps, the record stays, and once rank 1
/// arrives the group forms and leaves nothing.
#[test]
fn a_live_jobs_record_is_never_swept() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let group = JobGroup::new(false);
    let record = format!("/dev/shm/epcomm.{}", group.name);
    let rank = |r: usize| {
        ranks::spawn_test(
            RANK_TEST,
            &[
                ("EPCOMM_CK_WORLD", "2".to_owned()),
                ("EPCOMM_CK_RANK", r.to_string()),
                ("EPCOMM_CK_NAME", group.name.clone()),
            ],
        )
    };
    let rank0 = rank(0);
    ranks::wait_for_record(&group.name, Duration::from_secs(10));
    // SAFETY: signalling the child we started.
    unsafe { libc::kill(rank0.id() as libc::pid_t, libc::SIGSTOP) };
    let log = run_next_process();
    assert!(
        std::path::Path::new(&record).exists(),
        "the live job's record was removed:\n{log}"
    );
    assert!(!log.contains(&group.name), "{log}");
    // SAFETY: as above.
    unsafe { libc::kill(rank0.id() as libc::pid_t, libc::SIGCONT) };
    let results = wait_all(vec![(0, rank0), (1, rank(1))], Duration::from_secs(30));
    for r in &results {
        assert!(r.stdout.contains("CK_RESULT Ok(())"), "{}", r.output());
    }
    assert!(shm_leftovers(&group.name).is_empty());
}
