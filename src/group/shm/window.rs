//! Symmetric memory (windows): buffers a rank allocates from its group
//! ([`Group::alloc_shared`](crate::group::Group::alloc_shared)) that every peer maps, through
//! the same kind of sealed memfd as the data regions (opened once through `/proc/{pid}/fd/{fd}`,
//! checked and cached).
//!
//! With the destination of `exchange_rows` in a window, each source writes its rows with plain
//! stores (streaming ones for transfers far larger than the caches) straight into their final
//! rows of the destination's window; with the source of `reduce_rows` in a window, each
//! destination reads the holder's rows with plain loads. No system call per transfer and one
//! copy per byte; everything else (agreement, liveness, the decision word) is the op protocol's.
//!
//! Who touches a window when: its owner holds the [`SharedBuf`]. A peer writes it only during an
//! `exchange_rows` op in which the owner passed (part of) it as the destination and published
//! its take lists, and only the rows the owner's list for that peer names (distinct rows: the
//! owner offers the window only then); a peer reads it only during a `reduce_rows` op in which
//! the owner passed it as the source. Both end before the op commits (every rank consumed it).
//!
//! Allocation is per rank, never collective: a peer maps a window only when an op offers it,
//! so sizes and counts may differ between ranks. Callers outside Rust get windows through
//! `epcomm_mem_alloc` (the group handle keeps them until `epcomm_mem_free` or its destroy) and
//! the MoE manager's expert-output buffer (`epcomm_all2all_expert_output_buffer`). A peer that
//! mapped a window its owner freed keeps the mapping (so its memory is not yet returned) until
//! it maps another window after [`IDLE_OPS`] ops, holds [`MAPPED_PER_PEER`] newer ones of that
//! owner, or leaves the group; it never touches the freed window again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use super::layout::{SLOT_FAILED, SLOT_LEFT};
use super::segment::{pid_alive, FileKey, Segment};
use super::ShmGroup;
use crate::error::{Error, Result};

/// Shared memory of one rank of a shared-memory group that every peer maps (see the module
/// docs): a destination for `exchange_rows` and a source for `reduce_rows` that moves each
/// byte once with plain stores and loads. Zeroed when allocated; usable as ordinary memory.
pub struct SharedBuf {
    seg: Segment,
    info: Arc<WinInfo>,
}

/// What a group keeps of the windows it handed out (weakly: they live as long as their buffer).
#[derive(Debug)]
pub(super) struct WinInfo {
    session: u64,
    rank: usize,
    fd: u32,
    key: FileKey,
    addr: usize,
    len: usize,
}

impl SharedBuf {
    /// Bytes of the buffer.
    pub fn len(&self) -> usize {
        self.info.len
    }

    pub fn is_empty(&self) -> bool {
        self.info.len == 0
    }
}

impl std::fmt::Debug for SharedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuf")
            .field("name", &self.seg.name())
            .field("len", &self.info.len)
            .finish()
    }
}

impl std::ops::Deref for SharedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.seg.view(0, self.info.len)
    }
}

impl std::ops::DerefMut for SharedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.info.len;
        &mut self.seg.bytes_mut()[..len]
    }
}

/// The window section a rank appends to its row-index metadata (`rows::index_table`) when the
/// op's destination (exchange_rows) or source (reduce_rows) lies in one of its windows:
/// `[fd, dev, ino, window bytes, offset, bytes, (offset, count) per rank, packed u32 rows]`.
/// The per-rank lists (exchange_rows only) are the rows of the destination each source fills.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct WinMeta {
    pub(super) fd: u32,
    pub(super) key: FileKey,
    pub(super) win_len: usize,
    /// Where the op's buffer starts in the window, and its bytes.
    pub(super) off: usize,
    pub(super) len: usize,
    /// (offset in u32 units into the packed words, count) per rank.
    lists: Vec<(usize, usize)>,
    packed: usize,
}

const FIXED: usize = 6;

