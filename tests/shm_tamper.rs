//! A same-user process that writes into a group's shared memory must not crash a member: every
//! word a member reads from a segment is checked, and a bad one is an error naming the rank and
//! the segment. After creation the segments have no name and no open descriptor, so the only
//! way in is a member's own memory: these tests write through `/proc/PID/mem` into the
//! mappings named `memfd:epcomm.GROUP...` while the members run ops.
//!
//! - processes (3 ranks, direct reads and staged): random bytes over rank 1's op header and
//!   metadata, a huge metadata count, random 8-byte writes over the control segment's slots and
//!   data descriptors (all but the decision word): every rank returns an error (no signal death,
//!   no abort), within the timeout;
//! - a rendezvous record overwritten or truncated while the group joins is still removed;
//! - threads (3 ranks of this process, direct reads): a forged address table in rank 1's
//!   segment is never followed (the thread ranks read only the tables their peers recorded in
//!   this process's memory): no SIGSEGV and the data stays right; random bytes over the header
//!   are errors on every rank;
//! - truncation of a segment is refused by the kernel (sealed memfd), so it cannot raise SIGBUS.

mod common;
mod ranks;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use epcomm::group::shm::ShmGroup;
use epcomm::group::{AllToAllv, Group, GroupOptions};
use ranks::{shm_leftovers, wait_all, Finished};

const WORLD: usize = 3;
const CHILD_TEST: &str = "tamper_rank";
/// Every member's timeout.
const TIMEOUT: Duration = Duration::from_secs(2);
/// How long a member does ops at most (it stops at the first error).
const RUN_FOR: Duration = Duration::from_secs(6);

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// One collective step of the members: a barrier, an all_gatherv (meta-less, one buffer) and an
/// all_to_allv (meta words), each checked.
fn step(g: &mut ShmGroup, it: usize) -> epcomm::Result<()> {
    let (me, world) = (g.rank(), g.size());
    g.barrier()?;
    let size = 256 + it % 512;
    let mine = vec![(me + it) as u8; size];
    let mut out = vec![0u8; size * world];
    g.all_gatherv(&mine, &vec![size; world], &mut out)?;
    for r in 0..world {
        assert!(
            out[r * size..(r + 1) * size]
                .iter()
                .all(|&b| b == (r + it) as u8),
            "rank {me}: all_gatherv returned OK with wrong data from rank {r}"
        );
    }
    let send: Vec<u8> = (0..world)
        .flat_map(|r| vec![(me * 16 + r) as u8; 64])
        .collect();
    let mut recv = vec![0u8; 64 * world];
    g.all_to_allv(AllToAllv {
        send: &send,
        send_sizes: &vec![64; world],
        recv: &mut recv,
        recv_sizes: &vec![64; world],
    })?;
    for r in 0..world {
        assert!(
            recv[r * 64..(r + 1) * 64]
                .iter()
                .all(|&b| b == (r * 16 + me) as u8),
            "rank {me}: all_to_allv returned OK with wrong data from rank {r}"
        );
    }
    Ok(())
}

fn opts(direct: bool) -> GroupOptions {
    GroupOptions {
        timeout: TIMEOUT,
        direct_reads: direct,
        ..GroupOptions::default()
    }
}

/// Runs ops until one fails or RUN_FOR passed; the first error, if any.
fn run_ops(g: &mut ShmGroup) -> Option<epcomm::Error> {
    let start = Instant::now();
    let mut it = 0;
    while start.elapsed() < RUN_FOR {
        if let Err(e) = step(g, it) {
            return Some(e);
        }
        it += 1;
    }
    None
}

/// Child side (a rank process): joins, marks itself joined, runs ops, prints the outcome.
#[test]
fn tamper_rank() {
    let Ok(group) = std::env::var("EPCOMM_TA_GROUP") else {
        return;
    };
    let rank: usize = std::env::var("EPCOMM_TA_RANK").unwrap().parse().unwrap();
    let direct = std::env::var("EPCOMM_TA_DIRECT").unwrap() == "1";
    let marker = PathBuf::from(std::env::var("EPCOMM_TA_MARKER").unwrap());
    let mut g = match ShmGroup::join(&group, rank, WORLD, opts(direct)) {
        Ok(g) => g,
        Err(e) => {
            println!("\nTA_RESULT join {e}");
            return;
        }
    };
    std::fs::write(marker.join(rank.to_string()), b"").unwrap();
    match run_ops(&mut g) {
        Some(e) => println!("\nTA_RESULT err {e}"),
        None => println!("\nTA_RESULT ok"),
    }
}

