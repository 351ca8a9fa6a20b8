//! A reusable host barrier for ranks as threads that fails instead of hanging: when a rank
//! leaves (poison) or a wait runs past its timeout, every waiter gets an error. Used by
//! [`super::local::LocalFabric`]; pure std, tested on the CPU.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// A reusable barrier that fails instead of hanging when a rank left (its fabric was dropped,
/// e.g. after an error) or after a timeout; once failed it stays failed for every rank.
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<(usize, u64, bool)>, // (arrived, generation, poisoned)
    cv: Condvar,
}

impl Gate {
    /// A fresh gate.
    pub fn new() -> Gate {
        Gate::default()
    }

    /// Waits until `world` ranks arrived (`rank` is this one, for messages).
    pub fn wait(&self, world: usize, rank: usize, timeout: Duration) -> Result<()> {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if g.2 {
            return Err(left(rank));
        }
        let gen = g.1;
        g.0 += 1;
        if g.0 == world {
            g.0 = 0;
            g.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let start = Instant::now();
        while g.1 == gen {
            if g.2 {
                return Err(left(rank));
            }
            if start.elapsed() > timeout {
                g.2 = true;
                self.cv.notify_all();
                return Err(Error::Timeout(format!(
                    "local fabric: rank {rank} waited {timeout:?} for the other ranks"
                )));
            }
            g = self
                .cv
                .wait_timeout(g, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    /// Makes every current and future wait fail (a rank left).
    pub fn poison(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).2 = true;
        self.cv.notify_all();
    }
}

fn left(rank: usize) -> Error {
    Error::PeerFailure(format!(
        "local fabric: a peer of rank {rank} left the group (it failed or was dropped)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn passes_repeatedly_then_fails_when_poisoned() {
        let g = Arc::new(Gate::new());
        let hs: Vec<_> = (0..4)
            .map(|r| {
                let g = g.clone();
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        g.wait(4, r, Duration::from_secs(10)).unwrap();
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let g2 = g.clone();
        let waiter = std::thread::spawn(move || g2.wait(2, 0, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(100));
        g.poison();
        let e = waiter.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("left the group"), "{e}");
        assert!(g.wait(1, 0, Duration::from_secs(1)).is_err());
    }

    #[test]
    fn times_out_and_stays_failed() {
        let g = Gate::new();
        let e = g.wait(2, 1, Duration::from_millis(100)).unwrap_err();
        assert!(e.to_string().contains("rank 1 waited"), "{e}");
        assert!(g.wait(1, 0, Duration::from_secs(1)).is_err());
    }
}