/// The window section for a buffer at `off` (`len` bytes) of window `w`, with the take lists
/// of an exchange_rows destination (`None` for a reduce_rows source).
pub(super) fn encode(w: &WinInfo, off: usize, len: usize, take: Option<&[Vec<u32>]>) -> Vec<u64> {
    let mut words = vec![
        u64::from(w.fd),
        w.key.0,
        w.key.1,
        w.len as u64,
        off as u64,
        len as u64,
    ];
    let mut rows: Vec<u32> = Vec::new();
    for list in take.unwrap_or(&[]) {
        words.extend([rows.len() as u64, list.len() as u64]);
        rows.extend_from_slice(list);
    }
    rows.resize(rows.len().div_ceil(2) * 2, 0);
    words.extend(
        rows.chunks_exact(2)
            .map(|c| u64::from(c[0]) | u64::from(c[1]) << 32),
    );
    words
}

/// exchange_rows into windows stores its rows with streaming stores once the rows this rank
/// writes in the call (to every destination, its own included) reach this many bytes. Below
/// the caches' size, but measured: with every rank of a host storing at once, cached stores
/// pay a read for ownership of each destination line and fall far behind streaming ones from
/// a few MiB per rank (deepep_low_latency at T = 128 stores 14.7 MB per rank: its row stores
/// ran at a quarter of memcpy's speed), while smaller transfers stay cached for the reader
/// that usually follows.
pub(super) const EXCHANGE_STREAMING_MIN_BYTES: usize = 4 << 20;

/// Whether an exchange_rows of `give` (rows of `row_bytes`) stores with streaming stores.
pub(super) fn exchange_streams(give: &[Vec<u32>], row_bytes: usize) -> bool {
    let rows: usize = give.iter().map(Vec::len).sum();
    rows.saturating_mul(row_bytes) >= EXCHANGE_STREAMING_MIN_BYTES
}

/// The window section of `meta` (a rank's exchange_rows or reduce_rows metadata for `world`
/// ranks), if any; every word checked, so a forged section is an error, never an access out
/// of range.
pub(super) fn parse(meta: &[u64], world: usize) -> std::result::Result<Option<WinMeta>, String> {
    let base = 2 + 2 * world;
    let Some(sec) = meta.get(base..).filter(|s| !s.is_empty()) else {
        return Ok(None);
    };
    if sec.len() < FIXED {
        return Err(format!("a window section of {} words", sec.len()));
    }
    let size = |w: u64| usize::try_from(w).unwrap_or(usize::MAX);
    let (win_len, off, len) = (size(sec[3]), size(sec[4]), size(sec[5]));
    if off.checked_add(len).is_none_or(|end| end > win_len) {
        return Err(format!(
            "a buffer of {len} bytes at offset {off} of a window of {win_len} bytes"
        ));
    }
    let fd = u32::try_from(sec[0]).map_err(|_| format!("window descriptor {}", sec[0]))?;
    let rest = &sec[FIXED..];
    let with_lists = rest.len() >= 2 * world;
    let (lists, packed) = if with_lists {
        let lists: Vec<(usize, usize)> = rest[..2 * world]
            .chunks_exact(2)
            .map(|c| (size(c[0]), size(c[1])))
            .collect();
        (lists, rest.len() - 2 * world)
    } else if rest.is_empty() {
        (Vec::new(), 0)
    } else {
        return Err(format!("a window section of {} words", sec.len()));
    };
    if let Some((r, (o, c))) = lists
        .iter()
        .enumerate()
        .find(|(_, (o, c))| o.checked_add(*c).is_none_or(|e| e > packed * 2))
    {
        return Err(format!(
            "window rows for rank {r} at {o} with {c} rows, past the {packed} words of rows"
        ));
    }
    Ok(Some(WinMeta {
        fd,
        key: (sec[1], sec[2]),
        win_len,
        off,
        len,
        lists,
        packed,
    }))
}

impl WinMeta {
    /// Whether the section carries take lists (an exchange_rows destination).
    pub(super) fn has_lists(&self) -> bool {
        !self.lists.is_empty()
    }

    /// How many rows the owner takes from rank `r`.
    pub(super) fn count(&self, r: usize) -> usize {
        self.lists.get(r).map_or(0, |l| l.1)
    }

