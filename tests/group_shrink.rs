//! Shrinking a group after a failure (`Group::lost_ranks`, `Group::shrink`,
//! `epcomm_group_lost_ranks`, `epcomm_group_shrink`).
//!
//! Process cases run 4 ranks as child processes (this test binary run again as `shrink_rank`)
//! with `EPCOMM_TIMEOUT_S=1`, looping over checked collectives (all_gatherv of uneven sizes
//! whose contents name every member's original rank, reduce_scatterv whose sums weigh every
//! member by its original rank) until one fails; then every survivor reports `lost_ranks()`,
//! shrinks by it and runs checked collectives over the smaller group:
//!
//! - **kill**: a random rank is SIGKILLed at a random moment;
//! - **stall**: a random rank is SIGSTOPped past the timeout, then resumed once the survivors
//!   are done: its shrink is refused (it never joins the survivors' group);
//! - **twice**: two successive kills, two shrinks (4 → 3 → 2 ranks);
//! - **disagree**: one survivor excludes a live rank too: every survivor's shrink fails (the
//!   views meet under different names and time out), and no group forms;
//! - **host**: the host-callback transport (through the C ABI) over an inner shared-memory
//!   group: the host's peer failure is a real SIGKILL, reported as PEER_FAILURE; the host's
//!   lost_ranks and shrink callbacks serve epcomm_group_lost_ranks and epcomm_group_shrink.
//!
//! Thread cases: 4 thread ranks of one process under a 60-character name, one rank leaving
//! (dropping its handle) at a random round, twice. After every case nothing of the groups is
//! left in /dev/shm.

mod ranks;

use std::collections::BTreeMap;
use std::ffi::{c_void, CStr};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::{Duration, Instant};

use epcomm::ffi::group::{
    epcomm_group, epcomm_group_all_gather, epcomm_group_create_host, epcomm_group_create_shm,
    epcomm_group_destroy, epcomm_group_lost_ranks, epcomm_group_rank, epcomm_group_shrink,
    epcomm_group_size, epcomm_host_callbacks,
};
use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions, ReduceScatterv};
use epcomm::num::{self, FloatKind};
use epcomm::Status;
use ranks::{shm_leftovers, wait_all, Finished};

const WORLD: usize = 4;
const CHILD_TEST: &str = "shrink_rank";
/// `EPCOMM_TIMEOUT_S` of every rank process.
const TIMEOUT_S: f64 = 1.0;
/// The parent's bound on a case.
const CASE_DEADLINE: Duration = Duration::from_secs(30);
/// How long a rank loops waiting for a failure before it gives up (a test failure).
const LOOP_LIMIT: Duration = Duration::from_secs(15);

fn seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    (t.as_nanos() as u64 ^ u64::from(std::process::id()) << 32) | 1
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// One round of checked collectives over `g`, whose member p was rank `orig[p]` of the first
/// group: all_gatherv of uneven sizes (contents name the original ranks) and reduce_scatterv
/// (sums weigh each member by its original rank + 1). A wrong result panics.
fn round(g: &mut dyn Group, i: u64, orig: &[usize]) -> epcomm::Result<()> {
    let (me, world) = (g.rank(), g.size());
    assert_eq!(world, orig.len());
    let bytes_of = |p: usize| {
        let len = (p + i as usize) % 3 + 3;
        let mut b = vec![(orig[p] * 17 + i as usize) as u8; len];
        b[..3].copy_from_slice(&[orig[p] as u8, p as u8, i as u8]);
        b
    };
    let sizes: Vec<usize> = (0..world).map(|p| bytes_of(p).len()).collect();
    let mut out = vec![0u8; sizes.iter().sum()];
    g.all_gatherv(&bytes_of(me), &sizes, &mut out)?;
    let want: Vec<u8> = (0..world).flat_map(bytes_of).collect();
    assert_eq!(out, want, "all_gatherv round {i} on member {me}");
    let rows: Vec<usize> = (0..world).map(|p| p % 2 + 1).collect();
    let total: usize = rows.iter().sum();
    let value = |o: usize, j: usize| (o + 1) as f32 * (j as u64 + i % 7) as f32;
    let x: Vec<f32> = (0..total * 4).map(|j| value(orig[me], j)).collect();
    let mut y = vec![0u8; rows[me] * 16];
    let xb = num::from_f32(&x, FloatKind::F32);
    g.reduce_scatterv(ReduceScatterv {
        input: &xb,
        rows: &rows,
        row_elems: 4,
        kind: FloatKind::F32,
        output: &mut y,
    })?;
    let start: usize = rows[..me].iter().sum::<usize>() * 4;
    let want: Vec<f32> = (start..start + rows[me] * 4)
        .map(|j| orig.iter().map(|&o| value(o, j)).sum())
        .collect();
    assert_eq!(
        num::to_f32(&y, FloatKind::F32),
        want,
        "reduce_scatterv round {i}"
    );
    Ok(())
}

