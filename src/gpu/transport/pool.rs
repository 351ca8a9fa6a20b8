//! [`Pool`]: the GPU manager's named device buffers, device-independent (the CUDA executor
//! holds `DeviceMemory` in it, the host emulation its own allocations), so the sizing policy
//! the emulation tests is the one a GPU runs.
//!
//! - Sized at creation: [`crate::gpu::transport::pipeline::Pipeline::reserve`] asks for every
//!   buffer at its largest size for `max_tokens_per_rank` tokens; a call within that bound
//!   never allocates (and never frees: `cuMemFree` synchronises the device, a hang hazard next
//!   to NCCL kernels of other communicators, and a freed buffer may be one a captured CUDA
//!   graph still writes).
//! - Beyond it (counts mode with `max_tokens_per_rank = 0`, or more tokens than it in an
//!   exact-size layout) a buffer grows geometrically (at least double), so sizes settle after a
//!   few calls; every allocation after creation is counted in [`PoolStats::reallocations`].
//! - While the stream is being captured into a CUDA graph no buffer may grow: the request is
//!   an `InvalidState` naming the buffer, its size and the size asked for.

use std::collections::HashMap;

use crate::error::{Error, Result};

/// Device allocations are rounded up to this many bytes (and at least this many).
pub const ALIGN: usize = 256;

/// One allocation of a [`Pool`].
pub trait Block {
    /// The device address.
    fn ptr(&self) -> u64;
    /// The usable bytes.
    fn bytes(&self) -> usize;
}

/// What a pool allocated, for the manager's stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers held.
    pub buffers: usize,
    /// Bytes held.
    pub bytes: usize,
    /// Bytes allocated at creation ([`Pool::reserve`]).
    pub reserved_bytes: usize,
    /// Allocations after creation: a buffer first used, or grown, by a call (0 for calls
    /// within the configuration's `max_tokens_per_rank`).
    pub reallocations: u64,
}

/// Named grow-only buffers (stable addresses once sized, which CUDA graphs need).
#[derive(Debug)]
pub struct Pool<B> {
    bufs: HashMap<String, B>,
    reserved_bytes: usize,
    reallocations: u64,
}

impl<B> Default for Pool<B> {
    fn default() -> Self {
        Pool {
            bufs: HashMap::new(),
            reserved_bytes: 0,
            reallocations: 0,
        }
    }
}

/// `bytes` rounded up to [`ALIGN`] (at least [`ALIGN`]).
pub fn rounded(bytes: usize) -> usize {
    bytes.max(1).next_multiple_of(ALIGN)
}

/// The message of a growth refused during a CUDA-graph capture.
pub fn capture_growth_message(name: &str, has: usize, wants: usize) -> String {
    format!(
        "GPU buffer '{name}' needs {wants} bytes but has {has}: it cannot grow while the stream is being captured into a CUDA graph (an allocation there would free memory an earlier graph may still use); raise max_tokens_per_rank, or run one uncaptured call of this size before capturing"
    )
}

impl<B: Block> Pool<B> {
    /// An empty pool.
    pub fn new() -> Pool<B> {
        Pool::default()
    }

    /// Creation-time sizing: `name` gets at least `bytes` now (exact, rounded), not counted
    /// as a reallocation.
    pub fn reserve(
        &mut self,
        name: &str,
        bytes: usize,
        alloc: impl FnOnce(usize) -> Result<B>,
    ) -> Result<u64> {
        let want = rounded(bytes);
        if let Some(b) = self.bufs.get(name).filter(|b| b.bytes() >= want) {
            return Ok(b.ptr());
        }
        let b = alloc(want)?;
        let p = b.ptr();
        let old = self
            .bufs
            .insert(name.to_owned(), b)
            .map_or(0, |o| o.bytes());
        self.reserved_bytes = self.reserved_bytes - old.min(self.reserved_bytes) + want;
        Ok(p)
    }

