//! The GPU transport's two flows that are not a plain counts-mode exchange, run with the
//! manager's own pipeline (`epcomm::gpu::transport::pipeline`) on the host executor of
//! tests/gpu_emu (the real kernel sources compiled for the host, ranks as threads):
//! - capacity mode (`GpuMode::Capacity`, EXPERT_MAJOR): padded slabs of M rows with ids -1
//!   broadcast to every rank, device-side selection into buckets, combine returning M*K rows
//!   per peer at fixed positions (the "iota" pair positions);
//! - REPLICATED: each token packed once (R = 1, all flags set), broadcast, ids kept with
//!   `ep_unpack_token_major(E_local = E, rank = 0)`, `ep_sum_ranks` without flags.
//!
//! Both on the two-rank worked example (R = 2, E = 4, K = 2), expecting its combine results.
//! One kernel-level check stays in C++: capacity mode's `ep_pair_rows` on bad wire ids.
//!
//! And the NCCL loader against non-blocking communicators (tests/gpu_emu/fake_nccl.rs, in a
//! child process): owned ones are created non-blocking (`ncclCommInitRankConfig`), and
//! `ncclInProgress` is queued work, waited out by polling `ncclCommGetAsyncError`, bounded (an
//! init never completed is aborted); abort happens once and only for owned communicators.

mod common;
mod gpu_emu;

use std::time::Duration;

use epcomm::error::Status;
use epcomm::gpu::kernels::{self, IdDtype};
use epcomm::gpu::nccl::{self, counts_plan, ExchangeOptions, NcclComm, NcclUniqueId};
use epcomm::gpu::transport::pipeline::Pipeline;
use epcomm::gpu::transport::{DispatchInput, GpuDispatch, GpuMode};
use epcomm::moe::MoeConfig;
use epcomm::num::FloatKind;

use common::cuda_emu;
use gpu_emu::{emu_or_skip, on_ranks, read, serial, Fabric, HostExec};

const EMU_MAIN: &str = r##"#include "emu_prelude.h"
#include "prelude_tail.h"
#include "layout.cu"
#include <functional>
using namespace std;
static void launch(unsigned grid, unsigned block, const function<void()>& f) { emu_seq(grid, block, f); }
static vector<int> scan(const vector<int>& v) { vector<int> o(v.size() + 1); int s = 0; for (size_t i = 0; i < v.size(); ++i) { o[i] = s; s += v[i]; } o[v.size()] = s; return o; }
static int fails = 0;
#define CHECK(c) do { if (!(c)) { printf("FAIL line %d: %s\n", __LINE__, #c); ++fails; } } while (0)

const int R = 2, E = 4, EL = 2, K = TOPK, M = 3, N = R * M;

// Capacity mode never checks the error word before combine: an id >= E (or < -1) travels on
// the wire, and the source's ep_pair_rows must not index pair_pos with its owner (which would
// read past the iota array and then past the combine receive buffer).
static void capacity_bad_id() {
    vector<int> ones(N * K, 1); vector<int> iota = scan(ones);
    vector<int> ids = {0, 9, 1000000, 1, 3, -5};  // T = 3; ids 9, 1000000 and -5 are bad
    vector<int> crow(M * K, 7);
    launch(1, 32, [&] { ep_pair_rows(ids.data(), M, E, EL, iota.data(), crow.data()); });
    CHECK(crow == vector<int>({0 * M * K + 0, -1, -1, 0 * M * K + 1 * K + 1, 1 * M * K + 2 * K + 0, -1}));
    for (int r : crow) CHECK(r >= -1 && r < N * K);
}

int main() {
    capacity_bad_id();
    printf("%s (%d failures)\n", fails ? "FAILED" : "OK", fails);
    return fails != 0;
}
"##;

