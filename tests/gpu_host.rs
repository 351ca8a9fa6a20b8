//! The host side of the GPU transports, without a GPU: NCCL exchange plans and capacity
//! layout, the one-sided workspace layout, epochs, device error words (and signal.cu's epochs,
//! wait and error word run on the CPU against them), the peer table, fd
//! passing (SCM_RIGHTS, threads and a child process), the capability JSON and the loaders'
//! "unavailable" messages.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use epcomm::error::{Error, Status};
use epcomm::gpu::caps;
use epcomm::gpu::kernels::{
    self, encode_error_word, DeviceError, ERR_CAPACITY, ERR_DUPLICATE_ID, ERR_HOST_REJECTED,
    ERR_ID_OUT_OF_RANGE, ERR_RANK_CAPACITY, ERR_WAIT_TIMEOUT,
};
use epcomm::gpu::nccl::{
    self, counts_plan, supports_zero_size_p2p, version_parts, CapacityLayout, ExchangeOptions,
    LocalCopy, NcclComm, NcclUniqueId, PeerTransfer,
};
use epcomm::gpu::onesided::fdpass::{
    exchange_fds, recv_with_fds, send_with_fds, socket_pair, PeerFd,
};
use epcomm::gpu::onesided::{
    epoch_reached, Epoch, ErrorWord, PeerEntry, PeerSource, PeerTable, WorkspaceLayout,
    ERROR_WORD_BYTES, REGION_ALIGN, ROW_ALIGN,
};

mod common;

// ---- NCCL versions and the counts-mode plan ------------------------------------------------

#[test]
fn nccl_version_codes() {
    assert_eq!(version_parts(22809), (2, 28, 9));
    assert_eq!(version_parts(21210), (2, 12, 10));
    assert_eq!(version_parts(2804), (2, 8, 4));
    assert!(supports_zero_size_p2p(21210));
    assert!(supports_zero_size_p2p(22809));
    assert!(!supports_zero_size_p2p(21209));
    assert!(!supports_zero_size_p2p(2804));
    assert!(ExchangeOptions::for_version(22809).zero_size_p2p);
    assert!(!ExchangeOptions::for_version(21012).zero_size_p2p);
}

/// counts[src][dst] for 3 ranks, with zeros off the diagonal.
const M3: [i32; 9] = [
    2, 0, 3, //
    1, 4, 0, //
    0, 5, 6,
];

#[test]
fn counts_plan_offsets_rank0() {
    let p = counts_plan(&M3, 3, 0, 10, ExchangeOptions::for_version(22809)).unwrap();
    // Send buffer by destination: [self 2 rows][to 1: 0 rows][to 2: 3 rows].
    assert_eq!(
        p.sends,
        vec![
            PeerTransfer {
                peer: 1,
                offset: 20,
                bytes: 0
            },
            PeerTransfer {
                peer: 2,
                offset: 20,
                bytes: 30
            },
        ]
    );
    // Receive buffer by source: [self 2][from 1: 1][from 2: 0].
    assert_eq!(
        p.recvs,
        vec![
            PeerTransfer {
                peer: 1,
                offset: 20,
                bytes: 10
            },
            PeerTransfer {
                peer: 2,
                offset: 30,
                bytes: 0
            },
        ]
    );
    assert_eq!(
        p.local,
        Some(LocalCopy {
            send_offset: 0,
            recv_offset: 0,
            bytes: 20
        })
    );
    assert_eq!((p.send_bytes, p.recv_bytes), (50, 30));
    assert_eq!(p.recv_rows, vec![2, 1, 0]);
}

#[test]
fn counts_plan_old_nccl_skips_zero_sizes() {
    let p = counts_plan(&M3, 3, 0, 10, ExchangeOptions::for_version(21000)).unwrap();
    assert_eq!(p.sends.iter().map(|t| t.peer).collect::<Vec<_>>(), vec![2]);
    assert_eq!(p.recvs.iter().map(|t| t.peer).collect::<Vec<_>>(), vec![1]);
}

/// A pseudo-random matrix (xorshift), zeros included.
fn matrix(world: usize, seed: u64) -> Vec<i32> {
    let mut s = seed | 1;
    (0..world * world)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            if s.is_multiple_of(3) {
                0
            } else {
                (s % 50) as i32
            }
        })
        .collect()
}

#[test]
fn counts_plans_agree_between_sender_and_receiver() {
    for world in [1usize, 2, 3, 5, 8] {
        for zero in [true, false] {
            for self_nccl in [true, false] {
                let m = matrix(world, world as u64 * 7 + zero as u64);
                let opts = ExchangeOptions {
                    zero_size_p2p: zero,
                    self_via_nccl: self_nccl,
                };
                let plans: Vec<_> = (0..world)
                    .map(|r| counts_plan(&m, world, r, 7, opts).unwrap())
                    .collect();
                for s in 0..world {
                    for d in 0..world {
                        let send = plans[s].sends.iter().find(|t| t.peer == d);
                        let recv = plans[d].recvs.iter().find(|t| t.peer == s);
                        // Issued on both sides or on neither (else NCCL hangs), same size.
                        assert_eq!(send.is_some(), recv.is_some(), "{world} {s}->{d}");
                        if let (Some(a), Some(b)) = (send, recv) {
                            assert_eq!(a.bytes, b.bytes);
                            assert_eq!(a.bytes, m[s * world + d] as usize * 7);
                        }
                        let bytes = m[s * world + d] as usize * 7;
                        let expect = (s != d || self_nccl) && (zero || bytes > 0);
                        assert_eq!(send.is_some(), expect, "{world} {s}->{d}");
                    }
                    // With zero sizes every peer appears: all R-1 (or R) entries.
                    if zero {
                        let n = if self_nccl { world } else { world - 1 };
                        assert_eq!(plans[s].sends.len(), n);
                        assert_eq!(plans[s].recvs.len(), n);
                    }
                    // Offsets are the prefix sums and stay inside the buffers.
                    for t in &plans[s].sends {
                        assert!(t.offset + t.bytes <= plans[s].send_bytes);
                        let before: i32 = (0..t.peer).map(|d| m[s * world + d]).sum();
                        assert_eq!(t.offset, before as usize * 7);
                    }
                    for t in &plans[s].recvs {
                        assert!(t.offset + t.bytes <= plans[s].recv_bytes);
                        let before: i32 = (0..t.peer).map(|x| m[x * world + s]).sum();
                        assert_eq!(t.offset, before as usize * 7);
                    }
                    assert_eq!(plans[s].local.is_some(), !self_nccl && m[s * world + s] > 0);
                }
            }
        }
    }
}

