//! A rank asleep on a futex word is woken by each kind of change it can wait for: a peer's
//! publish, its consumed count, a decision of the op (by any rank, whichever slot the sleeper
//! sleeps on), a peer's failure and a peer leaving. The sleeper's futex sleeps last 30 s here
//! ([`TEST_SLEEP`]), so a change that does not wake it shows as a wait of 30 s; the changing
//! rank acts only once it sees the sleeper counted on the slot. And counts that killed or
//! forged sleepers and pollers left behind cost nothing but system calls.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::TEST_SLEEP;
use crate::error::{Error, Result};
use crate::group::shm::decision::{abort_word, Cause};
use crate::group::shm::layout::{SLOT_LEFT, VERDICT_OK};
use crate::group::shm::ShmGroup;
use crate::group::{Group, GroupOptions, Op};

/// Longer than any wait here takes when the wake works, far shorter than TEST_SLEEP.
const BOUND: Duration = Duration::from_secs(10);

fn opts() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(60),
        ..GroupOptions::default()
    }
}

fn name(what: &str) -> String {
    format!("unit-futex-{what}-{}", std::process::id())
}

/// Joins `world` thread ranks of group `name`; returns the handles in rank order.
fn join_all(name: &str, world: usize) -> Vec<ShmGroup> {
    let handles: Vec<_> = (0..world)
        .map(|r| {
            let name = name.to_owned();
            std::thread::spawn(move || ShmGroup::join(&name, r, world, opts()).unwrap())
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Runs `wait` on a thread whose futex sleeps last 30 s; returns its result and how long it
/// took. `wait` hands the group back, so it is not destroyed on that thread.
fn sleeper<T: Send + 'static>(
    g: ShmGroup,
    wait: impl FnOnce(ShmGroup) -> T + Send + 'static,
) -> std::thread::JoinHandle<(T, Duration)> {
    std::thread::spawn(move || {
        TEST_SLEEP.with(|t| t.set(Some(Duration::from_secs(30))));
        let t = Instant::now();
        let out = wait(g);
        (out, t.elapsed())
    })
}

/// Destroys the handles at once, each on its own thread (each waits for the others to leave).
fn drop_all(gs: Vec<ShmGroup>) {
    let hs: Vec<_> = gs
        .into_iter()
        .map(|g| std::thread::spawn(move || drop(g)))
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

/// Waits (bounded) until some rank sleeps on rank `p`'s slot and `also` holds.
fn until_asleep_on(g: &ShmGroup, p: usize, also: impl Fn(&ShmGroup) -> bool) {
    let t = Instant::now();
    while !(g.slot(p).wake.sleepers.load(Ordering::SeqCst) > 0 && also(g)) {
        assert!(t.elapsed() < BOUND, "no rank fell asleep on slot {p}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn woken_in_time(took: Duration) {
    assert!(
        took < BOUND,
        "the sleeper was not woken: it waited {took:?}"
    );
}

/// A peer's publish wakes a rank waiting for it (and its consumed count, in the same barrier).
#[test]
fn a_publish_wakes_the_sleeper() {
    let mut gs = join_all(&name("publish"), 2);
    let h = sleeper(gs.pop().unwrap(), |mut g| (g.barrier(), g));
    let mut g0 = gs.pop().unwrap();
    until_asleep_on(&g0, 0, |_| true);
    g0.barrier().unwrap();
    let ((r, g1), took) = h.join().unwrap();
    r.unwrap();
    woken_in_time(took);
    drop_all(vec![g0, g1]);
}

/// A peer storing its consumed count wakes a rank waiting in the end of the op.
#[test]
fn a_consumed_count_wakes_the_sleeper() {
    let mut gs = join_all(&name("consumed"), 2);
    let h = sleeper(gs.pop().unwrap(), |mut g| (g.barrier(), g));
    let mut g0 = gs.pop().unwrap();
    let n = g0.begin(Op::Barrier).unwrap();
    g0.publish_as(Op::Barrier, n, VERDICT_OK, &[], &[], &[])
        .unwrap();
    g0.gather_published(Op::Barrier, n).unwrap();
    // The sleeper reached its finish (consumed n) and sleeps waiting for rank 0's.
    until_asleep_on(&g0, 0, |g| g.slot(1).consumed.load(Ordering::Acquire) >= n);
    g0.finish(Op::Barrier, n).unwrap();
    let ((r, g1), took) = h.join().unwrap();
    r.unwrap();
    woken_in_time(took);
    drop_all(vec![g0, g1]);
}

/// A decision wakes every sleeper, also one asleep on another rank's slot: rank 1 waits for
/// rank 2 (rank 0 published), and rank 0 aborts the op naming rank 2 as stalled.
#[test]
fn a_decision_wakes_sleepers_on_every_slot() {
    let group = name("decision");
    let mut gs = join_all(&group, 3);
    let mut g2 = gs.pop().unwrap();
    let h = sleeper(gs.pop().unwrap(), |mut g| (g.barrier(), g));
    let mut g0 = gs.pop().unwrap();
    let n = g0.begin(Op::Barrier).unwrap();
    g0.publish_as(Op::Barrier, n, VERDICT_OK, &[], &[], &[])
        .unwrap();
    until_asleep_on(&g0, 2, |_| true);
    g0.decide(n, abort_word(n, 2, Cause::Stalled));
    // Rank 1 then waits (as a failed rank in direct mode) until its thread peers stop
    // reading its buffers: they learn of the abort and fail, which wakes it again.
    assert_eq!(
        g2.barrier().unwrap_err().to_string(),
        format!("rank 2 of group '{group}' (this rank) was late for barrier (op #1): the other ranks timed out after 60.0 s waiting for it and aborted the op")
    );
    g0.fail(Error::Internal("test over".into()));
    let ((r, g1), took) = h.join().unwrap();
    assert_eq!(
        r.unwrap_err().to_string(),
        format!(
            "timed out after 60.0 s in barrier of group '{group}' (op #1) waiting for rank(s) 2"
        )
    );
    woken_in_time(took);
    drop_all(vec![g0, g1, g2]);
}

/// A peer that fails in the op wakes the rank waiting for it, which reports that failure.
#[test]
fn a_failure_wakes_the_sleeper() {
    let group = name("failure");
    let mut gs = join_all(&group, 2);
    let h = sleeper(gs.pop().unwrap(), |mut g| (g.barrier(), g));
    let mut g0 = gs.pop().unwrap();
    g0.begin(Op::Barrier).unwrap();
    until_asleep_on(&g0, 0, |_| true);
    g0.fail(Error::Internal("injected".into()));
    let ((r, g1), took) = h.join().unwrap();
    assert_eq!(
        r.unwrap_err().to_string(),
        format!("rank 0 of group '{group}' failed (an error on that rank aborted its group) during barrier (op #1, seen from rank 1)")
    );
    woken_in_time(took);
    drop_all(vec![g0, g1]);
}

/// A peer leaving (its slot state) wakes a rank waiting in its own destroy for the others to
/// leave.
#[test]
fn a_slot_state_wakes_the_sleeper() {
    let mut gs = join_all(&name("state"), 2);
    let h = sleeper(gs.pop().unwrap(), drop);
    let g0 = gs.pop().unwrap();
    until_asleep_on(&g0, 0, |g| {
        g.slot(1).state.load(Ordering::Acquire) == SLOT_LEFT
    });
    drop(g0);
    let ((), took) = h.join().unwrap();
    woken_in_time(took);
}

/// Sleeper counts that sleepers killed in their sleep left behind, and a forged count of
/// polling ranks, leave every op right: notifications then make system calls for nobody, and
/// waits sleep at once.
#[test]
fn leaked_counts_cost_only_system_calls() -> Result<()> {
    let world = 3;
    let group = name("leaked");
    let gs = join_all(&group, world);
    for r in 0..world {
        gs[0].slot(r).wake.sleepers.store(5, Ordering::SeqCst);
    }
    gs[0].header().polling.store(u32::MAX / 2, Ordering::SeqCst);
    let handles: Vec<_> = gs
        .into_iter()
        .map(|mut g| {
            std::thread::spawn(move || -> Result<ShmGroup> {
                let me = g.rank() as u8;
                for it in 0..200u8 {
                    let mine = [me ^ it; 16];
                    let mut all = [0u8; 48];
                    g.all_gatherv(&mine, &[16; 3], &mut all)?;
                    let want: Vec<u8> = (0..3u8).flat_map(|r| [r ^ it; 16]).collect();
                    assert_eq!(all.to_vec(), want);
                }
                Ok(g)
            })
        })
        .collect();
    let gs = handles
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect::<Result<Vec<_>>>()?;
    drop_all(gs);
    Ok(())
}