    /// The rows of the owner's buffer that rank `r` fills, from the owner's `meta`.
    pub(super) fn list<'m>(
        &self,
        meta: &'m [u64],
        world: usize,
        r: usize,
    ) -> impl Iterator<Item = u32> + 'm {
        let start = meta.len() - self.packed;
        debug_assert_eq!(start, 2 + 2 * world + FIXED + 2 * world);
        let (o, c) = self.lists.get(r).copied().unwrap_or((0, 0));
        (o..o + c).map(move |i| {
            let w = meta[start + i / 2];
            (if i % 2 == 0 { w } else { w >> 32 }) as u32
        })
    }
}

/// Windows of a group's peers this rank keeps mapped (a few per peer), and for how many ops
/// one stays mapped unused.
const MAPPED_PER_PEER: usize = 4;
const IDLE_OPS: u64 = 16;

/// A peer's window mapped here: (rank, file identity, mapping, the last op that used it).
pub(super) type PeerWindow = (usize, FileKey, Segment, u64);

impl ShmGroup {
    /// A new window of `len` bytes (see [`SharedBuf`]).
    pub(super) fn alloc_window(&mut self, len: usize) -> Result<SharedBuf> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let label = format!(
            "/epcomm.{}.{:016x}.w{}.{id}.{}",
            self.name, self.session, self.rank, self.pid
        );
        let bytes = len.max(1).div_ceil(4096) * 4096;
        let seg = Segment::create(&label, bytes).map_err(|e| {
            super::rendezvous::sys_err(
                format!(
                    "cannot create {len} bytes of shared memory for rank {} of group '{}'",
                    self.rank, self.name
                ),
                e,
            )
        })?;
        let info = Arc::new(WinInfo {
            session: self.session,
            rank: self.rank,
            fd: seg.fd().unwrap_or(0),
            key: seg.key(),
            addr: seg.addr(),
            len,
        });
        self.windows.retain(|w| w.strong_count() > 0);
        self.windows.push(Arc::downgrade(&info));
        Ok(SharedBuf { seg, info })
    }

    /// Whether `buf` is a window of this rank of this group.
    pub(super) fn owns_window(&self, buf: &SharedBuf) -> bool {
        buf.info.session == self.session && buf.info.rank == self.rank
    }

    /// The window of this rank holding all of `buf`, and where `buf` starts in it.
    pub(super) fn window_of(&self, buf: &[u8]) -> Option<(Arc<WinInfo>, usize)> {
        let (a, n) = (buf.as_ptr() as usize, buf.len());
        self.windows.iter().filter_map(Weak::upgrade).find_map(|w| {
            (a >= w.addr && a - w.addr <= w.len && n <= w.len - (a - w.addr))
                .then(|| (w.clone(), a - w.addr))
        })
    }

    /// Maps peer `p`'s window `w` (once; cached), checking it holds the published buffer.
    pub(super) fn map_window(&self, p: usize, w: &WinMeta) -> Result<()> {
        let mut cache = self.peer_windows.borrow_mut();
        let n = self.seq;
        if let Some(e) = cache
            .iter_mut()
            .find(|e| e.0 == p && e.1 == w.key && e.2.len() >= w.win_len)
        {
            e.3 = n;
            return Ok(());
        }
        // A peer's window unused for a while is probably freed by its owner: unmapping it lets
        // its memory go.
        cache.retain(|e| n.saturating_sub(e.3) < IDLE_OPS);
        let pid = self.slot(p).pid.load(Ordering::Acquire);
        let label = format!("/epcomm.{}.{:016x}.w{p}", self.name, self.session);
        let seg = Segment::open_peer(&label, pid, w.fd, w.key, w.win_len).map_err(|e| {
            self.gone(p, pid).unwrap_or_else(|| {
                Error::PeerFailure(format!(
                    "cannot map the shared memory of rank {p} of group '{}' (pid {pid}, descriptor {}) on rank {}: {e}",
                    self.name, w.fd, self.rank
                ))
            })
        })?;
        if cache.iter().filter(|e| e.0 == p).count() >= MAPPED_PER_PEER {
            if let Some(i) = cache.iter().position(|e| e.0 == p) {
                cache.remove(i);
            }
        }
        cache.push((p, w.key, seg, n));
        Ok(())
    }

    /// What became of peer `p` (pid `pid`) if it left, failed or died.
    fn gone(&self, p: usize, pid: u32) -> Option<Error> {
        let (name, me) = (&self.name, self.rank);
        let what = match self.slot(p).state.load(Ordering::Acquire) {
            SLOT_LEFT => "left the group (destroyed its handle)".to_string(),
            SLOT_FAILED => "failed (an error on that rank aborted its group)".to_string(),
            _ if !pid_alive(pid) => format!("died (pid {pid} is gone)"),
            _ => return None,
        };
        Some(Error::PeerFailure(format!(
            "rank {p} of group '{name}' {what} before rank {me} could map its shared memory"
        )))
    }

    /// Runs `f` on peer `p`'s window `w`, mapped before by [`ShmGroup::map_window`].
    pub(super) fn with_window<T>(
        &self,
        p: usize,
        w: &WinMeta,
        f: impl FnOnce(&Segment) -> Result<T>,
    ) -> Result<T> {
        let cache = self.peer_windows.borrow();
        let seg = cache
            .iter()
            .find(|e| e.0 == p && e.1 == w.key && e.2.len() >= w.win_len)
            .map(|e| &e.2)
            .ok_or_else(|| {
                Error::Internal(format!(
                    "the window of rank {p} is not mapped on rank {}",
                    self.rank
                ))
            })?;
        f(seg)
    }
}

