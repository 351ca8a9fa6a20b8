//! Bounded waiting: deadlines, the liveness period, the spin-then-futex waits of ops
//! ([`Waiter`] sleeping on a slot's [`Wake`] word) and the spin-yield-sleep backoff of the join.
//!
//! A rank waiting for its peers spins briefly, then yields while few ranks of the group do
//! (a CPU is left for the ranks with work), then sleeps on a futex word in the slot of a peer
//! it waits for. Every change a waiter can wait for (publish, consumed, the slot state, the
//! decision word) is followed by [`Wake::notify`], which makes the system call only when the
//! slot counts sleepers, so a wait that ends while spinning costs no system call on either
//! side. A sleep never outlasts the next liveness check, so a peer that dies or stalls, which
//! wakes nobody, is still detected about every [`LIVENESS_PERIOD`], and the timeout is obeyed.

use std::cell::Cell;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::segment::{futex_wait, futex_wake};

pub(super) const LIVENESS_PERIOD: Duration = Duration::from_millis(50);

/// Spins of a wait before it yields or sleeps: about a microsecond.
const SPINS: u32 = 64;
/// How long a wait may yield before it sleeps on the futex (a peer this close is cheaper to
/// poll than to wake).
const POLL_FOR: Duration = Duration::from_micros(50);
/// A thread whose recent waits took this long on average polls no more: it sleeps after its
/// spins (polling then only takes CPU from the ranks with work, which keep it waiting).
const LONG_WAIT_US: u32 = 1000;
/// Polling ranks of a group per CPU, at most.
const POLLERS_PER_CPU: u32 = 4;
/// The longest sleep: the backstop for a change that nobody notifies (none in the op protocol).
const MAX_SLEEP: Duration = Duration::from_millis(5);

/// The futex word of a slot, bumped by a notification while ranks sleep on it, and how many
/// do. A count that a killed sleeper leaked only costs the slot's owner a system call per
/// notification; a forged word only wakes a sleeper early.
#[repr(C)]
pub(super) struct Wake {
    word: AtomicU32,
    sleepers: AtomicU32,
}

impl Wake {
    /// Wakes the ranks sleeping on this word, after a change (stored before the call) that
    /// they may wait for. Without sleepers: a fence and a load, no system call.
    pub(super) fn notify(&self) {
        // Pairs with the fence in `sleep`: either this sees the sleeper, or the sleeper's
        // check after registering sees the change.
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::Relaxed) != 0 {
            self.word.fetch_add(1, Ordering::Release);
            futex_wake(&self.word);
        }
    }

    /// Sleeps until notified or for at most `max`, unless `done()` holds once registered.
    fn sleep(&self, max: Duration, done: impl Fn() -> bool) {
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        // A notification after this load changes the word, so the futex does not sleep on it.
        let seen = self.word.load(Ordering::Acquire);
        if !done() {
            futex_wait(&self.word, seen, max);
        }
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
thread_local! {
    /// Tests: how long this thread's futex sleeps last, in place of the slice bounded by the
    /// liveness period, so a change that fails to wake the thread shows as a wait that long.
    pub(super) static TEST_SLEEP: std::cell::Cell<Option<Duration>> =
        const { std::cell::Cell::new(None) };
}

thread_local! {
    /// How long this thread's recent waits took (µs, a moving average over about 8 waits).
    static TYPICAL_US: Cell<u32> = const { Cell::new(0) };
}

/// CPUs this process may run on (at least 1).
fn cpus() -> u32 {
    static CPUS: OnceLock<u32> = OnceLock::new();
    *CPUS.get_or_init(|| {
        std::thread::available_parallelism().map_or(1, |n| n.get().min(1 << 16) as u32)
    })
}

/// One wait of an op: spin, yield while fewer ranks of the group poll than there are CPUs
/// less one, then sleep on the futex of a peer waited for. `polling` is the group's count of
/// ranks yielding now (a rank killed while counted only makes the others sleep sooner).
pub(super) struct Waiter<'a> {
    polling: &'a AtomicU32,
    start: Instant,
    spins: u32,
    /// Counted in `polling` now.
    counted: bool,
    /// Done with polling: sleeps from now on.
    sleeps: bool,
}

