//! A forked child of a process in a shared-memory group (issue 27 item 10): every call the
//! child makes on its parent's group and manager, through the C ABI (destroy included) and the
//! Rust API, is EPCOMM_ERROR_INVALID_STATE naming the fork, and the child's destroy and drop
//! leave the parent's slot alone: the parent's and the peer's next barrier and dispatch are OK.
//! Before the fix the child's barrier "succeeded" as its parent's rank and the peer failed.
//!
//! Also: a fork while another thread calls epcomm nonstop never leaves the child's epcomm
//! locked (the child creates and destroys a handle of its own).
//!
//! Its own test binary, its tests serialized: the first forks while no other thread is inside
//! epcomm (the peer rank's thread is parked on a channel).

mod ranks;

use std::ffi::{c_char, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use epcomm::error::Error;
use epcomm::ffi::all2all::{
    epcomm_all2all, epcomm_all2all_create, epcomm_all2all_destroy_checked, epcomm_all2all_dispatch,
    epcomm_dispatch_output, epcomm_moe_config, epcomm_moe_config_init,
};
use epcomm::ffi::eplb_runtime::{
    epcomm_eplb_state_create, epcomm_eplb_state_destroy_checked,
    epcomm_eplb_state_migration_batching,
};
use epcomm::ffi::error::{epcomm_clear_last_error, epcomm_last_error_message};
use epcomm::ffi::group::{
    epcomm_group, epcomm_group_barrier, epcomm_group_create_shm, epcomm_group_destroy,
    epcomm_group_destroy_checked, epcomm_group_options_init, epcomm_group_size,
};
use epcomm::ffi::tensor::{epcomm_device, epcomm_tensor};
use epcomm::ffi::*;
use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions};

/// The tests fork: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn message() -> Option<String> {
    let p: *const c_char = epcomm_last_error_message();
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// The handles of one rank.
struct Rank {
    g: *mut epcomm_group,
    a: *mut epcomm_all2all,
    core: ShmGroup,
}

// SAFETY: each rank's handles are used by one thread at a time.
unsafe impl Send for Rank {}

fn join(name: &str, core_name: &str, rank: usize) -> Rank {
    let mut o = std::mem::MaybeUninit::zeroed();
    assert_eq!(
        unsafe { epcomm_group_options_init(o.as_mut_ptr()) },
        EPCOMM_OK
    );
    let mut o = unsafe { o.assume_init() };
    o.timeout_s = 20.0;
    let c = format!("{name}\0");
    let mut g = std::ptr::null_mut();
    let rc = unsafe { epcomm_group_create_shm(c.as_ptr().cast(), rank as i32, 2, &o, &mut g) };
    assert_eq!(rc, EPCOMM_OK, "{:?}", message());
    let mut cfg = std::mem::MaybeUninit::<epcomm_moe_config>::zeroed();
    assert_eq!(
        unsafe { epcomm_moe_config_init(cfg.as_mut_ptr()) },
        EPCOMM_OK
    );
    let mut cfg = unsafe { cfg.assume_init() };
    let f32t = epcomm_dtype {
        code: 2,
        bits: 32,
        lanes: 1,
    };
    (cfg.num_experts, cfg.top_k, cfg.hidden_size) = (4, 1, 2);
    (cfg.hidden_dtype, cfg.expert_dtype, cfg.out_dtype) = (f32t, f32t, f32t);
    let mut a = std::ptr::null_mut();
    let rc = unsafe { epcomm_all2all_create(g, c"deepep_high_throughput".as_ptr(), &cfg, &mut a) };
    assert_eq!(rc, EPCOMM_OK, "{:?}", message());
    let opts = GroupOptions {
        timeout: Duration::from_secs(20),
        ..GroupOptions::default()
    };
    let core = ShmGroup::join(core_name, rank, 2, opts).expect("core group");
    Rank { g, a, core }
}

