//! The fault and tamper campaign (docs/reliability.md, "Fault campaign"): multi-step, 3-rank
//! workloads in real processes (this test binary run again as `campaign_rank`), with a fault at
//! a random moment, every rank's outcome checked against the rules:
//!
//! - **moe**, **eplb**, **collectives**: dispatch/combine steps, EPLB rearrangement rounds, or
//!   barrier/all_gatherv/reduce_scatterv/broadcast steps; one random rank gets SIGKILL, SIGSTOP
//!   (SIGCONT after more than the timeout), SIGTERM or SIGINT at a random moment;
//! - **same_name**: two jobs of two ranks start at once with one group name;
//! - **tamper**: the parent (a third process) overwrites or truncates the group's /dev/shm
//!   segments during the run.
//!
//! Rules: no rank dies of a signal it was not sent, nor ends without a result (crashes); no
//! rank runs past the deadline, no survivor ends later than 2 timeouts + 1 s after the fault
//! (hangs); nothing of the group is left in /dev/shm (leftovers); every OK result matches the
//! reference (silent wrong); all ranks that report reach the same outcome, steps and EPLB
//! layers, including a stalled rank once resumed (divergent); a survivor's error names the
//! faulty rank and only it (misblamed); no group mixes two jobs (mixed groups).
//!
//! `EPCOMM_TEST_FULL=1 cargo test --test fault_campaign` runs the CI size (40 runs per class,
//! `EPCOMM_TIMEOUT_S=1`; a plain `cargo test` half of it) and prints the table; `scripts/fault-campaign.sh [RUNS]` the long one. Variables:
//! `EPCOMM_CAMPAIGN_RUNS` (runs per class), `EPCOMM_CAMPAIGN_SEED`, `EPCOMM_CAMPAIGN_CLASSES`
//! (comma-separated names), `EPCOMM_CAMPAIGN_FAULTS` (comma-separated KILL, STOP, TERM, INT:
//! the signals drawn from), `EPCOMM_CAMPAIGN_TIMEOUT_S` (the ranks' timeout, default 1),
//! `EPCOMM_CAMPAIGN_VERBOSE=1` (a line per signal run), `EPCOMM_CAMPAIGN_STRICT=1` (the rules
//! listed in `EXPECTED_TO_FAIL` fail too instead of printing a SKIPPED line).

mod campaign;
mod common;
mod ranks;

use std::fmt::Write as _;
use std::io::Write as _;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, ExitStatus};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use campaign::workload::{self, SAME_NAME_WORLD, WORLD};
use campaign::{ranks_named, table, Class, Fault, Report, Rng, Rule, Tally};
use epcomm::Status;
use ranks::shm_leftovers;

/// `EPCOMM_TIMEOUT_S` of every rank: 1 s, or `EPCOMM_CAMPAIGN_TIMEOUT_S` (whole seconds).
fn timeout() -> Duration {
    static T: OnceLock<Duration> = OnceLock::new();
    *T.get_or_init(|| Duration::from_secs(env_u64("EPCOMM_CAMPAIGN_TIMEOUT_S").unwrap_or(1).max(1)))
}
/// How long a stopped rank stays stopped: more than the timeout.
fn stop_for() -> Duration {
    timeout() + Duration::from_millis(300)
}
/// How much later than two timeouts after the fault a survivor may end (the failing call is
/// bounded by one timeout, destroying the group by one more).
const MARGIN: Duration = Duration::from_secs(1);
/// The parent's bound on a whole run, from the start.
fn run_deadline() -> Duration {
    Duration::from_secs(8) + 4 * timeout()
}
const CHILD_TEST: &str = "campaign_rank";
/// A same-name rank ends within 3 timeouts (waiting for a rank 0 or the join, the call, the
/// destroy) plus this after its job started: the group's settle time (up to 1 s) and a margin.
const SAME_NAME_BOUND_EXTRA: Duration = Duration::from_secs(2);
/// Runs per class in CI (the full tier; a plain `cargo test` runs half).
const CI_RUNS: u64 = 40;

