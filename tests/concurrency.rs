//! Concurrency, through the C entry points:
//! (a) the pure registry, configuration and policy functions from 8 threads at once, every
//!     result compared with a single-thread reference;
//! (b) the last error is per thread: concurrent failures with different messages and hints
//!     never show on another thread, a message stays valid while other threads fail, and a
//!     thread that never failed sees NULL;
//! (c) two independent shm groups in one process (2 ranks each, as threads) used at the same
//!     time with distinct data;
//! (d) one group (and one all2all manager) handle used from two threads at once: the second
//!     caller gets EPCOMM_ERROR_INVALID_STATE "in use by another thread", nothing crashes, and
//!     the handle works afterwards;
//! (e) a destroy of the group or the manager while another thread's call on it is in flight is
//!     refused with EPCOMM_ERROR_INVALID_STATE and frees nothing; stale pointers are refused;
//!     a manager keeps its destroyed group alive.
//!
//! Bounded: EPCOMM_CONCURRENCY_ITERS (default 200) iterations per thread in (a) and (b).

mod ranks;

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use epcomm::ffi::all2all::{
    epcomm_all2all, epcomm_all2all_check_layer, epcomm_all2all_create, epcomm_all2all_destroy,
    epcomm_all2all_destroy_checked, epcomm_all2all_dispatch, epcomm_all2all_get_stats,
    epcomm_all2all_stats, epcomm_dispatch_output, epcomm_moe_config, epcomm_moe_config_init,
};
use epcomm::ffi::config::{epcomm_config_check, epcomm_config_check_report};
use epcomm::ffi::eplb::epcomm_eplb_rebalance;
use epcomm::ffi::error::{
    epcomm_clear_last_error, epcomm_last_error_hint, epcomm_last_error_message,
    epcomm_status_string,
};
use epcomm::ffi::group::{
    epcomm_group, epcomm_group_all_gatherv, epcomm_group_barrier, epcomm_group_create_shm,
    epcomm_group_destroy, epcomm_group_destroy_checked, epcomm_group_options,
    epcomm_group_options_init, epcomm_group_reduce_scatterv, epcomm_group_size,
};
use epcomm::ffi::log::epcomm_set_log_callback;
use epcomm::ffi::select::{
    epcomm_all2all_backend_resolve, epcomm_eplb_communicator_select, epcomm_eplb_select_request,
};
use epcomm::ffi::tensor::{epcomm_device, epcomm_tensor};
use epcomm::ffi::*;

const THREADS: usize = 8;

fn iters() -> usize {
    std::env::var("EPCOMM_CONCURRENCY_ITERS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(200)
}

/// splitmix64, for thread-specific orders.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn text(p: *const c_char) -> Option<String> {
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fn message() -> Option<String> {
    text(epcomm_last_error_message())
}

fn hint() -> Option<String> {
    text(epcomm_last_error_hint())
}

/// Every log message, counted (the callback is process-wide and called from many threads).
static LOGGED: AtomicUsize = AtomicUsize::new(0);
static W1_LOGGED: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn count_log(_level: i32, msg: *const c_char, _user: *mut c_void) {
    LOGGED.fetch_add(1, Ordering::Relaxed);
    let m = unsafe { CStr::from_ptr(msg) }.to_string_lossy();
    if m.starts_with("'flashinfer_all2allv' is deprecated") {
        W1_LOGGED.fetch_add(1, Ordering::Relaxed);
    }
}

fn quiet_logs() {
    epcomm_set_log_callback(Some(count_log), std::ptr::null_mut());
}

/// A raw pointer handed to another thread (the tests keep the pointee alive).
struct Shared<T>(*mut T);
impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Shared<T> {}
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// The pointer (a method, so closures capture the whole Send wrapper).
    fn ptr(self) -> *mut T {
        self.0
    }
}

// ---- (a) pure functions from many threads ---------------------------------------------------

