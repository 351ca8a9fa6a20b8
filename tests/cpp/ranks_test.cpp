// The C++17 wrapper (include/epcomm.hpp) on two forked ranks of one shared-memory group:
// send/recv and all_gather, shared buffers, zero-copy combines through the manager's
// expert-output buffer and through a SharedBuffer, extra payloads, FP8 dispatch, the EPLB
// communicator and every rearrangement (plain, with a rank mapping, batched, double-buffered
// and its failure), and the load statistics (record, record_dispatch, step with vLLM's
// balancedness line, logical load). Every outcome is checked on both ranks: data contents
// and the library's full error strings. Built as C++17 under ASan+UBSan by
// tests/cpp_wrapper.rs; the parent (tests/c/test_ranks.h) checks that nothing is left in
// /dev/shm.
//
// Usage: ranks_test GROUP_NAME
#include "checks.hpp"  // first: it selects POSIX for the system headers

#include <cstring>
#include <string>
#include <vector>

using I64 = std::vector<int64_t>;
using epcomm::Tensor;

constexpr int WORLD = 2, E = 4, K = 2, H = 8, T = 3;

// ---- groups and shared buffers ----------------------------------------------------------------

struct Pair {
    int32_t rank;
    int32_t value;
};

static void test_group(epcomm::Group &g, int rank) {
    // A ring: every rank sends 3 int32 to rank+1 and receives from rank-1.
    std::vector<int32_t> out = {rank * 10, rank * 10 + 1, rank * 10 + 2}, in(3, -1);
    const int prev = (rank + WORLD - 1) % WORLD;
    const Tensor ts = Tensor::of(out, {3}), tr = Tensor::of(in, {3});
    if (CHECK_NOTHROW(g.send_recv({epcomm::p2p_send((rank + 1) % WORLD, ts), epcomm::p2p_recv(prev, tr)}))) {
        CHECK(in == (std::vector<int32_t>{prev * 10, prev * 10 + 1, prev * 10 + 2}));
    }
    CHECK_NOTHROW(g.send_recv({}));
    const std::vector<Pair> all = g.all_gather(Pair{rank, 10 * rank + 1});
    CHECK(all.size() == WORLD && all[0].rank == 0 && all[0].value == 1 && all[1].rank == 1 && all[1].value == 11);
    int64_t mine = 100 + rank, both[WORLD] = {0, 0};
    g.all_gather(&mine, sizeof mine, both);
    CHECK(both[0] == 100 && both[1] == 101);
    CHECK(g.lost_ranks() == (std::vector<int32_t>{0, 0}));  // nothing failed
}

// The row collectives: rank r contributes r + 1 rows of two floats, 10 r + i.
static void test_collectives(epcomm::Group &g, int rank) {
    std::vector<float> mine(2 * (rank + 1)), all(2 * 3, -1.0f);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = float(10 * rank) + float(i);
    g.all_gatherv(Tensor::of(mine, {rank + 1, 2}), {1, 2}, Tensor::of(all, {3, 2}));
    CHECK(all == (std::vector<float>{0, 1, 10, 11, 12, 13}));
    // Sum of both ranks' [3, 2] rows; rank 0 keeps row 0, rank 1 rows 1 and 2.
    std::vector<float> in(6), part(2 * (rank + 1), -1.0f);
    for (int i = 0; i < 6; ++i) in[i] = float(i * (rank + 1));
    g.reduce_scatterv(Tensor::of(in, {3, 2}), {1, 2}, Tensor::of(part, {rank + 1, 2}));
    CHECK(part == (rank == 0 ? std::vector<float>{0, 3} : std::vector<float>{6, 9, 12, 15}));
    // Rank r sends rows r, r to rank 0 and row 100 + r to rank 1 (int32).
    std::vector<int32_t> send = {rank, rank, 100 + rank}, recv(rank == 0 ? 4 : 2, -1);
    g.all_to_allv(Tensor::of(send, {3, 1}), {2, 1}, Tensor::of(recv, {int64_t(recv.size()), 1}),
                  rank == 0 ? std::vector<int64_t>{2, 2} : std::vector<int64_t>{1, 1});
    CHECK(recv == (rank == 0 ? std::vector<int32_t>{0, 0, 1, 1} : std::vector<int32_t>{100, 101}));
    std::vector<int64_t> b = {rank == 1 ? 7 : -1, rank == 1 ? 8 : -1};
    g.broadcast(Tensor::of(b, {2}), 1);
    CHECK(b == (std::vector<int64_t>{7, 8}));
}