#[test]
fn capacity_pair_rows_never_index_with_a_bad_wire_id() {
    let Some(cxx) = cuda_emu::cxx_or_skip("capacity_pair_rows_never_index_with_a_bad_wire_id")
    else {
        return;
    };
    let dir = cuda_emu::temp_dir("pipeline-emu");
    cuda_emu::write_sources(
        &dir,
        &[("layout.cu", kernels::LAYOUT_CU), ("main.cpp", EMU_MAIN)],
    );
    // ID_DTYPE=0: the wire ids are int32 (capacity mode's ep_pair_rows runs on them).
    let (ok, stdout) = cuda_emu::build_and_run(&cxx, &dir, &["-DID_DTYPE=0".into()], "emu");
    println!("{stdout}");
    assert!(ok && stdout.contains("OK (0 failures)"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

const R: usize = 2;
const E: usize = 4;
const EL: usize = 2;
const K: usize = 2;
const M: usize = 3;

/// One rank of the worked example: x, ids, weights, and the combine result.
type Example = (Vec<f32>, Vec<i32>, Vec<f32>, Vec<f32>);

/// The worked example, per rank.
fn worked_example() -> [Example; R] {
    [
        (
            vec![10., 11., 12.],
            vec![0, 2, 1, 0, 3, -1],
            vec![0.5, 0.5, 0.25, 0.75, 1., 0.],
            vec![20., 13.75, 48.],
        ),
        (
            vec![20., 21.],
            vec![2, 3, 1, -1],
            vec![0.5, 0.5, 1., 0.],
            vec![70., 42.],
        ),
    ]
}

/// One rank of the pipeline on the host.
struct Rank {
    pipe: Pipeline,
    x: HostExec,
    d: usize,
}

fn ranks(backend: &str, mode: GpuMode) -> Vec<Rank> {
    let cfg = MoeConfig {
        num_experts: E,
        top_k: K,
        hidden: 1,
        hidden_dtype: FloatKind::F32.dtype(),
        expert_dtype: FloatKind::F32,
        out_dtype: FloatKind::F32,
        max_tokens_per_rank: M,
        extra_row_bytes: vec![],
        apply_router_weight_on_input: false,
    };
    let fabric = Fabric::new(R);
    (0..R)
        .map(|d| {
            let pipe = Pipeline::new(backend, cfg.clone(), d, R, mode, true).unwrap();
            let mut x = HostExec::new(d, fabric.clone(), K as u32, FloatKind::F32);
            // What GpuManager::new does.
            pipe.reserve(&mut x).unwrap();
            Rank { pipe, x, d }
        })
        .collect()
}

impl Rank {
    fn dispatch(&mut self) -> GpuDispatch {
        let (x, ids, w, _) = &worked_example()[self.d];
        let input = DispatchInput {
            hidden: self.x.put("in_hidden", epcomm::bytes::as_bytes(x)),
            topk_ids: self.x.put("in_ids", epcomm::bytes::as_bytes(ids)),
            id_dtype: IdDtype::I32,
            topk_weights: self.x.put("in_w", epcomm::bytes::as_bytes(w)),
            tokens: x.len(),
            extras: vec![],
        };
        let o = self.pipe.dispatch(&mut self.x, &input).unwrap();
        let err = self.x.mem.get("err");
        assert_eq!(
            read::<u64>(err, 1)[0],
            0,
            "device error word, rank {}",
            self.d
        );
        o
    }

    fn combine(&mut self, y: &[f32]) -> Vec<f32> {
        let t = worked_example()[self.d].0.len();
        let y = self.x.put("expert_output", epcomm::bytes::as_bytes(y));
        let out = self.x.mem.input("comb_out", 4 * t);
        self.pipe.combine(&mut self.x, y, out).unwrap();
        read::<f32>(out, t)
    }
}

#[test]
fn capacity_mode_worked_example_on_the_host() {
    let _serial = serial();
    if emu_or_skip("capacity_mode_worked_example_on_the_host").is_none() {
        return;
    }
    let mut rs = ranks("deepep_low_latency", GpuMode::Capacity);
    let cap = M * R;
    let ys = on_ranks(&mut rs, |r| {
        let o = r.dispatch();
        let counts = read::<i32>(o.counts, EL);
        assert_eq!(counts, vec![2, 2], "rank {}", r.d);
        let rows = read::<f32>(o.hidden, EL * cap);
        let want = if r.d == 0 {
            [10., 11., 11., 21.]
        } else {
            [10., 20., 12., 20.]
        };
        assert_eq!(
            [rows[0], rows[1], rows[cap], rows[cap + 1]],
            want,
            "rank {}",
            r.d
        );
        // Experts y = (e+1) x on the received rows of each bucket.
        let mut y = vec![0f32; rows.len()];
        for (j, &c) in counts.iter().enumerate() {
            for i in j * cap..j * cap + c as usize {
                y[i] = (r.d * EL + j + 1) as f32 * rows[i];
            }
        }
        y
    });
    let mut pairs: Vec<(&mut Rank, &Vec<f32>)> = rs.iter_mut().zip(&ys).collect();
    let outs = on_ranks(&mut pairs, |(r, y)| r.combine(y));
    for (d, out) in outs.iter().enumerate() {
        println!("capacity out: {out:?}");
        assert_eq!(*out, worked_example()[d].3, "rank {d}");
    }
}

#[test]
fn replicated_worked_example_on_the_host() {
    let _serial = serial();
    if emu_or_skip("replicated_worked_example_on_the_host").is_none() {
        return;
    }
    let mut rs = ranks("allgather_reducescatter", GpuMode::Counts);
    let all_ids: Vec<i64> = worked_example()
        .iter()
        .flat_map(|r| r.1.iter().map(|&i| i64::from(i)))
        .collect();
    let all_w: Vec<f32> = worked_example().iter().flat_map(|r| r.2.clone()).collect();
    let ys = on_ranks(&mut rs, |r| {
        let o = r.dispatch();
        let n = o.shape.received_rows;
        let rows = read::<f32>(o.hidden, n);
        assert_eq!(rows, vec![10., 11., 12., 20., 21.], "rank {}", r.d);
        let (ids, w) = (
            read::<i64>(o.topk_ids, n * K),
            read::<f32>(o.topk_weights, n * K),
        );
        assert_eq!(ids, all_ids, "rank {}", r.d);
        assert_eq!(w, all_w, "rank {}", r.d);
        // This rank's partial sums over its own experts.
        let mut y = vec![0f32; n];
        for i in 0..n {
            for k in 0..K {
                let e = ids[i * K + k];
                if e >= 0 && e as usize / EL == r.d {
                    y[i] += w[i * K + k] * (e + 1) as f32 * rows[i];
                }
            }
        }
        y
    });
    let mut pairs: Vec<(&mut Rank, &Vec<f32>)> = rs.iter_mut().zip(&ys).collect();
    let outs = on_ranks(&mut pairs, |(r, y)| r.combine(y));
    for (d, out) in outs.iter().enumerate() {
        println!("replicated out: {out:?}");
        assert_eq!(*out, worked_example()[d].3, "rank {d}");
    }
}

// ---- a non-blocking NCCL communicator (a fake libnccl in a child process) -----------------

const FAKE_NB_ENV: &str = "EPCOMM_TEST_FAKE_NONBLOCKING_NCCL";

/// An all-gather through `c` (the fake never dereferences the addresses).
fn fake_gather(c: &NcclComm) -> epcomm::Result<()> {
    // SAFETY: the fake never dereferences the addresses.
    unsafe {
        c.all_gather(
            8 as *const _,
            16 as *mut _,
            3,
            nccl::NcclDataType::Int32,
            std::ptr::null_mut(),
        )
    }
}

/// Runs in a child process with `VLLM_NCCL_SO_PATH` = the fake (the loader is per process).
#[test]
fn nonblocking_nccl_child() {
    let Ok(path) = std::env::var(FAKE_NB_ENV) else {
        return;
    };
    let log = || gpu_emu::fake_nccl::log(&path);
    let api = nccl::api().unwrap();
    let id = NcclUniqueId::from_bytes(&[0; 128]).unwrap();
    // Created non-blocking (ncclCommInitRankConfig, NCCL 2.14's 40-byte config, blocking 0;
    // the CTA fields NCCL_CONFIG_UNDEF_INT), the init waited out.
    let owned = NcclComm::init_rank(&id, 1, 2).unwrap();
    assert_eq!(
        log(),
        format!("initcfg 40 21400 0 {};poll;poll;poll;poll;", i32::MIN)
    );
    // SAFETY: the fake's communicator lives for the process.
    let mut comm = unsafe { NcclComm::adopt(owned.raw()) }.unwrap();
    let opts = ExchangeOptions::for_version(api.version);
    let plan = counts_plan(&[1, 2, 3, 4], 2, 1, 10, opts).unwrap();
    // ncclInProgress from the send in the group and from the group end: queued, waited out.
    let before = log().len();
    // SAFETY: the fake never dereferences the addresses.
    unsafe { comm.exchange(&plan, 0x1000, 0x8000, std::ptr::null_mut()) }.unwrap();
    assert_eq!(&log()[before..], "gs;send;recv;ge;poll;poll;poll;poll;");
    let before = log().len();
    fake_gather(&comm).unwrap();
    assert_eq!(&log()[before..], "allgather;poll;poll;poll;poll;");
    // Queued work that then fails is that failure.
    std::env::set_var("FAKE_ASYNC", "1");
    let e = fake_gather(&comm).unwrap_err();
    std::env::remove_var("FAKE_ASYNC");
    assert_eq!(e.status(), Status::PeerFailure);
    assert_eq!(
        e.to_string(),
        "NCCL error in ncclAllGather: remote process exited or there was a network error (ncclResult_t 6)"
    );
    // Never leaving ncclInProgress: bounded by the timeout.
    comm.set_timeout(Duration::from_millis(50));
    std::env::set_var("FAKE_STUCK", "1");
    // SAFETY: as above.
    let e = unsafe { comm.exchange(&plan, 0x1000, 0x8000, std::ptr::null_mut()) }.unwrap_err();
    std::env::remove_var("FAKE_STUCK");
    assert_eq!(e.status(), Status::Timeout);
    assert_eq!(
        e.to_string(),
        epcomm::Error::Timeout(
            "NCCL: ncclGroupEnd was still in progress after 50ms (a non-blocking communicator; a peer rank is not participating?)".into()
        )
        .to_string()
    );
    abort_then_stuck_init(comm, owned, &id, &log);
}

/// The borrowed `comm` is never aborted; the `owned` one is aborted once, then refuses calls
/// and is not destroyed; an init some rank never joins is a Timeout, the communicator aborted.
fn abort_then_stuck_init(
    comm: NcclComm,
    owned: NcclComm,
    id: &NcclUniqueId,
    log: &dyn Fn() -> String,
) {
    assert_eq!(comm.abort().unwrap_err().status(), Status::InvalidState);
    drop(comm);
    owned.abort().unwrap();
    owned.abort().unwrap();
    assert!(log().ends_with("abort;"));
    assert_eq!(log().matches("abort;").count(), 1);
    let e = fake_gather(&owned).unwrap_err();
    assert_eq!(
        e.to_string(),
        epcomm::Error::InvalidState(
            "the NCCL communicator was aborted after an earlier failure".into()
        )
        .to_string()
    );
    drop(owned);
    assert!(!log().contains("destroy;"));
    std::env::set_var("FAKE_STUCK", "1");
    let e = NcclComm::init_rank_within(id, 0, 2, Duration::from_millis(50)).unwrap_err();
    std::env::remove_var("FAKE_STUCK");
    assert_eq!(
        e.to_string(),
        epcomm::Error::Timeout(
            "NCCL: ncclCommInitRankConfig was still in progress after 50ms (a non-blocking communicator; a peer rank is not participating?)".into()
        )
        .to_string()
    );
    assert!(log().ends_with("poll;abort;"));
}

#[test]
fn nonblocking_nccl_in_progress_is_queued_work_waited_out_bounded() {
    if std::env::var(FAKE_NB_ENV).is_ok() {
        return;
    }
    let test = "nonblocking_nccl_in_progress_is_queued_work_waited_out_bounded";
    let dir = cuda_emu::temp_dir("fake-nb-nccl");
    let lib = match gpu_emu::fake_nccl::build(&dir) {
        Ok(lib) => lib,
        Err(why) => {
            common::skip::skipped(test, &format!("cannot build the fake libnccl: {why}"));
            return;
        }
    };
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "nonblocking_nccl_child",
            "--exact",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(FAKE_NB_ENV, &lib)
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
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
}
