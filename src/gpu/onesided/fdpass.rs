//! File-descriptor passing with SCM_RIGHTS over AF_UNIX sockets, and the rendezvous that
//! all-gathers one fd (a VMM allocation's POSIX handle) per rank of a group on one host.
//!
//! SCM_RIGHTS rather than `pidfd_getfd`: the latter needs CAP_SYS_PTRACE and Linux ≥ 5.6, and
//! sandboxes (gVisor reports kernel 4.4) look older than that. Sockets are `SOCK_SEQPACKET`, so
//! every message (bytes + its fds) arrives whole and on its own.
//!
//! Rendezvous: rank 0 listens on the abstract socket `\0epcomm.<group>.fds` (abstract: nothing
//! on disk to go stale, and it disappears with the process); the other ranks connect, each
//! sends `hello(rank, world, payload, fd)`; once all arrived rank 0 sends every rank the other
//! ranks' entries. Every wait is bounded by the timeout and errors name the rank. Abstract
//! names are per network namespace: ranks must share one (as processes of one host normally do).

use std::ffi::c_int;
use std::io;
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Most fds one message may carry.
const MAX_FDS_PER_MESSAGE: usize = 16;
/// Largest per-rank payload in the rendezvous.
const MAX_PAYLOAD_BYTES: usize = 4096;

const MAGIC: u32 = 0x6570_6664; // "epfd"
const KIND_HELLO: u32 = 1;
const KIND_ENTRY: u32 = 2;
const KIND_ABORT: u32 = 3;
const HEADER_BYTES: usize = 20;

fn sys_err(what: &str, e: io::Error) -> Error {
    Error::System(format!("{what}: {e}"))
}

/// A connected pair of AF_UNIX `SOCK_SEQPACKET` sockets (close-on-exec).
pub fn socket_pair() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds: [c_int; 2] = [-1, -1];
    // SAFETY: `fds` is a writable array of two ints.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(sys_err("socketpair(AF_UNIX)", io::Error::last_os_error()));
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Sends `data` (at least one byte) with `fds` attached as SCM_RIGHTS in one message. The
/// receiver gets its own duplicates; the caller keeps (and still must close) its fds.
pub fn send_with_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    if data.is_empty() {
        return Err(Error::InvalidArgument(
            "send_with_fds: a message must carry at least one byte".into(),
        ));
    }
    if fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(Error::InvalidArgument(format!(
            "send_with_fds: {} fds in one message, at most {MAX_FDS_PER_MESSAGE}",
            fds.len()
        )));
    }
    let fd_bytes = fds.len() * size_of::<c_int>();
    // SAFETY: CMSG_SPACE is pure arithmetic.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    // u64 storage keeps the control buffer aligned for `cmsghdr`.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer is `space` bytes, aligned, and large enough for one
        // header with `fds.len()` ints (CMSG_SPACE); CMSG_FIRSTHDR is non-NULL for it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
            let dst = libc::CMSG_DATA(cmsg).cast::<c_int>();
            for (i, fd) in fds.iter().enumerate() {
                dst.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    loop {
        // SAFETY: `msg` points at live buffers for the duration of the call. MSG_NOSIGNAL: a
        // closed peer is an EPIPE error, not a SIGPIPE that kills the host process.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            if n as usize != data.len() {
                return Err(Error::System(format!(
                    "sendmsg sent {n} of {} bytes",
                    data.len()
                )));
            }
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(sys_err("sendmsg(SCM_RIGHTS)", e));
        }
    }
}

/// One received message.
#[derive(Debug)]
pub struct Received {
    /// Bytes written into the caller's buffer.
    pub len: usize,
    /// The fds that came with it (owned; close-on-exec).
    pub fds: Vec<OwnedFd>,
}

/// Why a receive failed (mapped to a status naming the peer by the callers).
#[derive(Debug)]
enum RecvFail {
    TimedOut,
    Closed,
    Truncated,
    Io(io::Error),
}

/// Waits until `fd` is readable (or hung up) or the deadline passes.
fn wait_readable(fd: RawFd, deadline: Option<Instant>) -> std::result::Result<(), RecvFail> {
    loop {
        let ms: c_int = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(RecvFail::TimedOut);
                }
                // Round up so a sub-millisecond remainder does not spin.
                left.as_millis().clamp(1, c_int::MAX as u128) as c_int
            }
        };
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut p, 1, ms) };
        if rc > 0 {
            return Ok(());
        }
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(RecvFail::Io(e));
            }
        }
    }
}