static void test_shared_buffer(epcomm::Group &g, const std::string &name) {
    CHECK_THROWS(g.alloc(0), EPCOMM_ERROR_INVALID_ARGUMENT, "bytes is 0: expected at least 1");
    epcomm::SharedBuffer b = g.alloc(4097);
    CHECK(b.data() != nullptr && b.size() == 4097);
    bool zero = true;
    for (size_t i = 0; i < 4097; ++i) zero = zero && b.as<unsigned char>()[i] == 0;
    CHECK(zero);
    std::memset(b.data(), 0x5a, 4097);
    CHECK(b.tensor(epcomm::f32(), {1024}).as<float>() == b.as<float>());
    CHECK_THROWS(b.tensor(epcomm::f32(), {1025}), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "a view of 4100 bytes does not fit a shared buffer of 4097 bytes");
    epcomm::SharedBuffer moved = std::move(b);
    CHECK(b.data() == nullptr && moved.size() == 4097 && moved.as<unsigned char>()[4096] == 0x5a);
    void *p = moved.data();
    moved.free();
    CHECK(moved.data() == nullptr && moved.size() == 0);
    CHECK_NOTHROW(moved.free());
    // Freed once: the C call now refuses the pointer, naming the group.
    char want[512];
    std::snprintf(want, sizeof want,
                  "ptr %p is not memory of group '%s' from epcomm_mem_alloc (freed already, from "
                  "another group, or not the start of an allocation)",
                  p, name.c_str());
    CHECK(epcomm_mem_free(g.get(), p) == EPCOMM_ERROR_INVALID_ARGUMENT);
    CHECK_MSG_EQ(want);
    {
        epcomm::SharedBuffer scoped = g.alloc(64);
        p = scoped.data();
    }
    CHECK(epcomm_mem_free(g.get(), p) == EPCOMM_ERROR_INVALID_ARGUMENT);
    (void)g.alloc(1 << 20).data();  // freed at once by the temporary's destructor
}

// ---- all2all ----------------------------------------------------------------------------------

static epcomm::MoeConfig f32_config() {
    epcomm::MoeConfig c;
    c.experts(E).top_k(K).hidden_size(H).dtypes(epcomm::f32()).max_tokens_per_rank(T);
    return c;
}

// Rank r's T tokens: x = 10 * (r * T + t) + h; experts (t + r) % 4 and (t + r + 2) % 4 (one
// on each rank) with weights 0.25 and 0.5.
struct Tokens {
    std::vector<float> x = std::vector<float>(T * H);
    std::vector<int32_t> ids = std::vector<int32_t>(T * K);
    std::vector<float> w = std::vector<float>(T * K);
    explicit Tokens(int r) {
        for (int t = 0; t < T; ++t) {
            for (int h = 0; h < H; ++h) x[t * H + h] = value(r, t, h);
            ids[t * K] = (t + r) % E;
            ids[t * K + 1] = (t + r + 2) % E;
            w[t * K] = 0.25f;
            w[t * K + 1] = 0.5f;
        }
    }
    static float value(int r, int t, int h) { return float(10 * (r * T + t) + h); }
    epcomm_dispatch_output dispatch(epcomm::All2All &a, const std::vector<Tensor> &extras = {}) {
        return a.dispatch(Tensor::of(x, {T, H}), Tensor::of(ids, {T, K}), Tensor::of(w, {T, K}), extras);
    }
};

// Toy experts that double their input: combine gives 2 * (0.25 + 0.5) * x = 1.5 x per token.
static void expect_one_and_a_half(epcomm::All2All &a, const Tensor &y, const Tokens &in, const char *what) {
    std::vector<float> out(T * H, -1.0f);
    if (!CHECK_NOTHROW(a.combine(y, Tensor::of(out, {T, H})))) return;
    int bad = 0;
    for (int i = 0; i < T * H; ++i) bad += out[i] != 1.5f * in.x[i];
    if (bad != 0) {
        test_fail_at(__FILE__, __LINE__);
        printf("%s: %d combined values differ from 1.5 x\n", what, bad);
    } else {
        g_passed++;
    }
}

