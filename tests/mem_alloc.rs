//! Zero-copy views: the manager's expert-output buffer (a window of the group's shared memory)
//! and caller memory from epcomm_mem_alloc. Combine from either gives exactly the bytes of
//! combine from a private copy, for every backend's layout on 2 and 4 thread ranks and 2 and
//! 4 process ranks; the manager counts each combine that read its buffer in place; every misuse
//! of the C calls is an error code with its message; nothing is left in /dev/shm.

mod ranks;

use std::ffi::{c_void, CStr};
use std::ptr;
use std::time::Duration;

use epcomm::ffi::group::{epcomm_group, epcomm_group_create_shm, epcomm_group_destroy};
use epcomm::ffi::mem::{epcomm_mem_alloc, epcomm_mem_free};
use epcomm::group::shm::ShmGroup;
use epcomm::group::{Group, GroupOptions};
use epcomm::moe::reference::ToyExperts;
use epcomm::moe::{Manager, MoeConfig};
use epcomm::num::{self, FloatKind};
use epcomm::select::all2all::ACCEPTED_NAMES;

fn opts() -> GroupOptions {
    GroupOptions {
        timeout: Duration::from_secs(30),
        ..GroupOptions::default()
    }
}

fn cfg(world: usize) -> MoeConfig {
    MoeConfig {
        num_experts: 4 * world,
        top_k: 3,
        hidden: 40,
        hidden_dtype: FloatKind::Bf16.dtype(),
        expert_dtype: FloatKind::Bf16,
        out_dtype: FloatKind::Bf16,
        max_tokens_per_rank: 16,
        extra_row_bytes: vec![],
        apply_router_weight_on_input: false,
    }
}

/// Rank `r`'s tokens: a count that differs per rank (0 on rank 1 of 4), ids with one masked.
fn inputs(r: usize, world: usize, e: usize) -> (Vec<u8>, Vec<i64>, Vec<f32>) {
    let t = if world == 4 && r == 1 { 0 } else { 5 + 3 * r };
    let ids: Vec<i64> = (0..t * 3)
        .map(|i| match i % 7 {
            6 => -1,
            _ => ((i * 5 + r * 3 + i / 3) % e) as i64,
        })
        .collect();
    let ws: Vec<f32> = (0..t * 3).map(|i| 0.25 + (i % 4) as f32 * 0.125).collect();
    let x: Vec<f32> = (0..t * 40)
        .map(|i| ((i * 7 + r) % 19) as f32 * 0.5 - 4.0)
        .collect();
    (num::from_f32(&x, FloatKind::Bf16), ids, ws)
}

/// One backend on this rank: combine from a private copy, from the manager's expert-output
/// buffer (combine_in_place, and combine given the buffer), and from caller shared memory;
/// the three results must equal the copying one byte for byte. Returns the in-place count.
fn zero_copy_round(g: &mut dyn Group, name: &str, world: usize) -> u64 {
    let r = g.rank();
    let c = cfg(world);
    let experts = ToyExperts::new(c.num_experts, c.hidden, 11);
    let mut m = Manager::new(name, c.clone(), r, world).unwrap();
    let (x, ids, ws) = inputs(r, world, c.num_experts);
    let t = ws.len() / 3;
    let mut outs = Vec::new();
    for path in 0..4 {
        let v = m.dispatch(g, &x, &ids, &ws, &[]).unwrap();
        let y = num::from_f32(
            &experts.run_local(&v, FloatKind::Bf16, r, world, 3),
            FloatKind::Bf16,
        );
        let mut out = vec![0u8; t * 40 * 2];
        match path {
            0 => m.combine(g, &y, &mut out).unwrap(),
            1 => {
                m.expert_output_buffer(g).unwrap().copy_from_slice(&y);
                m.combine_in_place(g, &mut out).unwrap();
            }
            2 => {
                let buf = m.expert_output_buffer(g).unwrap();
                buf.copy_from_slice(&y);
                // The caller's view of the buffer (as C and Python hold it).
                let view = unsafe { std::slice::from_raw_parts(buf.as_ptr(), buf.len()) };
                m.combine(g, view, &mut out).unwrap();
            }
            _ => {
                let mut mine = g.alloc_shared(y.len()).unwrap().unwrap();
                mine.copy_from_slice(&y);
                m.combine(g, &mine, &mut out).unwrap();
            }
        }
        outs.push(out);
    }
    for (p, o) in outs.iter().enumerate().skip(1) {
        assert_eq!(o, &outs[0], "{name} R={world} rank {r}: path {p} differs");
    }
    m.zero_copy_combines()
}

fn backends() -> impl Iterator<Item = &'static str> {
    ACCEPTED_NAMES
        .iter()
        .map(|n| n.name)
        .filter(|n| *n != "moonep")
}

