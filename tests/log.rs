//! Log routing: vLLM's warnings reach the sink with vLLM's wording; `warning_once` texts once
//! (one in-process test function, so the once-per-process state is predictable). Stderr lines
//! carry the NCCL-style prefix, with the rank where the thread's rank is known, and reach stderr
//! in one write each: checked in child processes (this binary run again for one test).

mod log_lines;
#[path = "common/skip.rs"]
#[allow(dead_code)]
mod skip;

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions};
use epcomm::log::{self, Level};
use epcomm::select::all2all;
use log_lines::{parse, run_child, short_hostname};
use skip::skipped;

/// Set in a child process to the case it runs.
const CHILD: &str = "EPCOMM_TEST_LOG_CHILD";

#[test]
fn warnings_reach_the_sink_once_where_vllm_warns_once() {
    let seen: Arc<Mutex<Vec<(Level, String)>>> = Arc::default();
    let s = seen.clone();
    log::set_sink(Some(Arc::new(move |l, m| {
        s.lock().unwrap().push((l, m.to_owned()))
    })));

    all2all::resolve("naive").unwrap();
    all2all::resolve("naive").unwrap();
    all2all::resolve("flashinfer_all2allv").unwrap();
    all2all::resolve("flashinfer_all2allv").unwrap();
    all2all::resolve("deepep_low_latency").unwrap();
    assert!(all2all::resolve("bogus").is_err());

    let w2 =
        "The 'naive' all2all backend has been removed. Falling back to 'allgather_reducescatter'.";
    let w1 = "'flashinfer_all2allv' is deprecated and has been renamed to'flashinfer_nvlink_two_sided'. It will be removed in a futurerelease.";
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            (Level::Warn, w2.to_owned()),
            (Level::Warn, w2.to_owned()),
            (Level::Warn, w1.to_owned()),
        ]
    );

    // Infos reach a sink; debug only at debug level.
    seen.lock().unwrap().clear();
    log::info("hello");
    log::log(Level::Debug, "dbg");
    log::set_level(Level::Debug);
    log::log(Level::Debug, "dbg2");
    log::set_level(Level::Warn);
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            (Level::Info, "hello".to_owned()),
            (Level::Debug, "dbg2".to_owned())
        ]
    );

    // The config checker logs every warning it reports.
    seen.lock().unwrap().clear();
    let o = epcomm::select::config::check_json(r#"{"all2all_backend": "pplx"}"#, false, false);
    assert!(o.result.is_ok());
    assert!(seen.lock().unwrap().contains(&(
        Level::Warn,
        "The 'pplx' all2all backend has been removed. Falling back to 'allgather_reducescatter'."
            .to_owned()
    )));
    log::set_sink(None);

    assert_eq!(Level::parse("WARNING"), Some(Level::Warn));
    assert_eq!(Level::parse("debug"), Some(Level::Debug));
    assert_eq!(Level::parse("loud"), None);
}

/// Child side of the stderr tests: logs what the case in `EPCOMM_TEST_LOG_CHILD` asks for. In a
/// normal run (variable unset) it does nothing.
#[test]
fn child() {
    let Some(case) = std::env::var_os(CHILD) else {
        return;
    };
    match case.to_str().unwrap() {
        "prefix" => {
            log::warn("no rank yet");
            log::log(Level::Error, "an error");
            log::info("an info below the threshold");
            log::set_thread_rank(Some(3));
            log::warn("after joining as rank 3");
            {
                let _scope = log::rank_scope(5);
                log::warn("inside a scope for rank 5");
                let _inner = log::rank_scope(6);
                log::warn("inside a nested scope for rank 6");
            }
            log::warn("after the scopes");
            std::thread::spawn(|| log::warn("from another thread"))
                .join()
                .unwrap();
            log::set_thread_rank(None);
            log::warn("rank forgotten");
            // Threads as the ranks of one shared-memory group: each logs its own rank.
            let name = format!("logtest{}", std::process::id());
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    let name = name.clone();
                    std::thread::spawn(move || {
                        let g = ShmGroup::join(&name, rank, 2, GroupOptions::default()).unwrap();
                        log::warn(&format!("joined as rank {}", g.rank()));
                        g
                    })
                })
                .collect();
            let groups: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
            drop(groups);
        }
        w => {
            let writer: usize = w.strip_prefix("writer").unwrap().parse().unwrap();
            for i in 0..WRITER_LINES {
                log::warn(&writer_message(writer, i));
            }
        }
    }
}

/// Lines each concurrent writer logs.
const WRITER_LINES: usize = 2000;

/// Line `i` of writer `w`: long enough that a line split into several writes would be caught
/// between another process's writes.
fn writer_message(w: usize, i: usize) -> String {
    format!("writer {w} line {i} {}", "x".repeat(160))
}

