// The C++17 wrapper's EPLB policy, scheduler and plans (include/epcomm.hpp) in one process, on
// vLLM v0.33.0's vectors (the same as tests/c/eplb_algo_test.c and tests/c/eplb_runtime_test.c,
// from vLLM's tests/distributed/test_eplb_algo.py and test_eplb_migration_scheduler.py): each
// policy step, the one-node option, -1 slots, the logical maps, vLLM's migration batches and
// the per-rank transfer plan, and their errors. Built as C++17 under ASan+UBSan by
// tests/cpp_wrapper.rs.
#include "checks.hpp"  // first: it selects POSIX for the system headers

#include <vector>

using I64 = std::vector<int64_t>;

static void test_policy() {
    // G % N != 0 and R % N != 0: vLLM's policy goes global; the option folds to one node.
    const std::vector<float> w = {28, 20, 6, 2, 0, 2, 7, 49, 9, 32, 37, 11};
    const I64 vllm = {0, 8, 3, 7, 9, 4, 7, 11, 6, 1, 9, 2, 10, 10, 5};
    const I64 one_node = {0, 8, 5, 7, 9, 4, 7, 11, 6, 1, 9, 2, 10, 10, 3};
    CHECK(epcomm::eplb_rebalance_experts(w, 1, 12, 15, 3, 2, 5) == vllm);
    CHECK(epcomm::eplb_rebalance_experts(w, 1, 12, 15, 3, 2, 5, nullptr, EPCOMM_EPLB_ONE_NODE_FALLBACK) == one_node);
    CHECK(epcomm::eplb_rebalance_experts_hierarchical(w, 1, 12, 15, 3, 1, 5) == one_node);
    CHECK(epcomm::eplb_rebalance(w, 1, 12, 15, 3, 2, 5) == one_node);
    // G % N == 0, R % N != 0: vLLM's AssertionError, unless the option is asked for.
    const std::vector<float> w8 = {1, 2, 3, 4, 5, 6, 7, 8};
    CHECK_THROWS(epcomm::eplb_rebalance_experts(w8, 1, 8, 12, 2, 2, 3), EPCOMM_ERROR_ASSERTION,
                 "num_gpus % num_nodes == 0 (3 % 2)");
    CHECK(epcomm::eplb_rebalance_experts(w8, 1, 8, 12, 2, 2, 3, nullptr, EPCOMM_EPLB_ONE_NODE_FALLBACK).size() == 12);
    // An old map with -1 (unused) slots keeps experts in their slots.
    const std::vector<float> w24 = {37, 5,  81, 12, 64, 29, 93, 48, 71, 2,  56, 18,
                                    88, 41, 7,  66, 23, 99, 14, 52, 35, 77, 60, 9};
    const I64 old = {0,  1,  2,  3,  4,  5,  -1, -1, 6,  7,  8,  9,  10, 11, -1,
                     -1, 12, 13, 14, 15, 16, 17, -1, -1, 18, 19, 20, 21, 22, 23};
    const I64 kept = {15, 6,  2,  3,  8,  18, 4,  2,  6,  5,  8,  1,  22, 11, 7,
                      21, 23, 13, 14, 10, 16, 17, 12, 0,  17, 19, 20, 21, 12, 9};
    CHECK(epcomm::eplb_rebalance_experts(w24, 1, 24, 30, 3, 2, 5, &old) == kept);
    // A buffer shorter than its dimensions is refused before the C call reads past it.
    CHECK_THROWS(epcomm::eplb_rebalance_experts(w8, 2, 8, 12, 2, 2, 3), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "weight has 8 entries; expected 16 (num_layers * num_logical_experts)");
    try {
        epcomm::eplb_rebalance({10, 20, 30, 40}, 1, 4, 7, 2, 2, 4);
        CHECK(false);
    } catch (const epcomm::Error &e) {
        CHECK(e.exception_class() == "AssertionError");
    }
    std::vector<float> load = {90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86};
    CHECK(epcomm::eplb_rebalance(load, 1, 12, 16, 4, 2, 8) == (I64{5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1}));
}