#[test]
fn counts_plan_rejects_bad_input() {
    let e = counts_plan(&[1, -2, 0, 0], 2, 0, 4, ExchangeOptions::for_version(22809)).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert_eq!(
        e.to_string(),
        "exchange plan: count from rank 0 to rank 1 is -2; counts must be >= 0"
    );
    let e = counts_plan(&[1, 2, 3], 2, 0, 4, ExchangeOptions::for_version(22809)).unwrap_err();
    assert!(e.to_string().contains("has 3 entries, expected"), "{e}");
    let e = counts_plan(&[0; 4], 2, 2, 4, ExchangeOptions::for_version(22809)).unwrap_err();
    assert!(e.to_string().contains("rank 2 is out of range"), "{e}");
    let e = counts_plan(
        &[i32::MAX; 4],
        2,
        0,
        usize::MAX / 2,
        ExchangeOptions::for_version(22809),
    )
    .unwrap_err();
    assert!(e.to_string().contains("overflows"), "{e}");
}

#[test]
fn capacity_layout() {
    let l = CapacityLayout::new(4, 3, 10).unwrap();
    // [16-byte header][3 × 10 rows] = 46 → 48 bytes per slab.
    assert_eq!((l.header_bytes, l.slab_bytes, l.total_bytes), (16, 48, 192));
    assert_eq!(l.slab_offset(2), 96);
    assert_eq!(l.count_offset(2), 96);
    assert_eq!(l.row_offset(2, 1), 96 + 16 + 10);
    for peer in 0..4 {
        assert_eq!(l.slab_offset(peer) % 16, 0);
        assert_eq!(l.row_offset(peer, 0) % 16, 0);
        assert!(l.row_offset(peer, 2) + 10 <= l.slab_offset(peer) + l.slab_bytes);
    }
    l.check_counts(1, &[0, 3, 1, 2]).unwrap();
    let e = l.check_counts(1, &[0, 4, 1, 2]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "capacity mode: rank 1 sends 4 rows to rank 1, outside the capacity of 0..=3 rows per peer (max_tokens_per_rank)"
    );
    assert!(l.check_counts(1, &[0, 1]).is_err());

    // Static plan: every peer a whole slab, self by a local copy.
    let p = l.plan(1, false).unwrap();
    assert_eq!(p.sends.len(), 3);
    assert!(p
        .sends
        .iter()
        .chain(&p.recvs)
        .all(|t| t.bytes == 48 && t.offset == 48 * t.peer && t.peer != 1));
    assert_eq!(
        p.local,
        Some(LocalCopy {
            send_offset: 48,
            recv_offset: 48,
            bytes: 48
        })
    );
    let p = l.plan(1, true).unwrap();
    assert_eq!(p.sends.len(), 4);
    assert!(p.local.is_none());
    assert!(CapacityLayout::new(0, 1, 1).is_err());
}

// ---- one-sided workspace ------------------------------------------------------------------

#[test]
fn workspace_layout_is_aligned_and_disjoint() {
    for (world, cap, row, meta) in [(1, 1, 1, 0), (2, 128, 7168 * 2, 24), (8, 33, 100, 12)] {
        let l = WorkspaceLayout::new(world, cap, row, meta).unwrap();
        assert_eq!(l.row_stride % ROW_ALIGN, 0);
        assert!(l.row_stride >= row && l.row_stride < row + ROW_ALIGN);
        for off in [
            l.data_offset,
            l.meta_offset,
            l.counts_offset,
            l.flags_offset,
            l.error_offset,
            l.total_bytes,
        ] {
            assert_eq!(off % REGION_ALIGN, 0, "{l:?}");
        }
        assert!(l.meta_offset >= l.row_offset(world - 1, cap - 1) + row);
        assert!(l.counts_offset >= l.meta_offset_of(world - 1, cap - 1) + meta);
        assert!(l.flags_offset >= l.count_offset(world - 1) + 4);
        assert!(l.error_offset >= l.flag_offset(world - 1) + 4);
        assert!(l.total_bytes >= l.error_offset + 16);
        for src in 0..world {
            assert_eq!(l.row_offset(src, 0) % REGION_ALIGN, 0);
            assert_eq!(l.row_offset(src, cap - 1) % ROW_ALIGN, 0);
            assert!(l.row_offset(src, cap - 1) + row <= l.row_offset(src, 0) + l.slab_bytes);
        }
        let a = l.allocation_bytes(2 << 20).unwrap();
        assert!(a >= l.total_bytes && a.is_multiple_of(2 << 20));
    }
    let l = WorkspaceLayout::new(2, 2, 10, 0).unwrap();
    // Slab: 2 rows of 16 → 32 → 128; counts at 256, flags at 384, error at 512, total 640.
    assert_eq!(
        (
            l.slab_bytes,
            l.counts_offset,
            l.flags_offset,
            l.error_offset,
            l.total_bytes
        ),
        (128, 256, 384, 512, 640)
    );
    assert_eq!(l.row_offset(1, 1), 128 + 16);
    assert_eq!(l.flag_offset(1), 388);
    assert!(l.allocation_bytes(3).is_err());
    assert!(WorkspaceLayout::new(0, 1, 1, 0).is_err());
    assert!(WorkspaceLayout::new(2, usize::MAX / 4, 64, 0).is_err());
}

