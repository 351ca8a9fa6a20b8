// Fault tolerance through the C++17 wrapper (include/epcomm.hpp): three ranks of one
// shared-memory group run a fault-tolerant deepep_low_latency manager (vLLM's
// enable_fault_tolerance); rank 2's process is killed (SIGKILL) after the first round. The
// survivors' next dispatch fails naming it and its pid; vLLM's query_active_mask and
// query_fault say so, clean_buffers is the recovery point, and the next round runs over the
// survivors with the pairs routed to rank 2's experts dropped and counted. The group holds
// rank 2 as lost (Group::lost_ranks), the survivors form their own group (Group::shrink),
// the experts only rank 2 held are the lost ones (eplb_lost_experts), and the survivors
// rearrange to their own placement with the lost expert refused, then allowed. Built as C++17
// under ASan+UBSan by tests/cpp_wrapper.rs; the parent (tests/c/test_ranks.h) checks that
// nothing is left in /dev/shm.
//
// Usage: ft_test GROUP_NAME
#include "checks.hpp"  // first: it selects POSIX for the system headers

#include <csignal>
#include <string>
#include <vector>

using epcomm::Tensor;

constexpr int WORLD = 3, VICTIM = 2, E = 6, K = 2, H = 8, T = 2;

// Rank r's tokens: x = 10 * (r * T + t) + h, experts (2r + t) % 6 and (2r + t + 3) % 6 with
// weights 0.25 and 0.5 (experts 2r and 2r + 1 live on rank r).
struct Tokens {
    std::vector<float> x = std::vector<float>(T * H);
    std::vector<int32_t> ids = std::vector<int32_t>(T * K);
    std::vector<float> w = std::vector<float>(T * K);
    explicit Tokens(int r) {
        for (int t = 0; t < T; ++t) {
            for (int h = 0; h < H; ++h) x[t * H + h] = float(10 * (r * T + t) + h);
            ids[t * K] = (2 * r + t) % E;
            ids[t * K + 1] = (2 * r + t + 3) % E;
            w[t * K] = 0.25f;
            w[t * K + 1] = 0.5f;
        }
    }
    epcomm_dispatch_output dispatch(epcomm::All2All &a) {
        return a.dispatch(Tensor::of(x, {T, H}), Tensor::of(ids, {T, K}), Tensor::of(w, {T, K}));
    }
    // The weight of token t's pairs whose experts are not on rank `masked`.
    float live_weight(int t, int masked) const {
        float f = 0.0f;
        for (int k = 0; k < K; ++k) f += ids[t * K + k] / (E / WORLD) == masked ? 0.0f : w[t * K + k];
        return f;
    }
};

static epcomm::All2All manager(epcomm::Group &g) {
    epcomm::MoeConfig c;
    c.experts(E).top_k(K).hidden_size(H).dtypes(epcomm::f32()).max_tokens_per_rank(T).fault_tolerance(true);
    return epcomm::All2All(g, "deepep_low_latency", c);
}

// One round with experts that double their input: each token's output is 2 x times the weight
// of its pairs not routed to rank `masked` (-1: none masked).
static bool round_trip(epcomm::All2All &a, Tokens &in, int masked) {
    const Tensor hidden(in.dispatch(a).hidden);
    Tensor y = a.expert_output_buffer();
    for (int64_t i = 0; i < hidden.numel(); ++i) y.as<float>()[i] = 2.0f * hidden.as<float>()[i];
    std::vector<float> out(T * H, -1.0f);
    a.combine(y, Tensor::of(out, {T, H}));
    int bad = 0;
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) bad += out[t * H + h] != 2.0f * in.live_weight(t, masked) * in.x[t * H + h];
    return bad == 0;
}

// The survivors' manager after the kill: the failed dispatch naming rank 2, vLLM's mask and
// fault flag, the recovery point, a round over the survivors with the dropped pairs counted.
static void manager_after_kill(epcomm::All2All &a, Tokens &in, const std::string &want) {
    CHECK_THROWS(in.dispatch(a), EPCOMM_ERROR_PEER_FAILURE, want);
    CHECK(a.query_fault() && a.active_mask() == (std::vector<int32_t>{0, 0, 1}));
    a.clean_buffers();
    CHECK(!a.query_fault() && a.active_mask() == (std::vector<int32_t>{0, 0, 1}));
    // vLLM 0.34.0's sentinel replays the dead rank: nothing changes; a live rank is refused.
    a.update_mask(VICTIM, true);
    CHECK(!a.query_fault() && a.active_mask() == (std::vector<int32_t>{0, 0, 1}));
    CHECK_THROWS(a.update_mask(0, true), EPCOMM_ERROR_INVALID_STATE,
                 "update_mask: rank 0 is live in this group; epcomm masks a rank when the group loses it (it "
                 "then leaves the survivors' group), not by hand");
    CHECK(round_trip(a, in, VICTIM));
    uint64_t to_victim = 0;
    for (int32_t id : in.ids) to_victim += id / (E / WORLD) == VICTIM;
    const epcomm::All2All::DroppedPairs d = a.dropped_pairs();
    CHECK(to_victim > 0 && d.last == to_victim && d.total == to_victim);
}

static epcomm::Group join(const char *name, int rank) {
    epcomm_group_options opts = epcomm::group_options();
    opts.timeout_s = 20.0;
    return epcomm::Group::shm(name, rank, WORLD, &opts);
}

