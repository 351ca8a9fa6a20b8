//! Shared by the tests that read epcomm's stderr lines from a child process: running this test
//! binary again for one test with a clean `EPCOMM_*` environment, and taking a line apart into
//! its NCCL-style prefix (`{host}:{pid}:{tid} [{rank}] `) and the rest (`epcomm {LEVEL} {msg}`).
#![allow(dead_code)]

use std::ffi::OsString;
use std::process::{Command, Output, Stdio};

/// Every variable the library reads; a child starts without them, so the parent's environment
/// (CI sets some) cannot change what a test sees.
pub const LIBRARY_VARS: [&str; 7] = [
    epcomm::env::LOG_LEVEL,
    epcomm::env::TIMEOUT_S,
    epcomm::env::SHM_DIRECT,
    epcomm::env::NO_SIMD,
    epcomm::env::FAULT_POINT,
    epcomm::env::NVRTC_PATH,
    epcomm::env::CACHE_DIR,
];

/// A command that runs this test binary again for `test` alone, with `env` on top of the
/// parent's environment less [`LIBRARY_VARS`]; stdout (libtest's own report) is discarded.
pub fn child_command(test: &str, env: &[(&str, OsString)]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for var in LIBRARY_VARS {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs [`child_command`] to the end; returns the child's pid and what it left.
pub fn run_child(test: &str, env: &[(&str, OsString)]) -> (u32, Output) {
    let child = child_command(test, env).spawn().expect("spawn child");
    let pid = child.id();
    (pid, child.wait_with_output().expect("wait for child"))
}

/// The child's stderr as lines.
pub fn stderr_lines(o: &Output) -> Vec<String> {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// One stderr line of epcomm, taken apart.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub host: String,
    pub pid: u32,
    pub tid: u32,
    pub rank: Option<usize>,
    /// Everything after the prefix: `epcomm {LEVEL} {message}`.
    pub rest: String,
}

/// Parses `{host}:{pid}:{tid} [{rank}] epcomm ...` or `{host}:{pid}:{tid} epcomm ...`; panics
/// naming the line when it has another shape.
pub fn parse(line: &str) -> Line {
    let bad = || -> ! { panic!("not an epcomm log line: {line:?}") };
    let (head, tail) = line.split_once(' ').unwrap_or_else(|| bad());
    let mut fields = head.split(':');
    let (Some(host), Some(pid), Some(tid), None) =
        (fields.next(), fields.next(), fields.next(), fields.next())
    else {
        bad()
    };
    let number = |s: &str| -> u32 {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            bad()
        }
        s.parse().unwrap_or_else(|_| bad())
    };
    let (rank, rest) = match tail.strip_prefix('[') {
        Some(t) => {
            let (r, rest) = t.split_once("] ").unwrap_or_else(|| bad());
            (Some(number(r) as usize), rest)
        }
        None => (None, tail),
    };
    if host.is_empty() || host.contains('.') || !rest.starts_with("epcomm ") {
        bad()
    }
    Line {
        host: host.to_owned(),
        pid: number(pid),
        tid: number(tid),
        rank,
        rest: rest.to_owned(),
    }
}

/// This machine's short host name (up to the first `.`), as the prefix carries it.
pub fn short_hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for the length passed (one byte less, so it stays terminated).
    assert_eq!(
        unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) },
        0
    );
    let len = buf.iter().position(|&b| b == 0).unwrap();
    let name = String::from_utf8_lossy(&buf[..len]).into_owned();
    name.split('.').next().unwrap().to_owned()
}

/// The lines of a child, each checked to carry the child's host and pid, as `rest` strings.
pub fn messages(o: &Output, pid: u32) -> Vec<String> {
    let host = short_hostname();
    stderr_lines(o)
        .iter()
        .map(|l| {
            let p = parse(l);
            assert_eq!((p.host.as_str(), p.pid), (host.as_str(), pid), "{l}");
            p.rest
        })
        .collect()
}