/// The rules a class breaks on today's library, with what breaks: a violation of a listed rule
/// prints a SKIPPED line with the figures instead of failing (`EPCOMM_CAMPAIGN_STRICT=1` fails);
/// any other rule of the class still fails the test. None today: the rare misblame (a survivor
/// naming the other survivor after a death under direct reads, or the ranks that never arrived
/// when rank 0 died in the join window) is fixed, so a misblame fails the CI campaign.
const EXPECTED_TO_FAIL: &[(Class, Rule, &str)] = &[];

/// A child rank. Does nothing unless started by the campaign (`FC_CLASS` set).
#[test]
fn campaign_rank() {
    if std::env::var_os("FC_CLASS").is_none() {
        return;
    }
    workload::run_rank();
}

/// One process of a run as it ended.
struct Ended {
    rank: usize,
    job: u64,
    status: ExitStatus,
    /// Killed by the parent at the deadline.
    killed_at_deadline: bool,
    at: Instant,
    stdout: String,
    stderr: String,
}

impl Ended {
    fn describe(&self) -> String {
        format!(
            "--- job {} rank {} ({:?}{})\n{}{}",
            self.job,
            self.rank,
            self.status,
            if self.killed_at_deadline {
                ", killed at the deadline"
            } else {
                ""
            },
            self.stdout,
            self.stderr
        )
    }
}

/// A job's start gate: its ranks start (process start-up, which a loaded machine can stretch
/// past the 1 s timeout) and wait; the parent opens the gate once all are ready, so the random
/// moments count from a common start and a slow spawn is not taken for a fault.
struct Gate {
    path: String,
    world: usize,
}

/// How long the ranks of a job may take to start.
const START_LIMIT: Duration = Duration::from_secs(30);

impl Gate {
    fn new(group: &str, job: u64, world: usize) -> Gate {
        let path = std::env::temp_dir()
            .join(format!("{group}-{job}.gate"))
            .display()
            .to_string();
        Gate { path, world }
    }