/// The bytes of peer `p`'s buffer in its window `w`, if mapped (`cache`: the group's peer windows).
pub(super) fn window_view<'c>(cache: &'c [PeerWindow], p: usize, w: &WinMeta) -> Option<&'c [u8]> {
    cache
        .iter()
        .find(|e| e.0 == p && e.1 == w.key && e.2.len() >= w.win_len)
        .map(|e| e.2.view(w.off, w.len))
}

/// A window section that a parsed metadata cannot lack (checked when it was read).
fn internal(e: String) -> Error {
    Error::Internal(format!("a checked window section failed to parse: {e}"))
}

impl ShmGroup {
    /// The window section offering `dst` to the sources of an exchange_rows, when `dst` lies
    /// in a window of this rank and the rows of `take` (checked in range) are distinct, so
    /// every source writes rows no other touches.
    pub(super) fn offer_dst(
        &self,
        dst: &[u8],
        row_bytes: usize,
        take: &[Vec<u32>],
    ) -> Option<Vec<u64>> {
        let (w, off) = self.window_of(dst)?;
        let rows = dst.len().checked_div(row_bytes)?;
        let mut seen = vec![false; rows];
        for &r in take.iter().flatten() {
            if std::mem::replace(seen.get_mut(r as usize)?, true) {
                return None;
            }
        }
        Some(encode(&w, off, dst.len(), Some(take)))
    }

    /// The window section offering `src` (with the rows each peer gets, `give`) to the
    /// destinations of a reduce_rows, when `src` lies in a window of this rank.
    pub(super) fn offer_src(&self, src: &[u8], give: &[Vec<u32>]) -> Option<Vec<u64>> {
        let (w, off) = self.window_of(src)?;
        Some(encode(&w, off, src.len(), Some(give)))
    }

    /// Every rank's window section of the current op (None where it offers none).
    fn sections(&self) -> Result<Vec<(Vec<u64>, Option<WinMeta>)>> {
        (0..self.world)
            .map(|p| {
                let (meta, _) = self.parts(p)?;
                let w = parse(&meta, self.world).map_err(internal)?;
                Ok((meta, w.filter(WinMeta::has_lists)))
            })
            .collect()
    }