static void test_steps() {
    const epcomm::Packing p = epcomm::eplb_balanced_packing({5, 3, 9, 1, 7, 2}, 1, 6, 3);
    CHECK(p.pack_index == (I64{2, 2, 0, 0, 1, 1}) && p.rank_in_pack == (I64{0, 1, 0, 1, 0, 1}));
    CHECK_THROWS(epcomm::eplb_balanced_packing({5, 3, 9, 1, 7, 2}, 1, 6, 4), EPCOMM_ERROR_ASSERTION,
                 "num_groups % num_packs == 0 (6 % 4)");
    const epcomm::Replication r = epcomm::eplb_replicate_experts({10, 4, 7}, 1, 3, 6);
    CHECK(r.phy2log == (I64{0, 1, 2, 0, 2, 0}) && r.logcnt == (I64{3, 1, 2}));
    CHECK_THROWS(epcomm::eplb_replicate_experts({10, 4, 7}, 1, 3, 2), EPCOMM_ERROR_ASSERTION,
                 "num_redundant >= 0 (2 - 3)");
    // test_eplb_algo.py's "duplicates" case; -1 slots; ranks that do not divide: unchanged.
    const I64 old = {0, 1, 0, 2, 3, 4, 5, 6, 1, 2}, next = {0, 5, 4, 0, 1, 6, 2, 3, 2, 1};
    CHECK(epcomm::eplb_preserve_intragpu_slots(next, 1, 2, old) == (I64{0, 1, 0, 5, 4, 3, 2, 6, 1, 2}));
    CHECK(epcomm::eplb_preserve_intragpu_slots({1, 0, 2, 3, -1, 4}, 1, 2, {-1, 1, -1, 3, 4, -1}) ==
          (I64{0, 1, 2, 3, 4, -1}));
    CHECK(epcomm::eplb_preserve_intragpu_slots(next, 1, 3, old) == next);
    CHECK(epcomm::eplb_min_redundant_experts(10, 4) == 2);
    CHECK(epcomm::eplb_min_redundant_experts(8, 4) == 0);
    // vLLM 0.34.0's scale-down placement: 4 ranks of 2 slots, rank 1 (DP rank 1) dies.
    CHECK(epcomm::eplb_dead_ep_ranks({2, 0}, 2) == (I64{0, 1, 4, 5}));
    I64 map = {0, 1, 2, 3, 0, 1, 0, 1};
    epcomm::eplb_mark_dead_expert_slots(map, 1, epcomm::eplb_dead_ep_ranks({1}, 1), 2);
    CHECK(map == (I64{0, 1, -1, -1, 0, 1, 0, 1}));
    const std::vector<uint8_t> reload = epcomm::eplb_redistribute_expert_placement(map, 1, 4, 2);
    CHECK(map == (I64{0, 2, -1, -1, 0, 3, 0, 1}) && reload == (std::vector<uint8_t>{0, 0, 1, 1}));
    I64 thin = {0, 1, -1, -1};
    CHECK_THROWS(epcomm::eplb_redistribute_expert_placement(thin, 1, 3, 2), EPCOMM_ERROR_RUNTIME,
                 "Layer 0: no redundant slot for missing expert 2. EPLB redundancy insufficient.");
    CHECK(thin == (I64{0, 1, -1, -1}));
}

static void test_logical_maps() {
    // test_compute_logical_maps_with_negative_indices: width derived as max(logcnt) = 1.
    const I64 p2l = {0, 1, -1, 2, 3, -1, 3, -1, 2, 1, 0, -1};
    const epcomm::LogicalMaps m = epcomm::eplb_compute_logical_maps(p2l, 2, 4);
    CHECK(m.max_replicas == 1 && m.logcnt == I64(8, 1));
    CHECK(m.log2phy == (I64{0, 1, 3, 4, 4, 3, 2, 0}));
    CHECK_THROWS(epcomm::eplb_compute_logical_maps({0, 2}, 1, 2), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "phy2log[0][1] is 2; expected a logical expert id in [0, 2) or -1 for an unused slot");
    // The fixed-width form: two replicas of expert 0, padded with -1.
    const epcomm::LogicalMaps f = epcomm::eplb_logical_maps({0, 1, 0, 2}, 1, 3, 2);
    CHECK(f.logcnt == (I64{2, 1, 1}) && f.log2phy == (I64{0, 2, 1, -1, 3, -1}));
    CHECK_THROWS(epcomm::eplb_logical_maps({0, 1, 0, 2}, 1, 3, 1), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "expert 0 of layer 0 has 2 replicas, more than max_replicas = 1");
}