impl<'a> Waiter<'a> {
    pub(super) fn new(polling: &'a AtomicU32) -> Self {
        Waiter {
            polling,
            start: Instant::now(),
            spins: 0,
            counted: false,
            sleeps: false,
        }
    }

    /// Whether the wait is past its first spins (a caller's clock reads can wait until then).
    pub(super) fn spun(&self) -> bool {
        self.spins >= SPINS
    }

    /// One step of the wait for `done()`: a spin, a yield, or a sleep on `wake` (the word of a
    /// peer waited for) of at most `max()` (read only for a sleep).
    pub(super) fn pause(
        &mut self,
        wake: &Wake,
        max: impl FnOnce() -> Duration,
        done: impl Fn() -> bool,
    ) {
        if self.spins < SPINS {
            self.spins += 1;
            std::hint::spin_loop();
        } else if self.may_poll() {
            std::thread::yield_now();
        } else {
            let max = max().min(MAX_SLEEP);
            #[cfg(test)]
            let max = TEST_SLEEP.with(std::cell::Cell::get).unwrap_or(max);
            wake.sleep(max, done);
        }
    }

    /// Whether to poll (yield) rather than sleep: within [`POLL_FOR`] and while a CPU is left
    /// for a rank with work.
    fn may_poll(&mut self) -> bool {
        if self.sleeps {
            return false;
        }
        if !self.counted {
            if TYPICAL_US.with(Cell::get) >= LONG_WAIT_US {
                self.sleeps = true;
                return false;
            }
            self.counted = true;
            let before = self.polling.fetch_add(1, Ordering::Relaxed);
            if before >= cpus().saturating_mul(POLLERS_PER_CPU) {
                self.stop_polling();
            }
        } else if self.start.elapsed() >= POLL_FOR {
            self.stop_polling();
        }
        !self.sleeps
    }

    fn stop_polling(&mut self) {
        self.sleeps = true;
        if self.counted {
            self.counted = false;
            self.polling.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        self.stop_polling();
        if self.spun() {
            // Only waits past their spins read the clock (and count: the others were short).
            let took = self.start.elapsed().as_micros().min(1 << 20) as u32;
            TYPICAL_US.with(|t| t.set(t.get() - t.get() / 8 + took / 8));
        } else {
            TYPICAL_US.with(|t| t.set(t.get() - t.get() / 8));
        }
    }
}

/// A wait's time limit, counting only the time this rank was running: a rank that was itself
/// stopped (SIGSTOP, a debugger) or not scheduled does not blame its peers for the time it
/// could not watch them. A gap of more than [`Deadline::GAP`] between two checks is not
/// counted (waits check at least every [`LIVENESS_PERIOD`]).
pub(super) struct Deadline {
    start: std::cell::Cell<Instant>,
    last: std::cell::Cell<Instant>,
    pub(super) timeout: Duration,
}

impl Deadline {
    /// The longest gap between two checks that counts as time spent waiting.
    const GAP: Duration = Duration::from_millis(250);

    pub(super) fn new(timeout: Duration) -> Self {
        let now = Instant::now();
        Deadline {
            start: now.into(),
            last: now.into(),
            timeout,
        }
    }

    pub(super) fn expired(&self) -> bool {
        let now = Instant::now();
        let gap = now.saturating_duration_since(self.last.get());
        if gap > Self::GAP {
            self.start.set(self.start.get() + (gap - LIVENESS_PERIOD));
        }
        self.last.set(now);
        now.saturating_duration_since(self.start.get()) >= self.timeout
    }
}

/// Spin, then yield, then sleep in short steps (the join's waits, on words nobody notifies):
/// fast when peers are close, cheap when not.
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

#[cfg(test)]
mod tests;