/// One call and everything it returned.
#[derive(Debug, Clone, PartialEq)]
enum Call {
    Resolve(&'static str),
    Config(&'static str),
    Report(&'static str),
    Rebalance(usize),
    Select(usize),
    Status(i32),
}

#[derive(Debug, Clone, PartialEq)]
struct Outcome {
    rc: i32,
    value: Vec<i64>,
    text: Option<String>,
    message: Option<String>,
    hint: Option<String>,
}

const NAMES: [&str; 10] = [
    "deepep_low_latency",
    "naive",
    "pplx",
    "flashinfer_all2allv",
    "allgather_reducescatter",
    "nixl_ep",
    "deepep_low_latenc",
    "DeepEP_LL",
    "",
    "moonep ",
];

const CONFIGS: [&str; 10] = [
    "{}",
    r#"{"all2all_backend": "deepep_low_latency", "enable_expert_parallel": true}"#,
    r#"{"all2all_backend": "naive", "platform": "cpu"}"#,
    r#"{"all2all_backend": "deepep_low_latency", "enable_expert_parallel": true, "enable_eplb": true, "data_parallel_size": 2, "eplb_config": {"use_async": false, "communicator": "torch_gloo"}, "nccl_available": true, "nixl_available": false}"#,
    r#"{"enable_eplb": true, "eplb_config": {"communicator": "pynccl"}}"#,
    r#"{"enable_elastic_ep": true}"#,
    r#"{"all2all_bakend": "naive"}"#,
    r#"{"platform": "tpu"}"#,
    r#"{"all2all_backend": "deepep_v2", "enable_dbo": true}"#,
    "{not json",
];

/// (L, E, P, G, N, R) and loads derived from the index.
const REBALANCE: [(i64, i64, i64, i64, i64, i64); 4] = [
    (2, 16, 24, 4, 2, 8),
    (1, 8, 12, 2, 1, 4),
    (3, 6, 9, 3, 2, 3),
    (1, 4, 3, 1, 1, 1),
];

fn loads(i: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|j| ((j * 37 + i * 11) % 101) as f32 * if j % 5 == 0 { 7.0 } else { 1.0 })
        .collect()
}

fn select_request(i: usize, dtypes: &[epcomm_dtype]) -> epcomm_eplb_select_request {
    let names: [Option<&CStr>; 5] = [
        None,
        Some(c"torch_gloo"),
        Some(c"pynccl"),
        Some(c"nixl"),
        Some(c"torch_ncc"),
    ];
    epcomm_eplb_select_request {
        struct_size: std::mem::size_of::<epcomm_eplb_select_request>() as u32,
        communicator: names[i % names.len()].map_or(std::ptr::null(), CStr::as_ptr),
        elastic: i.is_multiple_of(3),
        device_type: if i.is_multiple_of(2) {
            EPCOMM_DEVICE_CUDA
        } else {
            EPCOMM_DEVICE_CPU
        },
        weight_dtypes: dtypes.as_ptr(),
        num_weight_dtypes: dtypes.len(),
        nccl_available: (i % 2) as i32,
        nixl_available: (i / 2 % 2) as i32,
    }
}

fn all_calls() -> Vec<Call> {
    let mut v: Vec<Call> = NAMES.iter().map(|n| Call::Resolve(n)).collect();
    v.extend(CONFIGS.iter().map(|c| Call::Config(c)));
    v.extend(CONFIGS.iter().map(|c| Call::Report(c)));
    v.extend((0..REBALANCE.len()).map(Call::Rebalance));
    v.extend((0..10).map(Call::Select));
    v.extend((-2..14).map(Call::Status));
    v
}

fn run(call: &Call) -> Outcome {
    epcomm_clear_last_error();
    let mut value = Vec::new();
    let mut out_text = None;
    let rc = match call {
        Call::Resolve(name) => {
            let c = format!("{name}\0");
            let mut out = -1;
            let rc = unsafe { epcomm_all2all_backend_resolve(c.as_ptr().cast(), &mut out) };
            value.push(out as i64);
            rc
        }
        Call::Config(json) => {
            let c = format!("{json}\0");
            unsafe { epcomm_config_check(c.as_ptr().cast()) }
        }
        Call::Report(json) => {
            let c = format!("{json}\0");
            let mut len = 0usize;
            let rc = unsafe {
                epcomm_config_check_report(c.as_ptr().cast(), std::ptr::null_mut(), 0, &mut len)
            };
            if rc == EPCOMM_OK {
                let mut buf = vec![0u8; len + 1];
                let rc = unsafe {
                    epcomm_config_check_report(
                        c.as_ptr().cast(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        &mut len,
                    )
                };
                assert_eq!(rc, EPCOMM_OK);
                out_text = Some(String::from_utf8_lossy(&buf[..len]).into_owned());
            }
            rc
        }
        Call::Rebalance(i) => {
            let (l, e, p, g, n, r) = REBALANCE[*i];
            let w = loads(*i, (l * e) as usize);
            let mut out = vec![-1i64; (l * p) as usize];
            let rc = unsafe {
                epcomm_eplb_rebalance(
                    w.as_ptr(),
                    l,
                    e,
                    p,
                    g,
                    n,
                    r,
                    std::ptr::null(),
                    out.as_mut_ptr(),
                )
            };
            value = out;
            rc
        }
        Call::Select(i) => {
            let dtypes = [
                epcomm_dtype {
                    code: 4,
                    bits: 16,
                    lanes: 1,
                },
                epcomm_dtype {
                    code: 10,
                    bits: 8,
                    lanes: 1,
                },
            ];
            let req = select_request(*i, &dtypes[..i % 3]);
            let mut out = -1;
            let rc = unsafe { epcomm_eplb_communicator_select(&req, &mut out) };
            value.push(out as i64);
            rc
        }
        Call::Status(s) => {
            out_text = text(epcomm_status_string(*s));
            assert!(out_text.is_some(), "epcomm_status_string({s}) is NULL");
            EPCOMM_OK
        }
    };
    Outcome {
        rc,
        value,
        text: out_text,
        message: message(),
        hint: hint(),
    }
}

#[test]
fn pure_functions_from_many_threads() {
    quiet_logs();
    let calls = Arc::new(all_calls());
    let reference: Arc<Vec<Outcome>> = Arc::new(calls.iter().map(run).collect());
    // The reference itself: successes leave no message, failures have one.
    for (c, o) in calls.iter().zip(reference.iter()) {
        assert_eq!(o.rc == EPCOMM_OK, o.message.is_none(), "{c:?}: {o:?}");
        assert_ne!(o.rc, EPCOMM_ERROR_INTERNAL, "{c:?}: {o:?}");
    }
    assert!(
        reference
            .iter()
            .any(|o| o.rc == EPCOMM_OK && o.value.len() > 8),
        "no rebalance succeeded in the reference"
    );
    let n = iters();
    let start = Arc::new(Barrier::new(THREADS));
    let t0 = Instant::now();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (calls, reference, start) = (calls.clone(), reference.clone(), start.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(t as u64 * 7919 + 1);
                start.wait();
                let mut mismatches = Vec::new();
                for _ in 0..n {
                    let i = rng.below(calls.len());
                    let got = run(&calls[i]);
                    if got != reference[i] && mismatches.len() < 5 {
                        mismatches.push(format!(
                            "thread {t}: {:?}\n   got {got:?}\n  want {:?}",
                            calls[i], reference[i]
                        ));
                    }
                }
                mismatches
            })
        })
        .collect();
    let mismatches: Vec<String> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("a thread panicked"))
        .collect();
    println!(
        "{THREADS} threads x {n} calls of {} kinds in {:.2?}; {} log messages",
        calls.len(),
        t0.elapsed(),
        LOGGED.load(Ordering::Relaxed)
    );
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    // vLLM's warning_once: the deprecated alias warns once per process, however many threads.
    assert_eq!(W1_LOGGED.load(Ordering::Relaxed), 1);
}