/// The data region of rank `rank` of `group` as mapped in process `pid`.
fn region_of(pid: u32, group: &str, rank: usize) -> Option<(u64, u64)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let prefix = format!("memfd:epcomm.{group}.");
    maps.lines()
        .filter_map(|l| {
            let name = &l[l.find(&prefix)? + prefix.len()..];
            let fields: Vec<&str> = name.split('.').collect();
            if fields.len() < 4 || fields[0] == "control" || fields[1] != rank.to_string() {
                return None;
            }
            let gen: u64 = fields[2].parse().ok()?;
            let (a, b) = l.split_whitespace().next()?.split_once('-')?;
            Some((
                gen,
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        })
        .max_by_key(|m| m.0)
        .map(|(_, a, b)| (a, b))
}

/// The control segment as mapped in process `pid`: (start, end).
fn control_of(pid: u32, group: &str) -> Option<(u64, u64)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let name = format!("memfd:epcomm.{group}.control");
    let line = maps.lines().find(|l| l.contains(&name))?;
    let (a, b) = line.split_whitespace().next()?.split_once('-')?;
    Some((
        u64::from_str_radix(a, 16).ok()?,
        u64::from_str_radix(b, 16).ok()?,
    ))
}

/// What the attacker writes, and where.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Attack {
    /// Random bytes over the op header and the first metadata words of rank 1's region.
    RandomHeader,
    /// A metadata count of 2^43 words.
    HugeMetaLen,
    /// Random bytes over the slots and data descriptors of the control segment.
    RandomControl,
}

impl Attack {
    fn tag(self) -> &'static str {
        match self {
            Attack::RandomHeader => "random-header",
            Attack::HugeMetaLen => "huge-meta-len",
            Attack::RandomControl => "random-control",
        }
    }

    /// One write into process `pid`'s memory (false if the target is not mapped any more).
    fn strike(self, mem: &File, pid: u32, group: &str, rng: &mut u64) -> bool {
        match self {
            Attack::RandomHeader => {
                let Some((start, _)) = region_of(pid, group, 1) else {
                    return false;
                };
                let bytes: Vec<u8> = (0..128).map(|_| xorshift(rng) as u8).collect();
                mem.write_at(&bytes, start).is_ok()
            }
            Attack::HugeMetaLen => {
                let Some((start, _)) = region_of(pid, group, 1) else {
                    return false;
                };
                mem.write_at(&(1u64 << 43).to_ne_bytes(), start + 24)
                    .is_ok()
            }
            Attack::RandomControl => {
                let Some((start, end)) = control_of(pid, group) else {
                    return false;
                };
                let len = (end - start - 4096) as usize;
                let at = start + 4096 + xorshift(rng) % len as u64;
                // Not the group's decision word (rank 0's slot, bytes 64..72 after the header):
                // a forged blamed rank there is a known gap (see docs/reliability.md).
                let decision = start + 4096 + 64;
                if at + 8 > decision && at < decision + 8 {
                    return true;
                }
                let bytes: Vec<u8> = (0..8).map(|_| xorshift(rng) as u8).collect();
                mem.write_at(&bytes, at).is_ok()
            }
        }
    }
}