static void test_schedule() {
    // vLLM's test_schedule_migration_batches_is_deterministic: transfers (src, dst, expert)
    // (1,3,0) (2,4,1) (0,1,2) (0,2,3) (0,3,4) (0,4,5) on 5 ranks of 4 slots.
    const I64 old = {2, 3, 4, 5, 0, -1, -1, -1, 1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    const I64 next = {-1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1, 0, 4, -1, -1, 1, 5, -1, -1};
    const epcomm::MigrationSchedule s(old, next, 4);
    const std::vector<std::vector<epcomm::MigrationFlow>> b = s.batches();
    const I64 want_batches = {2, 1, 1, 1, 1};
    const I64 want_flows = {1, 3, 2, 4, 0, 1, 0, 2, 0, 3, 0, 4};
    CHECK(b.size() == 5 && s.view().num_flows == 6 && s.view().num_expert_ids == 6);
    size_t f = 0;
    for (size_t i = 0; i < b.size() && i < 5; ++i) {
        CHECK(static_cast<int64_t>(b[i].size()) == want_batches[i]);
        for (const epcomm::MigrationFlow &flow : b[i]) {
            CHECK(flow.src == want_flows[2 * f] && flow.dst == want_flows[2 * f + 1]);
            CHECK(flow.experts == I64{static_cast<int64_t>(f)});
            ++f;
        }
    }
    CHECK(f == 6);
    CHECK(epcomm::MigrationSchedule(next, next, 4).batches().empty());
    CHECK_THROWS(epcomm::MigrationSchedule(old, next, 3), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "cannot reshape a map of 20 slots into blocks of 3 slots per rank");
}

static void test_plan() {
    // Expert 0 held by ranks 0 and 1, needed also on 2, 3, 4.
    const I64 old = {0, 5, 0, 6, 7, 8, 9, 10, 11, 12};
    const I64 next = {0, 5, 0, 6, 0, 8, 0, 10, 0, 12};
    const epcomm::LayerPlan p0(old, next, 2, 0);
    const epcomm_eplb_plan_view v = p0.view();
    CHECK(v.num_slots == 2 && v.unchanged[0] == 1 && v.unchanged[1] == 1);
    CHECK(v.num_sends == 2 && v.num_recvs == 0 && v.num_local_copies == 0 && v.num_duplicates == 0);
    if (v.num_sends == 2) {
        CHECK(I64(v.sends, v.sends + 6) == (I64{0, 0, 2, 0, 0, 4}));
    }
    const epcomm::LayerPlan p3(old, next, 2, 3);
    const epcomm_eplb_plan_view v3 = p3.view();
    CHECK(v3.num_slots == 2 && v3.unchanged[0] == 0 && v3.unchanged[1] == 1);
    CHECK(v3.num_recvs == 1 && v3.num_sends == 0);
    if (v3.num_recvs == 1) {
        CHECK(I64(v3.recvs, v3.recvs + 3) == (I64{0, 0, 1}));
    }
    CHECK_THROWS(epcomm::LayerPlan(old, next, 2, 5), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "rank 5 has no slots in a map of 10 slots (2 per rank)");
    CHECK_THROWS(epcomm::LayerPlan(old, {0, 5}, 2, 0), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "new_phy2log has 2 entries; expected 10 (old_phy2log's size)");
}

// After a failure: the experts with no replica on a surviving rank.
static void test_lost_experts() {
    // Experts 2 and 4 lived only on old rank 1 (2 slots per rank); 0 has a replica on rank 2.
    const I64 old = {0, 1, 2, 4, 3, 0};
    CHECK(epcomm::eplb_lost_experts(old, 2, {0, -1, 1}) == (I64{2, 4}));
    CHECK(epcomm::eplb_lost_experts(old, 2, {0, 1, 2}).empty());
    CHECK_THROWS(epcomm::eplb_lost_experts(old, 2, {0, -1}), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "the old placement has 6 slots; expected one block of 2 slots per entry of the rank "
                 "mapping (2 entries)");
}

int main() {
    test_policy();
    test_steps();
    test_logical_maps();
    test_schedule();
    test_plan();
    test_lost_experts();
    return test_report();
}