    /// exchange_rows into windows, checked alike on every rank before any row moves: each
    /// source gives every window owner as many rows as the owner takes from it, all of them
    /// rows of the owner's buffer.
    pub(super) fn check_windows(&self, row_bytes: usize) -> Result<()> {
        let all = self.sections()?;
        let world = self.world;
        for (b, (meta_b, w)) in all.iter().enumerate() {
            let Some(w) = w else { continue };
            let rows = w.len.checked_div(row_bytes).unwrap_or(0);
            for (a, (meta_a, _)) in all.iter().enumerate() {
                let (gives, takes) = (meta_a[3 + 2 * b] as usize, w.count(a));
                if gives != takes {
                    return Err(Error::InvalidArgument(format!(
                        "exchange_rows: rank {a} gives {gives} rows to rank {b} but rank {b} expects {takes}"
                    )));
                }
                if let Some(r) = w.list(meta_b, world, a).find(|&r| r as usize >= rows) {
                    return Err(Error::InvalidArgument(format!(
                        "exchange_rows: rank {b} takes row {r} from rank {a} into a buffer of {rows} rows"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Whether op `n` was aborted already (a late source then writes nothing more).
    fn aborted(&self, n: u64) -> bool {
        use super::decision::{decoded, Decision};
        matches!(
            decoded(self.decision_word().load(Ordering::Acquire), n),
            Decision::Abort { .. }
        )
    }

    /// Writes rows `give[p]` of `src` straight into every peer p's window that is this op's
    /// destination, at the rows p's take list for this rank names (checked by
    /// [`ShmGroup::check_windows`]); streaming stores when the call stores many rows
    /// ([`exchange_streams`]).
    /// Returns the peers written to.
    pub(super) fn push_rows(
        &self,
        src: &[u8],
        row_bytes: usize,
        give: &[Vec<u32>],
    ) -> Result<Vec<bool>> {
        let (me, world) = (self.rank, self.world);
        let mut pushed = vec![false; world];
        let streaming = exchange_streams(give, row_bytes);
        for (p, (meta, w)) in self.sections()?.into_iter().enumerate() {
            let Some(w) = w.filter(|_| p != me) else {
                continue;
            };
            if self.aborted(self.seq) {
                break;
            }
            self.map_window(p, &w)?;
            self.with_window(p, &w, |seg| {
                for (&s, d) in give[p].iter().zip(w.list(&meta, world, me)) {
                    let at = d as usize * row_bytes;
                    let row = &src[s as usize * row_bytes..][..row_bytes];
                    if at + row_bytes > w.len {
                        return Err(Error::Internal(format!(
                            "exchange_rows: row {d} of rank {p}'s window is out of range"
                        )));
                    }
                    if streaming {
                        seg.write_streaming(w.off + at, row);
                    } else {
                        seg.write(w.off + at, row);
                    }
                }
                Ok(())
            })?;
            pushed[p] = true;
        }
        crate::copy::streaming_fence();
        Ok(pushed)
    }

    /// Peer `p`'s window section if its reduce_rows source lies in a window, mapped, with the
    /// rows it gives this rank (checked: `expected` of them, all within its buffer).
    pub(super) fn source_window(
        &self,
        p: usize,
        row_bytes: usize,
        expected: usize,
    ) -> Result<Option<(WinMeta, Vec<u32>)>> {
        let (meta, _) = self.parts(p)?;
        let Some(w) = parse(&meta, self.world)
            .map_err(internal)?
            .filter(WinMeta::has_lists)
        else {
            return Ok(None);
        };
        let me = self.rank;
        let count = w.count(me);
        if count != expected {
            return Err(Error::InvalidArgument(format!(
                "reduce_rows: rank {p} gives {count} rows to rank {me} but rank {me} expects {expected}"
            )));
        }
        let rows = w.len.checked_div(row_bytes).unwrap_or(0);
        let idx: Vec<u32> = w.list(&meta, self.world, me).collect();
        if let Some(bad) = idx.iter().find(|&&i| i as usize >= rows) {
            return Err(Error::InvalidArgument(format!(
                "reduce_rows: rank {p} gives row {bad} of a buffer with {rows} rows"
            )));
        }
        self.map_window(p, &w)?;
        Ok(Some((w, idx)))
    }
}