// ---- (b) thread-local last errors -----------------------------------------------------------

/// How a thread fails (or does not), and what it must then see.
#[derive(Clone, Copy)]
enum Role {
    /// An unknown backend name: message and a hint.
    Name(&'static str, &'static str, &'static str),
    /// A bad configuration: message, no hint expected to match another's.
    Config(&'static str),
    /// A NULL handle: a message, no hint.
    Null,
    /// Only successful calls: message and hint stay NULL.
    Never,
}

fn act(role: Role) -> i32 {
    match role {
        Role::Name(name, _, _) => {
            let c = format!("{name}\0");
            let mut out = 0;
            unsafe { epcomm_all2all_backend_resolve(c.as_ptr().cast(), &mut out) }
        }
        Role::Config(json) => {
            let c = format!("{json}\0");
            unsafe { epcomm_config_check(c.as_ptr().cast()) }
        }
        Role::Null => unsafe { epcomm_group_barrier(std::ptr::null_mut()) },
        Role::Never => {
            let mut out = 0;
            let a =
                unsafe { epcomm_all2all_backend_resolve(c"deepep_low_latency".as_ptr(), &mut out) };
            let b = unsafe { epcomm_config_check(c"{}".as_ptr()) };
            a.max(b)
        }
    }
}

#[test]
fn last_error_is_per_thread() {
    quiet_logs();
    let roles = [
        Role::Name(
            "deepep_low_latenc",
            "Unknown all2all backend: deepep_low_latenc",
            "deepep_low_latency",
        ),
        Role::Name(
            "mori_high_throughpt",
            "Unknown all2all backend: mori_high_throughpt",
            "mori_high_throughput",
        ),
        Role::Config(r#"{"platform": "tpu"}"#),
        Role::Null,
        Role::Never,
        Role::Never,
    ];
    // Each failing role's own message and hint, taken alone.
    let own: Vec<(Option<String>, Option<String>)> = roles
        .iter()
        .map(|&r| {
            epcomm_clear_last_error();
            act(r);
            (message(), hint())
        })
        .collect();
    epcomm_clear_last_error();
    for (r, (m, h)) in roles.iter().zip(&own) {
        match r {
            Role::Name(_, msg, near) => {
                assert_eq!(m.as_deref(), Some(*msg));
                assert!(h.as_deref().is_some_and(|h| h.contains(near)), "{h:?}");
            }
            Role::Config(_) => assert!(m.as_deref().is_some_and(|m| m.contains("platform"))),
            Role::Null => {
                assert!(m.as_deref().is_some_and(|m| m.contains("'group'")), "{m:?}");
                assert_eq!(h, &None);
            }
            Role::Never => assert_eq!((m, h), (&None, &None)),
        }
    }
    let n = iters();
    let step = Arc::new(Barrier::new(roles.len()));
    let own = Arc::new(own);
    let handles: Vec<_> = roles
        .iter()
        .enumerate()
        .map(|(i, &role)| {
            let (step, own) = (step.clone(), own.clone());
            std::thread::spawn(move || {
                let mut errors = Vec::new();
                let check = |what: &str, errors: &mut Vec<String>| {
                    let got = (message(), hint());
                    if got != own[i] && errors.len() < 5 {
                        errors.push(format!("role {i} {what}: got {got:?}, want {:?}", own[i]));
                    }
                };
                for it in 0..n {
                    // Everybody calls at once, then everybody reads at once.
                    step.wait();
                    let rc = act(role);
                    if matches!(role, Role::Never) {
                        assert_eq!(rc, EPCOMM_OK);
                    } else {
                        assert_ne!(rc, EPCOMM_OK);
                    }
                    step.wait();
                    check("after the concurrent calls", &mut errors);
                    // The message pointer stays valid (and unchanged) while the others keep
                    // failing; successful calls on this thread leave it alone.
                    let p = epcomm_last_error_message();
                    step.wait();
                    for _ in 0..5 {
                        if !matches!(role, Role::Never) {
                            let mut out = 0;
                            let ok = unsafe {
                                epcomm_all2all_backend_resolve(c"naive".as_ptr(), &mut out)
                            };
                            assert_eq!(ok, EPCOMM_OK);
                        }
                    }
                    step.wait();
                    if text(p) != own[i].0 && errors.len() < 5 {
                        errors.push(format!(
                            "role {i}: the saved message changed to {:?}",
                            text(p)
                        ));
                    }
                    check("after others failed again", &mut errors);
                    if it % 50 == 49 && !matches!(role, Role::Never) {
                        // Clearing is per thread too.
                        epcomm_clear_last_error();
                        if message().is_some() || hint().is_some() {
                            errors.push(format!("role {i}: clear left {:?}", message()));
                        }
                        act(role);
                    }
                }
                errors
            })
        })
        .collect();
    let errors: Vec<String> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("a thread panicked"))
        .collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

// ---- groups -----------------------------------------------------------------------------------

fn options(timeout_s: f64) -> epcomm_group_options {
    let mut o = std::mem::MaybeUninit::<epcomm_group_options>::zeroed();
    assert_eq!(
        unsafe { epcomm_group_options_init(o.as_mut_ptr()) },
        EPCOMM_OK
    );
    let mut o = unsafe { o.assume_init() };
    o.timeout_s = timeout_s;
    o
}

fn join(name: &str, rank: usize, world: usize) -> Shared<epcomm_group> {
    let c = format!("{name}\0");
    let o = options(20.0);
    let mut g = std::ptr::null_mut();
    let rc = unsafe {
        epcomm_group_create_shm(c.as_ptr().cast(), rank as i32, world as i32, &o, &mut g)
    };
    assert_eq!(rc, EPCOMM_OK, "join {name} rank {rank}: {:?}", message());
    Shared(g)
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

/// The value rank `rank` of group `group` contributes at iteration `it`, row `r`, column `c`.
fn datum(group: usize, rank: usize, it: usize, r: usize, c: usize) -> i64 {
    ((group as i64 + 1) << 40)
        | ((rank as i64) << 32)
        | ((it as i64) << 12)
        | (r as i64) << 4
        | c as i64
}

/// (c): two groups of two ranks, four threads, at the same time.
#[test]
fn two_groups_in_one_process() {
    quiet_logs();
    let groups = 2;
    let world = 2;
    let n = iters().max(20);
    let names: Vec<String> = (0..groups).map(|_| ranks::unique("cc", "g")).collect();
    let start = Arc::new(Barrier::new(groups * world));
    let handles: Vec<_> = (0..groups * world)
        .map(|t| {
            let (gi, rank) = (t / world, t % world);
            let name = names[gi].clone();
            let start = start.clone();
            std::thread::spawn(move || {
                let g = join(&name, rank, world);
                start.wait();
                let cols = 3usize;
                for it in 0..n {
                    // Uneven row counts that change with the iteration and differ by group.
                    let sizes: Vec<i64> =
                        (0..world).map(|r| ((it + r + gi * 3) % 4) as i64).collect();
                    let mine = sizes[rank] as usize;
                    let total: usize = sizes.iter().map(|&s| s as usize).sum();
                    let mut input: Vec<i64> = (0..mine * cols)
                        .map(|k| datum(gi, rank, it, k / cols, k % cols))
                        .collect();
                    let mut output = vec![-1i64; total * cols];
                    let mut si = [mine as i64, cols as i64];
                    let mut so = [total as i64, cols as i64];
                    let ti = tensor(input.as_mut_ptr().cast(), &mut si, 0, 64);
                    let to = tensor(output.as_mut_ptr().cast(), &mut so, 0, 64);
                    let rc = unsafe { epcomm_group_all_gatherv(g.ptr(), &ti, sizes.as_ptr(), &to) };
                    assert_eq!(rc, EPCOMM_OK, "group {gi} rank {rank}: {:?}", message());
                    let mut k = 0;
                    for (r, &s) in sizes.iter().enumerate() {
                        for row in 0..s as usize {
                            for c in 0..cols {
                                assert_eq!(
                                    output[k],
                                    datum(gi, r, it, row, c),
                                    "group {gi} rank {rank} iteration {it}: row {row} of rank {r}"
                                );
                                k += 1;
                            }
                        }
                    }
                    // A reduction whose sum differs between the groups.
                    let rows = [1i64, 1];
                    let mut rin = [(gi * 10 + rank + 1) as f32; 2];
                    let mut rout = [0f32; 1];
                    let mut sri = [2i64];
                    let mut sro = [1i64];
                    let tri = tensor(rin.as_mut_ptr().cast(), &mut sri, 2, 32);
                    let tro = tensor(rout.as_mut_ptr().cast(), &mut sro, 2, 32);
                    let rc =
                        unsafe { epcomm_group_reduce_scatterv(g.ptr(), &tri, rows.as_ptr(), &tro) };
                    assert_eq!(rc, EPCOMM_OK, "{:?}", message());
                    let want: f32 = (0..world).map(|r| (gi * 10 + r + 1) as f32).sum();
                    assert_eq!(rout[0], want, "group {gi}: sums mixed between groups");
                    if it % 8 == 0 {
                        assert_eq!(unsafe { epcomm_group_barrier(g.ptr()) }, EPCOMM_OK);
                    }
                }
                unsafe { epcomm_group_destroy(g.ptr()) };
            })
        })
        .collect();
    for h in handles {
        h.join().expect("a rank panicked");
    }
    for name in &names {
        assert!(
            ranks::shm_leftovers(name).is_empty(),
            "{name}: {:?}",
            ranks::shm_leftovers(name)
        );
    }
}

// ---- (d) one handle, two threads ------------------------------------------------------------

const IN_USE: &str = "in use by another thread";

/// Calls `probe` until it reports the handle busy (bounded); returns the message seen.
fn until_busy(what: &str, mut probe: impl FnMut() -> i32) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        epcomm_clear_last_error();
        let rc = probe();
        if rc == EPCOMM_ERROR_INVALID_STATE {
            return message().unwrap_or_default();
        }
        assert_eq!(rc, EPCOMM_OK, "{what}: {:?}", message());
        assert!(
            Instant::now() < deadline,
            "{what}: never saw the handle in use while another thread was inside a call"
        );
        std::thread::yield_now();
    }
}

/// Runs `call` until it is not refused as "in use" (bounded); returns its status and message.
fn retry_while_in_use(mut call: impl FnMut() -> i32) -> (i32, Option<String>) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        epcomm_clear_last_error();
        let rc = call();
        let busy =
            rc == EPCOMM_ERROR_INVALID_STATE && message().is_some_and(|m| m.contains(IN_USE));
        if !busy || Instant::now() > deadline {
            return (rc, message());
        }
        std::thread::yield_now();
    }
}