#[test]
fn stderr_lines_carry_host_pid_tid_and_the_rank_where_known() {
    let (pid, o) = run_child("child", &[(CHILD, "prefix".into())]);
    assert!(o.status.success(), "{o:?}");
    let lines: Vec<_> = log_lines::stderr_lines(&o)
        .iter()
        .map(|l| parse(l))
        .collect();
    let host = short_hostname();
    for l in &lines {
        assert_eq!((l.host.as_str(), l.pid), (host.as_str(), pid), "{l:?}");
    }
    let got: Vec<_> = lines.iter().map(|l| (l.rank, l.rest.as_str())).collect();
    let (head, shm) = got.split_at(got.len() - 2);
    assert_eq!(
        head,
        [
            (None, "epcomm WARNING no rank yet"),
            (None, "epcomm ERROR an error"),
            (Some(3), "epcomm WARNING after joining as rank 3"),
            (Some(5), "epcomm WARNING inside a scope for rank 5"),
            (Some(6), "epcomm WARNING inside a nested scope for rank 6"),
            (Some(3), "epcomm WARNING after the scopes"),
            (None, "epcomm WARNING from another thread"),
            (None, "epcomm WARNING rank forgotten"),
        ]
    );
    let mut shm = shm.to_vec();
    shm.sort();
    assert_eq!(
        shm,
        [
            (Some(0), "epcomm WARNING joined as rank 0"),
            (Some(1), "epcomm WARNING joined as rank 1"),
        ]
    );
    // The thread id is the kernel's: one for the main thread's lines, another for the others.
    let tids: Vec<u32> = lines.iter().map(|l| l.tid).collect();
    let main = tids[0];
    assert_eq!(&tids[..6], [main; 6], "{lines:?}");
    assert_eq!(tids[7], main, "{lines:?}");
    let others = [tids[6], tids[8], tids[9]];
    assert!(
        others.iter().all(|t| *t != main) && others[0] != others[1] && others[1] != others[2],
        "{lines:?}"
    );
}

/// Four processes log 2000 lines each into one pipe at once; every line comes back whole.
#[test]
fn each_line_reaches_stderr_in_one_write() {
    const WRITERS: usize = 4;
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let children: Vec<_> = (0..WRITERS)
        .map(|w| {
            let mut cmd =
                log_lines::child_command("child", &[(CHILD, format!("writer{w}").into())]);
            cmd.stderr(Stdio::from(write_end.try_clone().unwrap()));
            let child = cmd.spawn().unwrap();
            (child.id(), child)
        })
        .collect();
    // Only the children hold the write end now, so the read ends when the last one exits.
    drop(write_end);
    let mut out = String::new();
    std::fs::File::from(read_end)
        .read_to_string(&mut out)
        .unwrap();
    let pids: Vec<u32> = children.iter().map(|(pid, _)| *pid).collect();
    for (_, mut c) in children {
        assert!(c.wait().unwrap().success());
    }

    let mut seen = vec![vec![false; WRITER_LINES]; WRITERS];
    let host = short_hostname();
    for line in out.lines() {
        let l = parse(line);
        let rest = l
            .rest
            .strip_prefix("epcomm WARNING writer ")
            .unwrap_or_else(|| panic!("line is not a whole writer line: {line:?}"));
        let (w, rest) = rest.split_once(" line ").unwrap();
        let (i, _) = rest.split_once(' ').unwrap();
        let (w, i): (usize, usize) = (w.parse().unwrap(), i.parse().unwrap());
        assert_eq!(l.rest, format!("epcomm WARNING {}", writer_message(w, i)));
        assert_eq!(
            (l.host.as_str(), l.pid, l.rank),
            (host.as_str(), pids[w], None)
        );
        assert!(!seen[w][i], "line {i} of writer {w} twice");
        seen[w][i] = true;
    }
    for (w, lines) in seen.iter().enumerate() {
        let missing = lines.iter().filter(|s| !**s).count();
        assert_eq!(missing, 0, "writer {w}: {missing} lines missing");
    }
}

/// Under strace (when it is installed and may trace), each line is exactly one write(2) to fd 2.
#[test]
fn strace_shows_one_write_per_line() {
    let strace = std::path::Path::new("/usr/bin/strace");
    if !strace.exists() {
        return skipped("strace_shows_one_write_per_line", "strace is not installed");
    }
    let trace = std::env::temp_dir().join(format!("epcomm-log-strace-{}", std::process::id()));
    let mut cmd = std::process::Command::new(strace);
    cmd.args([
        "-f",
        "-qq",
        "-e",
        "trace=write",
        "-e",
        "signal=none",
        "-s",
        "400",
        "-o",
    ])
    .arg(&trace)
    .arg(std::env::current_exe().unwrap())
    .args(["--exact", "child", "--nocapture", "--test-threads=1"])
    .env(CHILD, "prefix");
    for var in log_lines::LIBRARY_VARS {
        cmd.env_remove(var);
    }
    let o = cmd.output().unwrap();
    let text = std::fs::read_to_string(&trace).unwrap_or_default();
    let _ = std::fs::remove_file(&trace);
    if !o.status.success() || text.is_empty() {
        return skipped(
            "strace_shows_one_write_per_line",
            &format!(
                "strace cannot trace here: {}",
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .next()
                    .unwrap_or("no trace")
            ),
        );
    }
    // `PID write(2, "host:pid:tid ... epcomm WARNING no rank yet\n", N) = N`
    let writes: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_once("write(2, \"").map(|(_, w)| w))
        .collect();
    let lines = log_lines::stderr_lines(&o);
    assert_eq!(writes.len(), lines.len(), "{text}");
    for (w, line) in writes.iter().zip(&lines) {
        let body = w.rsplit_once("\", ").unwrap().0;
        assert!(body.ends_with("\\n"), "a write without its newline: {w}");
        assert!(line.contains(" epcomm "), "{line}");
    }
}
