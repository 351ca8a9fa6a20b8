//! Joining and leaving: claiming a slot, waiting for every rank, settling (so a conflicting
//! job under the same name is met), agreeing on direct reads; and leaving on drop.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::layout::{
    desc_offset, now_ns, publish_desc, slot_offset, DataDesc, Header, Slot, ABANDONED, FORMED,
    OP_HEADER_BYTES, SLOT_ACTIVE, SLOT_EMPTY, SLOT_FAILED, SLOT_GAVE_UP, SLOT_LEFT,
};
use super::payload::local_tables;
use super::rendezvous::{
    check_file_size, check_map_budget, check_name, random_u64, sys_err, UniqueId,
};
use super::segment::{copy_from_process, pid_alive, Segment};
use super::wait::{Backoff, Deadline, LIVENESS_PERIOD};
use super::waiting::{self, WARN_AFTER};
use super::ShmGroup;
use crate::error::{Error, Result};
use crate::group::{GroupOptions, Op};

/// Bounds of the settle time: after every rank joined, a group keeps its rendezvous record
/// for three times the spread of its ranks' arrivals, within these bounds, so that the ranks of
/// another job started at about the same time under the same name meet it and both jobs fail
/// instead of forming mixed groups.
const SETTLE_MIN: Duration = Duration::from_millis(20);
const SETTLE_MAX: Duration = Duration::from_secs(1);
/// Largest world size the shm transport accepts.
pub const MAX_WORLD: usize = 1024;

/// The arguments of a join that no peer is needed to check.
fn check_join_args(name: &str, rank: usize, world: usize, opts: &GroupOptions) -> Result<()> {
    check_name(name)?;
    if world == 0 || world > MAX_WORLD {
        return Err(Error::InvalidArgument(format!(
            "world_size is {world}; expected 1..={MAX_WORLD}"
        )));
    }
    if rank >= world {
        return Err(Error::InvalidArgument(format!(
            "rank is {rank}; expected 0 <= rank < world_size ({world})"
        )));
    }
    // From here on this thread works as `rank`: its log lines say so.
    crate::log::set_thread_rank(Some(rank));
    if opts.max_capacity != 0 && opts.initial_capacity > opts.max_capacity {
        return Err(Error::InvalidArgument(format!(
            "initial capacity {} bytes exceeds the maximum capacity {} bytes",
            opts.initial_capacity, opts.max_capacity
        )));
    }
    Ok(())
}

/// A join that failed before the group formed: rank 0 removes the record it created.
fn abandon(rank: usize, control_name: &str, e: Error) -> Error {
    if rank == 0 {
        Segment::unlink(control_name);
    }
    e
}

impl ShmGroup {
    /// Creates (rank 0) or joins (other ranks) the group `name` of `world` ranks; returns once
    /// every rank has joined.
    pub fn join(name: &str, rank: usize, world: usize, opts: GroupOptions) -> Result<ShmGroup> {
        check_join_args(name, rank, world, &opts)?;
        check_map_budget(name, rank, world)?;
        check_file_size(name, rank, world, opts.initial_capacity.max(4096))?;
        let control_name = format!("/epcomm.{name}");
        let deadline = Deadline::new(opts.timeout);
        let started_ns = now_ns();
        let pid = std::process::id();
        let token = random_u64();
        let control = Self::claim_slot(name, &control_name, rank, world, token, &deadline)?;
        let header: &Header = control.at(0);
        let session = header.session.load(Ordering::Acquire);
        let capacity = opts.initial_capacity.max(4096);
        let region = Self::create_region(&control, name, rank, session, capacity);
        let data = region.map_err(|e| abandon(rank, &control_name, e))?;
        let slot: &Slot = control.at(slot_offset(rank));
        let probe = Box::new(token);
        slot.probe_addr
            .store(&*probe as *const u64 as u64, Ordering::Relaxed);
        slot.data_bytes.store(capacity as u64, Ordering::Relaxed);
        slot.data_gen.store(1, Ordering::Relaxed);
        let desc: &DataDesc = control.at(desc_offset(world, rank));
        desc.started_ns.store(started_ns, Ordering::Relaxed);
        publish_desc(desc, &data, 1);
        slot.pid.store(pid, Ordering::Relaxed);
        slot.state.store(SLOT_ACTIVE, Ordering::Release);

        let g = ShmGroup {
            name: name.to_owned(),
            rank,
            world,
            opts,
            control,
            control_name,
            control_unlinked: false,
            session,
            data,
            gen: 1,
            peers: (0..world).map(|_| None).collect(),
            seq: 0,
            broken: None,
            pid,
            direct: false,
            _probe: probe,
            exposed: None,
            grown_at: 0,
            tables: local_tables(session, world),
            windows: Vec::new(),
            peer_windows: std::cell::RefCell::new(Vec::new()),
            survivors: None,
        };
        g.form(&deadline)
    }

