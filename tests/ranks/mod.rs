//! Plumbing shared by the integration tests whose ranks are threads or real processes: group
//! names unique to the test run, ranks on threads, and ranks as child processes — this test
//! binary run again for one test, with the rank's environment — waited for with a deadline
//! (stragglers are killed), their output collected; and a group's leftovers in /dev/shm.
#![allow(dead_code)]

use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A group name unique to this test binary's run: `{prefix}{pid}-{name}-{n}`, `n` counting the
/// names made so far.
pub fn unique(prefix: &str, name: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}{}-{name}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Runs `f(rank)` on `world` threads; returns the results in rank order, panicking if a rank
/// panicked.
pub fn on_threads<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let f = f.clone();
            std::thread::spawn(move || f(r))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank panicked"))
        .collect()
}

/// Starts this test binary again as one child process running only `test_name`, with `env`
/// added to its environment; its stdout and stderr are piped.
pub fn spawn_test(test_name: &str, env: &[(&str, String)]) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test_name, "--nocapture", "--test-threads=1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn rank")
}

/// Starts one child process (`spawn_test`) per rank in `ranks`, with `env(rank)` added to its
/// environment.
pub fn spawn_ranks(
    test_name: &str,
    ranks: impl IntoIterator<Item = usize>,
    env: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> Vec<(usize, Child)> {
    ranks
        .into_iter()
        .map(|rank| (rank, spawn_test(test_name, &env(rank))))
        .collect()
}

/// A rank process that ended (or was killed at the deadline).
pub struct Finished {
    pub rank: usize,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// Everything the rank printed, under a header naming the rank and how it ended.
    pub fn output(&self) -> String {
        format!(
            "--- rank {} ({:?})\n{}{}",
            self.rank, self.status, self.stdout, self.stderr
        )
    }
}

/// Waits for all children; kills everything still running `limit` after the call (a failure).
/// Returns them in the order given.
pub fn wait_all(children: Vec<(usize, Child)>, limit: Duration) -> Vec<Finished> {
    let start = Instant::now();
    let mut out = Vec::new();
    for (rank, mut c) in children {
        loop {
            if let Some(_status) = c.try_wait().unwrap() {
                break;
            }
            if start.elapsed() > limit {
                let _ = c.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let o = c.wait_with_output().unwrap();
        out.push(Finished {
            rank,
            status: o.status,
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        });
    }
    out
}

/// Panics with every rank's output unless all of them succeeded.
pub fn assert_all_ok(results: &[Finished]) {
    if results.iter().any(|r| !r.success()) {
        let all: Vec<String> = results.iter().map(Finished::output).collect();
        panic!("some ranks failed:\n{}", all.join("\n"));
    }
}

/// Waits for group `group`'s rendezvous record, `/dev/shm/epcomm.{group}` (its rank 0 created
/// the group), polling every 200 µs; panics when none appeared within `limit`. Returns its path.
pub fn wait_for_record(group: &str, limit: Duration) -> String {
    let path = format!("/dev/shm/epcomm.{group}");
    let start = Instant::now();
    while !std::path::Path::new(&path).exists() {
        assert!(
            start.elapsed() < limit,
            "no record of group '{group}' appeared"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    path
}

/// Entries of /dev/shm that belong to group `group` ("epcomm.GROUP" or "epcomm.GROUP.*").
pub fn shm_leftovers(group: &str) -> Vec<String> {
    let prefix = format!("epcomm.{group}");
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n == &prefix || n.starts_with(&format!("{prefix}.")))
        .collect()
}

/// The ready files of a run's rank processes: rank r writes `{path}.{r}` once it has joined;
/// removed when dropped.
pub struct Ready {
    path: String,
    world: usize,
}

impl Ready {
    /// Ready files named after group `name`, in the temporary directory.
    pub fn new(name: &str, world: usize) -> Ready {
        let path = std::env::temp_dir().join(name);
        Ready {
            path: path.to_string_lossy().into_owned(),
            world,
        }
    }

    /// The path the ranks append `.{rank}` to.
    pub fn path(&self) -> String {
        self.path.clone()
    }

    /// Waits (at most `limit`) until every rank wrote its file.
    pub fn wait(&self, limit: Duration) {
        let start = Instant::now();
        while (0..self.world).any(|r| !std::path::Path::new(&format!("{}.{r}", self.path)).exists())
            && start.elapsed() < limit
        {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Ready {
    fn drop(&mut self) {
        for r in 0..self.world {
            let _ = std::fs::remove_file(format!("{}.{r}", self.path));
        }
    }
}