fn thread_case(world: usize) {
    let name = ranks::unique("za", "threads");
    let group = name.clone();
    let counts = ranks::on_threads(world, move |r| {
        let mut g = ShmGroup::join(&group, r, world, opts()).unwrap();
        assert!(g.direct(), "zero-copy needs a direct-mode group");
        backends()
            .map(|b| zero_copy_round(&mut g, b, world))
            .collect::<Vec<_>>()
    });
    for c in counts {
        assert!(c.iter().all(|&n| n == 2), "in-place combines: {c:?}");
    }
    assert!(ranks::shm_leftovers(&name).is_empty());
}

#[test]
fn zero_copy_matches_copying_on_2_thread_ranks() {
    thread_case(2);
}

#[test]
fn zero_copy_matches_copying_on_4_thread_ranks() {
    thread_case(4);
}

/// One rank process of [`zero_copy_matches_copying_on_2_process_ranks`] and the 4-rank case.
#[test]
fn zero_copy_rank_child() {
    let (Ok(name), Ok(rank), Ok(world)) = (
        std::env::var("ZC_GROUP"),
        std::env::var("ZC_RANK"),
        std::env::var("ZC_WORLD"),
    ) else {
        return;
    };
    let (rank, world): (usize, usize) = (rank.parse().unwrap(), world.parse().unwrap());
    let mut g = ShmGroup::join(&name, rank, world, opts()).unwrap();
    let counts: Vec<u64> = backends()
        .map(|b| zero_copy_round(&mut g, b, world))
        .collect();
    assert!(counts.iter().all(|&n| n == 2), "{counts:?}");
    g.barrier().unwrap();
    println!("ZC_OK");
}

fn process_case(world: usize) {
    let name = ranks::unique("zp", "procs");
    let kids = ranks::spawn_ranks("zero_copy_rank_child", 0..world, |r| {
        vec![
            ("ZC_GROUP", name.clone()),
            ("ZC_RANK", r.to_string()),
            ("ZC_WORLD", world.to_string()),
        ]
    });
    let done = ranks::wait_all(kids, Duration::from_secs(120));
    ranks::assert_all_ok(&done);
    for d in &done {
        assert!(d.stdout.contains("ZC_OK"), "{}", d.output());
    }
    assert!(ranks::shm_leftovers(&name).is_empty());
}

#[test]
fn zero_copy_matches_copying_on_2_process_ranks() {
    process_case(2);
}

#[test]
fn zero_copy_matches_copying_on_4_process_ranks() {
    process_case(4);
}

/// Before a dispatch there is no expert-output buffer and no in-place combine.
#[test]
fn expert_output_buffer_needs_a_dispatch() {
    let name = ranks::unique("za", "before");
    ranks::on_threads(1, move |r| {
        let mut g = ShmGroup::join(&name, r, 1, opts()).unwrap();
        let mut m = Manager::new("deepep_high_throughput", cfg(1), 0, 1).unwrap();
        let e = m.expert_output_buffer(&mut g).unwrap_err();
        assert_eq!(
            e.to_string(),
            "expert_output_buffer called without a successful dispatch: call dispatch first"
        );
        let e = m.combine_in_place(&mut g, &mut []).unwrap_err();
        assert_eq!(
            e.to_string(),
            "expert_output_buffer called without a successful dispatch: call dispatch first"
        );
    });
}

