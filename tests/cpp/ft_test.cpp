// Fault tolerance through the C++17 wrapper (include/epcomm.hpp): three ranks of one
// shared-memory group; rank 2's process is killed (SIGKILL) once every rank has joined. The
// survivors' next collective fails naming it and its pid, the group holds it as lost
// (Group::lost_ranks), and the survivors form their own group (Group::shrink) that works;
// the experts only rank 2 held are the lost ones (eplb_lost_experts), and the survivors
// rearrange to their own placement with the lost expert refused, then allowed. Built as C++17 under
// ASan+UBSan by tests/cpp_wrapper.rs; the parent (tests/c/test_ranks.h) checks that nothing is
// left in /dev/shm.
//
// Usage: ft_test GROUP_NAME
#include "checks.hpp"  // first: it selects POSIX for the system headers

#include <csignal>
#include <string>
#include <vector>

constexpr int WORLD = 3, VICTIM = 2;

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
    const std::string want = "rank 2 of group '" + std::string(name) + "' died (pid " + std::to_string(pids[VICTIM]) +
                             " is gone) during barrier (op #2, seen from rank " + std::to_string(rank) + ")";
    CHECK_THROWS(g.barrier(), EPCOMM_ERROR_PEER_FAILURE, want);
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
        const char ok = 1;
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