    /// The buffer `name` of at least `bytes`. A new or larger one is refused while
    /// `capturing()` says the stream is being captured; otherwise it is allocated at
    /// `max(bytes, 2 × old)` (rounded), replacing the old one, and counted.
    pub fn get(
        &mut self,
        name: &str,
        bytes: usize,
        capturing: impl FnOnce() -> Result<bool>,
        alloc: impl FnOnce(usize) -> Result<B>,
    ) -> Result<u64> {
        let want = rounded(bytes);
        let has = self.bufs.get(name).map_or(0, |b| b.bytes());
        if let Some(b) = self.bufs.get(name).filter(|_| has >= want) {
            return Ok(b.ptr());
        }
        if capturing()? {
            return Err(Error::InvalidState(capture_growth_message(name, has, want)));
        }
        let size = want.max(has.saturating_mul(2));
        let b = alloc(size)?;
        let p = b.ptr();
        // The old allocation is released here (after the new one exists: a failed
        // allocation leaves the pool as it was).
        self.bufs.insert(name.to_owned(), b);
        self.reallocations += 1;
        Ok(p)
    }

    /// The buffer `name`, if allocated.
    pub fn find(&self, name: &str) -> Option<&B> {
        self.bufs.get(name)
    }

    /// Every buffer, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &B)> {
        self.bufs.iter().map(|(n, b)| (n.as_str(), b))
    }

    /// Releases every buffer (the manager does it with its context current).
    pub fn clear(&mut self) {
        self.bufs.clear();
    }

    /// What the pool holds and allocated.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            buffers: self.bufs.len(),
            bytes: self.bufs.values().map(Block::bytes).sum(),
            reserved_bytes: self.reserved_bytes,
            reallocations: self.reallocations,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fake(u64, usize);

    impl Block for Fake {
        fn ptr(&self) -> u64 {
            self.0
        }
        fn bytes(&self) -> usize {
            self.1
        }
    }

    fn alloc(next: &mut u64) -> impl FnMut(usize) -> Result<Fake> + '_ {
        move |n| {
            *next += 0x1000;
            Ok(Fake(*next, n))
        }
    }

    #[test]
    fn reserved_buffers_never_move_and_growth_is_geometric() {
        let mut next = 0;
        let mut p: Pool<Fake> = Pool::new();
        let a = p.reserve("a", 1000, alloc(&mut next)).unwrap();
        assert_eq!(p.stats().reserved_bytes, 1024);
        for n in [0, 1, 1000, 1024] {
            assert_eq!(p.get("a", n, || Ok(false), alloc(&mut next)).unwrap(), a);
        }
        assert_eq!(p.stats().reallocations, 0);
        // 1025 bytes: doubled to 2048, not 1280.
        let b = p.get("a", 1025, || Ok(false), alloc(&mut next)).unwrap();
        assert_ne!(a, b);
        assert_eq!(p.find("a").unwrap().bytes(), 2048);
        assert_eq!(p.get("a", 2048, || Ok(false), alloc(&mut next)).unwrap(), b);
        let s = p.stats();
        assert_eq!((s.buffers, s.bytes, s.reallocations), (1, 2048, 1));
    }

    #[test]
    fn no_growth_while_capturing() {
        let mut next = 0;
        let mut p: Pool<Fake> = Pool::new();
        let a = p.reserve("cap_rank_flag", 512, alloc(&mut next)).unwrap();
        assert_eq!(
            p.get("cap_rank_flag", 512, || Ok(true), alloc(&mut next))
                .unwrap(),
            a
        );
        let e = p
            .get("cap_rank_flag", 513, || Ok(true), alloc(&mut next))
            .unwrap_err();
        assert_eq!(e.status(), crate::error::Status::InvalidState);
        assert_eq!(
            e.to_string(),
            Error::InvalidState(capture_growth_message("cap_rank_flag", 512, 768)).to_string()
        );
        let e = p.get("new", 4, || Ok(true), alloc(&mut next)).unwrap_err();
        assert!(
            e.to_string()
                .contains("GPU buffer 'new' needs 256 bytes but has 0"),
            "{e}"
        );
        assert_eq!(p.stats().reallocations, 0);
        assert_eq!(p.find("cap_rank_flag").unwrap().ptr(), a);
    }
}