/// This thread's last error message ("" when there is none: the pointer is then NULL).
fn last_error() -> String {
    let p = epcomm::ffi::error::epcomm_last_error_message();
    if p.is_null() {
        return String::new();
    }
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A one-rank shm group through the C ABI.
fn c_group(name: &str) -> *mut epcomm_group {
    let cname = std::ffi::CString::new(name).unwrap();
    let mut g = ptr::null_mut();
    let rc = unsafe { epcomm_group_create_shm(cname.as_ptr(), 0, 1, ptr::null(), &mut g) };
    assert_eq!(rc, 0, "{}", last_error());
    g
}

/// epcomm_mem_alloc / epcomm_mem_free misuse: each an error code with its message, the group
/// usable after, and nothing left in /dev/shm.
#[test]
fn mem_alloc_misuse_is_an_error() {
    let (na, nb) = (ranks::unique("zm", "a"), ranks::unique("zm", "b"));
    let (a, b) = (c_group(&na), c_group(&nb));
    let mut p: *mut c_void = ptr::null_mut();
    unsafe {
        assert_eq!(epcomm_mem_alloc(a, 0, &mut p), 2);
        assert_eq!(last_error(), "bytes is 0: expected at least 1");
        assert_eq!(epcomm_mem_alloc(a, 100, ptr::null_mut()), 1);
        assert_eq!(epcomm_mem_alloc(a, 100, &mut p), 0);
        let bytes = std::slice::from_raw_parts_mut(p.cast::<u8>(), 100);
        assert!(bytes.iter().all(|&x| x == 0), "not zeroed");
        bytes.fill(0xab);
        let not_mine = format!(
            "ptr {p:p} is not memory of group '{nb}' from epcomm_mem_alloc (freed already, from another group, or not the start of an allocation)"
        );
        assert_eq!(epcomm_mem_free(b, p), 2);
        assert_eq!(last_error(), not_mine);
        let inside = p.cast::<u8>().add(8).cast::<c_void>();
        assert_eq!(epcomm_mem_free(a, inside), 2);
        assert_eq!(
            last_error(),
            not_mine
                .replace(&format!("{p:p}"), &format!("{inside:p}"))
                .replace(&nb, &na)
        );
        assert_eq!(epcomm_mem_free(a, ptr::null_mut()), 0);
        assert_eq!(epcomm_mem_free(a, p), 0);
        assert_eq!(epcomm_mem_free(a, p), 2, "double free");
        assert_eq!(last_error(), not_mine.replace(&nb, &na));
        assert_eq!(epcomm_mem_free(ptr::null_mut(), p), 1);
        // Left for the group's destroy to free.
        assert_eq!(epcomm_mem_alloc(a, 1 << 20, &mut p), 0);
        epcomm_group_destroy(a);
        epcomm_group_destroy(b);
    }
    assert!(ranks::shm_leftovers(&na).is_empty());
    assert!(ranks::shm_leftovers(&nb).is_empty());
}

/// A region-mode group (direct_reads off, as EPCOMM_SHM_DIRECT=0) has no windows.
#[test]
fn mem_alloc_without_windows_is_unavailable() {
    let name = ranks::unique("zm", "region");
    ranks::on_threads(1, move |r| {
        let o = GroupOptions {
            direct_reads: false,
            ..opts()
        };
        let mut g = ShmGroup::join(&name, r, 1, o).unwrap();
        assert!(g.alloc_shared(64).unwrap().is_none());
    });
}

/// Freeing while another thread's call on the group is in flight (a barrier rank 1 has not
/// reached: it could be a combine reading the memory) is refused, and the memory stays valid.
#[test]
fn mem_free_during_a_call_is_refused() {
    let name = ranks::unique("zm", "busy");
    let cname = std::ffi::CString::new(name.clone()).unwrap();
    let join = |rank: i32| {
        let cname = cname.clone();
        std::thread::spawn(move || {
            let mut g = ptr::null_mut();
            let rc =
                unsafe { epcomm_group_create_shm(cname.as_ptr(), rank, 2, ptr::null(), &mut g) };
            assert_eq!(rc, 0, "{}", last_error());
            g as usize
        })
    };
    let (j0, j1) = (join(0), join(1));
    let (g0, g1) = (j0.join().unwrap(), j1.join().unwrap());
    let mut p: *mut c_void = ptr::null_mut();
    assert_eq!(
        unsafe { epcomm_mem_alloc(g0 as *mut epcomm_group, 256, &mut p) },
        0
    );
    // The barrier waits for rank 1, holding g0 all along; it retries while the probe below
    // holds the handle for an instant (that is the same refusal, seen from its side).
    let in_call = std::thread::spawn(move || loop {
        let rc = unsafe { epcomm::ffi::group::epcomm_group_barrier(g0 as *mut epcomm_group) };
        if rc != 9 {
            break rc;
        }
    });
    // A side-effect-free probe: freeing a pointer that was never allocated is INVALID_ARGUMENT
    // while the handle is free, INVALID_STATE (9) once the barrier holds it.
    let bogus = std::ptr::without_provenance_mut::<c_void>(8);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while unsafe { epcomm_mem_free(g0 as *mut epcomm_group, bogus) } != 9 {
        assert!(!in_call.is_finished(), "the barrier returned early");
        assert!(
            std::time::Instant::now() < deadline,
            "the barrier never held the group"
        );
        std::thread::yield_now();
    }
    let rc = unsafe { epcomm_mem_free(g0 as *mut epcomm_group, p) };
    assert_eq!(rc, 9);
    assert_eq!(
        last_error(),
        "the group handle is in use by another thread; use a group from one thread at a time"
    );
    unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), 256).fill(1) };
    assert_eq!(
        unsafe { epcomm::ffi::group::epcomm_group_barrier(g1 as *mut epcomm_group) },
        0
    );
    assert_eq!(in_call.join().unwrap(), 0);
    assert_eq!(unsafe { epcomm_mem_free(g0 as *mut epcomm_group, p) }, 0);
    unsafe {
        epcomm_group_destroy(g0 as *mut epcomm_group);
        epcomm_group_destroy(g1 as *mut epcomm_group);
    }
    assert!(ranks::shm_leftovers(&name).is_empty());
}
