/* EPLB policy through the C ABI: vLLM's test vectors (tests/distributed/test_eplb_algo.py). */
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

int main(void) {
    const float weight[2 * 12] = {90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86,
                                  20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27};
    const int64_t want[2 * 16] = {5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1,
                                  7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1};
    const int64_t want_cnt[2 * 12] = {1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1,
                                      1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1};
    int64_t p2l[2 * 16];
    memset(p2l, 0, sizeof p2l);
    CHECK(epcomm_eplb_rebalance(weight, 2, 12, 16, 4, 2, 8, NULL, p2l) == EPCOMM_OK);
    CHECK(memcmp(p2l, want, sizeof want) == 0);

    int64_t cnt[2 * 12];
    int64_t l2p[2 * 12 * 3];
    CHECK(epcomm_eplb_logical_maps(p2l, 2, 16, 12, 3, cnt, l2p) == EPCOMM_OK);
    CHECK(memcmp(cnt, want_cnt, sizeof want_cnt) == 0);

    const int64_t small[2 * 6] = {0, 1, 2, 3, 0, 1, 0, 2, 0, 1, 0, 3};
    const int64_t small_map[2 * 4 * 3] = {0, 4, -1, 1, 5, -1, 2, -1, -1, 3, -1, -1,
                                          0, 2, 4,  3, -1, -1, 1, -1, -1, 5, -1, -1};
    const int64_t small_cnt[2 * 4] = {2, 2, 1, 1, 3, 1, 1, 1};
    int64_t scnt[8];
    int64_t smap[24];
    CHECK(epcomm_eplb_logical_maps(small, 2, 6, 4, 3, scnt, smap) == EPCOMM_OK);
    CHECK(memcmp(scnt, small_cnt, sizeof small_cnt) == 0);
    CHECK(memcmp(smap, small_map, sizeof small_map) == 0);
    /* Too narrow a map is an error naming the expert; outputs untouched. */
    smap[0] = 77;
    CHECK(epcomm_eplb_logical_maps(small, 2, 6, 4, 2, scnt, smap) == EPCOMM_ERROR_INVALID_ARGUMENT);
    CHECK(strcmp(epcomm_last_error_message(),
                 "expert 0 of layer 1 has 3 replicas, more than max_replicas = 2") == 0);
    CHECK(smap[0] == 77);

    const float four[4] = {10, 20, 30, 40};
    int64_t perm[4] = {-1, -1, -1, -1};
    CHECK(epcomm_eplb_rebalance(four, 1, 4, 4, 1, 1, 1, NULL, perm) == EPCOMM_OK);
    int seen[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4; i++)
        if (perm[i] >= 0 && perm[i] < 4) seen[perm[i]]++;
    CHECK(seen[0] == 1 && seen[1] == 1 && seen[2] == 1 && seen[3] == 1);
    int64_t bad[7];
    int32_t rc = epcomm_eplb_rebalance(four, 1, 4, 7, 2, 2, 4, NULL, bad);
    CHECK(rc == EPCOMM_ERROR_ASSERTION);
    CHECK(strcmp(epcomm_status_exception(rc), "AssertionError") == 0);

    /* Keeping old slots: identical maps stay identical. */
    int64_t again[2 * 16];
    CHECK(epcomm_eplb_rebalance(weight, 2, 12, 16, 4, 2, 8, p2l, again) == EPCOMM_OK);
    CHECK(memcmp(again, p2l, sizeof again) == 0);

    /* An old map with vLLM's -1 (unused) slots: accepted, and the same placement as
     * epcomm_eplb_rebalance_experts with vLLM's eplb_state rule (one policy behaviour). */
    int64_t holes[2 * 16];
    int64_t via_algo[2 * 16];
    memcpy(holes, p2l, sizeof holes);
    holes[3] = -1;
    holes[16 + 9] = -1;
    CHECK(epcomm_eplb_rebalance(weight, 2, 12, 16, 4, 2, 8, holes, again) == EPCOMM_OK);
    CHECK(epcomm_eplb_rebalance_experts(weight, 2, 12, 16, 4, 2, 8, holes,
                                        EPCOMM_EPLB_ONE_NODE_FALLBACK, via_algo) == EPCOMM_OK);
    CHECK(memcmp(again, via_algo, sizeof again) == 0);
    /* Experts that stay keep their old slots; the freed slot is filled. */
    CHECK(again[0] == p2l[0] && again[16] == p2l[16]);
    CHECK(again[3] >= 0 && again[16 + 9] >= 0);

    int64_t r = -1;
    CHECK(epcomm_eplb_min_redundant_experts(58, 8, &r) == EPCOMM_OK && r == 6);
    CHECK(epcomm_eplb_rebalance(NULL, 1, 4, 4, 1, 1, 1, NULL, perm) == EPCOMM_ERROR_NULL_POINTER);

    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