static void doubled(const Tensor &hidden, float *y) {
    for (int64_t i = 0; i < hidden.numel(); ++i) y[i] = 2.0f * hidden.as<float>()[i];
}

// The expert outputs written into the manager's buffer are read in place (one zero-copy
// combine counted); a SharedBuffer input gives the same result.
static void test_zero_copy(epcomm::Group &g, int rank, const char *backend) {
    epcomm::All2All a(g, backend, f32_config());
    CHECK_THROWS(a.expert_output_buffer(), EPCOMM_ERROR_INVALID_STATE,
                 "expert_output_buffer called without a successful dispatch: call dispatch first");
    Tokens in(rank);
    Tensor hidden(in.dispatch(a).hidden);
    Tensor y = a.expert_output_buffer();
    CHECK(y.numel() == hidden.numel() && y.shape().size() == 2 && y.shape()[1] == H);
    CHECK(epcomm::same_dtype(y.dtype(), epcomm::f32()));
    doubled(hidden, y.as<float>());
    expect_one_and_a_half(a, y, in, backend);
    CHECK(a.zero_copy_combines() == 1);
    hidden = Tensor(in.dispatch(a).hidden);
    epcomm::SharedBuffer buf = g.alloc(static_cast<size_t>(hidden.numel()) * sizeof(float));
    Tensor ys = buf.tensor(epcomm::f32(), hidden.shape());
    doubled(hidden, ys.as<float>());
    expect_one_and_a_half(a, ys, in, backend);
    CHECK(a.zero_copy_combines() == 1);
}

// TOKEN_MAJOR rows come by source rank, then token (here every token to both ranks), each
// with its extra payload; experts e = (e + 1) x weighted on this side.
static void test_extras(epcomm::Group &g, int rank) {
    epcomm::MoeConfig c = f32_config();
    epcomm::All2All a(g, "deepep_high_throughput", c.extra_row_bytes({4}));
    Tokens in(rank);
    std::vector<uint8_t> tag(T * 4);
    for (int i = 0; i < T * 4; ++i) tag[i] = uint8_t(rank * 16 + i);
    const epcomm_dispatch_output o = in.dispatch(a, {Tensor::of(tag, {T, 4})});
    CHECK(o.layout == EPCOMM_LAYOUT_TOKEN_MAJOR && o.received_rows == WORLD * T && o.num_extras == 1);
    if (o.received_rows != WORLD * T || o.num_extras != 1) return;
    const Tensor hidden(o.hidden), extra(o.extras[0]);
    const int64_t *ids = static_cast<const int64_t *>(o.topk_ids.data);
    const float *w = static_cast<const float *>(o.topk_weights.data);
    std::vector<float> y(WORLD * T * H, 0.0f);
    int bad = 0;
    for (int i = 0; i < WORLD * T; ++i) {
        const int src = i / T, t = i % T;
        bad += hidden.as<float>()[i * H + 1] != Tokens::value(src, t, 1);
        bad += extra.as<uint8_t>()[i * 4 + 3] != uint8_t(src * 16 + t * 4 + 3);
        for (int k = 0; k < K; ++k) {
            if (ids[i * K + k] < 0) continue;
            bad += ids[i * K + k] / (E / WORLD) != rank;  // only this rank's experts
            const float f = w[i * K + k] * float(ids[i * K + k] + 1);
            for (int h = 0; h < H; ++h) y[i * H + h] += f * hidden.as<float>()[i * H + h];
        }
    }
    CHECK(bad == 0);
    std::vector<float> out(T * H, -1.0f);
    if (!CHECK_NOTHROW(a.combine(Tensor::of(y, {WORLD * T, H}), Tensor::of(out, {T, H})))) return;
    bad = 0;
    for (int t = 0; t < T; ++t) {
        const float f = 0.25f * float(in.ids[t * K] + 1) + 0.5f * float(in.ids[t * K + 1] + 1);
        for (int h = 0; h < H; ++h) bad += out[t * H + h] != f * in.x[t * H + h];
    }
    CHECK(bad == 0);
}