/// Rank 0's thread A blocks in a collective (rank 1 holds back); thread B calls on the same
/// handle meanwhile and must be refused; then rank 1 joins and everything completes.
#[test]
fn same_group_from_two_threads() {
    quiet_logs();
    let name = ranks::unique("cc", "d");
    let n1 = name.clone();
    let release = Arc::new(AtomicBool::new(false));
    let r1 = {
        let release = release.clone();
        std::thread::spawn(move || {
            let g = join(&n1, 1, 2);
            while !release.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(
                unsafe { epcomm_group_barrier(g.ptr()) },
                EPCOMM_OK,
                "{:?}",
                message()
            );
            // And once more, after the handle on rank 0 was refused to the second thread.
            assert_eq!(
                unsafe { epcomm_group_barrier(g.ptr()) },
                EPCOMM_OK,
                "{:?}",
                message()
            );
            unsafe { epcomm_group_destroy(g.ptr()) };
        })
    };
    let g0 = join(&name, 0, 2);
    let a = std::thread::spawn(move || {
        // The probing thread may hold the handle for an instant as this call starts: retry
        // until this call is the one inside.
        retry_while_in_use(|| unsafe { epcomm_group_barrier(g0.ptr()) })
    });
    let msg = until_busy("epcomm_group_size", || {
        let mut size = 0;
        let rc = unsafe { epcomm_group_size(g0.ptr(), &mut size) };
        if rc == EPCOMM_OK {
            assert_eq!(size, 2);
        }
        rc
    });
    assert!(msg.contains(IN_USE), "{msg:?}");
    release.store(true, Ordering::Release);
    let (rc, m) = a.join().expect("thread A");
    assert_eq!(rc, EPCOMM_OK, "thread A's barrier: {m:?}");
    // The handle works afterwards, from this thread.
    assert_eq!(
        unsafe { epcomm_group_barrier(g0.ptr()) },
        EPCOMM_OK,
        "{:?}",
        message()
    );
    r1.join().expect("rank 1");
    unsafe { epcomm_group_destroy(g0.ptr()) };
}