    /// Opens (or creates) the control segment and claims `rank`'s slot with `token`. A slot
    /// held by a dead or failed process belongs to an earlier attempt that is being torn down:
    /// wait for the next segment instead of failing.
    fn claim_slot(
        name: &str,
        control_name: &str,
        rank: usize,
        world: usize,
        token: u64,
        deadline: &Deadline,
    ) -> Result<Segment> {
        loop {
            let control = if rank == 0 {
                Self::create_control(name, control_name, world, deadline)?
            } else {
                Self::open_control(name, control_name, rank, world, deadline)?
            };
            let slot: &Slot = control.at(slot_offset(rank));
            if slot
                .token
                .compare_exchange(0, token, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Ok(control);
            }
            let other = slot.pid.load(Ordering::Acquire);
            let failed_attempt = (0..world).any(|r| {
                let s: &Slot = control.at(slot_offset(r));
                let p = s.pid.load(Ordering::Acquire);
                s.state.load(Ordering::Acquire) == SLOT_FAILED || (p != 0 && !pid_alive(p))
            });
            if rank != 0 && failed_attempt && !deadline.expired() {
                drop(control);
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            // Another live process holds this rank: another job uses the name (or this job
            // started the rank twice). Neither may form a group with the other's ranks.
            let header: &Header = control.at(0);
            let _ = header.conflict_pid.compare_exchange(
                0,
                u64::from(std::process::id()),
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            return Err(abandon(rank, control_name, Error::InvalidState(format!(
                "group name '{name}' is in use by another job: rank {rank} is already taken (by pid {other}); each rank joins once, and jobs that run at the same time need distinct group names"
            ))));
        }
    }

    /// Creates `rank`'s first data segment (`capacity` bytes) once its slot is claimed; a
    /// failure marks the slot failed, so the others stop waiting for this rank.
    fn create_region(
        control: &Segment,
        name: &str,
        rank: usize,
        session: u64,
        capacity: usize,
    ) -> Result<Segment> {
        let pid = std::process::id();
        let slot: &Slot = control.at(slot_offset(rank));
        slot.pid.store(pid, Ordering::Release);
        Segment::create(&Self::data_name(name, session, rank, 1, pid), capacity).map_err(|e| {
            slot.state.store(SLOT_FAILED, Ordering::Release);
            sys_err(
                format!("cannot create the shared-memory region of rank {rank} of group '{name}' ({capacity} bytes)"),
                e,
            )
        })
    }

    /// Waits for every rank, agrees on direct reads and settles; then closes what could
    /// still reach the group by name or descriptor.
    fn form(mut self, deadline: &Deadline) -> Result<ShmGroup> {
        crate::fault::point("join");
        if let Err(e) = self.wait_joined(deadline) {
            let e = self.conflict_or(e);
            if matches!(e, Error::Timeout(_)) {
                // The others wait for the same missing ranks and time out on their own, naming
                // them; marking this rank failed (or letting it look dead once it exits) would
                // only blur their message.
                self.broken = Some(e.to_string());
                self.mark(SLOT_GAVE_UP);
                return Err(e);
            }
            self.linger_on_conflict();
            return Err(self.fail(e));
        }
        if let Err(e) = self.agree_direct().and_then(|()| self.settle()) {
            let e = self.conflict_or(e);
            self.linger_on_conflict();
            return Err(self.fail(e));
        }
        // Every rank mapped every segment (agree_direct maps them before it reports): from here
        // on nothing of the group is reachable by name or descriptor.
        self.data.close_fd();
        self.control.close_fd();
        if self.rank == 0 {
            self.unlink_own_control();
            self.control_unlinked = true;
        }
        Ok(self)
    }

    /// Joins the group of unique id `id` (made by one rank with [`UniqueId::new`] and passed to
    /// the others): as [`ShmGroup::join`] with the name the id stands for.
    pub fn join_unique(
        id: &UniqueId,
        rank: usize,
        world: usize,
        opts: GroupOptions,
    ) -> Result<ShmGroup> {
        Self::join(&id.group_name()?, rank, world, opts)
    }

    /// Fails if a process of another job met this group (its record or a taken slot).
    fn check_conflict(&self) -> Result<()> {
        let (name, me) = (&self.name, self.rank);
        let waited = (SETTLE_MAX + self.opts.timeout).as_secs_f64();
        match self.header().conflict_pid.load(Ordering::Acquire) {
            0 | FORMED => Ok(()),
            ABANDONED if me == 0 => Err(Error::PeerFailure(format!(
                "rank 0 of group '{name}' (this rank) was late completing its creation: the other ranks timed out after {waited:.1} s waiting for it"
            ))),
            ABANDONED => Err(Error::Timeout(format!(
                "timed out after {waited:.1} s waiting for rank 0 of group '{name}' to complete its creation (rank {me})"
            ))),
            pid => Err(Error::InvalidState(format!(
                "group name '{}' is in use by another job: pid {pid} tried to join this group under the same name, so rank {} refuses to form it; jobs that run at the same time need distinct group names",
                self.name, self.rank
            ))),
        }
    }

    /// What explains a failed join best: a conflict with another job, else a rank that died
    /// (a rank that failed because of that death would otherwise be blamed), else `e`.
    fn conflict_or(&self, e: Error) -> Error {
        if let Err(c) = self.check_conflict() {
            return c;
        }
        match self.dead_while_joining() {
            Some(dead) if matches!(e, Error::PeerFailure(_)) => dead,
            Some(_) | None => e,
        }
    }

    /// Three times the spread of the ranks' arrivals so far, within the settle bounds.
    fn settle_time(&self) -> Duration {
        let first = (0..self.world)
            .map(|r| self.desc(r).started_ns.load(Ordering::Relaxed))
            .filter(|&t| t != 0)
            .min()
            .unwrap_or(0);
        let spread = Duration::from_nanos(now_ns().saturating_sub(first));
        (spread * 3).clamp(SETTLE_MIN, SETTLE_MAX)
    }

    /// Rank 0 of a group another job met keeps its record (marked with the clash) for one
    /// timeout after it learns of it (at least the longest settle time) before it fails: the
    /// time a rank of a healthy group has to arrive. So every rank of either job that arrives
    /// meanwhile meets the mark and fails at once naming the clash, instead of forming a group
    /// with this job's leftover ranks, or waiting out its own timeout for a rank 0 that was
    /// refused and then timing out with a message that cannot name the clash. It says so at
    /// once (warn), as its error comes only after that wait.
    fn linger_on_conflict(&self) {
        let c = self.header().conflict_pid.load(Ordering::Acquire);
        if self.rank == 0 && !matches!(c, 0 | FORMED | ABANDONED) {
            let linger = self.opts.timeout.max(SETTLE_MAX);
            crate::log::warn(&waiting::clash_linger(&self.name, c, linger));
            std::thread::sleep(linger);
        }
    }

    /// Waits out the settle time (rank 0) or for rank 0's verdict (the others), with the record
    /// and descriptors still open, so a job that started at about the same time under the same
    /// name meets this group; then the group forms unless such a job marked it.
    pub(super) fn settle(&self) -> Result<()> {
        let h = self.header();
        if self.rank == 0 {
            let until = Instant::now() + self.settle_time();
            while Instant::now() < until && h.conflict_pid.load(Ordering::Acquire) == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            let _ = h
                .conflict_pid
                .compare_exchange(0, FORMED, Ordering::AcqRel, Ordering::Acquire);
            return self.check_conflict();
        }
        let deadline = Deadline::new(SETTLE_MAX + self.opts.timeout);
        let mut last_check = Instant::now();
        while h.conflict_pid.load(Ordering::Acquire) == 0 {
            if last_check.elapsed() >= LIVENESS_PERIOD {
                last_check = Instant::now();
                let s = self.slot(0);
                let pid = s.pid.load(Ordering::Acquire);
                if s.state.load(Ordering::Acquire) != SLOT_ACTIVE || !pid_alive(pid) {
                    return Err(Error::PeerFailure(format!(
                        "rank 0 of group '{}' (pid {pid}) failed or died while the group was forming (seen from rank {})",
                        self.name, self.rank
                    )));
                }
                // Giving up is a decision too: rank 0 either formed the group first or finds
                // it abandoned, so no rank forms a group another rank left.
                if deadline.expired() {
                    let _ = h.conflict_pid.compare_exchange(
                        0,
                        ABANDONED,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.check_conflict()
    }

    /// Maps rank `p`'s current data segment unless it is mapped already; a failure says what
    /// became of that rank.
    pub(super) fn map_peer(&mut self, p: usize) -> Result<()> {
        let d = self.desc(p);
        let gen = d.gen.load(Ordering::Acquire);
        if self.peers[p].as_ref().map(|(g, _)| *g) == Some(gen) {
            return Ok(());
        }
        let (fd, key) = (
            d.fd.load(Ordering::Relaxed),
            (d.dev.load(Ordering::Relaxed), d.ino.load(Ordering::Relaxed)),
        );
        let bytes = d.bytes.load(Ordering::Relaxed);
        let s = self.slot(p);
        let pid = s.pid.load(Ordering::Acquire);
        let label = Self::data_name(&self.name, self.session, p, gen, pid);
        let min_len = usize::try_from(bytes)
            .unwrap_or(usize::MAX)
            .max(OP_HEADER_BYTES);
        match Segment::open_peer(&label, pid, fd, key, min_len) {
            Ok(seg) => {
                self.peers[p] = Some((gen, seg));
                Ok(())
            }
            Err(e) => {
                let (name, me) = (&self.name, self.rank);
                // A dying process loses its descriptors before it stops looking alive: give
                // its death a moment to show, so the error names what happened.
                let deadline = Instant::now() + Duration::from_millis(500);
                while s.state.load(Ordering::Acquire) == SLOT_ACTIVE
                    && pid_alive(pid)
                    && Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(match s.state.load(Ordering::Acquire) {
                    SLOT_LEFT => Error::PeerFailure(format!(
                        "rank {p} of group '{name}' left the group (destroyed its handle) before rank {me} could map its shared-memory region"
                    )),
                    SLOT_FAILED => Error::PeerFailure(format!(
                        "rank {p} of group '{name}' failed (an error on that rank aborted its group) before rank {me} could map its shared-memory region"
                    )),
                    _ if !pid_alive(pid) => Error::PeerFailure(format!(
                        "rank {p} of group '{name}' died (pid {pid} is gone) before rank {me} could map its shared-memory region"
                    )),
                    _ => Error::PeerFailure(format!(
                        "cannot map the shared-memory region of rank {p} of group '{name}' (generation {gen}, pid {pid}, descriptor {fd}) on rank {me}: {e}"
                    )),
                })
            }
        }
    }

    /// The error naming a rank that died while the group was joining, if any: one that is
    /// joining or joined (its slot empty or active) and whose process is gone. A rank that
    /// failed, left or gave up said so first (and may have exited since). Rank 0 is known by
    /// its pid as the segment's creator before it claimed its slot, so its death in the join
    /// window names it, not the ranks that then never arrive.
    fn dead_while_joining(&self) -> Option<Error> {
        let gone = |r: usize| {
            let s = self.slot(r);
            let pid = match s.pid.load(Ordering::Acquire) {
                0 if r == 0 => self.header().creator_pid.load(Ordering::Acquire),
                pid => pid,
            };
            let joining = matches!(s.state.load(Ordering::Acquire), SLOT_EMPTY | SLOT_ACTIVE);
            (joining && pid != 0 && !pid_alive(pid)).then_some((r, pid))
        };
        let (r, pid) = (0..self.world).find_map(gone)?;
        Some(Error::PeerFailure(format!(
            "rank {r} of group '{}' died (pid {pid} is gone) while the group was joining",
            self.name
        )))
    }

    fn wait_joined(&self, deadline: &Deadline) -> Result<()> {
        let mut backoff = Backoff::new();
        let mut last_check = Instant::now();
        let started = Instant::now();
        let mut warned = false;
        loop {
            self.check_conflict()?;
            let h = self.header();
            let m = h.mismatch_rank.load(Ordering::Acquire);
            if m != 0 {
                return Err(Error::InvalidArgument(format!(
                    "rank {} tried to join group '{}' with world_size {}, but this group has world_size {}",
                    m - 1,
                    self.name,
                    h.mismatch_world.load(Ordering::Relaxed),
                    self.world
                )));
            }
            if let Some(r) =
                (0..self.world).find(|&r| self.slot(r).state.load(Ordering::Acquire) == SLOT_FAILED)
            {
                // A rank that failed because another died: name the dead one, as that rank does.
                if let Some(e) = self.dead_while_joining() {
                    return Err(e);
                }
                return Err(Error::PeerFailure(format!(
                    "rank {r} of group '{}' failed while joining (see that rank's error)",
                    self.name
                )));
            }
            let (missing, joined): (Vec<usize>, Vec<usize>) = (0..self.world)
                .partition(|&r| self.slot(r).state.load(Ordering::Acquire) == SLOT_EMPTY);
            let timed_out = || {
                Error::Timeout(waiting::join_timeout(
                    deadline.timeout,
                    &self.name,
                    self.world,
                    &joined,
                    &missing,
                ))
            };
            let gave_up = (0..self.world)
                .find(|&r| self.slot(r).state.load(Ordering::Acquire) == SLOT_GAVE_UP);
            match (gave_up, missing.is_empty()) {
                // Another rank timed out waiting for the same missing ranks: so does this one,
                // unless one of them died (then it names that rank, as the others do).
                (Some(_), false) => {
                    return Err(self.dead_while_joining().unwrap_or_else(timed_out))
                }
                (Some(r), true) => {
                    return Err(Error::PeerFailure(format!(
                    "rank {r} of group '{}' gave up waiting for the group to form (it timed out)",
                    self.name
                )))
                }
                (None, true) => return Ok(()),
                (None, false) => {}
            }
            if last_check.elapsed() >= LIVENESS_PERIOD {
                last_check = Instant::now();
                if let Some(e) = self.dead_while_joining() {
                    return Err(e);
                }
                if deadline.expired() {
                    return Err(timed_out());
                }
                if !warned && deadline.timeout > WARN_AFTER && started.elapsed() >= WARN_AFTER {
                    warned = true;
                    crate::log::warn(&waiting::join_warning(
                        started.elapsed(),
                        deadline.timeout,
                        &self.name,
                        self.rank,
                        self.world,
                        &joined,
                        &missing,
                    ));
                }
            }
            backoff.snooze();
        }
    }

    /// Tests direct reads of every peer's probe word and agrees on the mode with all ranks.
    fn agree_direct(&mut self) -> Result<()> {
        // Map every peer's region before reporting: once all reported, every rank mapped every
        // region and the descriptors can close.
        let me = self.rank;
        for p in (0..self.world).filter(|&p| p != me) {
            self.map_peer(p)?;
        }
        let wanted = self.opts.direct_reads && crate::env::shm_direct();
        let ok = wanted
            && (0..self.world).all(|p| {
                let s = self.slot(p);
                let pid = s.pid.load(Ordering::Acquire);
                let mut word = [0u8; 8];
                copy_from_process(
                    pid,
                    pid == self.pid,
                    s.probe_addr.load(Ordering::Acquire),
                    &mut word,
                )
                .is_ok()
                    && u64::from_ne_bytes(word) == s.token.load(Ordering::Acquire)
            });
        self.slot(self.rank)
            .direct_ok
            .store(if ok { 1 } else { 2 }, Ordering::Release);
        self.slot(self.rank).wake.notify();
        self.wait_peers(Op::Join, 0, |s| s.direct_ok.load(Ordering::Acquire) != 0)?;
        self.direct = (0..self.world).all(|p| self.slot(p).direct_ok.load(Ordering::Acquire) == 1);
        Ok(())
    }
}

impl Drop for ShmGroup {
    fn drop(&mut self) {
        if self.forked() {
            // The parent's rank: only this process's mappings and descriptors go (field drops).
            return;
        }
        if self.broken.is_none() {
            // Let peers finish reading this rank's last contribution before its region goes.
            let n = self.seq;
            let saved = self.opts.timeout;
            self.opts.timeout = saved.min(Duration::from_secs(5));
            let _ = self.wait_peers(Op::Leave, n, |s| {
                s.consumed.load(Ordering::Acquire) >= n
                    || s.state.load(Ordering::Acquire) != SLOT_ACTIVE
            });
            self.mark(SLOT_LEFT);
            // Give the others a moment to leave too, so a rank that dies right after its last
            // op is seen dead here and its region removed below.
            self.opts.timeout = saved.min(Duration::from_secs(1));
            let _ = self.wait_peers(Op::Leave, n, |s| {
                s.state.load(Ordering::Acquire) != SLOT_ACTIVE
            });
            self.opts.timeout = saved;
        }
        Segment::unlink(self.data.name());
        // Segments of peers that died after the last op anyone waited on.
        for p in (0..self.world).filter(|&p| p != self.rank) {
            let s = self.slot(p);
            let pid = s.pid.load(Ordering::Acquire);
            if pid != 0 && !pid_alive(pid) {
                let gen = s.data_gen.load(Ordering::Acquire);
                Segment::unlink(&Self::data_name(&self.name, self.session, p, gen, pid));
            }
        }
        if !self.control_unlinked
            && (self.rank == 0 || !pid_alive(self.header().creator_pid.load(Ordering::Acquire)))
        {
            self.unlink_own_control();
        }
    }
}
