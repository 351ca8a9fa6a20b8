//! Bounded waiting: deadlines, the spin-yield-sleep backoff and the liveness period.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub(super) const LIVENESS_PERIOD: Duration = Duration::from_millis(50);

pub(super) struct Deadline {
    start: Instant,
    pub(super) timeout: Duration,
}

impl Deadline {
    pub(super) fn new(timeout: Duration) -> Self {
        Deadline {
            start: Instant::now(),
            timeout,
        }
    }
    pub(super) fn expired(&self) -> bool {
        self.start.elapsed() >= self.timeout
    }
}

/// Spin, then yield, then sleep in short steps: fast when peers are close, cheap when not.
pub(super) struct Backoff {
    pub(super) iter: u32,
    start: Instant,
}

/// Threads of this process waiting in a Backoff now: long waits sleep in proportion, so 1024
/// thread ranks polling 1024 slots each do not starve the ones that have work.
static WAITING: AtomicU64 = AtomicU64::new(0);

impl Drop for Backoff {
    fn drop(&mut self) {
        WAITING.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Backoff {
    pub(super) fn new() -> Self {
        WAITING.fetch_add(1, Ordering::Relaxed);
        Backoff {
            iter: 0,
            start: Instant::now(),
        }
    }
    pub(super) fn snooze(&mut self) {
        self.iter += 1;
        if self.iter < 64 {
            std::hint::spin_loop();
        } else if self.start.elapsed() < Duration::from_millis(2) {
            std::thread::yield_now();
        } else if self.start.elapsed() < Duration::from_millis(50) {
            std::thread::sleep(Duration::from_micros(50));
        } else {
            // A long wait (ranks still starting, a slow peer): wake less often, the more so the
            // more threads of this process wait, so they leave the CPU to the ones with work.
            let waiting = WAITING.load(Ordering::Relaxed).max(1);
            let us = (waiting * 32).clamp(1000, 50_000);
            std::thread::sleep(Duration::from_micros(us));
        }
    }
}

pub(super) fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