/// Rounds until one fails (a panic after LOOP_LIMIT); returns the error and how long the
/// failing call took.
fn until_failure(g: &mut dyn Group, orig: &[usize], first: &mut u64) -> (epcomm::Error, u128) {
    let since = Instant::now();
    loop {
        let t = Instant::now();
        if let Err(e) = round(g, *first, orig) {
            return (e, t.elapsed().as_millis());
        }
        *first += 1;
        assert!(since.elapsed() < LOOP_LIMIT, "no failure in {LOOP_LIMIT:?}");
    }
}

fn env(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| panic!("{key} not set"))
}

fn mark(dir: &str, what: &str) {
    std::fs::write(Path::new(dir).join(what), b"1").unwrap();
}

/// A line for the parent: `GS|key|fields...`.
fn say(key: &str, fields: &[String]) {
    println!("GS|{key}|{}", fields.join("|"));
}

/// A child rank. Does nothing unless started by a case (`GS_CASE` set).
#[test]
fn shrink_rank() {
    let Ok(case) = std::env::var("GS_CASE") else {
        return;
    };
    let (group, dir) = (env("GS_GROUP"), env("GS_DIR"));
    let rank: usize = env("GS_RANK").parse().unwrap();
    if case == "host" {
        host_rank(&group, &dir, rank);
        return;
    }
    let g = ShmGroup::join(&group, rank, WORLD, GroupOptions::default()).expect("join");
    mark(&dir, &format!("joined-{rank}"));
    let stages = if case == "twice" { 2 } else { 1 };
    let mut g: Box<dyn Group> = Box::new(g);
    let mut orig: Vec<usize> = (0..WORLD).collect();
    let mut i = 0;
    for stage in 0..stages {
        let (e, ms) = until_failure(g.as_mut(), &orig, &mut i);
        say(
            &format!("fail{stage}"),
            &[format!("{:?}", e.status()), ms.to_string(), e.to_string()],
        );
        let lost = g.lost_ranks();
        let lost_orig: Vec<usize> = lost.iter().map(|&p| orig[p]).collect();
        say(&format!("lost{stage}"), &[format!("{lost_orig:?}")]);
        let mut excluded = lost.clone();
        if case == "disagree" && rank == 2 {
            excluded.insert(0, 0);
        }
        let t = Instant::now();
        match g.shrink(&excluded) {
            Err(e) => {
                let ms = t.elapsed().as_millis().to_string();
                say("shrink", &[format!("{:?}", e.status()), ms, e.to_string()]);
                return;
            }
            Ok(new) => {
                let ms = t.elapsed().as_millis() as usize;
                let fields = [new.rank(), new.size(), new.name().len(), ms].map(|v| v.to_string());
                say(&format!("shrunk{stage}"), &fields);
                orig.retain(|o| !lost_orig.contains(o));
                g = new;
            }
        }
        mark(&dir, &format!("shrunk{stage}-{rank}"));
    }
    for k in 0..5 {
        round(g.as_mut(), 1000 + k, &orig).expect("round over the shrunk group");
    }
    say("done", &[format!("{orig:?}")]);
}

/// What a child printed: its `GS|key|...` lines by key.
fn lines(f: &Finished) -> BTreeMap<String, Vec<String>> {
    f.stdout
        .lines()
        // The first line follows libtest's "test shrink_rank ... " on the same line.
        .filter_map(|l| l.split_once("GS|").map(|(_, rest)| rest))
        .map(|l| {
            let mut parts = l.split('|').map(str::to_owned);
            (parts.next().unwrap(), parts.collect())
        })
        .collect()
}

/// Field list `key` of a child's lines, or a panic showing every rank's output.
fn field<'a>(l: &'a BTreeMap<String, Vec<String>>, key: &str, all: &str) -> &'a Vec<String> {
    l.get(key)
        .unwrap_or_else(|| panic!("no line {key} from a rank:\n{all}"))
}

fn all_output(res: &[Finished]) -> String {
    res.iter()
        .map(Finished::output)
        .collect::<Vec<_>>()
        .join("\n")
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: sending a signal to a child process this test started.
    unsafe { libc::kill(pid as libc::pid_t, sig) };
}

/// A case's group name, marker folder and children.
struct Case {
    group: String,
    dir: PathBuf,
    kids: Vec<(usize, Child)>,
}