    /// Waits until every rank of `kids` is at the gate (or one ended, or `START_LIMIT`).
    fn wait_ready(&self, kids: &mut [Kid]) {
        let limit = Instant::now() + START_LIMIT;
        while Instant::now() < limit
            && !(0..self.world).all(|r| Path::new(&format!("{}.{r}.ready", self.path)).exists())
            && kids
                .iter_mut()
                .all(|(_, _, c)| c.try_wait().unwrap().is_none())
        {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Lets the waiting ranks go; returns when.
    fn open(&self) -> Instant {
        std::fs::write(format!("{}.go", self.path), b"go").expect("open the start gate");
        Instant::now()
    }

    /// `wait_ready`, then `open`.
    fn start(&self, kids: &mut [Kid]) -> Instant {
        self.wait_ready(kids);
        self.open()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(format!("{}.go", self.path));
        for r in 0..self.world {
            let _ = std::fs::remove_file(format!("{}.{r}.ready", self.path));
        }
    }
}

fn spawn(
    class: Class,
    group: &str,
    rank: usize,
    world: usize,
    job: u64,
    direct: bool,
    gate: &Gate,
) -> Child {
    let mut env = vec![
        ("FC_GATE", gate.path.clone()),
        ("FC_CLASS", class.name().to_owned()),
        ("FC_GROUP", group.to_owned()),
        ("FC_RANK", rank.to_string()),
        ("FC_WORLD", world.to_string()),
        ("FC_JOB", job.to_string()),
        ("EPCOMM_TIMEOUT_S", timeout().as_secs().to_string()),
        ("RUST_BACKTRACE", "0".to_owned()),
    ];
    if !direct {
        env.push(("EPCOMM_SHM_DIRECT", "0".to_owned()));
    }
    ranks::spawn_test(CHILD_TEST, &env)
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: a signal to a child process this test started and has not reaped.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

/// A child of a run: (rank, job, process).
type Kid = (usize, u64, Child);

/// The children of a run and when each ended, polled every 5 ms.
struct Watch {
    children: Vec<Kid>,
    ends: Vec<Option<(ExitStatus, Instant, bool)>>,
}

impl Watch {
    fn new(children: Vec<Kid>) -> Watch {
        let ends = vec![None; children.len()];
        Watch { children, ends }
    }

    /// Notes the children that ended by `until` (returns early when all did).
    fn poll_until(&mut self, until: Instant) {
        loop {
            for ((_, _, c), end) in self.children.iter_mut().zip(self.ends.iter_mut()) {
                if end.is_none() {
                    if let Some(s) = c.try_wait().unwrap() {
                        *end = Some((s, Instant::now(), false));
                    }
                }
            }
            if self.ends.iter().all(Option::is_some) || Instant::now() >= until {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits for every child; kills those still running at `deadline`.
    fn finish(mut self, deadline: Instant) -> Vec<Ended> {
        self.poll_until(deadline);
        for ((_, _, c), end) in self.children.iter_mut().zip(self.ends.iter_mut()) {
            if end.is_none() {
                let _ = c.kill();
                *end = Some((c.wait().unwrap(), Instant::now(), true));
            }
        }
        self.children
            .into_iter()
            .zip(self.ends)
            .map(|((rank, job, c), end)| {
                let (status, at, killed_at_deadline) = end.unwrap();
                let o = c.wait_with_output().unwrap();
                Ended {
                    rank,
                    job,
                    status,
                    killed_at_deadline,
                    at,
                    stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
                    stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
                }
            })
            .collect()
    }
}

/// Waits for every child, noting when each ended; kills those still running at `deadline`.
fn wait_ended(children: Vec<Kid>, deadline: Instant) -> Vec<Ended> {
    Watch::new(children).finish(deadline)
}

/// Counts and removes what the group left in /dev/shm.
fn check_leftovers(group: &str, t: &mut Tally, what: &str, ended: &[Ended]) {
    let left = shm_leftovers(group);
    if !left.is_empty() {
        t.leftovers += 1;
        t.note(
            Rule::Leftovers,
            format!(
                "{what}: left in /dev/shm: {left:?}; the ranks: {}",
                outcome_lines(ended)
            ),
        );
        for f in left {
            let _ = std::fs::remove_file(format!("/dev/shm/{f}"));
        }
    }
}

/// A process's report, or the crash/hang it counts as.
fn report_of(e: &Ended, expected_signal: Option<i32>, t: &mut Tally, what: &str) -> Option<Report> {
    if e.killed_at_deadline {
        t.hangs += 1;
        t.note(
            Rule::Hangs,
            format!("{what}: still running at the deadline\n{}", e.describe()),
        );
        return None;
    }
    if let Some(sig) = e.status.signal() {
        if Some(sig) != expected_signal {
            t.crashes += 1;
            t.note(
                Rule::Crashes,
                format!("{what}: died of signal {sig}\n{}", e.describe()),
            );
        }
        return None;
    }
    match Report::parse(&e.stdout) {
        Some(r) if e.status.success() => Some(r),
        _ => {
            t.crashes += 1;
            t.note(
                Rule::Crashes,
                format!("{what}: ended without a result\n{}", e.describe()),
            );
            None
        }
    }
}

/// The rules about outcomes shared by the classes: silent wrong results and divergence between
/// the ranks that reported.
fn check_outcomes(reports: &[(usize, Report)], t: &mut Tally, what: &str, all: &str) {
    let mut wrong = false;
    for (rank, r) in reports {
        if r.wrong > 0 {
            wrong = true;
            t.note(
                Rule::SilentWrong,
                format!("{what}: rank {rank}: wrong result: {}", r.message),
            );
        }
    }
    if wrong {
        t.silent_wrong += 1;
    }
    let key = |r: &Report| (r.ok && r.wrong == 0, r.steps, r.eplb);
    if let Some((_, first)) = reports.first() {
        if reports.iter().any(|(_, r)| key(r) != key(first)) {
            t.divergent += 1;
            let outcomes: Vec<String> = reports
                .iter()
                .map(|(rank, r)| {
                    format!(
                        "rank {rank}: {} after {} step(s){}: {}",
                        if r.ok { "ok" } else { "err" },
                        r.steps,
                        r.eplb.map_or(String::new(), |(round, l)| format!(
                            ", eplb round {round} layers {l}"
                        )),
                        r.message
                    )
                })
                .collect();
            t.note(
                Rule::Divergent,
                format!(
                    "{what}: outcomes differ:\n  {}\n{all}",
                    outcomes.join("\n  ")
                ),
            );
        }
    }
}

/// Each process's result line (or how it ended), on one line.
fn outcome_lines(ended: &[Ended]) -> String {
    ended
        .iter()
        .map(|e| {
            let line = e
                .stdout
                .lines()
                .find_map(|l| l.strip_prefix(campaign::RESULT))
                .map_or_else(|| format!("{:?}", e.status), str::to_owned);
            format!("job {} rank {}: {line}", e.job, e.rank)
        })
        .collect::<Vec<_>>()
        .join(" / ")
}

fn describe_all(ended: &[Ended]) -> String {
    ended
        .iter()
        .map(Ended::describe)
        .collect::<Vec<_>>()
        .join("\n")
}

/// How long a clean run of `class` takes here (start to the last exit), so the random moments
/// fall inside the work on a fast or a loaded machine. The clean run's ranks must all succeed;
/// one that only timed out (a rank descheduled past the 1 s timeout on a loaded machine) is
/// tried again, up to 3 times; any other failure is noted (it counts as divergent).
fn calibrate(class: Class, t: &mut Tally) -> Duration {
    let world = match class {
        Class::SameName => SAME_NAME_WORLD,
        Class::Moe | Class::Eplb | Class::Collectives | Class::Tamper => WORLD,
    };
    let mut window = Duration::from_millis(5);
    for attempt in 0..3 {
        let group = ranks::unique("fc", &format!("{}cal", class.name()));
        let gate = Gate::new(&group, 1, world);
        let mut kids: Vec<Kid> = (0..world)
            .map(|r| (r, 1, spawn(class, &group, r, world, 1, true, &gate)))
            .collect();
        let start = gate.start(&mut kids);
        let ended = wait_ended(kids, start + run_deadline());
        let last = ended.iter().map(|e| e.at).max().unwrap_or(start);
        window = (last - start).mul_f64(0.9).max(Duration::from_millis(5));
        let what = format!("{} clean run ({group})", class.name());
        let all = describe_all(&ended);
        let reports: Vec<(usize, Report)> = ended
            .iter()
            .filter_map(|e| report_of(e, None, t, &what).map(|r| (e.rank, r)))
            .collect();
        check_leftovers(&group, t, &what, &ended);
        let failed: Vec<&Report> = reports
            .iter()
            .map(|(_, r)| r)
            .filter(|r| !r.ok || r.wrong > 0)
            .collect();
        if reports.len() == world && failed.is_empty() {
            break;
        }
        let only_timeouts = reports.len() == world
            && failed
                .iter()
                .all(|r| r.wrong == 0 && r.message.contains("timed out after"));
        if only_timeouts && attempt < 2 {
            continue;
        }
        t.divergent += 1;
        t.note(
            Rule::Divergent,
            format!("{what}: not every rank succeeded without a fault\n{all}"),
        );
        break;
    }
    window
}

/// One run of a signal class.
fn signal_run(class: Class, n: u64, window: Duration, faults: &[Fault], rng: &mut Rng) -> Tally {
    let mut t = Tally {
        runs: 1,
        ..Tally::default()
    };
    let group = ranks::unique("fc", &format!("{}{n}", class.name()));
    let victim = rng.below(WORLD as u64) as usize;
    let fault = faults[rng.below(faults.len() as u64) as usize];
    let direct = rng.below(2) == 0;
    let delay = Duration::from_millis(rng.below(window.as_millis() as u64 + 1));
    let what = format!(
        "{} run {n} ({group}, {} rank {victim} after {delay:?}, {})",
        class.name(),
        fault.name(),
        if direct { "direct" } else { "staged" }
    );
    let gate = Gate::new(&group, 0, WORLD);
    let mut kids: Vec<Kid> = (0..WORLD)
        .map(|r| (r, 0, spawn(class, &group, r, WORLD, 0, direct, &gate)))
        .collect();
    let start = gate.start(&mut kids);
    std::thread::sleep(delay);
    let fault_at = Instant::now();
    let victim_pid = kids[victim].2.id();
    let hit = kids[victim].2.try_wait().unwrap().is_none();
    let mut watch = Watch::new(std::mem::take(&mut kids));
    if hit {
        signal(victim_pid, fault.signal());
        if fault == Fault::Stop {
            // The survivors' ends are noted while the victim is stopped.
            watch.poll_until(fault_at + stop_for());
            std::thread::sleep((fault_at + stop_for()).saturating_duration_since(Instant::now()));
            signal(victim_pid, libc::SIGCONT);
        }
    }
    let resumed_at = Instant::now();
    let ended = watch.finish(start + run_deadline());
    let all = describe_all(&ended);
    let expected_signal = match fault {
        Fault::Kill | Fault::Term | Fault::Int => Some(fault.signal()),
        Fault::Stop => None,
    };
    let mut reports = Vec::new();
    let mut victim_died = false;
    for e in &ended {
        let sig = if e.rank == victim {
            expected_signal
        } else {
            None
        };
        if e.rank == victim && sig.is_some() && e.status.signal() == sig {
            victim_died = true;
        }
        if let Some(r) = report_of(e, sig, &mut t, &format!("{what}: rank {}", e.rank)) {
            reports.push((e.rank, r));
        }
        // A survivor ends within two timeouts (its failing call, then the group's destroy)
        // after the fault; the resumed rank as long after it resumed.
        let from = if e.rank == victim {
            resumed_at
        } else {
            fault_at
        };
        if hit && e.rank != victim {
            t.slowest = t.slowest.max(e.at.saturating_duration_since(fault_at));
        }
        if hit && !e.killed_at_deadline && e.at > from + 2 * timeout() + MARGIN {
            t.hangs += 1;
            t.note(
                Rule::Hangs,
                format!(
                    "{what}: rank {} ended {:?} after the fault; the ranks: {}",
                    e.rank,
                    e.at - fault_at,
                    outcome_lines(&ended)
                ),
            );
        }
    }
    // Did the fault reach the victim while it worked? (It may have finished first.)
    let victim_report = reports.iter().find(|(r, _)| *r == victim).map(|(_, r)| r);
    let faulted = hit
        && (victim_died
            || fault == Fault::Stop
                && victim_report.is_none_or(|r| r.steps < workload::steps(class)));
    if faulted {
        t.hit = 1;
    }
    check_outcomes(&reports, &mut t, &what, &all);
    verbose(&what, faulted, &ended, &reports);
    for (rank, r) in &reports {
        if *rank == victim || r.ok {
            continue;
        }
        // A rank naming itself ("(rank 2 of 3)") blames nobody.
        let named: Vec<usize> = ranks_named(&r.message)
            .into_iter()
            .filter(|n| n != rank)
            .collect();
        if !faulted || named != [victim] {
            t.misblamed += 1;
            t.note(Rule::Misblamed, format!(
                "{what}: rank {rank}'s error names rank(s) {named:?}, the faulty rank is {victim}{}: {}",
                if faulted { "" } else { " (and the fault came after its work)" },
                r.message
            ));
        }
        if faulted
            && Status::from_code(r.status)
                .is_none_or(|s| s != Status::PeerFailure && s != Status::Timeout)
        {
            t.note(
                Rule::Info,
                format!(
                    "{what}: rank {rank} (information): status {} for a faulty peer: {}",
                    r.status, r.message
                ),
            );
        }
    }
    check_leftovers(&group, &mut t, &what, &ended);
    t
}

/// One run of two jobs with one group name.
fn same_name_run(n: u64, window: Duration, rng: &mut Rng) -> Tally {
    let mut t = Tally {
        runs: 1,
        ..Tally::default()
    };
    let group = ranks::unique("fc", &format!("same{n}"));
    let jobs = [1 + rng.below(1 << 40) * 2, 2 + rng.below(1 << 40) * 2];
    let gap = Duration::from_millis(rng.below(window.as_millis() as u64 + 1));
    let direct = rng.below(2) == 0;
    let what = format!("same_name run {n} ({group}, job B {gap:?} after job A)");
    let gates = jobs.map(|j| Gate::new(&group, j, SAME_NAME_WORLD));
    let mut job_kids: Vec<Vec<Kid>> = jobs
        .iter()
        .zip(&gates)
        .map(|(&j, gate)| {
            (0..SAME_NAME_WORLD)
                .map(|r| {
                    (
                        r,
                        j,
                        spawn(Class::SameName, &group, r, SAME_NAME_WORLD, j, direct, gate),
                    )
                })
                .collect()
        })
        .collect();
    // Both jobs at their gates; A goes, then B `gap` later.
    gates[1].wait_ready(&mut job_kids[1]);
    let start = gates[0].start(&mut job_kids[0]);
    std::thread::sleep(gap);
    let overlapped = job_kids[0]
        .iter_mut()
        .all(|(_, _, c)| c.try_wait().unwrap().is_none());
    gates[1].open();
    let kids: Vec<Kid> = job_kids.into_iter().flatten().collect();
    let ended = wait_ended(kids, start + run_deadline());
    let all = describe_all(&ended);
    if overlapped {
        t.hit = 1;
    }
    let mut mixed = false;
    for job in jobs {
        let mut reports = Vec::new();
        for e in ended.iter().filter(|e| e.job == job) {
            let w = format!("{what}: job {job} rank {}", e.rank);
            if let Some(mut r) = report_of(e, None, &mut t, &w) {
                if r.jobs
                    .as_ref()
                    .is_some_and(|ids| ids.iter().any(|&j| j != job))
                {
                    mixed = true;
                    t.note(
                        Rule::MixedGroups,
                        format!("{w}: in a group with jobs {:?}\n{all}", r.jobs),
                    );
                    r.wrong = 0; // counted as a mixed group, not twice
                }
                if e.at > start + gap + SAME_NAME_BOUND_EXTRA + 3 * timeout() {
                    t.hangs += 1;
                    t.note(
                        Rule::Hangs,
                        format!(
                            "{w}: ended {:?} after the start; the ranks: {}",
                            e.at - start,
                            outcome_lines(&ended)
                        ),
                    );
                }
                reports.push((e.rank, r));
            }
        }
        check_outcomes(&reports, &mut t, &format!("{what}: job {job}"), &all);
    }
    if mixed {
        t.mixed_groups += 1;
    }
    check_leftovers(&group, &mut t, &what, &ended);
    t
}

/// What the tamperer does to the segments it finds.
fn tamper(group: &str, rng: &mut Rng) -> Option<String> {
    let names = shm_leftovers(group);
    if names.is_empty() {
        return None;
    }
    let all = rng.below(3) == 0;
    let pick = rng.below(names.len() as u64) as usize;
    let how = rng.below(5);
    let mut done = Vec::new();
    for (i, name) in names.iter().enumerate() {
        if !all && i != pick {
            continue;
        }
        let path = format!("/dev/shm/{name}");
        let Ok(f) = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
        else {
            continue;
        };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let r = match how {
            0 => f.set_len(0).map(|()| "truncated to 0".to_owned()),
            1 => f
                .set_len(len / 2)
                .map(|()| format!("truncated to {}", len / 2)),
            2 => {
                use std::os::unix::fs::FileExt;
                let bytes: Vec<u8> = (0..len.min(4096)).map(|_| rng.next() as u8).collect();
                f.write_all_at(&bytes, 0)
                    .map(|()| format!("first {} bytes random", bytes.len()))
            }
            3 => {
                use std::os::unix::fs::FileExt;
                let off = rng.below(len.max(1));
                let bytes: Vec<u8> = (0..64).map(|_| rng.next() as u8).collect();
                f.write_all_at(&bytes, off.min(len.saturating_sub(64)))
                    .map(|()| format!("64 random bytes at {off}"))
            }
            _ => {
                use std::os::unix::fs::FileExt;
                let bytes = vec![0xFF; len.min(1 << 16) as usize];
                f.write_all_at(&bytes, 0)
                    .map(|()| format!("first {} bytes 0xFF", bytes.len()))
            }
        };
        if let Ok(r) = r {
            done.push(format!("{name}: {r}"));
        }
    }
    (!done.is_empty()).then(|| done.join("; "))
}

/// One run with the group's segments tampered with by the parent.
fn tamper_run(n: u64, window: Duration, rng: &mut Rng) -> Tally {
    let mut t = Tally {
        runs: 1,
        ..Tally::default()
    };
    let group = ranks::unique("fc", &format!("tamper{n}"));
    let delay = Duration::from_millis(rng.below(window.as_millis() as u64 + 1));
    let direct = rng.below(2) == 0;
    let gate = Gate::new(&group, 0, WORLD);
    let mut kids: Vec<Kid> = (0..WORLD)
        .map(|r| {
            (
                r,
                0,
                spawn(Class::Tamper, &group, r, WORLD, 0, direct, &gate),
            )
        })
        .collect();
    let start = gate.start(&mut kids);
    // Half the runs strike as soon as a segment appears (the join window: after creation the
    // names may be gone), half at a random moment of the work.
    let at_first_sight = rng.below(2) == 0;
    let tampered = if at_first_sight {
        let mut found = None;
        while found.is_none() && start.elapsed() < window + Duration::from_millis(100) {
            if !shm_leftovers(&group).is_empty() {
                found = tamper(&group, rng);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        found
    } else {
        std::thread::sleep(delay);
        tamper(&group, rng)
    };
    let tamper_at = Instant::now();
    let what = format!(
        "tamper run {n} ({group}, {}: {})",
        if at_first_sight {
            format!("at first sight, {:?}", tamper_at - start)
        } else {
            format!("after {delay:?}")
        },
        tampered.as_deref().unwrap_or("no segment to tamper with")
    );
    if tampered.is_some() {
        t.hit = 1;
    }
    let ended = wait_ended(kids, start + run_deadline());
    let all = describe_all(&ended);
    let mut reports = Vec::new();
    for e in &ended {
        let w = format!("{what}: rank {}", e.rank);
        if let Some(r) = report_of(e, None, &mut t, &w) {
            reports.push((e.rank, r));
        }
        if !e.killed_at_deadline && e.at > tamper_at + 2 * timeout() + MARGIN {
            t.hangs += 1;
            t.note(
                Rule::Hangs,
                format!("{w}: ended {:?} after the tampering", e.at - tamper_at),
            );
        }
    }
    check_outcomes(&reports, &mut t, &what, &all);
    check_leftovers(&group, &mut t, &what, &ended);
    t
}

/// With `EPCOMM_CAMPAIGN_VERBOSE=1`, one line per run: what was done and each rank's outcome.
fn verbose(what: &str, hit: bool, ended: &[Ended], reports: &[(usize, Report)]) {
    if !common::skip::required("EPCOMM_CAMPAIGN_VERBOSE") {
        return;
    }
    let mut line = format!("{what}: hit {hit}");
    for e in ended {
        let r = reports.iter().find(|(r, _)| *r == e.rank).map(|(_, r)| r);
        let _ = match r {
            Some(r) => write!(
                line,
                "; rank {} {} after {} step(s): {}",
                e.rank,
                if r.ok { "ok" } else { "err" },
                r.steps,
                r.message
            ),
            None => write!(line, "; rank {} {:?}", e.rank, e.status),
        };
    }
    show(&format!("{line}\n"));
}

fn env_u64(key: &str) -> Option<u64> {
    std::env::var(key).ok().and_then(|v| v.parse().ok())
}

/// Writes past libtest's capture, as common::skip does, so the table shows in `cargo test`.
fn show(text: &str) {
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}

#[test]
fn fault_campaign() {
    let runs = common::skip::campaign_runs("EPCOMM_CAMPAIGN_RUNS", CI_RUNS);
    let seed = env_u64("EPCOMM_CAMPAIGN_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    let strict = common::skip::required("EPCOMM_CAMPAIGN_STRICT");
    let classes: Vec<Class> = match std::env::var("EPCOMM_CAMPAIGN_CLASSES") {
        Ok(list) if !list.is_empty() => list
            .split(',')
            .map(|c| Class::parse(c.trim()).unwrap_or_else(|| panic!("unknown class {c:?}")))
            .collect(),
        _ => Class::ALL.to_vec(),
    };
    let faults: Vec<Fault> = match std::env::var("EPCOMM_CAMPAIGN_FAULTS") {
        Ok(list) if !list.is_empty() => list
            .split(',')
            .map(|f| {
                Fault::ALL
                    .into_iter()
                    .find(|x| x.name() == f.trim())
                    .unwrap_or_else(|| {
                        panic!("unknown fault {f:?}; expected KILL, STOP, TERM or INT")
                    })
            })
            .collect(),
        _ => Fault::ALL.to_vec(),
    };
    show(&format!(
        "fault campaign: {runs} run(s) per class, signals {}, seed {seed} (EPCOMM_CAMPAIGN_SEED={seed} repeats it), EPCOMM_TIMEOUT_S={}\n",
        faults.iter().map(|f| f.name()).collect::<Vec<_>>().join(","),
        timeout().as_secs()
    ));
    let started = Instant::now();
    let mut rows = Vec::new();
    for (i, &class) in classes.iter().enumerate() {
        let mut rng = Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9));
        let mut tally = Tally::default();
        let window = calibrate(class, &mut tally);
        for n in 0..runs {
            let t = match class {
                Class::Moe | Class::Eplb | Class::Collectives => {
                    signal_run(class, n, window, &faults, &mut rng)
                }
                Class::SameName => same_name_run(n, window, &mut rng),
                Class::Tamper => tamper_run(n, window, &mut rng),
            };
            tally.add(&t);
        }
        rows.push((class, tally));
    }
    show(&format!(
        "fault campaign summary ({:.0} s):\n{}",
        started.elapsed().as_secs_f64(),
        table(&rows)
    ));
    let mut failures = Vec::new();
    for (class, t) in &rows {
        for rule in Rule::VIOLATIONS {
            let expected = EXPECTED_TO_FAIL
                .iter()
                .find(|(c, r, _)| c == class && *r == rule);
            let n = t.count(rule);
            if n == 0 {
                if let Some((_, _, why)) = expected {
                    show(&format!(
                        "fault campaign: class {} kept rule {} in all {} runs (listed in EXPECTED_TO_FAIL: {why}; remove the entry once that is fixed)\n",
                        class.name(),
                        rule.name(),
                        t.runs
                    ));
                }
                continue;
            }
            let notes: Vec<&String> = t
                .notes
                .iter()
                .filter(|(r, _)| *r == rule)
                .map(|(_, n)| n)
                .collect();
            let detail = format!(
                "{} broke {} in {n} of {} runs; first: {}",
                class.name(),
                rule.name(),
                t.runs,
                notes
                    .iter()
                    .take(3)
                    .map(|s| s.lines().next().unwrap_or("").chars().take(300).collect())
                    .collect::<Vec<String>>()
                    .join(" | ")
            );
            match expected {
                Some((_, _, why)) if !strict => common::skip::skipped(
                    &format!("fault_campaign::{}::{}", class.name(), rule.name()),
                    &format!("expected to fail ({why}): {detail}"),
                ),
                Some(_) | None => failures.push(format!(
                    "{detail}\n{}",
                    notes
                        .iter()
                        .take(5)
                        .map(|n| n.chars().take(3000).collect::<String>())
                        .collect::<Vec<_>>()
                        .join("\n")
                )),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