#[test]
fn epochs_skip_zero_and_compare_across_wraparound() {
    assert_eq!(Epoch(0).next(), Epoch(1));
    assert_eq!(Epoch(41).next(), Epoch(42));
    assert_eq!(Epoch(u32::MAX).next(), Epoch(1));
    let mut e = Epoch(u32::MAX - 1);
    assert_eq!(e.advance(), Epoch(u32::MAX));
    assert_eq!(e.advance(), Epoch(1));
    assert_eq!(e, Epoch(1));

    assert!(epoch_reached(5, 5));
    assert!(epoch_reached(6, 5));
    assert!(!epoch_reached(4, 5));
    // A zeroed (never signalled) flag never counts, whatever the wanted epoch.
    for want in [1, 2, 0x7fff_ffff, 0x8000_0001, u32::MAX] {
        assert!(!epoch_reached(0, want), "{want}");
    }
    // Across the wrap: 1 and 2 come after u32::MAX.
    assert!(epoch_reached(1, u32::MAX));
    assert!(epoch_reached(2, u32::MAX - 1));
    assert!(!epoch_reached(u32::MAX, 1));
    // Walk a flag through the wrap: each epoch is reached by itself and the next, not before.
    let mut ep = Epoch(u32::MAX - 3);
    for _ in 0..8 {
        let prev = ep;
        let cur = ep.advance();
        assert!(epoch_reached(cur.0, cur.0));
        assert!(epoch_reached(cur.0, prev.0));
        assert!(!epoch_reached(prev.0, cur.0) || prev.0 == 0);
    }
}

/// `check` of an error word on rank 2 at epoch 17: (status, message).
fn check_word(w: u64) -> Option<(Status, String)> {
    ErrorWord(w)
        .check(2, Epoch(17))
        .err()
        .map(|e| (e.status(), e.to_string()))
}

#[test]
fn device_error_words() {
    assert_eq!(ERROR_WORD_BYTES, 8);
    assert_eq!(check_word(0), None);
    assert_eq!(ErrorWord::default().decode(), None);
    // A timeout on peer 0 is an error naming rank 0 (a four-word decoding once read the
    // kernel's word for peer 0 as "no error"); every peer index survives.
    for peer in [0u32, 1, 3, 4095, u32::MAX] {
        let w = encode_error_word(ERR_WAIT_TIMEOUT, peer, 0);
        assert_eq!(
            ErrorWord(w).decode(),
            Some(DeviceError::WaitTimeout { peer })
        );
        assert_eq!(
            check_word(w),
            Some((
                Status::Timeout,
                format!("one-sided transport: rank 2 timed out waiting for rank {peer} (epoch 17); the peer is slow, stuck or gone")
            ))
        );
    }
    let at = "one-sided transport: rank 2, epoch 17";
    let cases = [
        (
            encode_error_word(ERR_RANK_CAPACITY, 1, 400),
            Status::InvalidArgument,
            "one-sided transport: rank 1 sent 400 rows to rank 2 (epoch 17), more than the workspace capacity".to_string(),
        ),
        (
            encode_error_word(ERR_ID_OUT_OF_RANGE, 5, 1),
            Status::InvalidArgument,
            format!("{at}: topk_ids[5][1] is out of range: expected -1 (masked) or an expert id in [0, num_experts)"),
        ),
        (
            encode_error_word(ERR_DUPLICATE_ID, 0, 3),
            Status::InvalidArgument,
            format!("{at}: topk_ids[0] routes token 0 to one expert twice (entry 3 repeats an earlier one): the top-k experts of a token must be distinct"),
        ),
        (
            encode_error_word(ERR_CAPACITY, 9, 2),
            Status::InvalidArgument,
            format!("{at}: expert bucket 2 is full: received row 9 does not fit (more tokens than max_tokens_per_rank * world_size)"),
        ),
        (
            encode_error_word(ERR_HOST_REJECTED, 0, 0),
            Status::InvalidArgument,
            format!("{at}: its input failed the host-side checks (sizes, shapes, dtypes or alignment)"),
        ),
        (
            encode_error_word(7, 1, 2),
            Status::Internal,
            format!("{at}: unknown device error code 7 (a=1, b=2)"),
        ),
        (
            encode_error_word(255, 0, 0),
            Status::Internal,
            format!("{at}: unknown device error code 255 (a=0, b=0)"),
        ),
    ];
    for (w, status, msg) in cases {
        assert_eq!(check_word(w), Some((status, msg)), "{w:#018x}");
    }
    // The bytes read back from the workspace are the native-endian u64.
    let w = encode_error_word(ERR_WAIT_TIMEOUT, 0, 0);
    assert_eq!(ErrorWord::from_bytes(&w.to_ne_bytes()), ErrorWord(w));
    assert_eq!(ErrorWord::from_bytes(&[0; ERROR_WORD_BYTES]), ErrorWord(0));
}