fn manager(g: Shared<epcomm_group>) -> Shared<epcomm_all2all> {
    let mut c = std::mem::MaybeUninit::<epcomm_moe_config>::zeroed();
    assert_eq!(unsafe { epcomm_moe_config_init(c.as_mut_ptr()) }, EPCOMM_OK);
    let mut c = unsafe { c.assume_init() };
    c.num_experts = 4;
    c.top_k = 1;
    c.hidden_size = 2;
    let f32t = epcomm_dtype {
        code: 2,
        bits: 32,
        lanes: 1,
    };
    c.hidden_dtype = f32t;
    c.expert_dtype = f32t;
    c.out_dtype = f32t;
    let mut a = std::ptr::null_mut();
    let rc =
        unsafe { epcomm_all2all_create(g.ptr(), c"deepep_high_throughput".as_ptr(), &c, &mut a) };
    assert_eq!(rc, EPCOMM_OK, "{:?}", message());
    Shared(a)
}

fn dispatch_one(a: Shared<epcomm_all2all>, rank: usize) -> (i32, Option<String>) {
    let mut x = [rank as f32, 1.0];
    let mut ids = [(3 - rank) as i64];
    let mut w = [1.0f32];
    let (mut sx, mut si, mut sw) = ([1i64, 2], [1i64, 1], [1i64, 1]);
    let tx = tensor(x.as_mut_ptr().cast(), &mut sx, 2, 32);
    let ti = tensor(ids.as_mut_ptr().cast(), &mut si, 0, 64);
    let tw = tensor(w.as_mut_ptr().cast(), &mut sw, 2, 32);
    let mut out = std::mem::MaybeUninit::<epcomm_dispatch_output>::zeroed();
    let rc = unsafe {
        epcomm_all2all_dispatch(
            a.ptr(),
            &tx,
            &ti,
            &tw,
            std::ptr::null(),
            0,
            out.as_mut_ptr(),
        )
    };
    (rc, message())
}

