/*
 * Zero-copy views through the C ABI: two forked ranks of a shared-memory group dispatch
 * (R=2, E=4, K=2, H=8, float32) through one backend per layout and combine the same expert
 * outputs three ways: from malloc'd memory (the copying path), from the manager's
 * expert-output buffer (epcomm_all2all_expert_output_buffer) and from epcomm_mem_alloc
 * memory; the results must be byte-identical and the manager must count exactly the one
 * in-place combine (epcomm_all2all_zero_copy_combines). Then every misuse: zero bytes, NULL
 * outputs, a double free, a pointer inside an allocation, a malloc'd pointer, a pointer of
 * another group, the buffer before a dispatch; and allocations left for
 * epcomm_group_destroy (LeakSanitizer sees none leak). Built as C11 and C++17 under
 * ASan+UBSan by tests/c_mem.rs.
 *
 * Usage: mem_test GROUP_NAME
 */
#include "test_ranks.h" /* first: it selects POSIX for the system headers */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epcomm.h"

typedef struct epcomm_tensor tensor_t;
typedef struct epcomm_group group_t;
typedef struct epcomm_group_options options_t;
typedef struct epcomm_all2all a2a_t;
typedef struct epcomm_moe_config moe_config_t;
typedef struct epcomm_dispatch_output dispatch_t;

#define WORLD 2
#define NUM_EXPERTS 4
#define TOP_K 2
#define HIDDEN 8
#define TOKENS 3

static const char *const BACKENDS[5] = {
    "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
    "flashinfer_nvlink_two_sided",
};

static moe_config_t config(void) {
    moe_config_t c;
    memset(&c, 0, sizeof c);
    CHECK_ST(epcomm_moe_config_init(&c), EPCOMM_OK);
    c.num_experts = NUM_EXPERTS;
    c.top_k = TOP_K;
    c.hidden_size = HIDDEN;
    c.hidden_dtype.code = DL_FLOAT;
    c.hidden_dtype.bits = 32;
    c.hidden_dtype.lanes = 1;
    c.expert_dtype = c.hidden_dtype;
    c.out_dtype = c.hidden_dtype;
    c.max_tokens_per_rank = TOKENS;
    return c;
}

/* Dispatches this rank's tokens; 1 on success. */
static int dispatch(a2a_t *a, int rank, dispatch_t *o) {
    static float x[TOKENS * HIDDEN];
    static int32_t ids[TOKENS * TOP_K];
    static float w[TOKENS * TOP_K];
    static int64_t xs[2] = {TOKENS, HIDDEN}, is[2] = {TOKENS, TOP_K};
    tensor_t tx = test_cpu_tensor(x, DL_FLOAT, 32, 2, xs, NULL);
    tensor_t ti = test_cpu_tensor(ids, DL_INT, 32, 2, is, NULL);
    tensor_t tw = test_cpu_tensor(w, DL_FLOAT, 32, 2, is, NULL);
    int i;
    for (i = 0; i < TOKENS * HIDDEN; i++) {
        x[i] = (float)((i * 7 + rank * 3) % 11) - 5.0f;
    }
    for (i = 0; i < TOKENS * TOP_K; i++) {
        ids[i] = (i * 3 + rank + i / TOP_K) % NUM_EXPERTS;
        w[i] = 0.25f + 0.25f * (float)(i % 3);
    }
    memset(o, 0, sizeof *o);
    return CHECK_ST(epcomm_all2all_dispatch(a, &tx, &ti, &tw, NULL, 0, o), EPCOMM_OK);
}

/* Combine of `y` (shaped as the dispatch output's hidden) into `out` [TOKENS, HIDDEN]. */
static int combine(a2a_t *a, const dispatch_t *o, void *y, float *out) {
    static int64_t os[2] = {TOKENS, HIDDEN};
    tensor_t ty = o->hidden;
    tensor_t to = test_cpu_tensor(out, DL_FLOAT, 32, 2, os, NULL);
    ty.data = y;
    ty.strides = NULL;
    return CHECK_ST(epcomm_all2all_combine(a, &ty, &to), EPCOMM_OK);
}

/* The three combine paths of one backend give the same bytes; one in-place combine counted. */
static void test_paths(group_t *g, int rank, const char *backend) {
    moe_config_t c = config();
    a2a_t *a = NULL;
    dispatch_t o;
    float outs[3][TOKENS * HIDDEN];
    uint64_t in_place = 99;
    int path;
    if (!CHECK_ST(epcomm_all2all_create(g, backend, &c, &a), EPCOMM_OK)) {
        return;
    }
    for (path = 0; path < 3; path++) {
        int64_t rows = -1, n, i;
        void *y = NULL;
        float *hidden;
        if (!dispatch(a, rank, &o)) {
            break;
        }
        n = 1;
        for (i = 0; i < o.hidden.ndim; i++) {
            n *= o.hidden.shape[i];
        }
        if (path == 0) {
            y = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
        } else if (path == 1) {
            CHECK_ST(epcomm_all2all_expert_output_buffer(a, &y, &rows), EPCOMM_OK);
            CHECK(rows * HIDDEN == n);
        } else {
            CHECK_ST(epcomm_mem_alloc(g, (size_t)(n > 0 ? n : 1) * sizeof(float), &y), EPCOMM_OK);
        }
        if (y == NULL) {
            CHECK(y != NULL);
            break;
        }
        /* The toy experts: twice their input, written where combine reads. */
        hidden = (float *)o.hidden.data;
        for (i = 0; i < n; i++) {
            ((float *)y)[i] = 2.0f * hidden[i];
        }
        memset(outs[path], 0, sizeof outs[path]);
        combine(a, &o, y, outs[path]);
        if (path == 0) {
            free(y);
        } else if (path == 2) {
            CHECK_ST(epcomm_mem_free(g, y), EPCOMM_OK);
        }
    }
    if (memcmp(outs[0], outs[1], sizeof outs[0]) != 0 ||
        memcmp(outs[0], outs[2], sizeof outs[0]) != 0) {
        test_fail_at(__FILE__, __LINE__);
        printf("%s: a zero-copy combine differs from the copying one\n", backend);
    }
    CHECK_ST(epcomm_all2all_zero_copy_combines(a, &in_place), EPCOMM_OK);
    CHECK(in_place == 1);
    epcomm_all2all_destroy(a);
}