fn recv_inner(
    sock: RawFd,
    buf: &mut [u8],
    deadline: Option<Instant>,
) -> std::result::Result<Received, RecvFail> {
    wait_readable(sock, deadline)?;
    // SAFETY: pure arithmetic.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS_PER_MESSAGE * size_of::<c_int>()) as u32) };
    let mut control = vec![0u64; (space as usize).div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: plain data; zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: `msg` points at live, writable buffers. MSG_CMSG_CLOEXEC: received fds must
        // not leak into processes the host spawns.
        let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(RecvFail::Io(e));
        }
    };
    // Take ownership of every fd first, so they are closed on any error below.
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `msg_control`/`msg_controllen`; the CMSG_* walkers stay within
    // them, and SCM_RIGHTS data is an array of ints that are now ours.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data_len = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(cmsg).cast::<c_int>();
                for i in 0..data_len / size_of::<c_int>() {
                    fds.push(OwnedFd::from_raw_fd(p.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(RecvFail::Truncated);
    }
    if n == 0 && fds.is_empty() {
        return Err(RecvFail::Closed);
    }
    Ok(Received { len: n, fds })
}

/// Receives one message into `buf` with up to [`MAX_FDS_PER_MESSAGE`] fds, waiting at most
/// `timeout` (`None`: forever). A closed peer is PeerFailure, a timeout Timeout, a message
/// larger than `buf` (or with too many fds) InvalidArgument.
pub fn recv_with_fds(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    timeout: Option<Duration>,
) -> Result<Received> {
    let deadline = timeout.map(|t| Instant::now() + t);
    recv_inner(sock.as_raw_fd(), buf, deadline).map_err(|f| match f {
        RecvFail::TimedOut => Error::Timeout(format!(
            "recv_with_fds: no message within {:?}",
            timeout.unwrap_or_default()
        )),
        RecvFail::Closed => Error::PeerFailure("recv_with_fds: the peer closed the socket".into()),
        RecvFail::Truncated => Error::InvalidArgument(format!(
            "recv_with_fds: message larger than {} bytes or with more than {MAX_FDS_PER_MESSAGE} fds",
            buf.len()
        )),
        RecvFail::Io(e) => sys_err("recvmsg", e),
    })
}

/// The abstract socket name (without the leading NUL) of `group`'s fd rendezvous.
fn rendezvous_socket_name(group: &str) -> String {
    format!("epcomm.{group}.fds")
}

fn abstract_addr(name: &str) -> Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: plain data; zero is valid.
    let mut addr: libc::sockaddr_un = unsafe { zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = name.as_bytes();
    if bytes.len() + 1 > addr.sun_path.len() {
        return Err(Error::InvalidArgument(format!(
            "fd rendezvous: group socket name '{name}' is longer than {} bytes",
            addr.sun_path.len() - 1
        )));
    }
    // sun_path[0] stays 0: the abstract namespace.
    for (i, &b) in bytes.iter().enumerate() {
        addr.sun_path[i + 1] = b as libc::c_char;
    }
    let len = size_of::<libc::sa_family_t>() + 1 + bytes.len();
    Ok((addr, len as libc::socklen_t))
}

fn seqpacket_socket() -> Result<OwnedFd> {
    // SAFETY: no pointers.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(sys_err("socket(AF_UNIX)", io::Error::last_os_error()));
    }
    // SAFETY: freshly created, owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// One rank's contribution, as every rank receives it from the rendezvous.
#[derive(Debug)]
pub struct PeerFd {
    /// The rank this entry is from.
    pub rank: usize,
    /// The peer's fd (a duplicate owned by this process); `None` for the own rank (use the
    /// local object) and for a peer that sent none.
    pub fd: Option<OwnedFd>,
    /// The peer's payload (e.g. allocation size, pid).
    pub payload: Vec<u8>,
}

fn encode(kind: u32, rank: usize, world: usize, has_fd: bool, payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(HEADER_BYTES + payload.len());
    for w in [MAGIC, kind, rank as u32, world as u32, has_fd as u32] {
        m.extend_from_slice(&w.to_le_bytes());
    }
    m.extend_from_slice(payload);
    m
}

struct Msg {
    kind: u32,
    rank: usize,
    world: usize,
    has_fd: bool,
    payload: Vec<u8>,
    fd: Option<OwnedFd>,
}

fn decode(buf: &[u8], mut fds: Vec<OwnedFd>) -> Option<Msg> {
    if buf.len() < HEADER_BYTES || fds.len() > 1 {
        return None;
    }
    let w =
        |i: usize| u32::from_le_bytes([buf[4 * i], buf[4 * i + 1], buf[4 * i + 2], buf[4 * i + 3]]);
    if w(0) != MAGIC {
        return None;
    }
    let has_fd = w(4) != 0;
    if has_fd != (fds.len() == 1) {
        return None;
    }
    Some(Msg {
        kind: w(1),
        rank: w(2) as usize,
        world: w(3) as usize,
        has_fd,
        payload: buf[HEADER_BYTES..].to_vec(),
        fd: fds.pop(),
    })
}

/// All-gathers one optional fd and a small payload per rank of `group` (ranks on one host,
/// processes or threads). Returns `world` entries in rank order; the own entry has no fd.
/// Bounded by `timeout`: a rank that never shows up is reported by number, on rank 0 and (via
/// an abort message) on every rank already connected.
pub fn exchange_fds(
    group: &str,
    rank: usize,
    world: usize,
    fd: Option<BorrowedFd<'_>>,
    payload: &[u8],
    timeout: Duration,
) -> Result<Vec<PeerFd>> {
    if world == 0 || rank >= world || world > u32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "fd rendezvous: rank {rank} is out of range for world size {world}"
        )));
    }
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(Error::InvalidArgument(format!(
            "fd rendezvous: payload of {} bytes, at most {MAX_PAYLOAD_BYTES}",
            payload.len()
        )));
    }
    let name = rendezvous_socket_name(group);
    let (addr, addr_len) = abstract_addr(&name)?;
    if world == 1 {
        return Ok(vec![PeerFd {
            rank,
            fd: None,
            payload: payload.to_vec(),
        }]);
    }
    let m = Meeting {
        group,
        rank,
        world,
        fd,
        payload,
        addr,
        addr_len,
        deadline: Instant::now() + timeout,
        timeout,
    };
    if rank == 0 {
        m.serve()
    } else {
        m.join()
    }
}