// ---- FP8 dispatch -----------------------------------------------------------------------------

static float pow2f(int k) {
    const uint32_t bits = uint32_t(k + 127) << 23;
    float v;
    std::memcpy(&v, &bits, 4);
    return v;
}

// e4m3fn code -> value (bias 7, 3 mantissa bits; the codes here are finite).
static float e4m3_value(uint8_t c) {
    const int e = (c >> 3) & 15, m = c & 7;
    const float v = e == 0 ? float(m) / 512.0f : (1.0f + float(m) / 8.0f) * pow2f(e - 7);
    return (c & 0x80) ? -v : v;
}

// Element j of token t of rank r: each block's first element is 448 (code 0x7e), so with the
// block's amax 448 * 2^k the quantised code is exactly this and the scale exactly 2^k, k =
// 2r + t naming the token.
static uint8_t fp8_code(int r, int t, int j) {
    return (j % 128 == 0) ? 0x7e : uint8_t(((j * 5 + t + r) % 0x7e) | ((j & 1) << 7));
}

constexpr int FH = 256, FT = 2;

// Rows whose scales name a token carry that token's codes; returns the rows matched.
static int64_t fp8_rows(const Tensor &q, const Tensor &scales) {
    int64_t matched = 0;
    for (int64_t i = 0; i < q.numel() / FH; ++i) {
        const float *s = scales.as<float>() + 2 * i;
        for (int r = 0; r < WORLD; ++r) {
            for (int t = 0; t < FT; ++t) {
                if (s[0] != pow2f(2 * r + t) || s[1] != s[0]) continue;
                int bad = 0;
                for (int j = 0; j < FH; ++j) bad += q.as<uint8_t>()[i * FH + j] != fp8_code(r, t, j);
                CHECK(bad == 0);
                ++matched;
            }
        }
    }
    return matched;
}

static void test_fp8(epcomm::Group &g, int rank, epcomm::Fp8 mode) {
    epcomm::MoeConfig c;
    c.experts(E).top_k(K).hidden_size(FH).dtypes(epcomm::bf16()).max_tokens_per_rank(FT).dispatch_fp8(mode);
    epcomm::All2All a(g, "deepep_low_latency", c);
    CHECK(a.dispatch_scales().shape() == I64{0});
    std::vector<uint16_t> x(FT * FH);
    std::vector<int32_t> ids = {0, 2, 1, 3};
    std::vector<float> w(FT * K, 0.5f);
    for (int t = 0; t < FT; ++t) {
        for (int j = 0; j < FH; ++j) {
            const float v = e4m3_value(fp8_code(rank, t, j)) * pow2f(2 * rank + t);
            uint32_t bits;
            std::memcpy(&bits, &v, 4);
            x[t * FH + j] = uint16_t(bits >> 16);  // exact: 4 significant bits
        }
    }
    const Tensor tx(x.data(), epcomm::bf16(), {FT, FH}), tids = Tensor::of(ids, {FT, K}), tw = Tensor::of(w, {FT, K});
    const Tensor q(a.dispatch(tx, tids, tw).hidden), scales = a.dispatch_scales();
    CHECK(epcomm::same_dtype(q.dtype(), epcomm::f8_e4m3fn()) && epcomm::same_dtype(scales.dtype(), epcomm::f32()));
    I64 want = q.shape();
    want.back() = FH / 128;
    CHECK(scales.shape() == want);
    const epcomm_all2all_stats st = a.stats();
    CHECK(st.tokens_received[0] + st.tokens_received[1] == WORLD * FT);  // one expert per rank
    CHECK(fp8_rows(q, scales) == WORLD * FT);
    CHECK_THROWS(a.set_dispatch_fp8(static_cast<epcomm::Fp8>(3)), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "dispatch_fp8 is 3; expected EPCOMM_DISPATCH_FP8_OFF (0), EPCOMM_DISPATCH_FP8_E4M3 (1) or "
                 "EPCOMM_DISPATCH_FP8_E4M3_UE8M0 (2)");
    a.set_dispatch_fp8(epcomm::Fp8::Off);
    CHECK(epcomm::same_dtype(Tensor(a.dispatch(tx, tids, tw).hidden).dtype(), epcomm::bf16()));
    CHECK(a.dispatch_scales().shape() == I64{0});
    CHECK_THROWS(epcomm::All2All(g, "deepep_low_latency", c.dispatch_fp8(static_cast<epcomm::Fp8>(7))),
                 EPCOMM_ERROR_INVALID_ARGUMENT,
                 "config->dispatch_fp8 is 7; expected EPCOMM_DISPATCH_FP8_OFF (0), EPCOMM_DISPATCH_FP8_E4M3 (1) "
                 "or EPCOMM_DISPATCH_FP8_E4M3_UE8M0 (2)");
}

