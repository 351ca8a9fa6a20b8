//! The GPU transport's two flows that are not a plain counts-mode exchange, replayed with the
//! real kernel sources on the host (the C++ emulation of tests/gpu_kernels.rs, copied here):
//! - capacity mode (`GpuManager` with `GpuMode::Capacity`, EXPERT_MAJOR): padded slabs of M
//!   rows with ids -1 broadcast to every rank, device-side selection into buckets, combine
//!   returning M*K rows per peer at fixed positions (the "iota" pair positions);
//! - REPLICATED: each token packed once (R = 1, all flags set), broadcast, ids kept with
//!   `ep_unpack_token_major(E_local = E, rank = 0)`, `ep_sum_ranks` without flags.
//!
//! Both on SPEC §4's worked example (R = 2, E = 4, K = 2), expecting its combine results. The
//! host sequence mirrors src/gpu/transport/manager.rs step by step (same kernels, same
//! arguments); the exchanges are plain copies following `plan::broadcast_plan` and
//! `counts_plan` of a uniform matrix.

use epcomm::gpu::kernels;

const EMU_PRELUDE: &str = r##"// Host emulation of the CUDA prelude: runs the kernel bodies sequentially, thread by thread
// (valid for every kernel without __syncthreads/shuffles: all but scan and signal).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(x)
struct dim3_ { unsigned x, y, z; };
static thread_local dim3_ threadIdx;
static dim3_ blockIdx, blockDim, gridDim;
// Block-synchronous kernels (scan) run with one OS thread per CUDA thread: __syncthreads is a
// block barrier, a shuffle a per-warp exchange between two warp barriers, __shared__ a static.
#include <pthread.h>
#include <thread>
#define __shared__ static
struct EmuBlock { pthread_barrier_t block; pthread_barrier_t warp[32]; int xchg[1024]; };
static thread_local EmuBlock* emu_block;
static inline void __syncthreads() { pthread_barrier_wait(&emu_block->block); }
static inline int __shfl_up_sync(unsigned, int v, int o) {
    unsigned t = threadIdx.x, lane = t & 31u, w = t >> 5;
    emu_block->xchg[t] = v;
    pthread_barrier_wait(&emu_block->warp[w]);
    int r = lane >= (unsigned)o ? emu_block->xchg[t - o] : v;
    pthread_barrier_wait(&emu_block->warp[w]);
    return r;
}
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
struct uint4 { unsigned x, y, z, w; };
#ifndef TOPK
#define TOPK 1
#endif
#if ID_DTYPE == 0
typedef int id_t_;
#else
typedef long long id_t_;
#endif
static inline int atomicAdd(int* p, int v) { int o = *p; *p += v; return o; }
static inline u64 atomicCAS(u64* p, u64 c, u64 v) { u64 o = *p; if (o == c) *p = v; return o; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
"##;

const EMU_MAIN: &str = r##"#include "emu_prelude.h"
#include "prelude_tail.h"
#include "layout.cu"
#include "pack.cu"
#include "unpack.cu"
#include "combine.cu"
#include <functional>
using namespace std;
static void launch(unsigned grid, unsigned block, const function<void()>& f) {
    gridDim = {grid, 1, 1}; blockDim = {block, 1, 1};
    for (unsigned b = 0; b < grid; ++b) for (unsigned t = 0; t < block; ++t) { blockIdx = {b, 0, 0}; threadIdx = {t, 0, 0}; f(); }
}
static vector<int> scan(const vector<int>& v) { vector<int> o(v.size() + 1); int s = 0; for (size_t i = 0; i < v.size(); ++i) { o[i] = s; s += v[i]; } o[v.size()] = s; return o; }
static int fails = 0;
#define CHECK(c) do { if (!(c)) { printf("FAIL line %d: %s\n", __LINE__, #c); ++fails; } } while (0)
static void pr(const char* n, const vector<float>& v) { printf("%s:", n); for (float x : v) printf(" %g", x); printf("\n"); }

const int R = 2, E = 4, EL = 2, K = TOPK, M = 3, N = R * M;
vector<float> X[R] = {{10, 11, 12}, {20, 21}};
vector<int> IDS[R] = {{0, 2, 1, 0, 3, -1}, {2, 3, 1, -1}};
vector<float> W[R] = {{.5, .5, .25, .75, 1, 0}, {.5, .5, 1, 0}};
vector<float> WANT[R] = {{20, 13.75f, 48}, {70, 42}};

static void capacity() {
    // Every rank: static iota over N*K pair slots, [0, M, 2M] receive offsets.
    vector<int> ones(N * K, 1), mvals(R, M);
    vector<int> iota = scan(ones), d_off = scan(mvals);
    vector<float> send_rows[R], send_w[R]; vector<int> send_ids[R], send_src[R];
    u64 err = 0;
    for (int s = 0; s < R; ++s) {
        int T = (int)X[s].size();
        vector<int> dummy(R * T);
        launch(1, 32, [&] { ep_layout(IDS[s].data(), T, E, EL, R, dummy.data(), nullptr, nullptr, nullptr, &err); });
        send_rows[s].assign(M, -7); send_ids[s].assign(M * K, -1); send_w[s].assign(M * K, 0); send_src[s].assign(M, -7);
        launch(2, 64, [&] { ep_pack((const u8*)X[s].data(), 4, IDS[s].data(), W[s].data(), T, 1, ones.data(), iota.data(), (u8*)send_rows[s].data(), send_ids[s].data(), send_w[s].data(), send_src[s].data()); });
    }
    CHECK(err == 0);
    // Broadcast: rank d's receive slab s = rank s's send buffer.
    vector<float> ret[R]; vector<int> recv_ids[R]; vector<int> epos[R];
    for (int d = 0; d < R; ++d) {
        vector<float> rr, rw; vector<int> ri, rs;
        for (int s = 0; s < R; ++s) {
            rr.insert(rr.end(), send_rows[s].begin(), send_rows[s].end());
            ri.insert(ri.end(), send_ids[s].begin(), send_ids[s].end());
            rw.insert(rw.end(), send_w[s].begin(), send_w[s].end());
            rs.insert(rs.end(), send_src[s].begin(), send_src[s].end());
        }
        vector<int> eflag(EL * N, 7);
        launch(1, 64, [&] { ep_recv_flags(ri.data(), N, EL, d, eflag.data(), nullptr, nullptr); });
        epos[d] = scan(eflag);
        int cap = M * R;
        vector<float> rows(EL * cap, -1); vector<int> counts(EL, -1);
        launch(1, 64, [&] { ep_unpack_expert_major((const u8*)rr.data(), ri.data(), rw.data(), rs.data(), d_off.data(), N, R, 4, EL, d, eflag.data(), epos[d].data(), cap, (u8*)rows.data(), counts.data(), nullptr, nullptr, nullptr, &err); });
        CHECK(err == 0);
        CHECK(counts == vector<int>({2, 2}));
        if (d == 0) CHECK(rows[0] == 10 && rows[1] == 11 && rows[cap] == 11 && rows[cap + 1] == 21);
        else CHECK(rows[0] == 10 && rows[1] == 20 && rows[cap] == 12 && rows[cap + 1] == 20);
        // Experts y = (e+1) x on the received rows of each bucket.
        vector<float> y(rows.size(), 0);
        for (int j = 0; j < EL; ++j) for (int i = j * cap; i < j * cap + counts[j]; ++i) y[i] = (float)(d * EL + j + 1) * rows[i];
        ret[d].assign(N * K, -9);
        launch(1, 64, [&] { ep_combine_return_expert((const u8*)y.data(), 4, ri.data(), N, EL, d, epos[d].data(), cap, iota.data(), (u8*)ret[d].data()); });
    }
    // Combine exchange: slab s of expert rank r (M*K rows) goes to rank s, received at r*M*K.
    for (int s = 0; s < R; ++s) {
        vector<float> back;
        for (int r = 0; r < R; ++r) back.insert(back.end(), ret[r].begin() + s * M * K, ret[r].begin() + (s + 1) * M * K);
        vector<int> crow(M * K, 7);
        launch(1, 32, [&] { ep_pair_rows(send_ids[s].data(), M, E, EL, iota.data(), crow.data()); });
        int T = (int)X[s].size();
        vector<float> out(T, -1);
        launch(2, 32, [&] { ep_weighted_combine(back.data(), crow.data(), send_w[s].data(), T, 1, out.data()); });
        pr("capacity out", out);
        CHECK(out == WANT[s]);
    }
}

static void replicated() {
    vector<float> sr[R], sw[R]; vector<int> si[R], ss[R];
    for (int s = 0; s < R; ++s) {
        int T = (int)X[s].size();
        vector<int> ones(T, 1); vector<int> pos = scan(ones);
        sr[s].assign(T, -1); si[s].assign(T * K, 99); sw[s].assign(T * K, -1); ss[s].assign(T, -1);
        launch(1, 64, [&] { ep_pack((const u8*)X[s].data(), 4, IDS[s].data(), W[s].data(), T, 1, ones.data(), pos.data(), (u8*)sr[s].data(), si[s].data(), sw[s].data(), ss[s].data()); });
    }
    vector<float> y[R]; vector<int> off = {0, (int)X[0].size(), (int)(X[0].size() + X[1].size())};
    for (int d = 0; d < R; ++d) {
        vector<float> rr, rw; vector<int> ri;
        for (int s = 0; s < R; ++s) {
            rr.insert(rr.end(), sr[s].begin(), sr[s].end());
            ri.insert(ri.end(), si[s].begin(), si[s].end());
            rw.insert(rw.end(), sw[s].begin(), sw[s].end());
        }
        int n = (int)rr.size();
        vector<id_t_> oi(n * K, 99); vector<float> ow(n * K, -1);
        launch(1, 64, [&] { ep_unpack_token_major((const u8*)rr.data(), ri.data(), rw.data(), n, 4, E, 0, nullptr, oi.data(), ow.data()); });
        vector<id_t_> all_ids; vector<float> all_w;
        for (int s = 0; s < R; ++s) { all_ids.insert(all_ids.end(), IDS[s].begin(), IDS[s].end()); all_w.insert(all_w.end(), W[s].begin(), W[s].end()); }
        CHECK(oi == all_ids); CHECK(ow == all_w);
        CHECK(rr == vector<float>({10, 11, 12, 20, 21}));
        // This rank's partial sums over its own experts.
        y[d].assign(n, 0);
        for (int i = 0; i < n; ++i) for (int k = 0; k < K; ++k) { int e = (int)oi[i * K + k]; if (e >= 0 && e / EL == d) y[d][i] += ow[i * K + k] * (float)(e + 1) * rr[i]; }
    }
    for (int s = 0; s < R; ++s) {
        int T = (int)X[s].size();
        vector<float> back;
        for (int r = 0; r < R; ++r) back.insert(back.end(), y[r].begin() + off[s], y[r].begin() + off[s + 1]);
        vector<float> out(T, -1);
        launch(2, 32, [&] { ep_sum_ranks(back.data(), nullptr, nullptr, T, R, 1, out.data()); });
        pr("replicated out", out);
        CHECK(out == WANT[s]);
    }
}

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
    capacity();
    replicated();
    printf("%s (%d failures)\n", fails ? "FAILED" : "OK", fails);
    return fails != 0;
}
"##;

