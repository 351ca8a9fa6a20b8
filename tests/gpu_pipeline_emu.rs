//! The GPU transport's two flows that are not a plain counts-mode exchange, replayed with the
//! real kernel sources on the host (the C++ emulation of tests/common/cuda_emu.rs):
//! - capacity mode (`GpuManager` with `GpuMode::Capacity`, EXPERT_MAJOR): padded slabs of M
//!   rows with ids -1 broadcast to every rank, device-side selection into buckets, combine
//!   returning M*K rows per peer at fixed positions (the "iota" pair positions);
//! - REPLICATED: each token packed once (R = 1, all flags set), broadcast, ids kept with
//!   `ep_unpack_token_major(E_local = E, rank = 0)`, `ep_sum_ranks` without flags.
//!
//! Both on the two-rank worked example (R = 2, E = 4, K = 2), expecting its combine results. The
//! host sequence mirrors src/gpu/transport/manager.rs step by step (same kernels, same
//! arguments); the exchanges are plain copies following `plan::broadcast_plan` and
//! `counts_plan` of a uniform matrix.

use epcomm::gpu::kernels;

mod common;

use common::cuda_emu;

const EMU_MAIN: &str = r##"#include "emu_prelude.h"
#include "prelude_tail.h"
#include "layout.cu"
#include "pack.cu"
#include "unpack.cu"
#include "combine.cu"
#include <functional>
using namespace std;
static void launch(unsigned grid, unsigned block, const function<void()>& f) { emu_seq(grid, block, f); }
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
    let Some(cxx) = cuda_emu::cxx_or_skip("capacity_mode_and_replicated_flows_on_the_host") else {
        return;
    };
    let dir = cuda_emu::temp_dir("pipeline-emu");
    cuda_emu::write_sources(
        &dir,
        &[
            ("layout.cu", kernels::LAYOUT_CU),
            ("pack.cu", kernels::PACK_CU),
            ("unpack.cu", kernels::UNPACK_CU),
            ("combine.cu", kernels::COMBINE_CU),
            ("main.cpp", EMU_MAIN),
        ],
    );
    // ID_DTYPE=0: the wire ids are int32 (capacity mode's ep_pair_rows runs on them).
    let (ok, stdout) = cuda_emu::build_and_run(&cxx, &dir, &["-DID_DTYPE=0".into()], "emu");
    println!("{stdout}");
    assert!(ok && stdout.contains("OK (0 failures)"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}
