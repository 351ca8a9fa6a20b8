//! Logging: vLLM's warnings and infos, with vLLM's wording, to a host callback or stderr.
//!
//! Without a sink, messages at or above the threshold go to stderr as `epcomm {LEVEL}: {msg}`.
//! The threshold comes from `EPCOMM_LOG_LEVEL` (`error|warn|info|debug`, default `warn`) or
//! [`set_level`]. A sink receives every message up to `info` (and `debug` when the threshold is
//! `debug`) and filters itself.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

/// Log levels; numeric values are part of the C ABI.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
}

impl Level {
    pub fn from_code(code: i32) -> Option<Level> {
        [Level::Error, Level::Warn, Level::Info, Level::Debug]
            .into_iter()
            .find(|l| *l as i32 == code)
    }

    pub fn parse(s: &str) -> Option<Level> {
        match s.trim().to_ascii_lowercase().as_str() {
            "error" => Some(Level::Error),
            "warn" | "warning" => Some(Level::Warn),
            "info" => Some(Level::Info),
            "debug" => Some(Level::Debug),
            _ => None,
        }
    }

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

fn logger() -> &'static Logger {
    static LOGGER: OnceLock<Logger> = OnceLock::new();
    LOGGER.get_or_init(|| Logger {
        sink: RwLock::new(None),
        level: RwLock::new(
            std::env::var("EPCOMM_LOG_LEVEL")
                .ok()
                .and_then(|v| Level::parse(&v))
                .unwrap_or(Level::Warn),
        ),
        once: Mutex::new(HashSet::new()),
    })
}

/// Installs (or with `None` removes) the process-wide sink.
pub fn set_sink(sink: Option<Sink>) {
    *logger().sink.write().unwrap_or_else(|e| e.into_inner()) = sink;
}

/// Sets the threshold for stderr output (and `debug` for sinks).
pub fn set_level(level: Level) {
    *logger().level.write().unwrap_or_else(|e| e.into_inner()) = level;
}

/// The current threshold.
pub fn level() -> Level {
    *logger().level.read().unwrap_or_else(|e| e.into_inner())
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
                eprintln!("epcomm {}: {msg}", level.name());
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

pub fn warn(msg: &str) {
    log(Level::Warn, msg);
}

pub fn info(msg: &str) {
    log(Level::Info, msg);
}