// ---- EPLB -------------------------------------------------------------------------------------

static epcomm_eplb_select_request gloo_request() {
    epcomm_eplb_select_request r = epcomm::eplb_select_request("torch_gloo");
    r.nccl_available = 0;
    r.nixl_available = 0;
    return r;
}

// The j-th send from a to b fills the j-th receive on b from a, tensor by tensor.
static void test_communicator(epcomm::EplbCommunicator &comm, int rank) {
    const int peer = 1 - rank;
    std::vector<float> sa(4), ra(4, -1.0f);
    std::vector<uint8_t> sb(3), rb(3, 0xEE);
    for (int i = 0; i < 4; ++i) sa[i] = float(rank * 1000 + i) + 0.25f;
    for (int i = 0; i < 3; ++i) sb[i] = uint8_t(rank * 100 + i);
    comm.add_send({Tensor::of(sa, {1, 4}), Tensor::of(sb, {1, 3})}, peer, 7);
    comm.add_recv({Tensor::of(ra, {1, 4}), Tensor::of(rb, {1, 3})}, peer, 7);
    if (CHECK_NOTHROW(comm.execute())) {
        CHECK(ra[0] == float(peer * 1000) + 0.25f && ra[3] == float(peer * 1000 + 3) + 0.25f);
        CHECK(rb[0] == uint8_t(peer * 100) && rb[2] == uint8_t(peer * 100 + 2));
    }
    CHECK_THROWS(comm.add_recv({Tensor::of(ra, {1, 4})}, -1, 0), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "peer rank is -1; expected >= 0");
    CHECK_NOTHROW(comm.execute());  // nothing queued: still collective, still fine
}

constexpr int L = 2, SLOTS = 4, LOCAL = 2, COLS = 3;

static float row_value(int64_t expert, int layer, int col) { return float(expert * 100 + layer * 10 + col); }

// This rank's expert weights of L layers (one float32 [LOCAL, COLS] tensor per layer).
struct Weights {
    std::vector<std::vector<float>> w = std::vector<std::vector<float>>(L, std::vector<float>(LOCAL * COLS, -7.0f));
    std::vector<Tensor> views;
    int rank;
    Weights(int r, const I64 *map) : rank(r) {
        for (int l = 0; l < L; ++l) views.push_back(Tensor::of(w[l], {LOCAL, COLS}));
        if (map) fill(*map);
    }
    Weights(const Weights &) = delete;
    void fill(const I64 &map) {
        for (int l = 0; l < L; ++l)
            for (int s = 0; s < LOCAL; ++s)
                for (int c = 0; c < COLS; ++c) w[l][s * COLS + c] = row_value(map[l * SLOTS + rank * LOCAL + s], l, c);
    }
    bool holds(const I64 &map) const {
        for (int l = 0; l < L; ++l)
            for (int s = 0; s < LOCAL; ++s)
                for (int c = 0; c < COLS; ++c)
                    if (w[l][s * COLS + c] != row_value(map[l * SLOTS + rank * LOCAL + s], l, c)) return false;
        return true;
    }
};

static const I64 OLD_MAP = {0, 1, 2, 3, 0, 1, 2, 3};
// Layer 0 swaps the ranks' experts; layer 1 stays.
static const I64 NEW_MAP = {2, 3, 0, 1, 0, 1, 2, 3};