/* The last error is "ptr P is not memory of group NAME ..." for pointer `p`. */
static void check_not_mine(const void *p, const char *name) {
    char want[512];
    snprintf(want, sizeof want,
             "ptr %p is not memory of group '%s' from epcomm_mem_alloc (freed already, from "
             "another group, or not the start of an allocation)",
             p, name);
    CHECK_MSG_EQ(want);
}

static void test_misuse(group_t *g, group_t *other, const char *name, const char *other_name) {
    void *p = NULL, *q = NULL;
    char *heap = (char *)malloc(64);
    moe_config_t c = config();
    a2a_t *a = NULL;
    int64_t rows = -1;
    uint64_t n = 99;

    CHECK_ST(epcomm_mem_alloc(g, 0, &p), EPCOMM_ERROR_INVALID_ARGUMENT);
    CHECK_MSG_EQ("bytes is 0: expected at least 1");
    CHECK(p == NULL);
    CHECK_ST(epcomm_mem_alloc(g, 16, NULL), EPCOMM_ERROR_NULL_POINTER);
    CHECK_ST(epcomm_mem_alloc(NULL, 16, &p), EPCOMM_ERROR_NULL_POINTER);
    if (CHECK_ST(epcomm_mem_alloc(g, 4096 + 1, &p), EPCOMM_OK) && p != NULL) {
        int i, zero = 1;
        for (i = 0; i < 4097; i++) {
            zero &= ((unsigned char *)p)[i] == 0;
        }
        CHECK(zero);
        memset(p, 0x5a, 4097);
        CHECK_ST(epcomm_mem_free(other, p), EPCOMM_ERROR_INVALID_ARGUMENT);
        check_not_mine(p, other_name);
        CHECK_ST(epcomm_mem_free(g, (char *)p + 64), EPCOMM_ERROR_INVALID_ARGUMENT);
        check_not_mine((char *)p + 64, name);
        CHECK_ST(epcomm_mem_free(g, p), EPCOMM_OK);
        CHECK_ST(epcomm_mem_free(g, p), EPCOMM_ERROR_INVALID_ARGUMENT);
        check_not_mine(p, name);
    }
    CHECK_ST(epcomm_mem_free(g, heap), EPCOMM_ERROR_INVALID_ARGUMENT);
    check_not_mine(heap, name);
    CHECK_ST(epcomm_mem_free(g, NULL), EPCOMM_OK);
    free(heap);

    if (CHECK_ST(epcomm_all2all_create(g, "deepep_low_latency", &c, &a), EPCOMM_OK)) {
        CHECK_ST(epcomm_all2all_expert_output_buffer(a, &q, &rows), EPCOMM_ERROR_INVALID_STATE);
        CHECK_MSG_EQ(
            "expert_output_buffer called without a successful dispatch: call dispatch first");
        CHECK(q == NULL && rows == 0);
        CHECK_ST(epcomm_all2all_expert_output_buffer(a, NULL, &rows), EPCOMM_ERROR_NULL_POINTER);
        CHECK_ST(epcomm_all2all_zero_copy_combines(a, &n), EPCOMM_OK);
        CHECK(n == 0);
        CHECK_ST(epcomm_all2all_zero_copy_combines(a, NULL), EPCOMM_ERROR_NULL_POINTER);
        epcomm_all2all_destroy(a);
    }
    CHECK_ST(epcomm_all2all_zero_copy_combines(NULL, &n), EPCOMM_ERROR_NULL_POINTER);
    /* Left for epcomm_group_destroy to free. */
    CHECK_ST(epcomm_mem_alloc(g, 1 << 20, &q), EPCOMM_OK);
    CHECK_ST(epcomm_mem_alloc(other, 100, &q), EPCOMM_OK);
}

static int child_main(const char *name, int rank) {
    options_t opts;
    group_t *g = NULL, *solo = NULL;
    char solo_name[256];
    int i;

    CHECK_ST(epcomm_group_options_init(&opts), EPCOMM_OK);
    opts.timeout_s = 20.0;
    if (!CHECK_ST(epcomm_group_create_shm(name, rank, WORLD, &opts, &g), EPCOMM_OK)) {
        return 1;
    }
    for (i = 0; i < 5; i++) {
        test_paths(g, rank, BACKENDS[i]);
        CHECK_ST(epcomm_group_barrier(g), EPCOMM_OK);
    }
    /* A one-rank group of this rank ("NAME.sN": counted as the group's in /dev/shm). */
    snprintf(solo_name, sizeof solo_name, "%s.s%d", name, rank);
    if (CHECK_ST(epcomm_group_create_shm(solo_name, 0, 1, &opts, &solo), EPCOMM_OK)) {
        test_misuse(g, solo, name, solo_name);
        epcomm_group_destroy(solo);
    }
    CHECK_ST(epcomm_group_barrier(g), EPCOMM_OK);
    epcomm_group_destroy(g);
    return g_failed == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    return test_ranks_main(argc, argv, "mem_test", WORLD, child_main, TEST_RANKS_COUNT_RANKS);
}