fn marker_dir(group: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("epcomm-tamper-{group}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn result_line(f: &Finished) -> String {
    f.stdout
        .lines()
        .find_map(|l| l.strip_prefix("TA_RESULT "))
        .unwrap_or("<none>")
        .to_owned()
}

/// Three rank processes run ops while this process (a third party of the same user) writes
/// into rank 1's memory; every rank must end with an error, by itself, within the bound.
fn process_case(attack: Attack, direct: bool) {
    let group = ranks::unique("ta", attack.tag());
    let dir = marker_dir(&group);
    let children = ranks::spawn_ranks(CHILD_TEST, 0..WORLD, |rank| {
        vec![
            ("EPCOMM_TA_GROUP", group.clone()),
            ("EPCOMM_TA_RANK", rank.to_string()),
            (
                "EPCOMM_TA_DIRECT",
                if direct { "1" } else { "0" }.to_owned(),
            ),
            ("EPCOMM_TA_MARKER", dir.display().to_string()),
        ]
    });
    let pids: Vec<u32> = children.iter().map(|(_, c)| c.id()).collect();
    let start = Instant::now();
    while !(0..WORLD).all(|r| dir.join(r.to_string()).exists()) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{attack:?}: the group did not form"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let target = pids[1];
    let mem = File::options()
        .read(true)
        .write(true)
        .open(format!("/proc/{target}/mem"));
    let mem = match mem {
        Ok(m) => m,
        Err(e) => {
            for pid in &pids {
                // SAFETY: ending child processes we started.
                unsafe { libc::kill(*pid as libc::pid_t, libc::SIGKILL) };
            }
            let _ = wait_all(children, Duration::from_secs(10));
            common::skip::skipped(
                "shm_tamper",
                &format!("cannot write /proc/{target}/mem ({e}); needs ptrace access to a child"),
            );
            return;
        }
    };
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(target);
    let attack_start = Instant::now();
    let mut strikes = 0u64;
    while attack_start.elapsed() < RUN_FOR + TIMEOUT * 2 {
        if !attack.strike(&mem, target, &group, &mut rng) {
            break;
        }
        strikes += 1;
    }
    let results = wait_all(children, Duration::from_secs(20));
    let took = attack_start.elapsed();
    let lines: Vec<String> = results
        .iter()
        .map(|r| format!("rank {}: {:?} {}", r.rank, r.status, result_line(r)))
        .collect();
    let all: Vec<String> = results.iter().map(Finished::output).collect();
    for r in &results {
        assert!(
            r.status.success(),
            "{attack:?} direct={direct}: rank {} died ({:?}) instead of returning an error:\n{}",
            r.rank,
            r.status,
            all.join("\n")
        );
        assert!(
            result_line(r).starts_with("err "),
            "{attack:?} direct={direct}: rank {} did not return an error:\n{}",
            r.rank,
            lines.join("\n")
        );
    }
    assert!(
        took < RUN_FOR + TIMEOUT * 3,
        "{attack:?}: took {took:?}: {lines:?}"
    );
    eprintln!(
        "shm_tamper {} direct={direct}: {strikes} writes, {} ms: {}",
        attack.tag(),
        took.as_millis(),
        lines.join(" | ")
    );
    assert!(shm_leftovers(&group).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn random_header_bytes_are_errors_on_every_rank() {
    process_case(Attack::RandomHeader, true);
    process_case(Attack::RandomHeader, false);
}

#[test]
fn a_huge_metadata_count_is_an_error_not_an_allocation() {
    process_case(Attack::HugeMetaLen, true);
    process_case(Attack::HugeMetaLen, false);
}

/// Thread ranks in this process: while a forged address table (pointing at unmapped memory)
/// sits in rank 1's segment, all_gatherv (no metadata, so the table follows the op header)
/// never follows it: no SIGSEGV and the data stays right. Then random bytes over the header are
/// errors on every rank.
#[test]
fn thread_ranks_never_follow_a_forged_address_table() {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FORGED_OPS: usize = 300;
    let group = ranks::unique("ta", "threads");
    let g2 = group.clone();
    // 0: forge tables; 1: random headers; 2: stop.
    let phase = std::sync::Arc::new(AtomicU32::new(0));
    let done = std::sync::Arc::new(AtomicU32::new(0));
    let (phase2, done2) = (phase.clone(), done.clone());
    let attacker = std::thread::spawn(move || {
        let mem = File::options()
            .read(true)
            .write(true)
            .open("/proc/self/mem")
            .unwrap();
        let me = std::process::id();
        let mut rng = 12345u64;
        let (mut forged, mut random) = (0u64, 0u64);
        let t0 = Instant::now();
        while phase2.load(Ordering::Acquire) < 2 && t0.elapsed() < Duration::from_secs(30) {
            let Some((start, _)) = region_of(me, &g2, 1) else {
                std::thread::sleep(Duration::from_micros(100));
                continue;
            };
            if phase2.load(Ordering::Acquire) == 0 {
                let mut table = Vec::new();
                table.extend(0x10u64.to_ne_bytes());
                table.extend(256u64.to_ne_bytes());
                let _ = mem.write_at(&table, start + 64);
                forged += 1;
            } else {
                let bytes: Vec<u8> = (0..64).map(|_| xorshift(&mut rng) as u8).collect();
                let _ = mem.write_at(&bytes, start);
                random += 1;
            }
        }
        (forged, random)
    });
    let results = ranks::on_threads(WORLD, move |rank| {
        let mut g = ShmGroup::join(&group, rank, WORLD, opts(true)).unwrap();
        assert!(g.direct(), "thread ranks read each other directly");
        for it in 0..FORGED_OPS {
            let mine = vec![(rank + it) as u8; 256];
            let mut out = vec![0u8; 256 * WORLD];
            g.all_gatherv(&mine, &[256; WORLD], &mut out).unwrap();
            for r in 0..WORLD {
                assert!(
                    out[r * 256..(r + 1) * 256]
                        .iter()
                        .all(|&b| b == (r + it) as u8),
                    "rank {rank}: wrong data from rank {r} at op {it}"
                );
            }
        }
        if done.fetch_add(1, Ordering::AcqRel) + 1 == WORLD as u32 {
            phase.store(1, Ordering::Release);
        }
        while phase.load(Ordering::Acquire) == 0 {
            std::thread::yield_now();
        }
        let r = run_ops(&mut g).map(|e| e.to_string());
        phase.store(2, Ordering::Release);
        r
    });
    let _ = done2;
    let (forged, random) = attacker.join().unwrap();
    assert!(forged > 0 && random > 0, "forged {forged}, random {random}");
    for (rank, r) in results.iter().enumerate() {
        assert!(
            r.is_some(),
            "rank {rank}: random header bytes were not noticed: {results:?}"
        );
    }
    eprintln!(
        "shm_tamper threads: {forged} forged tables (never followed), {random} random headers: {results:?}"
    );
}

/// A sealed segment cannot be truncated, so no member can be made to fault on it.
#[test]
fn a_segment_cannot_be_truncated() {
    let group = ranks::unique("ta", "truncate");
    let g2 = group.clone();
    let results = ranks::on_threads(2, move |rank| {
        let mut g = ShmGroup::join(&g2, rank, 2, opts(true)).unwrap();
        g.barrier().unwrap();
        if rank == 1 {
            let (start, end) = region_of(std::process::id(), &g2, 1).expect("rank 1's region");
            let path = format!("/proc/self/map_files/{start:x}-{end:x}");
            match File::options().write(true).open(&path) {
                Ok(f) => {
                    let e = f.set_len(0).unwrap_err();
                    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
                }
                Err(e) => common::skip::skipped(
                    "a_segment_cannot_be_truncated",
                    &format!("cannot open {path} ({e}); needs CAP_SYS_ADMIN"),
                ),
            }
        }
        g.barrier().unwrap();
        step(&mut g, 3).unwrap();
    });
    assert_eq!(results.len(), 2);
    assert!(shm_leftovers(&group).is_empty());
}

/// A rendezvous record overwritten with random bytes (or truncated) during the join window is
/// still removed by the rank 0 that created it: the ranks time out (the record no longer names
/// rank 0's segment) and nothing is left in /dev/shm.
#[test]
fn an_overwritten_record_is_still_removed() {
    for truncate in [false, true] {
        let group = ranks::unique("ta", "record");
        let opts = GroupOptions {
            timeout: Duration::from_millis(800),
            ..GroupOptions::default()
        };
        let (g0, o0) = (group.clone(), opts.clone());
        let rank0 = std::thread::spawn(move || ShmGroup::join(&g0, 0, 2, o0).map(|_| ()));
        let path = ranks::wait_for_record(&group, Duration::from_secs(5));
        let f = File::options().write(true).open(&path).unwrap();
        if truncate {
            f.set_len(0).unwrap();
        } else {
            let mut rng = 77u64;
            let junk: Vec<u8> = (0..64).map(|_| xorshift(&mut rng) as u8).collect();
            f.write_at(&junk, 0).unwrap();
        }
        drop(f);
        let e1 = ShmGroup::join(&group, 1, 2, opts).unwrap_err();
        let e0 = rank0.join().unwrap().unwrap_err();
        assert_eq!(e0.status(), epcomm::Status::Timeout, "{e0}");
        assert_eq!(e1.status(), epcomm::Status::Timeout, "{e1}");
        assert_eq!(
            e1.to_string(),
            format!(
                "timed out after 0.8 s waiting for rank 0 to create group '{group}' (rank 1 of 2); no rank 0 created it (until it does, the other ranks cannot see each other): check that rank 0 was started and creates the group with the name '{group}' and world_size 2 (a rank that failed first reports its own error there; two jobs that use one name at the same time are refused, saying so), or raise the timeout (EPCOMM_TIMEOUT_S, or the group's timeout_s)"
            )
        );
        assert!(
            shm_leftovers(&group).is_empty(),
            "truncate={truncate}: left {:?}",
            shm_leftovers(&group)
        );
    }
}

#[test]
fn random_control_words_are_errors_on_every_rank() {
    process_case(Attack::RandomControl, true);
    process_case(Attack::RandomControl, false);
}