static void test_rearrange(epcomm::EplbCommunicator &comm, int rank) {
    Weights w(rank, &OLD_MAP);
    epcomm_eplb_summary s{};
    if (CHECK_NOTHROW(s = comm.rearrange(OLD_MAP, NEW_MAP, L, w.views))) {
        CHECK(w.holds(NEW_MAP));
        CHECK(s.layers_changed == 1 && s.rows_sent == 2 && s.rows_received == 2 && s.rows_copied_locally == 0);
    }
    // Back with the identity rank mapping (epcomm_eplb_rearrange).
    if (CHECK_NOTHROW(comm.rearrange(NEW_MAP, OLD_MAP, L, w.views, I64{0, 1}))) CHECK(w.holds(OLD_MAP));
    // Batched as vLLM's migration scheduler orders it, then back batched with the mapping.
    epcomm::RearrangeOptions batched;
    batched.migration_batching(true);
    if (CHECK_NOTHROW(s = comm.rearrange(OLD_MAP, NEW_MAP, L, w.views, batched))) {
        CHECK(w.holds(NEW_MAP) && s.rows_sent == 2 && s.rows_received == 2);
    }
    batched.rank_mapping({0, 1});
    CHECK(batched.get()->rank_mapping_len == 2 && batched.get()->migration_batching);
    if (CHECK_NOTHROW(comm.rearrange(NEW_MAP, OLD_MAP, L, w.views, batched))) CHECK(w.holds(OLD_MAP));
    // The ranks disagree on batching: the same error on both, nothing moves.
    CHECK_THROWS(comm.rearrange(OLD_MAP, NEW_MAP, L, w.views, epcomm::RearrangeOptions().migration_batching(rank == 0)),
                 EPCOMM_ERROR_INVALID_ARGUMENT,
                 "rearrange: ranks disagree on migration batching: rank 0 turns it on but rank 1 turns it off; "
                 "every rank must pass the same (EPLB rearrangement: no layer was changed)");
    CHECK(w.holds(OLD_MAP));
    // Sizes that do not divide into the layers are refused here, on each rank, before any call.
    CHECK_THROWS(comm.rearrange(OLD_MAP, NEW_MAP, 3, w.views), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "rearrange: maps of 8 and 8 slots and 2 weight tensors do not divide into 3 layers");
}

// Double-buffered: the next weights (garbage before) get the new placement, the live ones
// stay; a rank's bad next weights fail both ranks with no layer valid.
static void test_rearrange_into(epcomm::EplbCommunicator &comm, int rank) {
    // Layer 0 swaps experts between the ranks, layer 1 swaps rank 0's two slots.
    const I64 next_map = {2, 3, 0, 1, 1, 0, 2, 3};
    Weights live(rank, &OLD_MAP), next(rank, nullptr);
    for (int batched = 0; batched < 2; ++batched) {
        epcomm_eplb_summary s{};
        next.fill(I64(L * SLOTS, 9));
        if (CHECK_NOTHROW(s = comm.rearrange_into(OLD_MAP, next_map, L, live.views, next.views,
                                                  epcomm::RearrangeOptions().migration_batching(batched != 0)))) {
            CHECK(next.holds(next_map) && live.holds(OLD_MAP));
            CHECK(s.layers_changed == (rank == 0 ? 2 : 1) && s.rows_sent == 2 && s.rows_received == 2);
            CHECK(s.rows_copied_locally == (rank == 0 ? 2 : 0));
        }
    }
    next.fill(I64(L * SLOTS, 9));
    std::vector<Tensor> bad = next.views;
    if (rank == 1) bad[0] = Tensor::of(next.w[0], {LOCAL - 1, COLS});
    try {
        comm.rearrange_into(OLD_MAP, next_map, L, live.views, bad);
        CHECK(false);
    } catch (const epcomm::RearrangeError &e) {
        CHECK(e.status() == EPCOMM_ERROR_INVALID_ARGUMENT && e.next_valid() == 0);
        CHECK(std::string(e.what()) ==
              (rank == 1 ? "next_weights layer 0 tensor 0 has 12 bytes; expected 24 (the size of live layer 0 tensor 0)"
                         : "rearrange: rank 1 rejected its arguments (see that rank's error) (EPLB rearrangement: "
                           "no layer was changed)"));
    }
    CHECK(next.holds(I64(L * SLOTS, 9)) && live.holds(OLD_MAP));
}

