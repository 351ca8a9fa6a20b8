//! Zero-copy combine input: a window of the group's shared memory that the manager owns and
//! hands out ([`Manager::expert_output_buffer`]); the caller's experts write their outputs
//! into it, and combine lets the peers read those rows in place with plain loads (no staging
//! copy, no system call), as DeepEP's `get_next_combine_buffer` / `zero_copy=True` combine.

use super::Manager;
use crate::error::{Error, Result};
use crate::group::{Group, SharedBuf};

/// The manager's expert-output window and how often combine read it in place.
#[derive(Debug, Default)]
pub(super) struct ZeroCopy {
    buf: Option<SharedBuf>,
    in_place: u64,
}

impl ZeroCopy {
    /// Counts a combine whose expert output lies wholly in the window.
    pub(super) fn note_combine(&mut self, expert_output: &[u8]) {
        let Some(b) = self.buf.as_ref() else { return };
        let (a, n) = (expert_output.as_ptr() as usize, expert_output.len());
        let base = b.as_ptr() as usize;
        if n > 0 && a >= base && a - base + n <= b.len() {
            self.in_place += 1;
        }
    }
}

impl Manager {
    /// Bytes of the expert output combine expects after the last dispatch.
    fn expert_output_bytes(&self) -> Result<usize> {
        let rows = self.combine_rows().ok_or_else(|| {
            Error::InvalidState(
                "expert_output_buffer called without a successful dispatch: call dispatch first"
                    .into(),
            )
        })?;
        Ok(rows * self.cfg.hidden * self.cfg.expert_dtype.size())
    }

    /// The expert-output buffer for the last dispatch: `combine_rows() x hidden` elements of
    /// `expert_dtype` in a window of `g`'s shared memory owned by the manager (contents
    /// unspecified; reused, and grown by an eighth to spare, across dispatches). Passing it
    /// to [`Manager::combine`] lets the peers read it in place. Valid until the next call on
    /// the manager that takes `g`; a group without shared memory gives
    /// [`Error::Unavailable`].
    pub fn expert_output_buffer(&mut self, g: &mut dyn Group) -> Result<&mut [u8]> {
        let len = self.expert_output_bytes()?;
        self.over_group(g, |m, g| m.ensure_expert_output(g, len))?;
        let buf = self
            .zero_copy
            .buf
            .as_mut()
            .ok_or_else(|| Error::Internal("the expert-output buffer went missing".into()))?;
        Ok(&mut buf[..len])
    }

    /// Makes the window at least `len` bytes, in `g`'s shared memory.
    fn ensure_expert_output(&mut self, g: &mut dyn Group, len: usize) -> Result<()> {
        let fits = |b: &SharedBuf| b.len() >= len && g.owns_shared(b);
        if self.zero_copy.buf.as_ref().is_some_and(fits) {
            return Ok(());
        }
        self.zero_copy.buf = None;
        let cap = len.saturating_add(len / 8).max(1);
        let buf = g.alloc_shared(cap)?.ok_or_else(|| {
            Error::Unavailable(format!(
                "group '{}' has no shared memory for an expert-output buffer (a shared-memory group with EPCOMM_SHM_DIRECT=1 has; this transport reads expert outputs from ordinary memory)",
                g.name()
            ))
        })?;
        self.zero_copy.buf = Some(buf);
        Ok(())
    }

    /// Combine with the expert outputs in the manager's expert-output buffer (filled through
    /// [`Manager::expert_output_buffer`] after the last dispatch), read in place. Collective.
    pub fn combine_in_place(&mut self, g: &mut dyn Group, out: &mut [u8]) -> Result<()> {
        // Asked over the group in use (after a failure the survivors' group, formed first,
        // which drops the old group's window).
        let owned = self.over_group(g, |m, g| {
            Ok(m.zero_copy.buf.as_ref().is_some_and(|b| g.owns_shared(b)))
        })?;
        let len = self.expert_output_bytes();
        let buf = match (len, self.zero_copy.buf.take()) {
            (Ok(len), Some(b)) if b.len() >= len && owned => b,
            (len, b) => {
                self.zero_copy.buf = b;
                let e = len.err().unwrap_or_else(|| {
                    Error::InvalidState(
                        "combine_in_place called without an expert-output buffer for this dispatch: call expert_output_buffer first".into(),
                    )
                });
                return Err(self.reject_combine(g, e));
            }
        };
        let n = self.expert_output_bytes().unwrap_or(0);
        // The buffer is held outside the manager for the call so combine can borrow it.
        let r = self.combine(g, &buf[..n], out);
        self.zero_copy.buf = Some(buf);
        if r.is_ok() {
            self.zero_copy.in_place += 1;
        }
        r
    }

    /// Combines that read their expert output in place from the manager's expert-output
    /// buffer (proof that no copy of it was made on this rank).
    pub fn zero_copy_combines(&self) -> u64 {
        self.zero_copy.in_place
    }
}