/// The same with an all2all manager: a dispatch in flight on rank 0, and a second thread asking
/// the same manager for its statistics and checking a layer.
#[test]
fn same_manager_from_two_threads() {
    quiet_logs();
    let name = ranks::unique("cc", "m");
    let n1 = name.clone();
    let release = Arc::new(AtomicBool::new(false));
    let r1 = {
        let release = release.clone();
        std::thread::spawn(move || {
            let g = join(&n1, 1, 2);
            let a = manager(g);
            while !release.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            let (rc, m) = dispatch_one(a, 1);
            assert_eq!(rc, EPCOMM_OK, "rank 1 dispatch: {m:?}");
            unsafe {
                epcomm_all2all_destroy(a.ptr());
                epcomm_group_destroy(g.ptr());
            }
        })
    };
    let g0 = join(&name, 0, 2);
    let a0 = manager(g0);
    let t = std::thread::spawn(move || retry_while_in_use(|| dispatch_one(a0, 0).0));
    let msg = until_busy("epcomm_all2all_get_stats", || {
        let mut s = std::mem::MaybeUninit::<epcomm_all2all_stats>::zeroed();
        unsafe { epcomm_all2all_get_stats(a0.ptr(), s.as_mut_ptr()) }
    });
    assert!(msg.contains(IN_USE), "{msg:?}");
    epcomm_clear_last_error();
    let rc = unsafe { epcomm_all2all_check_layer(a0.ptr(), 1, 4) };
    // Still in flight (rank 1 has not dispatched): refused, or fine if it already finished.
    assert!(
        rc == EPCOMM_ERROR_INVALID_STATE || rc == EPCOMM_OK,
        "{rc} {:?}",
        message()
    );
    // The group under the manager is busy too.
    let msg = until_busy("epcomm_group_barrier on the manager's group", || unsafe {
        epcomm_group_barrier(g0.ptr())
    });
    assert!(msg.contains(IN_USE), "{msg:?}");
    release.store(true, Ordering::Release);
    let (rc, m) = t.join().expect("dispatching thread");
    assert_eq!(rc, EPCOMM_OK, "rank 0 dispatch: {m:?}");
    let mut s = std::mem::MaybeUninit::<epcomm_all2all_stats>::zeroed();
    assert_eq!(
        unsafe { epcomm_all2all_get_stats(a0.ptr(), s.as_mut_ptr()) },
        EPCOMM_OK
    );
    r1.join().expect("rank 1");
    unsafe {
        epcomm_all2all_destroy(a0.ptr());
        epcomm_group_destroy(g0.ptr());
    }
}