impl Case {
    fn start(case: &str) -> Case {
        let group = ranks::unique("gs", case);
        let dir = std::env::temp_dir().join(format!("epcomm-{group}"));
        std::fs::create_dir_all(&dir).unwrap();
        let kids = ranks::spawn_ranks(CHILD_TEST, 0..WORLD, |rank| {
            vec![
                ("GS_CASE", case.to_owned()),
                ("GS_GROUP", group.clone()),
                ("GS_DIR", dir.display().to_string()),
                ("GS_RANK", rank.to_string()),
                ("EPCOMM_TIMEOUT_S", TIMEOUT_S.to_string()),
                ("RUST_BACKTRACE", "0".to_owned()),
            ]
        });
        Case { group, dir, kids }
    }

    /// Waits (bounded) for every marker `{what}-{rank}` of `ranks`.
    fn wait_marks(&mut self, what: &str, ranks: &[usize]) {
        let start = Instant::now();
        while !ranks
            .iter()
            .all(|r| self.dir.join(format!("{what}-{r}")).exists())
        {
            if start.elapsed() > CASE_DEADLINE {
                let kids = std::mem::take(&mut self.kids);
                let res = wait_all(kids, Duration::ZERO);
                panic!("no {what} from {ranks:?}:\n{}", all_output(&res));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn pid(&self, rank: usize) -> u32 {
        self.kids.iter().find(|(r, _)| *r == rank).unwrap().1.id()
    }

    /// Waits for the children of `ranks` (bounded) and returns them.
    fn wait(&mut self, ranks: &[usize]) -> Vec<Finished> {
        let (these, rest) = std::mem::take(&mut self.kids)
            .into_iter()
            .partition(|(r, _)| ranks.contains(r));
        self.kids = rest;
        wait_all(these, CASE_DEADLINE)
    }
}

impl Drop for Case {
    fn drop(&mut self) {
        for (_, c) in &mut self.kids {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        if std::thread::panicking() {
            for f in shm_leftovers(&self.group) {
                let _ = std::fs::remove_file(format!("/dev/shm/{f}"));
            }
        }
    }
}

fn assert_no_leftovers(group: &str) {
    let left = shm_leftovers(group);
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");
}

/// Every survivor failed with `status`, holds exactly `lost` (original ranks), shrank to the
/// survivors renumbered in order and finished its checked rounds; prints the timings.
fn check_survivors(res: &[Finished], status: &str, lost: &[usize], stage: usize, all: &str) {
    let survivors: Vec<usize> = res.iter().map(|f| f.rank).collect();
    for f in res {
        assert!(f.success(), "rank {} failed:\n{all}", f.rank);
        let l = lines(f);
        let fail = &field(&l, &format!("fail{stage}"), all);
        assert_eq!(fail[0], status, "rank {}: {}\n{all}", f.rank, fail[2]);
        println!("rank {}: failing call {} ms: {}", f.rank, fail[1], fail[2]);
        assert_eq!(
            field(&l, &format!("lost{stage}"), all)[0],
            format!("{lost:?}"),
            "{all}"
        );
        let new_rank = survivors.iter().position(|&r| r == f.rank).unwrap();
        let shrunk = &field(&l, &format!("shrunk{stage}"), all);
        assert_eq!(shrunk[0], new_rank.to_string(), "{all}");
        assert_eq!(shrunk[1], survivors.len().to_string(), "{all}");
        assert!(shrunk[2].parse::<usize>().unwrap() <= 64, "{all}");
        if let Some(ms) = shrunk.get(3) {
            println!("rank {}: shrink took {ms} ms", f.rank);
        }
        assert_eq!(field(&l, "done", all)[0], format!("{survivors:?}"), "{all}");
    }
}

/// SIGKILL of a random rank at a random moment: every survivor fails naming it, all hold it as
/// lost, shrink to 3 ranks renumbered in order and compute correctly over them.
#[test]
fn survivors_of_a_kill_shrink_and_compute() {
    for run in 0..2 {
        let mut s = seed();
        let victim = (xorshift(&mut s) % WORLD as u64) as usize;
        let mut case = Case::start("kill");
        case.wait_marks("joined", &[0, 1, 2, 3]);
        std::thread::sleep(Duration::from_millis(xorshift(&mut s) % 300));
        signal(case.pid(victim), libc::SIGKILL);
        let survivors: Vec<usize> = (0..WORLD).filter(|&r| r != victim).collect();
        let res = case.wait(&survivors);
        let all = all_output(&res);
        println!("run {run} (seed {s}): rank {victim} killed");
        check_survivors(&res, "PeerFailure", &[victim], 0, &all);
        let died = format!("rank {victim} of group '{}' died", case.group);
        assert!(
            res.iter()
                .all(|f| field(&lines(f), "fail0", &all)[2].starts_with(&died)),
            "{all}"
        );
        drop(case.wait(&[victim]));
        assert_no_leftovers(&case.group);
    }
}

/// SIGSTOP of a random rank past the timeout: the survivors time out naming it and shrink
/// without it; resumed, it is refused: it never joins their group.
#[test]
fn a_stalled_rank_is_shrunk_out_and_refused_when_it_resumes() {
    let mut s = seed();
    let victim = (xorshift(&mut s) % WORLD as u64) as usize;
    let mut case = Case::start("stall");
    case.wait_marks("joined", &[0, 1, 2, 3]);
    std::thread::sleep(Duration::from_millis(xorshift(&mut s) % 300));
    let pid = case.pid(victim);
    signal(pid, libc::SIGSTOP);
    let survivors: Vec<usize> = (0..WORLD).filter(|&r| r != victim).collect();
    let res = case.wait(&survivors);
    signal(pid, libc::SIGCONT);
    let late = case.wait(&[victim]);
    let all = format!("{}\n{}", all_output(&res), all_output(&late));
    println!("seed {s}: rank {victim} stopped");
    check_survivors(&res, "Timeout", &[victim], 0, &all);
    let waiting = format!("waiting for rank(s) {victim}");
    assert!(
        res.iter()
            .all(|f| field(&lines(f), "fail0", &all)[2].ends_with(&waiting)),
        "{all}"
    );
    for f in &res {
        let ms: u128 = field(&lines(f), "fail0", &all)[1].parse().unwrap();
        assert!(ms < 1000 * TIMEOUT_S as u128 + 1500, "{all}");
    }
    let l = lines(&late[0]);
    assert_eq!(field(&l, "fail0", &all)[0], "PeerFailure", "{all}");
    // The survivors' processes ended before it resumed: gone, so lost to it.
    assert_eq!(
        field(&l, "lost0", &all)[0],
        format!("{survivors:?}"),
        "{all}"
    );
    let refused = &field(&l, "shrink", &all);
    assert_eq!(refused[0], "PeerFailure", "{all}");
    let head = format!(
        "shrink: rank {victim} of group '{}' was masked by its peers at op #",
        case.group
    );
    let tail = " (it stalled: they timed out after 1.0 s waiting for it); it cannot rejoin the survivors: create a new group to join again";
    assert!(
        refused[2].starts_with(&head) && refused[2].ends_with(tail),
        "{all}"
    );
    assert_no_leftovers(&case.group);
}

/// Two successive kills: 4 → 3 → 2 ranks, each shrink renumbering in order.
#[test]
fn two_failures_two_shrinks() {
    let mut s = seed();
    let mut case = Case::start("twice");
    case.wait_marks("joined", &[0, 1, 2, 3]);
    std::thread::sleep(Duration::from_millis(xorshift(&mut s) % 200));
    signal(case.pid(3), libc::SIGKILL);
    case.wait_marks("shrunk0", &[0, 1, 2]);
    std::thread::sleep(Duration::from_millis(xorshift(&mut s) % 200));
    signal(case.pid(1), libc::SIGKILL);
    let res = case.wait(&[0, 2]);
    let all = all_output(&res);
    for f in &res {
        let l = lines(f);
        assert_eq!(field(&l, "lost0", &all)[0], "[3]", "{all}");
        assert_eq!(
            field(&l, "shrunk0", &all)[..2],
            [f.rank.to_string(), "3".into()],
            "{all}"
        );
    }
    check_survivors(&res, "PeerFailure", &[1], 1, &all);
    drop(case.wait(&[1, 3]));
    assert_no_leftovers(&case.group);
}

/// One survivor excludes a live rank too: the views meet under different names, every
/// survivor's shrink times out (bounded) and no group forms.
#[test]
fn disagreeing_excluded_lists_fail_on_every_survivor() {
    let mut case = Case::start("disagree");
    case.wait_marks("joined", &[0, 1, 2, 3]);
    signal(case.pid(3), libc::SIGKILL);
    let res = case.wait(&[0, 1, 2]);
    let all = all_output(&res);
    for f in &res {
        let l = lines(f);
        assert!(f.success(), "{all}");
        assert_eq!(field(&l, "lost0", &all)[0], "[3]", "{all}");
        assert_eq!(field(&l, "shrink", &all)[0], "Timeout", "{all}");
        let ms: u128 = field(&l, "shrink", &all)[1].parse().unwrap();
        println!(
            "rank {}: shrink failed after {ms} ms: {}",
            f.rank,
            field(&l, "shrink", &all)[2]
        );
        assert!(ms < 1000 * TIMEOUT_S as u128 + 2500, "{all}");
        assert!(!l.contains_key("shrunk0"), "{all}");
    }
    drop(case.wait(&[3]));
    assert_no_leftovers(&case.group);
}

/// Thread ranks: one rank leaves (drops its handle) at a random round, twice; the survivors
/// shrink each time under names of at most 64 characters.
#[test]
fn thread_ranks_shrink_twice() {
    let base = ranks::unique("gs", "threads");
    let name = format!("{base}-{}", "x".repeat(60 - base.len().min(59)));
    let mut s = seed();
    let leave_at = [xorshift(&mut s) % 20, xorshift(&mut s) % 20];
    let n = name.clone();
    let res = ranks::on_threads(WORLD, move |rank| thread_rank(&n, rank, leave_at));
    for (rank, r) in res.iter().enumerate() {
        match rank {
            0 | 1 => assert_eq!(r, &Some(vec![0, 1]), "rank {rank}"),
            2 | 3 => assert_eq!(r, &None, "rank {rank}"),
            _ => unreachable!(),
        }
    }
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|f| f.starts_with(&format!("epcomm.{}", &name[..47])))
        .collect();
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");
}

/// Rank 3 leaves at round `leave_at[0]`, then (original) rank 2 at round `leave_at[1]` of the
/// shrunk group; the survivors return their final original ranks.
fn thread_rank(name: &str, rank: usize, leave_at: [u64; 2]) -> Option<Vec<usize>> {
    let opts = GroupOptions {
        timeout: Duration::from_secs(5),
        ..GroupOptions::default()
    };
    let mut g: Box<dyn Group> = Box::new(ShmGroup::join(name, rank, WORLD, opts).unwrap());
    let mut orig: Vec<usize> = (0..WORLD).collect();
    let mut i = 0;
    for (stage, leaver) in [3usize, 2].into_iter().enumerate() {
        let me = g.rank();
        let mut failed = None;
        while failed.is_none() {
            if orig[me] == leaver && i >= leave_at[stage] {
                return None;
            }
            failed = round(g.as_mut(), i, &orig).err();
            i += 1;
        }
        let e = failed.unwrap();
        assert_eq!(e.status(), Status::PeerFailure, "{e}");
        let lost = g.lost_ranks();
        assert_eq!(lost, vec![orig.len() - 1], "rank {rank}: {e}");
        let new = g.shrink(&lost).unwrap();
        assert!(new.name().len() <= 64 && new.name() != g.name());
        assert_eq!((new.rank(), new.size()), (me, orig.len() - 1));
        orig.pop();
        g = new;
    }
    for k in 0..3 {
        round(g.as_mut(), 500 + k, &orig).unwrap();
    }
    Some(orig)
}

/// The inner shared-memory group a host-callback test transport runs over.
struct Inner(Box<dyn Group>);

/// The user data the last shrink callback made (freed by the test once its group is gone).
static SHRUNK: AtomicPtr<Inner> = AtomicPtr::new(std::ptr::null_mut());

/// The status code of `r` as a host callback returns it.
fn code(r: epcomm::Result<()>) -> i32 {
    r.err().map_or(0, |e| e.status() as i32)
}

unsafe extern "C" fn cb_send(_: *mut c_void, _: i32, _: *const c_void, _: usize) -> i32 {
    Status::NotImplemented as i32
}

unsafe extern "C" fn cb_recv(_: *mut c_void, _: i32, _: *mut c_void, _: usize) -> i32 {
    Status::NotImplemented as i32
}

unsafe extern "C" fn cb_all_gather(
    user: *mut c_void,
    input: *const c_void,
    bytes: usize,
    output: *mut c_void,
) -> i32 {
    // SAFETY: `user` is the Inner this test made; the buffers are as epcomm documents.
    let inner = unsafe { &mut *user.cast::<Inner>() };
    let world = inner.0.size();
    let (mine, out) = unsafe {
        (
            std::slice::from_raw_parts(input.cast::<u8>(), bytes),
            std::slice::from_raw_parts_mut(output.cast::<u8>(), bytes * world),
        )
    };
    code(inner.0.all_gather(mine, out))
}

unsafe extern "C" fn cb_lost_ranks(user: *mut c_void, mask: *mut u8, world: i32) -> i32 {
    // SAFETY: as above; `mask` holds `world` entries.
    let inner = unsafe { &*user.cast::<Inner>() };
    let mask = unsafe { std::slice::from_raw_parts_mut(mask, world as usize) };
    for r in inner.0.lost_ranks() {
        mask[r] = 1;
    }
    0
}

unsafe extern "C" fn cb_shrink(
    user: *mut c_void,
    excluded: *const i32,
    n: usize,
    out: *mut *mut c_void,
) -> i32 {
    // SAFETY: as above; `excluded` holds `n` entries, `out` is writable.
    let inner = unsafe { &mut *user.cast::<Inner>() };
    let ex: Vec<usize> = unsafe { std::slice::from_raw_parts(excluded, n) }
        .iter()
        .map(|&r| r as usize)
        .collect();
    match inner.0.shrink(&ex) {
        Ok(g) => {
            let new = Box::into_raw(Box::new(Inner(g)));
            SHRUNK.store(new, Ordering::Release);
            unsafe { *out = new.cast() };
            0
        }
        Err(e) => e.status() as i32,
    }
}

fn callbacks(user: *mut Inner) -> epcomm_host_callbacks {
    epcomm_host_callbacks {
        struct_size: std::mem::size_of::<epcomm_host_callbacks>() as u32,
        user_data: user.cast(),
        send: Some(cb_send),
        recv: Some(cb_recv),
        all_gather: Some(cb_all_gather),
        barrier: None,
        lost_ranks: Some(cb_lost_ranks),
        shrink: Some(cb_shrink),
        all_to_allv: None,
    }
}

fn last_error() -> String {
    let p = epcomm::ffi::error::epcomm_last_error_message();
    // SAFETY: NULL or a NUL-terminated string valid until the next failing call.
    if p.is_null() {
        return String::new();
    }
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// An all_gather of 8 bytes naming each member's original rank over the handle `g`.
fn host_round(g: *mut epcomm_group, orig: &[usize], i: u64) -> i32 {
    let (mut me, mut world) = (0, 0);
    // SAFETY: `g` is a live handle; the outputs are writable.
    unsafe {
        assert_eq!(epcomm_group_rank(g, &mut me), 0);
        assert_eq!(epcomm_group_size(g, &mut world), 0);
    }
    let word = |p: usize| (orig[p] as u64) << 32 | i;
    let mine = word(me as usize);
    let mut out = vec![0u64; world as usize];
    // SAFETY: 8 input bytes, world * 8 output bytes.
    let rc = unsafe {
        epcomm_group_all_gather(g, (&mine as *const u64).cast(), 8, out.as_mut_ptr().cast())
    };
    if rc == 0 {
        let want: Vec<u64> = (0..world as usize).map(word).collect();
        assert_eq!(out, want, "host all_gather round {i}");
    }
    rc
}

/// A host-callback rank over an inner shm group: loops until the host's transport reports the
/// killed peer, then reports lost ranks and shrinks through the C ABI.
fn host_rank(group: &str, dir: &str, rank: usize) {
    let g = ShmGroup::join(group, rank, WORLD, GroupOptions::default()).expect("join");
    let user = Box::into_raw(Box::new(Inner(Box::new(g))));
    let cb = callbacks(user);
    let mut h: *mut epcomm_group = std::ptr::null_mut();
    // SAFETY: valid callbacks, name and out.
    let rc = unsafe {
        epcomm_group_create_host(
            &cb,
            c"host".as_ptr(),
            rank as i32,
            WORLD as i32,
            std::ptr::null(),
            &mut h,
        )
    };
    assert_eq!(rc, 0, "{}", last_error());
    mark(dir, &format!("joined-{rank}"));
    let orig: Vec<usize> = (0..WORLD).collect();
    let mut i = 0;
    let (rc, ms) = loop {
        let t = Instant::now();
        let rc = host_round(h, &orig, i);
        if rc != 0 {
            break (rc, t.elapsed().as_millis());
        }
        i += 1;
    };
    say(
        "fail0",
        &[
            format!("{:?}", Status::from_code(rc).unwrap()),
            ms.to_string(),
            last_error(),
        ],
    );
    let mut mask = [0i32; WORLD];
    // SAFETY: `h` is live; `mask` holds WORLD entries.
    assert_eq!(
        unsafe { epcomm_group_lost_ranks(h, mask.as_mut_ptr(), WORLD) },
        0
    );
    let lost: Vec<usize> = (0..WORLD).filter(|&r| mask[r] == 1).collect();
    say("lost0", &[format!("{lost:?}")]);
    let ex: Vec<i32> = lost.iter().map(|&r| r as i32).collect();
    let mut h2: *mut epcomm_group = std::ptr::null_mut();
    let t = Instant::now();
    // SAFETY: `h` is live; `ex` holds its entries; `h2` is writable.
    let rc = unsafe { epcomm_group_shrink(h, ex.as_ptr(), ex.len(), &mut h2) };
    assert_eq!(rc, 0, "{}", last_error());
    let (mut r2, mut w2) = (0, 0);
    // SAFETY: `h2` is a live handle.
    unsafe {
        assert_eq!(epcomm_group_rank(h2, &mut r2), 0);
        assert_eq!(epcomm_group_size(h2, &mut w2), 0);
    }
    let ms = t.elapsed().as_millis().to_string();
    say("shrunk0", &[r2.to_string(), w2.to_string(), "4".into(), ms]);
    let survivors: Vec<usize> = (0..WORLD).filter(|r| !lost.contains(r)).collect();
    for k in 0..5 {
        assert_eq!(host_round(h2, &survivors, 100 + k), 0, "{}", last_error());
    }
    say("done", &[format!("{survivors:?}")]);
    // SAFETY: the handles are live and not used after; the user data outlive them.
    unsafe {
        let user2 = SHRUNK.swap(std::ptr::null_mut(), Ordering::AcqRel);
        epcomm_group_destroy(h2);
        epcomm_group_destroy(h);
        drop(Box::from_raw(user2));
        drop(Box::from_raw(user));
    }
}

/// The host-callback transport over an inner shm group of which one rank is SIGKILLed: the
/// host's failure is PEER_FAILURE on every survivor (the callback's status passes through),
/// its lost_ranks callback names the dead rank, and its shrink callback makes the transport
/// of a 3-rank host group that computes correctly.
#[test]
fn host_callbacks_report_a_kill_and_shrink() {
    let mut s = seed();
    let victim = (xorshift(&mut s) % WORLD as u64) as usize;
    let mut case = Case::start("host");
    case.wait_marks("joined", &[0, 1, 2, 3]);
    std::thread::sleep(Duration::from_millis(xorshift(&mut s) % 300));
    signal(case.pid(victim), libc::SIGKILL);
    let survivors: Vec<usize> = (0..WORLD).filter(|&r| r != victim).collect();
    let res = case.wait(&survivors);
    let all = all_output(&res);
    check_survivors(&res, "PeerFailure", &[victim], 0, &all);
    for f in &res {
        let msg = field(&lines(f), "fail0", &all)[2].clone();
        let head = format!("host transport all_gather failed during all_gatherv of group 'host' on rank {}: callback returned 8 (EPCOMM_ERROR_PEER_FAILURE)", f.rank);
        assert_eq!(msg, head, "{all}");
    }
    drop(case.wait(&[victim]));
    assert_no_leftovers(&case.group);
}

/// A callbacks struct of the first layout (before lost_ranks and shrink) still works: no rank
/// is reported lost and shrink is NOT_IMPLEMENTED naming the missing callback; a struct_size
/// shorter than that layout is refused.
#[test]
fn host_callbacks_without_lost_ranks_and_shrink() {
    let g = ShmGroup::join(&ranks::unique("gs", "host1"), 0, 1, GroupOptions::default()).unwrap();
    let user = Box::into_raw(Box::new(Inner(Box::new(g))));
    let mut cb = callbacks(user);
    cb.lost_ranks = None;
    cb.shrink = None;
    cb.struct_size = std::mem::offset_of!(epcomm_host_callbacks, lost_ranks) as u32;
    let mut h: *mut epcomm_group = std::ptr::null_mut();
    // SAFETY: valid callbacks, name and out; the user data outlives the handle.
    unsafe {
        let rc = epcomm_group_create_host(&cb, c"old".as_ptr(), 0, 1, std::ptr::null(), &mut h);
        assert_eq!(rc, 0, "{}", last_error());
        assert_eq!(host_round(h, &[0], 1), 0, "{}", last_error());
        let mut mask = [7i32; 1];
        assert_eq!(epcomm_group_lost_ranks(h, mask.as_mut_ptr(), 1), 0);
        assert_eq!(mask, [0]);
        assert_eq!(
            epcomm_group_lost_ranks(h, mask.as_mut_ptr(), 2),
            Status::InvalidArgument as i32
        );
        assert_eq!(
            last_error(),
            "lost_ranks: out_mask has 2 entries; expected one per rank of the group (1)"
        );
        let mut h2: *mut epcomm_group = std::ptr::null_mut();
        assert_eq!(
            epcomm_group_shrink(h, std::ptr::null(), 0, &mut h2),
            Status::NotImplemented as i32
        );
        assert_eq!(last_error(), "group 'old' cannot shrink: its host transport has no shrink (the shrink callback of epcomm_host_callbacks is NULL)");
        assert!(h2.is_null());
        let bad = [0i32];
        assert_eq!(
            epcomm_group_shrink(h, bad.as_ptr(), 1, &mut h2),
            Status::InvalidArgument as i32
        );
        assert_eq!(last_error(), "shrink: excluded [0] holds rank 0, the calling rank of group 'old'; only the survivors call shrink");
        epcomm_group_destroy(h);
        cb.struct_size -= 8;
        let rc = epcomm_group_create_host(&cb, c"old".as_ptr(), 0, 1, std::ptr::null(), &mut h);
        assert_eq!(rc, Status::InvalidArgument as i32);
        let full = std::mem::size_of::<epcomm_host_callbacks>();
        assert_eq!(
            last_error(),
            format!(
                "callbacks->struct_size is 40: expected sizeof(epcomm_host_callbacks) = {full}"
            )
        );
        drop(Box::from_raw(user));
    }
}

/// Shrink's checks, and a healthy 1-rank shm group that shrinks by nothing through the C ABI:
/// a new normal handle of 1 rank under a derived name; the old handle stays valid; NULLs are
/// errors.
#[test]
fn shrink_arguments_through_the_c_abi() {
    let name = ranks::unique("gs", "cabi");
    let mut g = ShmGroup::join(&name, 0, 1, GroupOptions::default()).unwrap();
    assert_eq!(g.lost_ranks(), Vec::<usize>::new());
    let e = Group::shrink(&mut g, &[1]).err().unwrap();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert_eq!(
        e.to_string(),
        format!("shrink: excluded[0] is 1; expected a rank of group '{name}' (0..1)")
    );
    let g2 = g.shrunk(&[]).unwrap();
    assert!(g2.name().starts_with(&format!("{name}.")) && g2.name().len() == name.len() + 17);
    drop((g, g2));
    let cname = std::ffi::CString::new(name.clone()).unwrap();
    let (mut h, mut h2): (*mut epcomm_group, *mut epcomm_group) =
        (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid arguments, or NULLs that are checked.
    unsafe {
        assert_eq!(
            epcomm_group_create_shm(cname.as_ptr(), 0, 1, std::ptr::null(), &mut h),
            0
        );
        let mut mask = [5i32; 1];
        assert_eq!(epcomm_group_lost_ranks(h, mask.as_mut_ptr(), 1), 0);
        assert_eq!(mask, [0]);
        assert_eq!(
            epcomm_group_lost_ranks(h, std::ptr::null_mut(), 1),
            Status::NullPointer as i32
        );
        assert_eq!(
            epcomm_group_lost_ranks(std::ptr::null(), mask.as_mut_ptr(), 1),
            Status::NullPointer as i32
        );
        let neg = [-1i32];
        assert_eq!(
            epcomm_group_shrink(h, neg.as_ptr(), 1, &mut h2),
            Status::InvalidArgument as i32
        );
        assert_eq!(
            last_error(),
            "excluded[0] is -1; expected a non-negative value"
        );
        assert_eq!(
            epcomm_group_shrink(h, std::ptr::null(), 1, &mut h2),
            Status::NullPointer as i32
        );
        assert_eq!(
            epcomm_group_shrink(h, std::ptr::null(), 0, std::ptr::null_mut()),
            Status::NullPointer as i32
        );
        assert_eq!(
            epcomm_group_shrink(std::ptr::null_mut(), std::ptr::null(), 0, &mut h2),
            Status::NullPointer as i32
        );
        assert_eq!(
            epcomm_group_shrink(h, std::ptr::null(), 0, &mut h2),
            0,
            "{}",
            last_error()
        );
        let (mut r, mut w) = (9, 9);
        assert_eq!(
            (epcomm_group_rank(h2, &mut r), epcomm_group_size(h2, &mut w)),
            (0, 0)
        );
        assert_eq!((r, w), (0, 1));
        assert_eq!(host_round(h2, &[0], 3), 0, "{}", last_error());
        assert_eq!(host_round(h, &[0], 4), 0, "{}", last_error());
        epcomm_group_destroy(h2);
        epcomm_group_destroy(h);
    }
    assert_no_leftovers(&name);
}

unsafe extern "C" fn cb_shrink_times_out(
    _: *mut c_void,
    _: *const i32,
    _: usize,
    _: *mut *mut c_void,
) -> i32 {
    Status::Timeout as i32
}

unsafe extern "C" fn cb_lost_ranks_fails(_: *mut c_void, _: *mut u8, _: i32) -> i32 {
    5
}

/// A host shrink callback's TIMEOUT is the shrink's status, with the callback's code in the
/// message; a failing lost_ranks callback reports no rank lost.
#[test]
fn host_shrink_callback_failures_keep_their_status() {
    let g = ShmGroup::join(&ranks::unique("gs", "host2"), 0, 1, GroupOptions::default()).unwrap();
    let user = Box::into_raw(Box::new(Inner(Box::new(g))));
    let mut cb = callbacks(user);
    cb.shrink = Some(cb_shrink_times_out);
    cb.lost_ranks = Some(cb_lost_ranks_fails);
    let (mut h, mut h2): (*mut epcomm_group, *mut epcomm_group) =
        (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: valid callbacks, name and out; the user data outlives the handle.
    unsafe {
        let rc = epcomm_group_create_host(&cb, c"h2".as_ptr(), 0, 1, std::ptr::null(), &mut h);
        assert_eq!(rc, 0, "{}", last_error());
        let mut mask = [3i32; 1];
        assert_eq!(epcomm_group_lost_ranks(h, mask.as_mut_ptr(), 1), 0);
        assert_eq!(mask, [0]);
        let rc = epcomm_group_shrink(h, std::ptr::null(), 0, &mut h2);
        assert_eq!(rc, Status::Timeout as i32);
        assert_eq!(
            last_error(),
            "host transport shrink failed for group 'h2' on rank 0: callback returned 7 (EPCOMM_ERROR_TIMEOUT)"
        );
        assert!(h2.is_null());
        epcomm_group_destroy(h);
        drop(Box::from_raw(user));
    }
}