// The survivors' rearrangement from the old placement of three ranks (2 slots each; only rank
// 2 held experts 4 and 5) to two: refused while expert 4 is needed, then allowed, its slot
// keeping its rows. Rows are expert * 100 + column.
static void rearrange_survivors(epcomm::Group &s, int rank) {
    epcomm_eplb_select_request req = epcomm::eplb_select_request("torch_gloo");
    req.nccl_available = 0;
    req.nixl_available = 0;
    epcomm::EplbCommunicator comm(s, req);
    const std::vector<int64_t> old_map = {0, 1, 2, 0, 4, 5}, next_map = {1, 2, 0, 4};
    std::vector<float> w(2 * 3);
    for (int slot = 0; slot < 2; ++slot)
        for (int c = 0; c < 3; ++c) w[slot * 3 + c] = float(old_map[rank * 2 + slot] * 100 + c);
    const std::vector<epcomm::Tensor> views = {epcomm::Tensor::of(w, {2, 3})};
    epcomm::RearrangeOptions o;
    o.rank_mapping({0, 1, -1});
    CHECK_THROWS(comm.rearrange(old_map, next_map, 1, views, o), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "rearrange: layer 0 needs logical experts [4], which have no replica on a surviving rank "
                 "(rank_mapping removes ranks [2]); their weights are gone: allow lost experts to rearrange "
                 "the others and leave their slots unwritten (the call reports them; load their weights "
                 "there afterwards), or choose a new placement without them");
    epcomm::Rearranged r;
    if (CHECK_NOTHROW(r = comm.rearrange(old_map, next_map, 1, views, o.allow_lost_experts(true)))) {
        CHECK(r.lost_experts.size() == 1 && r.lost_experts[0].layer == 0 && r.lost_experts[0].expert == 4);
        const std::vector<float> want = rank == 0 ? std::vector<float>{100, 101, 102, 200, 201, 202}
                                                  : std::vector<float>{0, 1, 2, 0, 1, 2};
        CHECK(w == want);
    }
}

// A survivor: the failed barrier, the lost mask, the survivors' group.
static void survivor(const char *name, int rank) {
    epcomm::Group g = join(name, rank);
    const std::vector<int32_t> pids = g.all_gather(int32_t(getpid()));
    CHECK(g.lost_ranks() == (std::vector<int32_t>{0, 0, 0}));
    epcomm::All2All a = manager(g);
    Tokens in(rank);
    CHECK(a.active_mask() == (std::vector<int32_t>{0, 0, 0}) && !a.query_fault());
    CHECK(round_trip(a, in, -1));
    CHECK(a.dropped_pairs().last == 0 && a.dropped_pairs().total == 0);
    // Op 6: after the pids' all_gather (1) and the round trip (dispatch: its header, which
    // carries the routing, and the rows; combine: its header and the rows).
    const std::string want = "rank 2 of group '" + std::string(name) + "' died (pid " + std::to_string(pids[VICTIM]) +
                             " is gone) during dispatch (op #6, seen from rank " + std::to_string(rank) + ")";
    manager_after_kill(a, in, want);
    CHECK(g.lost_ranks() == (std::vector<int32_t>{0, 0, 1}));
    epcomm::Group s = g.shrink({VICTIM});
    CHECK(s.size() == 2 && s.rank() == rank);
    CHECK(s.all_gather(int32_t(10 * rank)) == (std::vector<int32_t>{0, 10}));
    CHECK(s.lost_ranks() == (std::vector<int32_t>{0, 0}));
    CHECK_NOTHROW(s.barrier());
    rearrange_survivors(s, rank);
    // Experts 4 and 5 lived only on rank 2 (2 slots per rank); 0 has a replica on rank 1.
    CHECK(epcomm::eplb_lost_experts({0, 1, 2, 0, 4, 5}, 2, {0, 1, -1}) == (std::vector<int64_t>{4, 5}));
}

// Rank 2 runs in a child process that joins, tells its pid, reports through a pipe and is then
// killed; the rank's own process checks that it was.
static void victim(const char *name) {
    int p[2];
    if (pipe(p) != 0) {
        CHECK(false);
        return;
    }
    const pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        epcomm::Group g = join(name, VICTIM);
        (void)g.all_gather(int32_t(getpid()));  // the survivors name this process in their errors
        epcomm::All2All a = manager(g);
        Tokens in(VICTIM);
        const char ok = round_trip(a, in, -1) ? 1 : 0;
        if (write(p[1], &ok, 1) != 1) _exit(3);
        raise(SIGKILL);
        _exit(4);
    }
    close(p[1]);
    char ok = 0;
    CHECK(pid > 0 && read(p[0], &ok, 1) == 1 && ok == 1);
    close(p[0]);
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
}

static int rank_main(const char *name, int rank) {
    try {
        if (rank == VICTIM) {
            victim(name);
        } else {
            survivor(name, rank);
        }
    } catch (const epcomm::Error &e) {
        test_fail_at(__FILE__, __LINE__);
        printf("uncaught epcomm::Error status %d: %s\n", (int)e.status(), e.what());
    }
    return g_failed == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    return test_ranks_main(argc, argv, "ft_test", WORLD, rank_main, TEST_RANKS_COUNT_CHECKS);
}