/// Best effort: two threads hammer one (1-rank) group handle; every call either runs or is
/// refused as in use, never anything else, and a refusal happens within the bound.
#[test]
fn racing_calls_on_one_handle() {
    quiet_logs();
    let name = ranks::unique("cc", "r");
    let g = join(&name, 0, 1);
    let refused = Arc::new(AtomicUsize::new(0));
    let ran = Arc::new(AtomicUsize::new(0));
    let other = Arc::new(Mutex::new(Vec::<String>::new()));
    let deadline = Instant::now() + Duration::from_secs(20);
    let min_iters = iters() * 20;
    let handles: Vec<_> = (0..2)
        .map(|t| {
            let (refused, ran, other) = (refused.clone(), ran.clone(), other.clone());
            std::thread::spawn(move || {
                let mut i = 0usize;
                // Until both outcomes were seen (and at least min_iters calls), or the bound.
                while i < min_iters
                    || (refused.load(Ordering::Relaxed) == 0 && Instant::now() < deadline)
                {
                    epcomm_clear_last_error();
                    let rc = if (i + t).is_multiple_of(2) {
                        unsafe { epcomm_group_barrier(g.ptr()) }
                    } else {
                        let mut v = [t as u8; 4];
                        let mut o = [0u8; 4];
                        let (mut si, mut so) = ([1i64, 4], [1i64, 4]);
                        let ti = tensor(v.as_mut_ptr(), &mut si, 1, 8);
                        let to = tensor(o.as_mut_ptr(), &mut so, 1, 8);
                        let sizes = [1i64];
                        let rc =
                            unsafe { epcomm_group_all_gatherv(g.ptr(), &ti, sizes.as_ptr(), &to) };
                        if rc == EPCOMM_OK {
                            assert_eq!(o, v, "all_gatherv mixed the two threads' data");
                        }
                        rc
                    };
                    match rc {
                        EPCOMM_OK => {
                            ran.fetch_add(1, Ordering::Relaxed);
                        }
                        EPCOMM_ERROR_INVALID_STATE
                            if message().is_some_and(|m| m.contains(IN_USE)) =>
                        {
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => other.lock().unwrap().push(format!("{rc} {:?}", message())),
                    }
                    i += 1;
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("a thread panicked");
    }
    let (ran, refused) = (ran.load(Ordering::Relaxed), refused.load(Ordering::Relaxed));
    println!("{ran} calls ran, {refused} refused as in use");
    let other = other.lock().unwrap();
    assert!(
        other.is_empty(),
        "unexpected outcomes: {:?}",
        &other[..other.len().min(5)]
    );
    assert!(ran > 0);
    if refused == 0 {
        // Two cores may never overlap within the bound; (d) above forces the overlap.
        println!("note: the two threads never overlapped within the bound");
    }
    // The handle still works.
    assert_eq!(unsafe { epcomm_group_barrier(g.ptr()) }, EPCOMM_OK);
    unsafe { epcomm_group_destroy(g.ptr()) };
}

// ---- (e) destroy while another thread's call is in flight ------------------------------------

const DESTROY_ITERS: usize = 25;

/// The refusal of a destroy under a call, for the handle `label` names.
fn busy_destroy(label: &str) -> String {
    format!(
        "cannot destroy {label}: a call using it is in flight on another thread; nothing was freed: destroy it after that call returns"
    )
}

/// The checked destroy's status and message, then the void destroy's recorded message.
fn assert_destroy_refused(checked: impl Fn() -> i32, void: impl Fn(), want: &str) {
    epcomm_clear_last_error();
    assert_eq!(checked(), EPCOMM_ERROR_INVALID_STATE, "{:?}", message());
    assert_eq!(message().as_deref(), Some(want));
    epcomm_clear_last_error();
    void();
    assert_eq!(message().as_deref(), Some(want));
}

/// Rank 0's thread A runs a barrier, then a dispatch, waiting for rank 1 (held back until rank
/// 0's main thread tried its destroys); every destroy of the group and of the manager is refused
/// with the full message and frees nothing, the call completes, and the handles work after; at
/// the end every destroy succeeds. Before the fix the destroy freed the handles under the call.
#[test]
fn destroy_refused_while_a_call_is_in_flight() {
    quiet_logs();
    let name = ranks::unique("cc", "x");
    let n1 = name.clone();
    let (go, gate) = std::sync::mpsc::channel::<()>();
    let r1 = std::thread::spawn(move || {
        let g = join(&n1, 1, 2);
        let a = manager(g);
        for _ in 0..DESTROY_ITERS {
            gate.recv_timeout(Duration::from_secs(30))
                .expect("released");
            assert_eq!(
                unsafe { epcomm_group_barrier(g.ptr()) },
                EPCOMM_OK,
                "{:?}",
                message()
            );
            gate.recv_timeout(Duration::from_secs(30))
                .expect("released");
            let (rc, m) = dispatch_one(a, 1);
            assert_eq!(rc, EPCOMM_OK, "rank 1 dispatch: {m:?}");
        }
        unsafe {
            assert_eq!(epcomm_all2all_destroy_checked(a.ptr()), EPCOMM_OK);
            assert_eq!(epcomm_group_destroy_checked(g.ptr()), EPCOMM_OK);
        }
    });
    let g0 = join(&name, 0, 2);
    let a0 = manager(g0);
    let group_busy = busy_destroy(&format!("group '{name}'"));
    let a2a_busy = busy_destroy("the epcomm_all2all handle");
    let destroy_group = || unsafe { epcomm_group_destroy_checked(g0.ptr()) };
    let destroy_group_void = || unsafe { epcomm_group_destroy(g0.ptr()) };
    let group_size = || {
        let mut n = 0;
        unsafe { epcomm_group_size(g0.ptr(), &mut n) }
    };
    for _ in 0..DESTROY_ITERS {
        // A barrier in flight.
        let t = std::thread::spawn(move || {
            retry_while_in_use(|| unsafe { epcomm_group_barrier(g0.ptr()) })
        });
        until_busy("epcomm_group_size", group_size);
        assert_destroy_refused(destroy_group, destroy_group_void, &group_busy);
        go.send(()).unwrap();
        let (rc, m) = t.join().expect("barrier thread");
        assert_eq!(rc, EPCOMM_OK, "rank 0 barrier: {m:?}");
        // A dispatch in flight: the manager and the group under it.
        let t = std::thread::spawn(move || retry_while_in_use(|| dispatch_one(a0, 0).0));
        until_busy("epcomm_all2all_get_stats", || {
            let mut s = std::mem::MaybeUninit::<epcomm_all2all_stats>::zeroed();
            unsafe { epcomm_all2all_get_stats(a0.ptr(), s.as_mut_ptr()) }
        });
        until_busy("epcomm_group_size", group_size);
        assert_destroy_refused(
            || unsafe { epcomm_all2all_destroy_checked(a0.ptr()) },
            || unsafe { epcomm_all2all_destroy(a0.ptr()) },
            &a2a_busy,
        );
        assert_destroy_refused(destroy_group, destroy_group_void, &group_busy);
        go.send(()).unwrap();
        let (rc, m) = t.join().expect("dispatch thread");
        assert_eq!(rc, EPCOMM_OK, "rank 0 dispatch: {m:?}");
    }
    r1.join().expect("rank 1");
    unsafe {
        assert_eq!(epcomm_all2all_destroy_checked(a0.ptr()), EPCOMM_OK);
        assert_eq!(epcomm_group_destroy_checked(g0.ptr()), EPCOMM_OK);
    }
}

/// After a destroy, a call or a second destroy on the stale pointer is refused (no use of freed
/// memory), and so is a pointer of another handle type; a manager keeps its destroyed group
/// alive (the group's handle is refused, the manager still dispatches) until its own destroy.
#[test]
fn stale_pointers_refused_and_managers_keep_their_group() {
    quiet_logs();
    let name = ranks::unique("cc", "s");
    let outcomes = ranks::on_threads(2, move |rank| {
        let g = join(&name, rank, 2);
        let a = manager(g);
        let spare = manager(g);
        unsafe { assert_eq!(epcomm_all2all_destroy_checked(spare.ptr()), EPCOMM_OK) };
        let gone = format!(
            "a2a ({:p}) is not a live epcomm_all2all handle: it was destroyed already, or was not made by epcomm",
            spare.ptr()
        );
        assert_eq!(
            dispatch_one(spare, rank),
            (EPCOMM_ERROR_INVALID_STATE, Some(gone.clone()))
        );
        unsafe {
            assert_eq!(
                epcomm_all2all_destroy_checked(spare.ptr()),
                EPCOMM_ERROR_INVALID_STATE
            );
        }
        assert_eq!(message(), Some(gone));
        // A group is not a manager.
        let (rc, m) = dispatch_one(Shared(g.ptr().cast()), rank);
        assert_eq!(rc, EPCOMM_ERROR_INVALID_STATE);
        assert_eq!(
            m,
            Some(format!(
                "a2a ({:p}) is not a live epcomm_all2all handle: it was destroyed already, or was not made by epcomm",
                g.ptr()
            ))
        );
        // The group goes first: retired, kept alive by the manager.
        unsafe { assert_eq!(epcomm_group_destroy_checked(g.ptr()), EPCOMM_OK) };
        let gone = format!(
            "group ({:p}) is not a live epcomm_group handle: it was destroyed already, or was not made by epcomm",
            g.ptr()
        );
        assert_eq!(
            unsafe { epcomm_group_barrier(g.ptr()) },
            EPCOMM_ERROR_INVALID_STATE
        );
        assert_eq!(message(), Some(gone));
        let (rc, m) = dispatch_one(a, rank);
        assert_eq!(rc, EPCOMM_OK, "{m:?}");
        unsafe { assert_eq!(epcomm_all2all_destroy_checked(a.ptr()), EPCOMM_OK) };
    });
    assert_eq!(outcomes.len(), 2);
}

/// An EPLB communicator's execute in flight (rank 0's thread sends, rank 1 held back): the
/// destroys of the communicator and of its group are refused with the full messages; the
/// transfer completes with the right bytes; the group destroyed first lives on with the
/// communicator, which frees it.
#[test]
fn eplb_communicator_destroy_refused_during_execute() {
    use epcomm::ffi::eplb_runtime::{
        epcomm_eplb_communicator, epcomm_eplb_communicator_add_recv,
        epcomm_eplb_communicator_add_send, epcomm_eplb_communicator_create,
        epcomm_eplb_communicator_destroy, epcomm_eplb_communicator_destroy_checked,
        epcomm_eplb_communicator_execute,
    };
    quiet_logs();
    let name = ranks::unique("cc", "e");
    let comm = |g: Shared<epcomm_group>| -> Shared<epcomm_eplb_communicator> {
        let request = epcomm_eplb_select_request {
            struct_size: std::mem::size_of::<epcomm_eplb_select_request>() as u32,
            communicator: c"torch_gloo".as_ptr(),
            elastic: false,
            device_type: EPCOMM_DEVICE_CPU,
            weight_dtypes: std::ptr::null(),
            num_weight_dtypes: 0,
            nccl_available: 0,
            nixl_available: 0,
        };
        let mut c = std::ptr::null_mut();
        let rc = unsafe { epcomm_eplb_communicator_create(g.ptr(), &request, &mut c) };
        assert_eq!(rc, EPCOMM_OK, "{:?}", message());
        Shared(c)
    };
    let (go, gate) = std::sync::mpsc::channel::<()>();
    let n1 = name.clone();
    let r1 = std::thread::spawn(move || {
        let g = join(&n1, 1, 2);
        let c = comm(g);
        gate.recv_timeout(Duration::from_secs(30))
            .expect("released");
        let mut buf = [0u8; 8];
        let mut shape = [8i64];
        let t = tensor(buf.as_mut_ptr(), &mut shape, 1, 8);
        unsafe {
            assert_eq!(
                epcomm_eplb_communicator_add_recv(c.ptr(), &t, 1, 0, 7),
                EPCOMM_OK
            );
            assert_eq!(
                epcomm_eplb_communicator_execute(c.ptr()),
                EPCOMM_OK,
                "{:?}",
                message()
            );
        }
        unsafe {
            assert_eq!(epcomm_group_destroy_checked(g.ptr()), EPCOMM_OK);
            assert_eq!(epcomm_eplb_communicator_destroy_checked(c.ptr()), EPCOMM_OK);
        }
        buf
    });
    let g0 = join(&name, 0, 2);
    let c0 = comm(g0);
    let t = std::thread::spawn(move || {
        let mut buf = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let mut shape = [8i64];
        let t = tensor(buf.as_mut_ptr(), &mut shape, 1, 8);
        unsafe {
            assert_eq!(
                epcomm_eplb_communicator_add_send(c0.ptr(), &t, 1, 1, 7),
                EPCOMM_OK
            );
            retry_while_in_use(|| epcomm_eplb_communicator_execute(c0.ptr()))
        }
    });
    until_busy("epcomm_group_size", || {
        let mut n = 0;
        unsafe { epcomm_group_size(g0.ptr(), &mut n) }
    });
    assert_destroy_refused(
        || unsafe { epcomm_eplb_communicator_destroy_checked(c0.ptr()) },
        || unsafe { epcomm_eplb_communicator_destroy(c0.ptr()) },
        &busy_destroy("the epcomm_eplb_communicator handle"),
    );
    assert_destroy_refused(
        || unsafe { epcomm_group_destroy_checked(g0.ptr()) },
        || unsafe { epcomm_group_destroy(g0.ptr()) },
        &busy_destroy(&format!("group '{name}'")),
    );
    go.send(()).unwrap();
    let (rc, m) = t.join().expect("executing thread");
    assert_eq!(rc, EPCOMM_OK, "rank 0 execute: {m:?}");
    assert_eq!(r1.join().expect("rank 1"), [1, 2, 3, 4, 5, 6, 7, 8]);
    unsafe {
        assert_eq!(epcomm_group_destroy_checked(g0.ptr()), EPCOMM_OK);
        assert_eq!(
            epcomm_eplb_communicator_destroy_checked(c0.ptr()),
            EPCOMM_OK
        );
    }
}