/// Host stand-ins for signal.cu's inline-PTX helpers; the rest of signal.cu (from its
/// "portable part" marker) is the real source. Virtual time: each `%globaltimer` read advances
/// 100 ns, so a wait gives up after `timeout_ns / 100` polls, deterministically.
const SIGNAL_EMU_MAIN: &str = r##"#include "emu_prelude.h"
#include "prelude_tail.h"
static u64 emu_clock = 0;
static inline void ep_st_release_sys(u32* p, u32 v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline u32 ep_ld_acquire_sys(const u32* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void ep_fence_acq_rel_sys() { __atomic_thread_fence(__ATOMIC_ACQ_REL); }
static inline u64 ep_globaltimer() { return emu_clock += 100; }
static inline void ep_nanosleep() {}
#include "signal_portable.cu"
static const u32 S[] = {0u, 1u, 2u, 0x7fffffffu, 0x80000000u, 0x80000001u, 0xfffffffeu, 0xffffffffu};
// Runs ep_wait for R = 4 peers whose flags are f at epoch e; prints the error word.
static void wait(const char* name, u32 e, u32 f0, u32 f1, u32 f2, u32 f3) {
    u32 flags[4] = {f0, f1, f2, f3}; u64 err = 0;
    emu_seq(1, 32, [&] { ep_wait(flags, 4, &e, 1000, &err); });
    printf("wait %s %llu\n", name, (unsigned long long)err);
}
int main() {
    for (u32 e : S) { u32 ep = e; emu_seq(1, 32, [&] { ep_epoch_bump(&ep); }); printf("next %u %u\n", e, ep); }
    for (u32 f : S) for (u32 w : S) printf("reached %u %u %d\n", f, w, (int)ep_epoch_reached(f, w));
    wait("all_signalled", 5, 5, 5, 6, 5);
    // Zeroed flags at an epoch past 2^31: a plain serial compare would take 0 as "reached".
    wait("never_signalled_high_epoch", 0xffffffffu, 0, 0, 0, 0);
    wait("never_signalled_mid_epoch", 0x80000001u, 0, 0, 0, 0);
    // Bumped across the wrap: 0xffffffff -> 1; a peer still at 0 (never signalled) is waited for.
    u32 wrapped = 0xffffffffu; emu_seq(1, 1, [&] { ep_epoch_bump(&wrapped); });
    wait("after_wrap", wrapped, 1, 1, 0, 1);
    wait("stale_peer_3", 9, 9, 10, 9, 8);
    wait("stale_peers_0_and_2", 9, 8, 9, 8, 9);
    // ep_signal stores the epoch into each peer's slot (0 = skip).
    u32 slots[3] = {0, 0, 0}; u32 ep = 42;
    u64 peers[3] = {(u64)&slots[0], 0ull, (u64)&slots[2]};
    emu_seq(1, 32, [&] { ep_signal(peers, 3, &ep); });
    printf("signal %u %u %u\n", slots[0], slots[1], slots[2]);
    return 0;
}
"##;

#[test]
fn signal_kernels_agree_with_the_host_on_the_host() {
    let Some(cxx) = common::cuda_emu::cxx_or_skip("signal_kernels_agree_with_the_host_on_the_host")
    else {
        return;
    };
    let marker = "// ---- portable part";
    let portable = kernels::SIGNAL_CU
        .split_once(marker)
        .map(|(_, rest)| format!("{marker}{rest}"))
        .expect("signal.cu marks its portable part");
    let dir = common::cuda_emu::temp_dir("signal-emu");
    common::cuda_emu::write_sources(
        &dir,
        &[
            ("signal_portable.cu", &portable),
            ("main.cpp", SIGNAL_EMU_MAIN),
        ],
    );
    let (ok, stdout) = common::cuda_emu::build_and_run(&cxx, &dir, &[], "signal");
    assert!(ok, "{stdout}");
    let mut waits = std::collections::HashMap::new();
    let mut counts = [0; 3];
    for line in stdout.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let n = |i: usize| f[i].parse::<u64>().expect("number");
        match f[0] {
            "next" => {
                assert_eq!(Epoch(n(1) as u32).next(), Epoch(n(2) as u32), "{line}");
                counts[0] += 1;
            }
            "reached" => {
                assert_eq!(epoch_reached(n(1) as u32, n(2) as u32), n(3) == 1, "{line}");
                counts[1] += 1;
            }
            "wait" => {
                waits.insert(f[1].to_string(), n(2));
            }
            "signal" => {
                assert_eq!(&f[1..], ["42", "0", "42"], "{line}");
                counts[2] += 1;
            }
            other => panic!("unexpected line {other:?}"),
        }
    }
    assert_eq!(counts, [8, 64, 1], "{stdout}");
    let timeout = |peer| encode_error_word(ERR_WAIT_TIMEOUT, peer, 0);
    let want = [
        ("all_signalled", 0),
        ("never_signalled_high_epoch", timeout(0)),
        ("never_signalled_mid_epoch", timeout(0)),
        ("after_wrap", timeout(2)),
        ("stale_peer_3", timeout(3)),
        ("stale_peers_0_and_2", timeout(0)),
    ];
    for (name, word) in want {
        assert_eq!(waits.get(name), Some(&word), "{name}:\n{stdout}");
    }
    assert_eq!(waits.len(), want.len());
    // What the host makes of the kernel's word: the peer that never signalled, peer 0 included.
    let e = ErrorWord(waits["never_signalled_high_epoch"])
        .check(1, Epoch(u32::MAX))
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "one-sided transport: rank 1 timed out waiting for rank 0 (epoch 4294967295); the peer is slow, stuck or gone"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn peer_table() {
    let mut t = PeerTable::new(1, 3).unwrap();
    let entry = |base, source| PeerEntry {
        base,
        bytes: 4096,
        source,
    };
    let e = t.bases(1).unwrap_err();
    assert_eq!(
        e.to_string(),
        "peer table: rank 0's workspace is not mapped on rank 1"
    );
    t.set(1, entry(0x2000, PeerSource::Local)).unwrap();
    assert!(t.set(0, entry(0x1000, PeerSource::Local)).is_err());
    assert!(t.set(2, entry(0, PeerSource::VmmFd)).is_err());
    assert!(t.set(3, entry(0x1000, PeerSource::VmmFd)).is_err());
    t.set(0, entry(0x1000, PeerSource::LegacyIpc)).unwrap();
    t.set(2, entry(0x3000, PeerSource::VmmFd)).unwrap();
    assert_eq!(
        t.set(2, entry(0x3000, PeerSource::VmmFd))
            .unwrap_err()
            .status(),
        Status::InvalidState
    );
    assert_eq!(t.bases(4096).unwrap(), vec![0x1000, 0x2000, 0x3000]);
    assert!(t
        .bases(4097)
        .unwrap_err()
        .to_string()
        .contains("rank 0's workspace has 4096 bytes"));
    assert_eq!(t.get(2).unwrap().source.name(), "vmm_fd");
    assert!(PeerTable::new(3, 3).is_err());
}

// ---- fd passing ---------------------------------------------------------------------------

fn memfd(name: &str) -> File {
    let c = std::ffi::CString::new(name).unwrap();
    // SAFETY: a valid C string; memfd_create returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(c.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh fd owned by nobody else.
    File::from(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The whole file from offset 0 with `pread`: fds passed with SCM_RIGHTS share one open file
/// description (one offset) with the sender's, and thread-ranks read the same memfd at once, so
/// seek + read raced (another thread's read moved the shared offset to the end: "").
fn read_all(f: &mut File) -> String {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; f.metadata().unwrap().len() as usize];
    f.read_exact_at(&mut buf, 0).unwrap();
    String::from_utf8(buf).unwrap()
}

#[test]
fn scm_rights_over_a_socket_pair() {
    let (a, b) = socket_pair().unwrap();
    let mut m1 = memfd("epcomm-test-1");
    let m2 = memfd("epcomm-test-2");
    m1.write_all(b"first").unwrap();
    send_with_fds(a.as_fd(), b"two fds", &[m1.as_fd(), m2.as_fd()]).unwrap();
    let mut buf = [0u8; 64];
    let r = recv_with_fds(b.as_fd(), &mut buf, Some(Duration::from_secs(5))).unwrap();
    assert_eq!(&buf[..r.len], b"two fds");
    assert_eq!(r.fds.len(), 2);
    let mut fds = r.fds.into_iter();
    // Same open file: what one side wrote the other reads, both ways.
    let mut got1 = File::from(fds.next().unwrap());
    assert_eq!(read_all(&mut got1), "first");
    got1.write_all(b" and more").unwrap();
    assert_eq!(read_all(&mut m1), "first and more");
    let mut got2 = File::from(fds.next().unwrap());
    got2.write_all(b"second").unwrap();
    let mut m2 = m2;
    assert_eq!(read_all(&mut m2), "second");

    // A message without fds; then the bounded wait and the closed peer.
    send_with_fds(b.as_fd(), b"x", &[]).unwrap();
    let r = recv_with_fds(a.as_fd(), &mut buf, None).unwrap();
    assert_eq!((r.len, r.fds.len()), (1, 0));
    let t0 = Instant::now();
    let e = recv_with_fds(a.as_fd(), &mut buf, Some(Duration::from_millis(100))).unwrap_err();
    assert_eq!(e.status(), Status::Timeout);
    assert!(t0.elapsed() < Duration::from_secs(5));
    drop(b);
    let e = recv_with_fds(a.as_fd(), &mut buf, Some(Duration::from_secs(5))).unwrap_err();
    assert_eq!(e.status(), Status::PeerFailure);
    assert!(send_with_fds(a.as_fd(), b"", &[]).is_err());
}

#[test]
fn oversized_message_is_an_error_and_fds_are_closed() {
    let (a, b) = socket_pair().unwrap();
    let m = memfd("epcomm-test-trunc");
    send_with_fds(a.as_fd(), &[7u8; 100], &[m.as_fd()]).unwrap();
    let mut small = [0u8; 10];
    let e = recv_with_fds(b.as_fd(), &mut small, Some(Duration::from_secs(5))).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
}

fn group_name(tag: &str) -> String {
    format!("gpuhost-{tag}-{}", std::process::id())
}

/// Ranks as threads: each passes a memfd holding its rank; every rank reads every peer's.
#[test]
fn rendezvous_all_gathers_fds_between_threads() {
    let world = 4;
    let group = group_name("threads");
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let group = group.clone();
            std::thread::spawn(move || {
                let mut f = memfd("rank");
                write!(f, "rank {rank}").unwrap();
                let payload = (rank as u64 * 1000).to_le_bytes();
                let got = exchange_fds(
                    &group,
                    rank,
                    world,
                    Some(f.as_fd()),
                    &payload,
                    Duration::from_secs(20),
                )
                .unwrap();
                assert_eq!(got.len(), world);
                for (
                    r,
                    PeerFd {
                        rank: pr,
                        fd,
                        payload,
                    },
                ) in got.into_iter().enumerate()
                {
                    assert_eq!(pr, r);
                    assert_eq!(payload, (r as u64 * 1000).to_le_bytes());
                    if r == rank {
                        assert!(fd.is_none());
                    } else {
                        let mut peer = File::from(fd.unwrap());
                        assert_eq!(read_all(&mut peer), format!("rank {r}"));
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn rendezvous_names_the_missing_rank() {
    let group = group_name("missing");
    let g1 = group.clone();
    let joiner = std::thread::spawn(move || {
        exchange_fds(&g1, 1, 3, None, b"", Duration::from_secs(20)).unwrap_err()
    });
    let t0 = Instant::now();
    let e = exchange_fds(&group, 0, 3, None, b"", Duration::from_secs(2)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert_eq!(e.status(), Status::Timeout);
    assert!(e.to_string().contains("rank(s) 2 did not join"), "{e}");
    // Rank 1 had joined: it hears the same reason from rank 0 at once, not after its timeout.
    let e1 = joiner.join().unwrap();
    assert_eq!(e1.status(), Status::PeerFailure);
    assert!(e1.to_string().contains("rank(s) 2 did not join"), "{e1}");

    // Nobody listening: a non-zero rank gives up in time and names rank 0.
    let e = exchange_fds(
        &group_name("norank0"),
        2,
        3,
        None,
        b"",
        Duration::from_millis(200),
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::Timeout);
    assert!(
        e.to_string().contains("rank 2 could not reach rank 0"),
        "{e}"
    );
}

#[test]
fn rendezvous_rejects_a_world_size_mismatch() {
    let group = group_name("mismatch");
    let g1 = group.clone();
    let joiner = std::thread::spawn(move || {
        exchange_fds(&g1, 1, 3, None, b"", Duration::from_secs(20)).unwrap_err()
    });
    let e = exchange_fds(&group, 0, 2, None, b"", Duration::from_secs(20)).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("fd rendezvous of group '{group}': rank 1 joined with world size 3, rank 0 has 2")
    );
    let e1 = joiner.join().unwrap();
    assert!(e1.to_string().contains("world size 3"), "{e1}");
    // world 1 needs nobody.
    let one = exchange_fds(&group, 0, 1, None, b"p", Duration::from_millis(1)).unwrap();
    assert_eq!(one.len(), 1);
    assert!(exchange_fds(&group, 1, 1, None, b"", Duration::from_millis(1)).is_err());
}

const CHILD_ENV: &str = "EPCOMM_TEST_FD_CHILD_GROUP";

/// Rank 1 in a child process (spawned by `rendezvous_with_a_child_process`); a no-op otherwise.
#[test]
fn fd_child_process_helper() {
    let Ok(group) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut mine = memfd("child");
    mine.write_all(b"written by the child").unwrap();
    let got = exchange_fds(
        &group,
        1,
        2,
        Some(mine.as_fd()),
        b"child",
        Duration::from_secs(20),
    )
    .unwrap();
    assert_eq!(got[0].payload, b"parent");
    let mut parent = File::from(got.into_iter().next().unwrap().fd.unwrap());
    assert_eq!(read_all(&mut parent), "written by the parent");
    // Answer through the parent's own file, so the parent sees it was really shared.
    parent.write_all(b" + child").unwrap();
}

#[test]
fn rendezvous_with_a_child_process() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let group = group_name("child");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "fd_child_process_helper",
            "--exact",
            "--test-threads=1",
            "--quiet",
        ])
        .env(CHILD_ENV, &group)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut mine = memfd("parent");
    mine.write_all(b"written by the parent").unwrap();
    let got = exchange_fds(
        &group,
        0,
        2,
        Some(mine.as_fd()),
        b"parent",
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(got[1].payload, b"child");
    let mut theirs = File::from(got.into_iter().nth(1).unwrap().fd.unwrap());
    assert_eq!(read_all(&mut theirs), "written by the child");
    let status = child.wait().unwrap();
    assert!(status.success(), "child failed: {status}");
    assert_eq!(read_all(&mut mine), "written by the parent + child");
}

// ---- capabilities and loaders without CUDA / NCCL -------------------------------------------

fn nccl_not_found() -> String {
    match std::env::var("VLLM_NCCL_SO_PATH") {
        Ok(p) if !p.is_empty() => format!("NCCL not found (tried {p}, libnccl.so.2, libnccl.so)"),
        _ => "NCCL not found (tried libnccl.so.2, libnccl.so)".to_owned(),
    }
}

#[test]
fn caps_json_reports_what_is_missing() {
    let c = caps::probe();
    let j = c.to_json();
    assert_eq!(j["features"]["cuda"], cfg!(feature = "cuda"));
    assert_eq!(j["features"]["nccl"], cfg!(feature = "nccl"));
    match epcomm::probe::cuda() {
        Err(why) => {
            assert_eq!(j["cuda"]["available"], false);
            assert_eq!(j["cuda"]["reason"], why.as_str());
            if !cfg!(feature = "cuda") {
                assert_eq!(
                    j["cuda"]["reason"],
                    "epcomm was built without the 'cuda' feature"
                );
            }
        }
        Ok(_) => {
            // A driver is present: either usable (devices listed) or a reason why not.
            if j["cuda"]["available"] == true {
                assert!(j["cuda"]["devices"].is_array());
            } else {
                assert!(j["cuda"]["reason"].is_string());
            }
        }
    }
    if epcomm::probe::nccl().is_err() {
        assert_eq!(j["nccl"]["available"], false);
        assert_eq!(j["nccl"]["reason"], nccl_not_found().as_str());
    } else {
        assert_eq!(j["nccl"]["available"], true);
        assert!(j["nccl"]["version_code"].as_i64().unwrap() > 20000);
    }
    assert!(j["nvrtc"]["available"].is_boolean());
    if j["nvrtc"]["available"] == false {
        assert!(
            j["nvrtc"]["reason"]
                .as_str()
                .unwrap()
                .starts_with("NVRTC not found")
                || j["nvrtc"]["reason"]
                    .as_str()
                    .unwrap()
                    .starts_with("NVRTC does not match the CUDA driver")
                || j["nvrtc"]["reason"]
                    .as_str()
                    .unwrap()
                    .contains("nvrtcVersion")
        );
    }
    if j["nvrtc"]["available"] == true {
        // Which NVRTC for which driver, and why.
        let choice = &j["nvrtc"]["choice"];
        println!("nvrtc: {}", j["nvrtc"]);
        let names: Vec<&str> = choice["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert!(
            names.contains(&j["nvrtc"]["path"].as_str().unwrap()),
            "{choice}"
        );
        let reason = choice["reason"].as_str().unwrap();
        if cfg!(feature = "cuda") && j["cuda"]["available"] == true {
            assert_eq!(
                choice["driver_version_code"],
                j["cuda"]["driver_version_code"]
            );
            assert!(reason.starts_with("the CUDA "), "{reason}");
        } else {
            assert!(choice["driver_version_code"].is_null(), "{choice}");
            assert!(choice["driver_unknown"].is_string(), "{choice}");
            assert!(
                reason.starts_with("the CUDA driver version is unknown: "),
                "{reason}"
            );
        }
        if !cfg!(feature = "cuda") {
            assert_eq!(
                choice["driver_unknown"],
                "epcomm was built without the 'cuda' feature"
            );
        }
    }
    // The string form is the same JSON.
    let back: serde_json::Value = serde_json::from_str(&c.to_json_string()).unwrap();
    assert_eq!(back, j);
}

#[test]
fn nccl_loader_reports_unavailable_without_nccl() {
    if epcomm::probe::nccl().is_ok() {
        let api = nccl::api().unwrap();
        assert!(api.version > 20000);
        assert!(!api.error_string(1).is_empty());
        return;
    }
    let expect = format!("NCCL is unavailable: {}", nccl_not_found());
    let e = nccl::api().unwrap_err();
    assert_eq!(e.status(), Status::Unavailable);
    assert_eq!(e.to_string(), expect);
    assert_eq!(nccl::unique_id().unwrap_err().to_string(), expect);
    let id = NcclUniqueId::from_bytes(&[0u8; 128]).unwrap();
    assert_eq!(
        NcclComm::init_rank(&id, 0, 1).unwrap_err().to_string(),
        expect
    );
    // SAFETY: a NULL communicator is rejected before use.
    let e = unsafe { NcclComm::adopt(std::ptr::null_mut()) }.unwrap_err();
    assert_eq!(e, Error::NullPointer("nccl_comm"));
}

#[test]
fn nccl_unique_id_bytes() {
    let mut b = [0u8; 128];
    b[0] = 7;
    b[127] = 9;
    let id = NcclUniqueId::from_bytes(&b).unwrap();
    assert_eq!(id.as_bytes(), &b);
    let e = NcclUniqueId::from_bytes(&b[..100]).unwrap_err();
    assert_eq!(e.to_string(), "an NCCL unique id has 128 bytes, got 100");
    assert_eq!(std::mem::size_of::<NcclUniqueId>(), 128);
}

#[cfg(feature = "cuda")]
#[test]
fn driver_reports_unavailable_without_cuda() {
    use epcomm::gpu::driver;
    if epcomm::probe::cuda().is_ok() {
        return;
    }
    for e in [
        driver::init().unwrap_err(),
        driver::device_count().unwrap_err(),
        driver::driver_version().unwrap_err(),
        driver::Device::get(0).unwrap_err(),
        driver::Module::load(b".version 8.0").unwrap_err(),
        driver::DeviceMemory::alloc(16).unwrap_err(),
        driver::VaRange::reserve(1 << 21, 0).unwrap_err(),
    ] {
        assert_eq!(e.status(), Status::Unavailable, "{e}");
        assert!(e.to_string().starts_with("CUDA is unavailable: "), "{e}");
    }
    // SAFETY: a NULL stream is the legacy default stream; no call reaches the driver.
    let s = unsafe { driver::Stream::borrowed(std::ptr::null_mut()) };
    assert_eq!(
        s.ensure_not_capturing().unwrap_err().status(),
        Status::Unavailable
    );
}

// ---- the NCCL loader against a fake libnccl (compiled here with cc) ---------------------------

/// A stand-in for libnccl.so.2: every symbol the loader resolves, logging the calls.
const FAKE_NCCL_C: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef struct { char internal[128]; } ncclUniqueId;
static char logbuf[65536];
static size_t loglen;
static void logs(const char *s) {
    size_t n = strlen(s);
    if (loglen + n < sizeof logbuf) { memcpy(logbuf + loglen, s, n); loglen += n; logbuf[loglen] = 0; }
}
const char *fake_nccl_log(void) { return logbuf; }
static int fail_peer(void) { const char *e = getenv("FAKE_FAIL_PEER"); return e ? atoi(e) : -1; }
int ncclGetVersion(int *v) { *v = 21100; return 0; }
int ncclGetUniqueId(ncclUniqueId *id) { memset(id, 0, sizeof *id); id->internal[0] = 42; return 0; }
static int comm_state[2];
int ncclCommInitRank(void **comm, int n, ncclUniqueId id, int rank) {
    char b[64];
    if (id.internal[0] != 42) return 4;
    comm_state[0] = n; comm_state[1] = rank; *comm = comm_state;
    snprintf(b, sizeof b, "init %d %d;", n, rank); logs(b);
    return 0;
}
int ncclCommDestroy(void *c) { (void)c; logs("destroy;"); return 0; }
int ncclCommAbort(void *c) { (void)c; logs("abort;"); return 0; }
int ncclCommGetAsyncError(void *c, int *e) { (void)c; *e = getenv("FAKE_ASYNC") ? 6 : 0; return 0; }
int ncclCommCount(void *c, int *n) { *n = ((int *)c)[0]; return 0; }
int ncclCommUserRank(void *c, int *r) { *r = ((int *)c)[1]; return 0; }
int ncclAllGather(const void *s, void *r, size_t n, int dt, void *c, void *st) {
    char b[96]; (void)c; (void)st;
    snprintf(b, sizeof b, "allgather %zu %zu %zu %d;", (size_t)s, (size_t)r, n, dt); logs(b);
    return 0;
}
int ncclSend(const void *p, size_t n, int dt, int peer, void *c, void *st) {
    char b[96]; (void)c; (void)st;
    if (peer == fail_peer()) return 4;
    snprintf(b, sizeof b, "send %d %zu %zu %d;", peer, (size_t)p, n, dt); logs(b);
    return 0;
}
int ncclRecv(void *p, size_t n, int dt, int peer, void *c, void *st) {
    char b[96]; (void)c; (void)st;
    snprintf(b, sizeof b, "recv %d %zu %zu %d;", peer, (size_t)p, n, dt); logs(b);
    return 0;
}
int ncclGroupStart(void) { logs("gs;"); return 0; }
int ncclGroupEnd(void) { logs("ge;"); return 0; }
const char *ncclGetErrorString(int r) {
    switch (r) {
    case 0: return "no error";
    case 4: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case 6: return "remote process exited or there was a network error";
    default: return "unhandled error";
    }
}
const char *ncclGetLastError(void *c) { (void)c; return "fake last error"; }
"#;

const FAKE_NCCL_ENV: &str = "EPCOMM_TEST_FAKE_NCCL";

fn fake_log(path: &str) -> String {
    let c = std::ffi::CString::new(path).unwrap();
    // SAFETY: the fake library is already loaded (RTLD_NOLOAD) and exports
    // `const char *fake_nccl_log(void)`.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY);
        assert!(!h.is_null());
        let f = libc::dlsym(h, c"fake_nccl_log".as_ptr());
        assert!(!f.is_null());
        let f: extern "C" fn() -> *const libc::c_char = std::mem::transmute(f);
        std::ffi::CStr::from_ptr(f()).to_string_lossy().into_owned()
    }
}

/// Runs in a child process with `VLLM_NCCL_SO_PATH` = the fake (the loader is per process).
#[test]
fn fake_nccl_child() {
    let Ok(path) = std::env::var(FAKE_NCCL_ENV) else {
        return;
    };
    let api = nccl::api().unwrap();
    assert_eq!(api.version, 21100);
    assert_eq!(api.lib.name, path);
    assert_eq!(
        api.error_string(6),
        "remote process exited or there was a network error"
    );

    let j = caps::probe().to_json();
    assert_eq!(j["nccl"]["available"], true);
    assert_eq!(j["nccl"]["version"], "2.11.0");
    assert_eq!(j["nccl"]["version_code"], 21100);
    assert_eq!(j["nccl"]["zero_size_p2p"], false);
    assert_eq!(j["nccl"]["path"], path.as_str());

    let id = nccl::unique_id().unwrap();
    assert_eq!(id.as_bytes()[0], 42);
    let comm = NcclComm::init_rank(&id, 1, 3).unwrap();
    assert_eq!((comm.rank(), comm.world(), comm.is_owned()), (1, 3, true));
    let e = NcclComm::init_rank(&NcclUniqueId::from_bytes(&[0; 128]).unwrap(), 0, 3).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert_eq!(
        e.to_string(),
        "NCCL error in ncclCommInitRank: invalid argument (run with NCCL_DEBUG=WARN for details) (ncclResult_t 4): fake last error"
    );

    // NCCL 2.11: zero sizes skipped. Rank 1 of M3 sends [1, 4, 0] and receives [0, 4, 5].
    let plan = counts_plan(&M3, 3, 1, 10, ExchangeOptions::for_version(api.version)).unwrap();
    let before = fake_log(&path);
    // SAFETY: the fake never dereferences the addresses.
    unsafe { comm.exchange(&plan, 0x1000, 0x8000, std::ptr::null_mut()) }.unwrap();
    let log = fake_log(&path);
    assert_eq!(
        &log[before.len()..],
        format!("gs;send 0 {} 10 1;recv 2 {} 50 1;ge;", 0x1000, 0x8000 + 40)
    );
    // SAFETY: as above.
    unsafe {
        comm.all_gather(
            8 as *const _,
            16 as *mut _,
            3,
            nccl::NcclDataType::Int32,
            std::ptr::null_mut(),
        )
    }
    .unwrap();
    assert!(fake_log(&path).ends_with("allgather 8 16 3 2;"));

    // A failing send inside the group: the error names the peer and the group is still closed.
    std::env::set_var("FAKE_FAIL_PEER", "0");
    let before = fake_log(&path);
    // SAFETY: as above.
    let e = unsafe { comm.exchange(&plan, 0x1000, 0x8000, std::ptr::null_mut()) }.unwrap_err();
    std::env::remove_var("FAKE_FAIL_PEER");
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(
        e.to_string()
            .starts_with("NCCL error in ncclSend to rank 0: invalid argument"),
        "{e}"
    );
    assert!(fake_log(&path)[before.len()..].ends_with("ge;"));
    // A plan for another rank is refused before any call.
    let other = counts_plan(&M3, 3, 0, 10, ExchangeOptions::for_version(api.version)).unwrap();
    // SAFETY: as above.
    assert!(unsafe { comm.exchange(&other, 0, 0, std::ptr::null_mut()) }.is_err());

    comm.async_error().unwrap();
    std::env::set_var("FAKE_ASYNC", "1");
    let e = comm.async_error().unwrap_err();
    std::env::remove_var("FAKE_ASYNC");
    assert_eq!(e.status(), Status::PeerFailure);
    assert_eq!(
        e.to_string(),
        "NCCL error in an asynchronous NCCL operation: remote process exited or there was a network error (ncclResult_t 6): fake last error"
    );

    // Borrowed: never destroyed or aborted by epcomm.
    // SAFETY: `comm` outlives `borrowed` and came from the same library.
    let borrowed = unsafe { NcclComm::adopt(comm.raw()) }.unwrap();
    assert_eq!(
        (borrowed.rank(), borrowed.world(), borrowed.is_owned()),
        (1, 3, false)
    );
    assert_eq!(borrowed.abort().unwrap_err().status(), Status::InvalidState);
    let before = fake_log(&path);
    // SAFETY: as above.
    drop(unsafe { NcclComm::adopt(comm.raw()) }.unwrap());
    assert_eq!(fake_log(&path), before);
    // Owned: destroyed on drop, or aborted (and then not destroyed).
    drop(comm);
    assert!(fake_log(&path).ends_with("destroy;"));
    let comm = NcclComm::init_rank(&id, 0, 1).unwrap();
    comm.abort().unwrap();
    assert!(fake_log(&path).ends_with("init 1 0;abort;"));
}

#[test]
fn nccl_loader_with_a_fake_libnccl() {
    if std::env::var(FAKE_NCCL_ENV).is_ok() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("epcomm-fake-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("fake_nccl.c");
    let lib = dir.join("libnccl-fake.so.2");
    std::fs::write(&src, FAKE_NCCL_C).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O0", "-o"])
        .arg(&lib)
        .arg(&src)
        .status();
    match built {
        Ok(s) if s.success() => {}
        other => {
            let why = match other {
                Ok(s) => format!("it exited with {s}"),
                Err(e) => e.to_string(),
            };
            common::skip::skipped(
                "nccl_loader_with_a_fake_libnccl",
                &format!("cannot build the fake libnccl with {cc} ({why}); install gcc or set $CC"),
            );
            return;
        }
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "fake_nccl_child",
            "--exact",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(FAKE_NCCL_ENV, &lib)
        .env("VLLM_NCCL_SO_PATH", &lib)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "child failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The child really ran the test (not filtered out).
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
}
