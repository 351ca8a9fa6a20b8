//! The dispatch's receive buffers: the hidden rows, the FP8 scales and every extra payload
//! land in shared memory of the group where it has some, so each source stores its rows
//! straight into their final place (one copy per byte, no system call); elsewhere in the heap,
//! filled by the group's own transfers.

use std::ops::{Deref, DerefMut, Index};

use super::plan::Plan;
use super::{check_available, ensure_len};
use crate::error::Result;
use crate::group::{Group, RowExchange, SharedBuf};

/// A receive buffer: shared memory of the group, or the heap (a group without any).
#[derive(Debug)]
enum RecvBuf {
    Heap(Vec<u8>),
    Shared(SharedBuf),
}

impl Default for RecvBuf {
    fn default() -> RecvBuf {
        RecvBuf::Heap(Vec::new())
    }
}

impl RecvBuf {
    fn bytes(&self) -> &[u8] {
        match self {
            RecvBuf::Heap(v) => v,
            RecvBuf::Shared(b) => b,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            RecvBuf::Heap(v) => v,
            RecvBuf::Shared(b) => b,
        }
    }

    /// Whether the buffer is `g`'s shared memory.
    fn shared_in(&self, g: &dyn Group) -> bool {
        match self {
            RecvBuf::Shared(b) => g.owns_shared(b),
            RecvBuf::Heap(_) => false,
        }
    }

    /// Makes the buffer at least `len` bytes, in `g`'s shared memory where `g` has some (asked
    /// when the buffer is first needed or must grow). It never shrinks; a shared one is
    /// replaced when it is too small or belongs to another group, with an eighth to spare
    /// where `spare` says sizes vary (exact-size layouts: token counts that vary a little do
    /// not reallocate; a fixed-capacity layout's size never changes). `what` names it in errors.
    fn ensure(&mut self, g: &mut dyn Group, len: usize, spare: bool, what: &str) -> Result<()> {
        let ranks = g.size();
        match self {
            RecvBuf::Shared(b) if b.len() >= len && g.owns_shared(b) => return Ok(()),
            // A heap buffer that suffices stays (its group had no shared memory when it grew).
            RecvBuf::Heap(v) if len == 0 || (v.len() >= len && !v.is_empty()) => return Ok(()),
            RecvBuf::Shared(_) | RecvBuf::Heap(_) => {}
        }
        let cap = if spare {
            len.saturating_add(len / 8)
        } else {
            len
        };
        check_available(cap, cap, ranks, what)?;
        match g.alloc_shared(cap)? {
            Some(b) => *self = RecvBuf::Shared(b),
            None => {
                if let RecvBuf::Shared(_) = self {
                    *self = RecvBuf::Heap(Vec::new());
                }
                if let RecvBuf::Heap(v) = self {
                    ensure_len(v, len, ranks, what)?;
                }
            }
        }
        Ok(())
    }
}

/// A receive buffer and the bytes of it the last dispatch filled (the hidden rows, the FP8
/// scales, an extra payload). Dereferences to the whole buffer.
#[derive(Debug, Default)]
pub(super) struct Received {
    buf: RecvBuf,
    len: usize,
}

impl Received {
    /// The bytes the last dispatch filled.
    pub(super) fn data(&self) -> &[u8] {
        &self.buf.bytes()[..self.len]
    }

    /// Receives `plan.buffer_rows` rows of `row_bytes` (this rank's rows of `src` to each
    /// destination, as `plan` says), in `g`'s shared memory where it has some (`spare`: as
    /// [`RecvBuf::ensure`]).
    pub(super) fn exchange(
        &mut self,
        g: &mut dyn Group,
        (src, row_bytes): (&[u8], usize),
        plan: &Plan,
        spare: bool,
        what: &str,
    ) -> Result<()> {
        let len = plan.buffer_rows * row_bytes;
        self.len = 0;
        self.buf.ensure(g, len, spare, what)?;
        let dst = &mut self.buf.bytes_mut()[..len];
        g.exchange_rows(RowExchange {
            src,
            row_bytes,
            give: &plan.give,
            dst,
            take: &plan.take,
        })?;
        self.len = len;
        Ok(())
    }

    /// The first `len` bytes of the buffer, made to hold them as [`Received::exchange`] does,
    /// for the caller to fill; they count as filled.
    pub(super) fn prepare(
        &mut self,
        g: &mut dyn Group,
        len: usize,
        spare: bool,
        what: &str,
    ) -> Result<&mut [u8]> {
        self.len = 0;
        self.buf.ensure(g, len, spare, what)?;
        self.len = len;
        Ok(&mut self.buf.bytes_mut()[..len])
    }

    /// Whether what the last dispatch filled is `g`'s shared memory (trivially when empty).
    pub(super) fn shared_in(&self, g: &dyn Group) -> bool {
        self.len == 0 || self.buf.shared_in(g)
    }
}

impl Deref for Received {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.bytes()
    }
}

impl DerefMut for Received {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.buf.bytes_mut()
    }
}

/// The extra payloads of a dispatch output ([`super::DispatchView::extras`]): payload `i` is
/// `rows x extra_row_bytes[i]` bytes, rows as the hidden rows. The manager's are its receive
/// buffers; any `Vec<Vec<u8>>` is one too.
pub trait ExtraRows: std::fmt::Debug + Sync {
    /// How many payloads.
    fn payloads(&self) -> usize;
    /// The bytes of payload `i` (`i < payloads()`).
    fn payload(&self, i: usize) -> &[u8];
}

impl ExtraRows for Vec<Vec<u8>> {
    fn payloads(&self) -> usize {
        self.len()
    }

    fn payload(&self, i: usize) -> &[u8] {
        &self[i]
    }
}

impl ExtraRows for Vec<Received> {
    fn payloads(&self) -> usize {
        self.len()
    }

    fn payload(&self, i: usize) -> &[u8] {
        self[i].data()
    }
}

impl dyn ExtraRows + '_ {
    /// How many payloads.
    pub fn len(&self) -> usize {
        self.payloads()
    }

    pub fn is_empty(&self) -> bool {
        self.payloads() == 0
    }

    /// Payload `i`, if there is one.
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        (i < self.payloads()).then(|| self.payload(i))
    }

    /// The first payload, if there is one.
    pub fn first(&self) -> Option<&[u8]> {
        self.get(0)
    }

    /// Every payload, in order.
    pub fn iter(&self) -> impl Iterator<Item = &[u8]> + '_ {
        (0..self.payloads()).map(|i| self.payload(i))
    }
}

impl Index<usize> for dyn ExtraRows + '_ {
    type Output = [u8];
    fn index(&self, i: usize) -> &[u8] {
        self.payload(i)
    }
}