#[test]
fn capacity_mode_and_replicated_flows_on_the_host() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    if std::process::Command::new(&cxx)
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIP capacity_mode_and_replicated_flows_on_the_host: no C++ compiler ({cxx})");
        return;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!(
        "epcomm-pipeline-emu-{}-{nanos}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let tail = kernels::PRELUDE_CU
        .split_once("// ---- device error word")
        .map(|(_, t)| format!("// ---- device error word{t}"))
        .expect("prelude marker");
    let files = [
        ("emu_prelude.h", EMU_PRELUDE.to_string()),
        ("prelude_tail.h", tail),
        ("layout.cu", kernels::LAYOUT_CU.to_string()),
        ("pack.cu", kernels::PACK_CU.to_string()),
        ("unpack.cu", kernels::UNPACK_CU.to_string()),
        ("combine.cu", kernels::COMBINE_CU.to_string()),
        ("main.cpp", EMU_MAIN.to_string()),
    ];
    for (name, text) in &files {
        std::fs::write(dir.join(name), text).expect("write");
    }
    // ID_DTYPE=0: the wire ids are int32 (capacity mode's ep_pair_rows runs on them).
    let exe = dir.join("emu");
    let out = std::process::Command::new(&cxx)
        .current_dir(&dir)
        .args([
            "-std=c++17",
            "-O1",
            "-ffp-contract=off",
            "-DTOPK=2",
            "-DID_DTYPE=0",
            "-w",
            "-pthread",
            "-o",
        ])
        .arg(&exe)
        .arg("main.cpp")
        .output()
        .expect("run the C++ compiler");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = std::process::Command::new(&exe).output().expect("run");
    let stdout = String::from_utf8_lossy(&run.stdout);
    println!("{stdout}");
    assert!(
        run.status.success() && stdout.contains("OK (0 failures)"),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