fn tensor(data: *mut u8, shape: &mut [i64], code: u8, bits: u8) -> epcomm_tensor {
    epcomm_tensor {
        data: data.cast(),
        device: epcomm_device {
            device_type: EPCOMM_DEVICE_CPU,
            device_id: 0,
        },
        ndim: shape.len() as i32,
        dtype: epcomm_dtype {
            code,
            bits,
            lanes: 1,
        },
        shape: shape.as_mut_ptr(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

fn dispatch(a: *mut epcomm_all2all, rank: usize) -> i32 {
    let mut x = [rank as f32, 1.0];
    let mut ids = [(3 - rank) as i64];
    let mut w = [1.0f32];
    let (mut sx, mut si, mut sw) = ([1i64, 2], [1i64, 1], [1i64, 1]);
    let tx = tensor(x.as_mut_ptr().cast(), &mut sx, 2, 32);
    let ti = tensor(ids.as_mut_ptr().cast(), &mut si, 0, 64);
    let tw = tensor(w.as_mut_ptr().cast(), &mut sw, 2, 32);
    let mut out = std::mem::MaybeUninit::<epcomm_dispatch_output>::zeroed();
    unsafe { epcomm_all2all_dispatch(a, &tx, &ti, &tw, std::ptr::null(), 0, out.as_mut_ptr()) }
}

/// Rank 0's next ops, as rank 1 runs them too: barrier, dispatch, core barrier.
fn next_ops(r: &mut Rank, rank: usize) {
    assert_eq!(
        unsafe { epcomm_group_barrier(r.g) },
        EPCOMM_OK,
        "rank {rank}: {:?}",
        message()
    );
    assert_eq!(
        dispatch(r.a, rank),
        EPCOMM_OK,
        "rank {rank}: {:?}",
        message()
    );
    r.core
        .barrier()
        .unwrap_or_else(|e| panic!("rank {rank} core barrier: {e}"));
}

/// In the child: each check, as "" when it held or a line saying what did not.
fn child_checks(r: Rank, name: &str, core_name: &str, parent: u32) -> Vec<String> {
    let me = std::process::id();
    let fork = |what: &str| {
        format!(
            "{what} was created by pid {parent}; this process (pid {me}) is a fork of it and cannot use it: create a new one in the child"
        )
    };
    let (group_msg, a2a_msg) = (
        fork(&format!("group '{name}'")),
        fork("the epcomm_all2all handle"),
    );
    let mut out = Vec::new();
    let mut expect = |what: &str, rc: i32, want: &str| {
        let got = message();
        if rc != EPCOMM_ERROR_INVALID_STATE || got.as_deref() != Some(want) {
            out.push(format!(
                "{what}: status {rc}, message {got:?}; expected {want:?}"
            ));
        }
        epcomm_clear_last_error();
    };
    expect("barrier", unsafe { epcomm_group_barrier(r.g) }, &group_msg);
    let mut n = 0;
    expect(
        "size",
        unsafe { epcomm_group_size(r.g, &mut n) },
        &group_msg,
    );
    expect("dispatch", dispatch(r.a, 0), &a2a_msg);
    expect(
        "all2all destroy",
        unsafe { epcomm_all2all_destroy_checked(r.a) },
        &a2a_msg,
    );
    expect(
        "group destroy",
        unsafe { epcomm_group_destroy_checked(r.g) },
        &group_msg,
    );
    unsafe { epcomm_group_destroy(r.g) };
    expect("void group destroy", EPCOMM_ERROR_INVALID_STATE, &group_msg);
    let mut core = r.core;
    match core.barrier() {
        Err(Error::InvalidState(m)) if m == fork(&format!("group '{core_name}'")) => {}
        other => out.push(format!("core barrier: {other:?}")),
    }
    // The drop must leave the parent's slot alone (the parent's next barrier shows it).
    drop(core);
    out
}

#[test]
fn forked_child_is_refused_and_leaves_the_parent_alone() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let name = ranks::unique("fk", "g");
    let core_name = ranks::unique("fk", "c");
    let (to_peer, peer_rx) = mpsc::channel::<()>();
    let (n1, c1) = (name.clone(), core_name.clone());
    let peer = std::thread::spawn(move || {
        let mut r = join(&n1, &c1, 1);
        next_ops(&mut r, 1);
        // Parked until the child is gone.
        peer_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("released");
        next_ops(&mut r, 1);
        unsafe {
            assert_eq!(epcomm_all2all_destroy_checked(r.a), EPCOMM_OK);
            assert_eq!(epcomm_group_destroy_checked(r.g), EPCOMM_OK);
        }
    });
    let mut r = join(&name, &core_name, 0);
    next_ops(&mut r, 0);
    let parent = std::process::id();
    // SAFETY: the child only calls epcomm (no lock of which is held now: the peer is parked
    // after its ops) and leaves with _exit.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork failed");
    if child == 0 {
        let copy = Rank {
            g: r.g,
            a: r.a,
            // SAFETY: the child's own copy of the group; the parent's value is never dropped
            // in the child (it leaves with _exit).
            core: unsafe { std::ptr::read(&r.core) },
        };
        let failed = child_checks(copy, &name, &core_name, parent);
        for f in &failed {
            eprintln!("child: {f}");
        }
        unsafe { libc::_exit(i32::from(!failed.is_empty())) };
    }
    let status = wait_child(child, Duration::from_secs(30)).expect("the child finished");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child's checks failed (wait status {status:#x}; see its stderr)"
    );
    // The parent's and the peer's next ops work.
    to_peer.send(()).unwrap();
    next_ops(&mut r, 0);
    peer.join().expect("peer rank");
    unsafe {
        assert_eq!(epcomm_all2all_destroy_checked(r.a), EPCOMM_OK);
        assert_eq!(epcomm_group_destroy_checked(r.g), EPCOMM_OK);
    }
}

/// The wait status of `child`, or None (after killing it) when it ran past `limit`.
fn wait_child(child: libc::pid_t, limit: Duration) -> Option<i32> {
    let deadline = Instant::now() + limit;
    let mut status = 0;
    loop {
        let w = unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) };
        if w == child {
            return Some(status);
        }
        assert_eq!(w, 0, "waitpid failed");
        if Instant::now() > deadline {
            unsafe { libc::kill(child, libc::SIGKILL) };
            unsafe { libc::waitpid(child, &mut status, 0) };
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn new_state() -> *mut epcomm::ffi::eplb_runtime::epcomm_eplb_state {
    let mut s = std::ptr::null_mut();
    let rc = unsafe { epcomm_eplb_state_create(std::ptr::null(), c"m".as_ptr(), 1, 4, &mut s) };
    assert_eq!(rc, EPCOMM_OK, "{:?}", message());
    s
}

/// Another thread takes and releases epcomm's handle registry nonstop while this one forks:
/// each child creates and destroys a handle of its own within 10 s (before the fix a child
/// forked while the registry was held would wait for it forever).
#[test]
fn a_fork_during_calls_leaves_the_child_usable() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let state = new_state() as usize;
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut calls = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let mut b = true;
                let s = state as *const _;
                assert_eq!(
                    unsafe { epcomm_eplb_state_migration_batching(s, &mut b) },
                    EPCOMM_OK
                );
                calls += 1;
            }
            calls
        })
    };
    for i in 0..100 {
        // SAFETY: the child calls epcomm and leaves with _exit.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork failed");
        if child == 0 {
            let mut s = std::ptr::null_mut();
            let ok = unsafe {
                epcomm_eplb_state_create(std::ptr::null(), c"m".as_ptr(), 1, 4, &mut s) == EPCOMM_OK
                    && epcomm_eplb_state_destroy_checked(s) == EPCOMM_OK
            };
            unsafe { libc::_exit(i32::from(!ok)) };
        }
        let status = wait_child(child, Duration::from_secs(10));
        assert!(
            status.is_some(),
            "fork {i}: the child hung in its first epcomm call (a lock inherited held)"
        );
        let status = status.unwrap_or_default();
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "fork {i}: the child's create/destroy failed (wait status {status:#x})"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let calls = busy.join().expect("the calling thread");
    assert!(calls > 0);
    assert_eq!(
        unsafe { epcomm_eplb_state_destroy_checked(state as *mut _) },
        EPCOMM_OK
    );
}