// Old rank 1 of 3 died: this group's two ranks are the survivors (old ranks 0 and 2), and the
// rank mapping {0, -1, 1} is longer than the group: a scale-down after a failure.
static const char SD_REFUSAL[] =
    "rearrange: layer 0 needs logical experts [2], which have no replica on a surviving rank "
    "(rank_mapping removes ranks [1]); their weights are gone: allow lost experts to rearrange "
    "the others and leave their slots unwritten (the call reports them; load their weights "
    "there afterwards), or choose a new placement without them";

static void survivor_fill(Weights &w, const I64 &old) {
    const int old_rank = w.rank == 0 ? 0 : 2;
    for (int l = 0; l < L; ++l)
        for (int s = 0; s < LOCAL; ++s)
            for (int c = 0; c < COLS; ++c) w.w[l][s * COLS + c] = row_value(old[l * 6 + old_rank * LOCAL + s], l, c);
}

static void test_rearrange_after_failure(epcomm::EplbCommunicator &comm, int rank) {
    // Every expert of the dead rank (2, 1) has a surviving replica ...
    const I64 redundant = {0, 1, 2, 1, 3, 2, 0, 1, 2, 1, 3, 2};
    // ... here expert 2 (and 4) lived only there.
    const I64 exposed = {0, 1, 2, 4, 3, 0, 0, 1, 2, 4, 3, 0};
    const I64 next_map = {2, 3, 1, 0, 2, 3, 1, 0};
    // next_map with expert 2's slot keeping what the survivor held there (expert 0).
    const I64 kept = {0, 3, 1, 0, 0, 3, 1, 0};
    Weights w(rank, nullptr), next(rank, nullptr);
    epcomm::RearrangeOptions o;
    o.rank_mapping({0, -1, 1});
    survivor_fill(w, redundant);
    epcomm::Rearranged r;
    if (CHECK_NOTHROW(r = comm.rearrange(redundant, next_map, L, w.views, o))) {
        CHECK(w.holds(next_map) && r.lost_experts.empty());
    }
    survivor_fill(w, exposed);
    const std::vector<std::vector<float>> before = w.w;
    CHECK_THROWS(comm.rearrange(exposed, next_map, L, w.views, o), EPCOMM_ERROR_INVALID_ARGUMENT, SD_REFUSAL);
    CHECK(w.w == before);
    // Allowed: the lost expert's slot keeps its rows and is reported, layer by layer.
    o.allow_lost_experts(true);
    if (CHECK_NOTHROW(r = comm.rearrange_into(exposed, next_map, L, w.views, next.views, o))) {
        CHECK(next.holds(kept) && w.w == before && r.lost_experts.size() == 2);
        if (r.lost_experts.size() == 2) {
            CHECK(r.lost_experts[0].layer == 0 && r.lost_experts[0].expert == 2);
            CHECK(r.lost_experts[1].layer == 1 && r.lost_experts[1].expert == 2);
        }
    }
    if (CHECK_NOTHROW(r = comm.rearrange(exposed, next_map, L, w.views, o))) {
        CHECK(w.holds(kept) && r.lost_experts.size() == 2);
    }
}

// ---- load statistics --------------------------------------------------------------------------