/// One rank's side of a rendezvous: who it is, what it brings, where rank 0 listens, and the
/// bound on the whole exchange.
struct Meeting<'a> {
    group: &'a str,
    rank: usize,
    world: usize,
    fd: Option<BorrowedFd<'a>>,
    payload: &'a [u8],
    addr: libc::sockaddr_un,
    addr_len: libc::socklen_t,
    deadline: Instant,
    timeout: Duration,
}

/// The entries gathered so far, by rank; this rank's own (without its fd) is there already.
fn own_entry(world: usize, rank: usize, payload: &[u8]) -> Vec<Option<PeerFd>> {
    let mut entries: Vec<Option<PeerFd>> = (0..world).map(|_| None).collect();
    entries[rank] = Some(PeerFd {
        rank,
        fd: None,
        payload: payload.to_vec(),
    });
    entries
}

impl Meeting<'_> {
    /// Rank 0: listen, admit every other rank's hello, send each rank every other entry; on a
    /// failure, tell the ranks already connected.
    fn serve(&self) -> Result<Vec<PeerFd>> {
        let listener = self.listen()?;
        let mut entries = own_entry(self.world, 0, self.payload);
        let mut conns: Vec<(usize, OwnedFd)> = Vec::new();
        let result = (|| -> Result<()> {
            while conns.len() + 1 < self.world {
                let Some((m, conn)) = self.accept_hello(&listener, &entries)? else {
                    continue;
                };
                self.admit(&m, &conn, &entries)?;
                entries[m.rank] = Some(PeerFd {
                    rank: m.rank,
                    fd: m.fd,
                    payload: m.payload,
                });
                conns.push((m.rank, conn));
            }
            self.send_entries(&conns, &entries)
        })();
        if let Err(e) = &result {
            // Tell the ranks already connected, so they fail now with the same reason.
            let text = e.to_string();
            for (_, conn) in &conns {
                let _ = send_with_fds(
                    conn.as_fd_ref(),
                    &encode(KIND_ABORT, 0, self.world, false, text.as_bytes()),
                    &[],
                );
            }
        }
        result?;
        Ok(entries.into_iter().flatten().collect())
    }

    /// The bound, listening socket of rank 0.
    fn listen(&self) -> Result<OwnedFd> {
        let group = self.group;
        let listener = seqpacket_socket()?;
        // SAFETY: `addr` is a valid sockaddr_un of `addr_len` bytes.
        let rc = unsafe {
            libc::bind(
                listener.as_raw_fd(),
                (&self.addr as *const libc::sockaddr_un).cast(),
                self.addr_len,
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EADDRINUSE) {
                return Err(Error::InvalidState(format!(
                    "fd rendezvous of group '{group}': the socket name is in use (is another group with this name running?)"
                )));
            }
            return Err(sys_err("bind(fd rendezvous socket)", e));
        }
        // SAFETY: a bound socket.
        if unsafe { libc::listen(listener.as_raw_fd(), self.world as c_int) } != 0 {
            return Err(sys_err(
                "listen(fd rendezvous socket)",
                io::Error::last_os_error(),
            ));
        }
        Ok(listener)
    }

    /// The next connection and its hello; `None` for an interrupted accept or a client that
    /// gave up and closed (not fatal for the others).
    fn accept_hello(
        &self,
        listener: &OwnedFd,
        entries: &[Option<PeerFd>],
    ) -> Result<Option<(Msg, OwnedFd)>> {
        let (group, timeout) = (self.group, self.timeout);
        if wait_readable(listener.as_raw_fd(), Some(self.deadline)).is_err() {
            let missing: Vec<String> = (1..self.world)
                .filter(|r| entries[*r].is_none())
                .map(|r| r.to_string())
                .collect();
            return Err(Error::Timeout(format!(
                "fd rendezvous of group '{group}': rank(s) {} did not join within {timeout:?}",
                missing.join(", ")
            )));
        }
        // SAFETY: NULL address outputs are allowed.
        let c = unsafe {
            libc::accept4(
                listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if c < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted || e.kind() == io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(sys_err("accept(fd rendezvous socket)", e));
        }
        // SAFETY: freshly accepted, owned here.
        let conn = unsafe { OwnedFd::from_raw_fd(c) };
        let mut buf = vec![0u8; HEADER_BYTES + MAX_PAYLOAD_BYTES];
        let msg = match recv_inner(conn.as_raw_fd(), &mut buf, Some(self.deadline)) {
            Ok(r) => decode(&buf[..r.len], r.fds),
            Err(RecvFail::TimedOut) => {
                return Err(Error::Timeout(format!(
                    "fd rendezvous of group '{group}': a rank connected but sent nothing within {timeout:?}"
                )))
            }
            // A client that gave up (its own timeout) and closed: not fatal for the others.
            Err(RecvFail::Closed | RecvFail::Truncated | RecvFail::Io(_)) => return Ok(None),
        };
        let Some(m) = msg.filter(|m| m.kind == KIND_HELLO) else {
            return Err(Error::InvalidArgument(format!(
                "fd rendezvous of group '{group}': a malformed message arrived (not an epcomm rank?)"
            )));
        };
        Ok(Some((m, conn)))
    }

    /// Checks a hello against the group: the same world size (else the joiner is told why),
    /// a rank in range that has not joined yet.
    fn admit(&self, m: &Msg, conn: &OwnedFd, entries: &[Option<PeerFd>]) -> Result<()> {
        let (group, world) = (self.group, self.world);
        if m.world != world {
            let r = m.rank;
            let why = format!(
                "rank {r} joined with world size {} but rank 0 has {world}",
                m.world
            );
            let abort = encode(KIND_ABORT, 0, world, false, why.as_bytes());
            let _ = send_with_fds(conn.as_fd_ref(), &abort, &[]);
            return Err(Error::InvalidArgument(format!(
                "fd rendezvous of group '{group}': rank {r} joined with world size {}, rank 0 has {world}",
                m.world
            )));
        }
        if m.rank == 0 || m.rank >= world || entries[m.rank].is_some() {
            return Err(Error::InvalidArgument(format!(
                "fd rendezvous of group '{group}': rank {} joined twice or is out of range for world size {world}",
                m.rank
            )));
        }
        Ok(())
    }

    /// Everyone joined: each rank gets every other rank's entry.
    fn send_entries(&self, conns: &[(usize, OwnedFd)], entries: &[Option<PeerFd>]) -> Result<()> {
        let group = self.group;
        for (dst, conn) in conns {
            for e in entries.iter().flatten().filter(|e| e.rank != *dst) {
                // Rank 0's own fd is the caller's (borrowed); the others were received.
                let fds: Vec<BorrowedFd<'_>> = if e.rank == 0 {
                    self.fd.into_iter().collect()
                } else {
                    e.fd.iter().map(|f| f.as_fd_ref()).collect()
                };
                let m = encode(KIND_ENTRY, e.rank, self.world, !fds.is_empty(), &e.payload);
                send_with_fds(conn.as_fd_ref(), &m, &fds).map_err(|err| {
                    Error::PeerFailure(format!(
                        "fd rendezvous of group '{group}': sending to rank {dst} failed: {err}"
                    ))
                })?;
            }
        }
        Ok(())
    }

    /// A rank other than 0: connect, send the hello, receive every other rank's entry.
    fn join(&self) -> Result<Vec<PeerFd>> {
        let (group, rank) = (self.group, self.rank);
        let sock = self.connect()?;
        let fds: Vec<BorrowedFd<'_>> = self.fd.into_iter().collect();
        send_with_fds(
            sock.as_fd_ref(),
            &encode(KIND_HELLO, rank, self.world, !fds.is_empty(), self.payload),
            &fds,
        )
        .map_err(|e| {
            Error::PeerFailure(format!(
                "fd rendezvous of group '{group}': rank {rank} could not send to rank 0: {e}"
            ))
        })?;
        let mut entries = own_entry(self.world, rank, self.payload);
        let mut buf = vec![0u8; HEADER_BYTES + MAX_PAYLOAD_BYTES];
        for _ in 1..self.world {
            let m = self.receive_entry(&sock, &mut buf)?;
            if m.rank >= self.world || m.rank == rank || entries[m.rank].is_some() {
                return Err(unexpected_entry(group, m.rank));
            }
            debug_assert_eq!(m.has_fd, m.fd.is_some());
            entries[m.rank] = Some(PeerFd {
                rank: m.rank,
                fd: m.fd,
                payload: m.payload,
            });
        }
        Ok(entries.into_iter().flatten().collect())
    }

    /// A socket connected to rank 0, which may not listen yet: retried until the deadline.
    fn connect(&self) -> Result<OwnedFd> {
        let (group, rank, timeout) = (self.group, self.rank, self.timeout);
        loop {
            let s = seqpacket_socket()?;
            // SAFETY: valid address of `addr_len` bytes.
            let rc = unsafe {
                libc::connect(
                    s.as_raw_fd(),
                    (&self.addr as *const libc::sockaddr_un).cast(),
                    self.addr_len,
                )
            };
            if rc == 0 {
                return Ok(s);
            }
            let e = io::Error::last_os_error();
            let retry = matches!(
                e.raw_os_error(),
                Some(libc::ECONNREFUSED)
                    | Some(libc::ENOENT)
                    | Some(libc::EAGAIN)
                    | Some(libc::EINTR)
            );
            if !retry {
                return Err(sys_err("connect(fd rendezvous socket)", e));
            }
            if Instant::now() >= self.deadline {
                return Err(Error::Timeout(format!(
                    "fd rendezvous of group '{group}': rank {rank} could not reach rank 0 within {timeout:?} (rank 0 not started or stuck)"
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The next entry rank 0 sends (an abort is its error).
    fn receive_entry(&self, sock: &OwnedFd, buf: &mut [u8]) -> Result<Msg> {
        let (group, rank, timeout) = (self.group, self.rank, self.timeout);
        let r = recv_inner(sock.as_raw_fd(), buf, Some(self.deadline)).map_err(|f| match f {
            RecvFail::TimedOut => Error::Timeout(format!(
                "fd rendezvous of group '{group}': rank {rank} got no answer from rank 0 within {timeout:?} (other ranks missing?)"
            )),
            RecvFail::Closed => Error::PeerFailure(format!(
                "fd rendezvous of group '{group}': rank 0 closed the connection to rank {rank}"
            )),
            RecvFail::Truncated => Error::InvalidArgument(format!(
                "fd rendezvous of group '{group}': oversized message from rank 0"
            )),
            RecvFail::Io(e) => sys_err("recvmsg(fd rendezvous)", e),
        })?;
        let m = decode(&buf[..r.len], r.fds).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "fd rendezvous of group '{group}': malformed message from rank 0"
            ))
        })?;
        if m.kind == KIND_ABORT {
            return Err(Error::PeerFailure(format!(
                "fd rendezvous of group '{group}' aborted by rank 0: {}",
                String::from_utf8_lossy(&m.payload)
            )));
        }
        if m.kind != KIND_ENTRY {
            return Err(unexpected_entry(group, m.rank));
        }
        Ok(m)
    }
}

fn unexpected_entry(group: &str, rank: usize) -> Error {
    Error::InvalidArgument(format!(
        "fd rendezvous of group '{group}': unexpected entry for rank {rank} from rank 0"
    ))
}

/// `BorrowedFd` from an `OwnedFd` without the `AsFd` import dance at every call site.
trait AsFdRef {
    fn as_fd_ref(&self) -> BorrowedFd<'_>;
}

impl AsFdRef for OwnedFd {
    fn as_fd_ref(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.as_fd()
    }
}
