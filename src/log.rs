//! Logging: vLLM's warnings and infos, with vLLM's wording, to a host callback or stderr.
//!
//! Without a sink, messages at or above the threshold go to stderr, one line per message in a
//! single write(2) (so lines of ranks sharing a terminal or pipe never interleave mid-line; the
//! kernel keeps writes to a pipe whole up to `PIPE_BUF`, 4096 bytes), prefixed like NCCL's
//! debug lines:
//!
//! ```text
//! {host}:{pid}:{tid} [{rank}] epcomm {LEVEL} {message}
//! {host}:{pid}:{tid} epcomm {LEVEL} {message}
//! ```
//!
//! `host` is the short host name (up to the first `.`), `tid` the kernel thread id (gettid),
//! `LEVEL` one of `ERROR`, `WARNING`, `INFO`, `DEBUG`. ` [{rank}]` appears when the logging
//! thread's rank is known ([`thread_rank`]): inside a [`rank_scope`], else the rank of the last
//! group the thread joined. A sink receives the bare message, without prefix or newline.
//!
//! The threshold comes from `EPCOMM_LOG_LEVEL` (`error|warn|info|debug`, default `warn`; see
//! [`crate::env`]) or [`set_level`]. A sink receives every message up to `info` (and `debug`
//! when the threshold is `debug`) and filters itself.

use std::cell::Cell;
use std::collections::HashSet;
use std::io::Write;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use crate::var::{invalid_message, lossy, read};

/// Log levels. Declaration order, from 1, is the C code (`EPCOMM_LOG_*`, asserted in ffi/mod.rs's
/// tests): only append.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// `EPCOMM_LOG_ERROR`.
    Error = 1,
    /// `EPCOMM_LOG_WARN`.
    Warn,
    /// `EPCOMM_LOG_INFO`.
    Info,
    /// `EPCOMM_LOG_DEBUG`.
    Debug,
}

impl Level {
    pub const ALL: [Level; 4] = [Level::Error, Level::Warn, Level::Info, Level::Debug];

    /// The level of an `EPCOMM_LOG_*` code.
    pub fn from_code(code: i32) -> Option<Level> {
        Level::ALL.into_iter().find(|l| *l as i32 == code)
    }

    /// `error`, `warn`/`warning`, `info` or `debug`, any case, surrounding space ignored.
    pub fn parse(s: &str) -> Option<Level> {
        match s.trim().to_ascii_lowercase().as_str() {
            "error" => Some(Level::Error),
            "warn" | "warning" => Some(Level::Warn),
            "info" => Some(Level::Info),
            "debug" => Some(Level::Debug),
            _ => None,
        }
    }

    /// The name in stderr lines: `ERROR`, `WARNING`, `INFO`, `DEBUG`.
    pub fn name(self) -> &'static str {
        match self {
            Level::Error => "ERROR",
            Level::Warn => "WARNING",
            Level::Info => "INFO",
            Level::Debug => "DEBUG",
        }
    }
}

/// A log sink: receives (level, message).
pub type Sink = Arc<dyn Fn(Level, &str) + Send + Sync>;

struct Logger {
    sink: RwLock<Option<Sink>>,
    level: RwLock<Level>,
    once: Mutex<HashSet<String>>,
}

static LOGGER: OnceLock<Logger> = OnceLock::new();

/// Log threshold for stderr (the one variable the logger reads itself: `env` logs through it).
pub const LOG_LEVEL: &str = "EPCOMM_LOG_LEVEL";

/// `EPCOMM_LOG_LEVEL`: the threshold (default `warn`) and, for an invalid value, the warning
/// to log. Read while the logger initialises, so the logger logs the warning once it can
/// (logging from here would recurse into the initialisation).
pub fn log_level() -> (Level, Option<String>) {
    const EXPECTED: &str = "error|warn|info|debug";
    match read(LOG_LEVEL) {
        None => (Level::Warn, None),
        Some(Ok(v)) => match Level::parse(&v) {
            Some(l) => (l, None),
            None => (
                Level::Warn,
                Some(invalid_message(LOG_LEVEL, &v, EXPECTED, "warn")),
            ),
        },
        Some(Err(raw)) => (
            Level::Warn,
            Some(invalid_message(LOG_LEVEL, &lossy(&raw), EXPECTED, "warn")),
        ),
    }
}

/// The logger, and the `EPCOMM_LOG_LEVEL` warning when this call initialised it (the caller
/// logs it: logging during the initialisation would recurse into it).
fn init() -> (&'static Logger, Option<String>) {
    let mut warning = None;
    let logger = LOGGER.get_or_init(|| {
        let (level, w) = log_level();
        warning = w;
        Logger {
            sink: RwLock::new(None),
            level: RwLock::new(level),
            once: Mutex::new(HashSet::new()),
        }
    });
    (logger, warning)
}