static void test_state(epcomm::Group &g, int rank) {
    static const char PREFIX[] = "EPLB step: 6 for model toy: avg_tokens=";
    static const char END[] = ", steps until the next rearrangement: 2";
    std::vector<std::string> lines;
    epcomm::LogSink sink([&](int32_t level, const std::string &m) {
        if (level == EPCOMM_LOG_INFO && m.rfind("EPLB step:", 0) == 0) lines.push_back(m);
    });
    epcomm::EplbState s("toy", 1, 4, "{\"window_size\": 4, \"step_interval\": 8, \"log_balancedness\": true}");
    // Rank 0 routes 3 tokens (one masked id), rank 1 routes 2: per expert [2, 1, 1, 1] and
    // [0, 0, 1, 2], summed [2, 1, 2, 3].
    std::vector<int32_t> ids = {3, 2, 3, -1};
    if (rank == 0) ids = {0, 1, 2, 3, 0, -1};
    const Tensor t = Tensor::of(ids, {rank == 0 ? 3 : 2, 2});
    s.record(0, t);
    CHECK(!s.step(g, false, true));  // step 6 of 8: the first rearrangement after step_interval / 4
    if (rank == 0) {
        CHECK(lines.size() == 1);
        if (lines.size() == 1) {
            CHECK(lines[0].rfind(PREFIX, 0) == 0 && lines[0].find(", balancedness=") != std::string::npos);
            const size_t n = sizeof END - 1;
            CHECK(lines[0].size() > n && lines[0].compare(lines[0].size() - n, n, END) == 0);
        }
    } else {
        CHECK(lines.empty());  // only rank 0 logs the line
    }
    CHECK(s.logical_load(g, {0, 1, 2, 3}, 1, 4) == (std::vector<float>{2, 1, 2, 3}));
    CHECK_THROWS(s.record(1, t), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "load of layer 1 with 4 experts; expected a layer below 1 and 4 physical experts");
    CHECK(!s.migration_batching());
    CHECK(epcomm::EplbState(1, 4, "toy", "{\"enable_migration_batching\": true}").migration_batching());
    const char *no_async = "{\"use_async\": false, \"enable_migration_batching\": true}";
    CHECK(!epcomm::EplbState(1, 4, "toy", no_async).migration_batching());
    CHECK_THROWS(epcomm::EplbState(1, 4, "toy", "{\"window_size\": 0}"), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "1 validation error for EPLBConfig\nwindow_size\n"
                 "  Input should be greater than 0 [type=greater_than, input_value=0, input_type=int]\n"
                 "    For further information visit https://errors.pydantic.dev/2.13/v/greater_than");
}

// The load of a dispatch, recorded from the manager (no second pass over the ids).
static void test_record_dispatch(epcomm::Group &g, int rank) {
    epcomm::All2All a(g, "deepep_low_latency", f32_config());
    Tokens in(rank);
    in.dispatch(a);
    epcomm::EplbState s("toy", 1, E);
    s.record_dispatch(0, a);
    CHECK(!s.step(g, false, false));
    std::vector<float> want(E, 0.0f);
    for (int r = 0; r < WORLD; ++r) {
        const Tokens other(r);
        for (int32_t id : other.ids) want[id] += 1.0f;
    }
    CHECK(s.logical_load(g, {0, 1, 2, 3}, 1, E) == want);
}

// ---- one rank ---------------------------------------------------------------------------------

static void run_all(epcomm::Group &g, const std::string &name, int rank) {
    test_group(g, rank);
    test_collectives(g, rank);
    test_shared_buffer(g, name);
    g.barrier();
    for (const char *backend : {"deepep_low_latency", "deepep_v2"}) test_zero_copy(g, rank, backend);
    test_extras(g, rank);
    test_fp8(g, rank, epcomm::Fp8::E4M3);
    test_fp8(g, rank, epcomm::Fp8::E4M3_UE8M0);
    g.barrier();
    epcomm::EplbCommunicator comm(g, gloo_request());
    test_communicator(comm, rank);
    test_rearrange(comm, rank);
    test_rearrange_into(comm, rank);
    test_rearrange_after_failure(comm, rank);
    g.barrier();
    test_state(g, rank);
    test_record_dispatch(g, rank);
    g.barrier();
}

static int rank_main(const char *name, int rank) {
    try {
        epcomm_group_options opts = epcomm::group_options();
        opts.timeout_s = 20.0;
        epcomm::Group g = epcomm::Group::shm(name, rank, WORLD, &opts);
        run_all(g, name, rank);
    } catch (const epcomm::Error &e) {
        test_fail_at(__FILE__, __LINE__);
        printf("uncaught epcomm::Error status %d: %s\n", (int)e.status(), e.what());
    }
    return g_failed == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    return test_ranks_main(argc, argv, "ranks_test", WORLD, rank_main, TEST_RANKS_COUNT_CHECKS);
}
