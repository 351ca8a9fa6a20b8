/* vLLM v0.33.0's EPLB policy steps through the C ABI (src/ffi/eplb_algo.rs): each function on
 * vLLM's vectors (tests/eplb_policy.rs has the same, from vLLM's own code), the one-node option,
 * -1 slots, and the errors. */
#include <stdio.h>
#include <string.h>

#include "epcomm.h"

static int passed, failed;
#define CHECK(cond)                                                              \
    do {                                                                         \
        if (cond) {                                                              \
            passed++;                                                            \
        } else {                                                                 \
            failed++;                                                            \
            fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n",        \
                    __FILE__, __LINE__, #cond,                                   \
                    epcomm_last_error_message() ? epcomm_last_error_message()    \
                                                : "none");                      \
        }                                                                        \
    } while (0)

#define SAME(a, b) (memcmp((a), (b), sizeof(b)) == 0)

static void policy(void) {
    /* G % N != 0 and R % N != 0: vLLM's policy goes global; the option folds to one node. */
    const float w[12] = {28, 20, 6, 2, 0, 2, 7, 49, 9, 32, 37, 11};
    const int64_t vllm[15] = {0, 8, 3, 7, 9, 4, 7, 11, 6, 1, 9, 2, 10, 10, 5};
    const int64_t one_node[15] = {0, 8, 5, 7, 9, 4, 7, 11, 6, 1, 9, 2, 10, 10, 3};
    int64_t out[15];
    CHECK(epcomm_eplb_rebalance_experts(w, 1, 12, 15, 3, 2, 5, NULL, 0, out) == EPCOMM_OK);
    CHECK(SAME(out, vllm));
    CHECK(epcomm_eplb_rebalance_experts(w, 1, 12, 15, 3, 2, 5, NULL,
                                        EPCOMM_EPLB_ONE_NODE_FALLBACK, out) == EPCOMM_OK);
    CHECK(SAME(out, one_node));
    CHECK(epcomm_eplb_rebalance_experts_hierarchical(w, 1, 12, 15, 3, 1, 5, out) == EPCOMM_OK);
    CHECK(SAME(out, one_node));
    CHECK(epcomm_eplb_rebalance_experts(w, 1, 12, 15, 3, 2, 5, NULL, 2, out) ==
          EPCOMM_ERROR_INVALID_ARGUMENT);

    /* G % N == 0, R % N != 0: vLLM's AssertionError, unless the option is asked for. */
    const float w8[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int64_t out12[12];
    CHECK(epcomm_eplb_rebalance_experts(w8, 1, 8, 12, 2, 2, 3, NULL, 0, out12) ==
          EPCOMM_ERROR_ASSERTION);
    CHECK(strcmp(epcomm_last_error_message(), "num_gpus % num_nodes == 0 (3 % 2)") == 0);
    CHECK(epcomm_eplb_rebalance_experts(w8, 1, 8, 12, 2, 2, 3, NULL,
                                        EPCOMM_EPLB_ONE_NODE_FALLBACK, out12) == EPCOMM_OK);

    /* An old map with -1 (unused) slots. */
    const float w24[24] = {37, 5,  81, 12, 64, 29, 93, 48, 71, 2,  56, 18,
                           88, 41, 7,  66, 23, 99, 14, 52, 35, 77, 60, 9};
    const int64_t old[30] = {0,  1,  2,  3,  4,  5,  -1, -1, 6,  7,  8,  9,  10, 11, -1,
                             -1, 12, 13, 14, 15, 16, 17, -1, -1, 18, 19, 20, 21, 22, 23};
    const int64_t kept[30] = {15, 6,  2,  3,  8,  18, 4,  2,  6,  5,  8,  1,  22, 11, 7,
                              21, 23, 13, 14, 10, 16, 17, 12, 0,  17, 19, 20, 21, 12, 9};
    int64_t out30[30];
    CHECK(epcomm_eplb_rebalance_experts(w24, 1, 24, 30, 3, 2, 5, old, 0, out30) == EPCOMM_OK);
    CHECK(SAME(out30, kept));
}

static void steps(void) {
    const double pw[6] = {5, 3, 9, 1, 7, 2};
    const int64_t want_pack[6] = {2, 2, 0, 0, 1, 1}, want_rank[6] = {0, 1, 0, 1, 0, 1};
    int64_t pack[6], rank[6];
    CHECK(epcomm_eplb_balanced_packing(pw, 1, 6, 3, pack, rank) == EPCOMM_OK);
    CHECK(SAME(pack, want_pack) && SAME(rank, want_rank));
    CHECK(epcomm_eplb_balanced_packing(pw, 1, 6, 4, pack, rank) == EPCOMM_ERROR_ASSERTION);

    const double rw[3] = {10, 4, 7};
    const int64_t want_p2l[6] = {0, 1, 2, 0, 2, 0}, want_cnt[3] = {3, 1, 2};
    int64_t p2l[6], cnt[3];
    CHECK(epcomm_eplb_replicate_experts(rw, 1, 3, 6, p2l, cnt) == EPCOMM_OK);
    CHECK(SAME(p2l, want_p2l) && SAME(cnt, want_cnt));
    CHECK(epcomm_eplb_replicate_experts(rw, 1, 3, 2, p2l, cnt) == EPCOMM_ERROR_ASSERTION);

    /* test_eplb_algo.py's "duplicates" case, then in place with -1 slots. */
    const int64_t old[10] = {0, 1, 0, 2, 3, 4, 5, 6, 1, 2};
    const int64_t new_map[10] = {0, 5, 4, 0, 1, 6, 2, 3, 2, 1};
    const int64_t want[10] = {0, 1, 0, 5, 4, 3, 2, 6, 1, 2};
    int64_t post[10];
    CHECK(epcomm_eplb_preserve_intragpu_slots(new_map, 1, 10, 2, old, post) == EPCOMM_OK);
    CHECK(SAME(post, want));
    int64_t inplace[6] = {1, 0, 2, 3, -1, 4};
    const int64_t old6[6] = {-1, 1, -1, 3, 4, -1}, want6[6] = {0, 1, 2, 3, 4, -1};
    CHECK(epcomm_eplb_preserve_intragpu_slots(inplace, 1, 6, 2, old6, inplace) == EPCOMM_OK);
    CHECK(SAME(inplace, want6));
    /* Ranks that do not divide the slots: unchanged, as vLLM. */
    CHECK(epcomm_eplb_preserve_intragpu_slots(new_map, 1, 10, 3, old, post) == EPCOMM_OK);
    CHECK(SAME(post, new_map));
}

static void logical_maps(void) {
    /* test_compute_logical_maps_with_negative_indices: width derived as max(logcnt) = 1. */
    const int64_t p2l[12] = {0, 1, -1, 2, 3, -1, 3, -1, 2, 1, 0, -1};
    const int64_t want_cnt[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    const int64_t want_map[8] = {0, 1, 3, 4, 4, 3, 2, 0};
    int64_t cnt[8], map[2 * 4 * 6], width = -7;
    CHECK(epcomm_eplb_compute_logical_maps(p2l, 2, 6, 4, cnt, NULL, 0, &width) == EPCOMM_OK);
    CHECK(width == 1 && SAME(cnt, want_cnt));
    memset(map, 0x55, sizeof map);
    CHECK(epcomm_eplb_compute_logical_maps(p2l, 2, 6, 4, cnt, map, 2 * 4 * 6, &width) ==
          EPCOMM_OK);
    CHECK(memcmp(map, want_map, sizeof want_map) == 0);
    CHECK(epcomm_eplb_compute_logical_maps(p2l, 2, 6, 4, cnt, map, 7, &width) ==
          EPCOMM_ERROR_INVALID_ARGUMENT);
    const int64_t bad[2] = {0, 2};
    CHECK(epcomm_eplb_compute_logical_maps(bad, 1, 2, 2, cnt, NULL, 0, &width) ==
          EPCOMM_ERROR_INVALID_ARGUMENT);
    CHECK(epcomm_eplb_compute_logical_maps(p2l, 2, 6, 4, cnt, map, 48, NULL) ==
          EPCOMM_ERROR_NULL_POINTER);
}

int main(void) {
    policy();
    steps();
    logical_maps();
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