fn logger() -> &'static Logger {
    let (logger, warning) = init();
    if let Some(w) = warning {
        log(Level::Warn, &w);
    }
    logger
}

/// Installs (or with `None` removes) the process-wide sink.
pub fn set_sink(sink: Option<Sink>) {
    // A warning about EPCOMM_LOG_LEVEL goes to the sink being installed, not to stderr.
    let (logger, warning) = init();
    *logger.sink.write().unwrap_or_else(|e| e.into_inner()) = sink;
    if let Some(w) = warning {
        log(Level::Warn, &w);
    }
}

/// Sets the threshold for stderr output (and `debug` for sinks).
pub fn set_level(level: Level) {
    *logger().level.write().unwrap_or_else(|e| e.into_inner()) = level;
}

/// The current threshold.
pub fn level() -> Level {
    *logger().level.read().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// The rank of the last group this thread joined ([`set_thread_rank`]).
    static JOINED_RANK: Cell<Option<usize>> = const { Cell::new(None) };
    /// The rank of the innermost [`RankScope`] alive on this thread.
    static SCOPED_RANK: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Records that the calling thread now works as `rank` of a group (a group calls this when it
/// joins, on the joining thread); its later messages carry `[rank]`. `None` forgets it.
pub fn set_thread_rank(rank: Option<usize>) {
    JOINED_RANK.with(|r| r.set(rank));
}

/// The rank this thread's messages carry: the innermost [`rank_scope`]'s, else the rank of the
/// last group the thread joined, else none.
pub fn thread_rank() -> Option<usize> {
    SCOPED_RANK
        .with(Cell::get)
        .or_else(|| JOINED_RANK.with(Cell::get))
}

/// While alive, the messages of the thread that made it carry its rank; see [`rank_scope`].
#[must_use = "the rank applies only while the scope is alive"]
pub struct RankScope {
    previous: Option<usize>,
    /// Tied to the thread whose rank it set.
    _not_send: PhantomData<*const ()>,
}

/// Makes the calling thread's messages carry `rank` until the returned scope drops (then the
/// rank before it applies again). For calls made on behalf of one rank of a group, so that a
/// thread that is a rank of several groups logs the rank of the call at hand.
pub fn rank_scope(rank: usize) -> RankScope {
    RankScope {
        previous: SCOPED_RANK.with(|r| r.replace(Some(rank))),
        _not_send: PhantomData,
    }
}

impl Drop for RankScope {
    fn drop(&mut self) {
        SCOPED_RANK.with(|r| r.set(self.previous));
    }
}

/// The short host name, as NCCL prints it (up to the first `.`); `localhost` if unknown.
fn hostname() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        let mut buf = [0u8; 256];
        // SAFETY: `buf` is writable for its length; gethostname NUL-terminates within it or
        // truncates, and the last byte stays 0 either way because we pass one byte less.
        let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
        let len = buf.iter().position(|&b| b == 0).unwrap_or(0);
        let name = String::from_utf8_lossy(&buf[..len]);
        match name.split('.').next() {
            Some(short) if rc == 0 && !short.is_empty() => short.to_owned(),
            _ => "localhost".to_owned(),
        }
    })
}

/// The stderr line of a message logged by this thread now, newline included:
/// `{host}:{pid}:{tid} [{rank}] epcomm {LEVEL} {msg}\n` (no ` [{rank}]` when
/// [`thread_rank`] is `None`).
pub fn stderr_line(level: Level, msg: &str) -> String {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    let rank = thread_rank().map(|r| format!(" [{r}]")).unwrap_or_default();
    format!(
        "{}:{}:{tid}{rank} epcomm {} {msg}\n",
        hostname(),
        std::process::id(),
        level.name()
    )
}

/// Emits one message.
pub fn log(level: Level, msg: &str) {
    let threshold = self::level();
    let sink = logger()
        .sink
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    match sink {
        Some(sink) => {
            if level <= threshold.max(Level::Info) {
                sink(level, msg);
            }
        }
        None => {
            if level <= threshold {
                let line = stderr_line(level, msg);
                // One write of the whole line: the lock orders this process's threads, the
                // single write(2) keeps other processes' lines from landing inside it. A
                // closed or full stderr is no reason to fail the caller.
                let _ = std::io::stderr().lock().write_all(line.as_bytes());
            }
        }
    }
}

/// Emits a message only the first time this exact text is seen in the process (vLLM's
/// `warning_once` / `info_once`).
pub fn log_once(level: Level, msg: &str) {
    let first = logger()
        .once
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(msg.to_owned());
    if first {
        log(level, msg);
    }
}

/// Emits a warning.
pub fn warn(msg: &str) {
    log(Level::Warn, msg);
}

/// Emits an info.
pub fn info(msg: &str) {
    log(Level::Info, msg);
}
