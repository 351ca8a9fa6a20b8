/*
 * A small multi-process program for valgrind memcheck (tests/valgrind.rs): two forked ranks form
 * a shared-memory group through the C ABI and run all_gatherv, reduce_scatterv and an all2all
 * dispatch/combine (TOKEN_MAJOR, checked exactly), destroy everything, then create and destroy
 * LOOPS groups and managers (each with a barrier, an all_gather and, every tenth time, a
 * dispatch/combine), so leaked memory would add up to definite leaks. Built without sanitizers.
 *
 * Usage: valgrind_test GROUP_NAME
 *
 * The parent forks the ranks before it calls anything in epcomm, waits for them with a
 * deadline, prints "N passed, M failed" counting ranks (a rank fails when any check fails or,
 * under valgrind --error-exitcode=1, when memcheck found an error in it) and exits non-zero if
 * any rank failed or the groups (GROUP_NAME and GROUP_NAME.l) left anything in /dev/shm.
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
#define COLS 4
#define NUM_EXPERTS 4
#define TOP_K 2
#define HIDDEN 8
#define MAX_TOKENS 8
#define LOOPS 50


/* Rows per rank of the v-collectives. */
static const int64_t ROWS[WORLD] = {2, 3};
#define TOTAL_ROWS 5

#define make_tensor(data, code, bits, ndim, shape) \
    test_cpu_tensor(data, code, bits, ndim, shape, NULL)

static void test_all_gatherv(group_t *g, int rank) {
    float in[3 * COLS];
    float out[TOTAL_ROWS * COLS];
    int64_t in_shape[2] = {ROWS[rank], COLS};
    int64_t out_shape[2] = {TOTAL_ROWS, COLS};
    tensor_t ti, to;
    int r, i, c, row = 0, bad = 0;

    for (i = 0; i < (int)ROWS[rank] * COLS; i++) {
        in[i] = (float)(rank * 100 + i);
    }
    ti = make_tensor(in, DL_FLOAT, 32, 2, in_shape);
    to = make_tensor(out, DL_FLOAT, 32, 2, out_shape);
    if (!CHECK_ST(epcomm_group_all_gatherv(g, &ti, ROWS, &to), EPCOMM_OK)) {
        return;
    }
    for (r = 0; r < WORLD; r++) {
        for (i = 0; i < (int)ROWS[r]; i++, row++) {
            for (c = 0; c < COLS; c++) {
                bad += out[row * COLS + c] != (float)(r * 100 + i * COLS + c);
            }
        }
    }
    CHECK(bad == 0);
}

static void test_reduce_scatterv(group_t *g, int rank) {
    float in[TOTAL_ROWS * COLS];
    float out[3 * COLS];
    int64_t in_shape[2] = {TOTAL_ROWS, COLS};
    int64_t out_shape[2] = {ROWS[rank], COLS};
    int64_t first = rank == 0 ? 0 : ROWS[0];
    tensor_t ti, to;
    int i, bad = 0;

    for (i = 0; i < TOTAL_ROWS * COLS; i++) {
        in[i] = (float)((rank + 1) * i);
    }
    ti = make_tensor(in, DL_FLOAT, 32, 2, in_shape);
    to = make_tensor(out, DL_FLOAT, 32, 2, out_shape);
    if (!CHECK_ST(epcomm_group_reduce_scatterv(g, &ti, ROWS, &to), EPCOMM_OK)) {
        return;
    }
    /* Sum over ranks of (r + 1) * i = 3 * i for two ranks. */
    for (i = 0; i < (int)ROWS[rank] * COLS; i++) {
        bad += out[i] != (float)(3 * ((int)first * COLS + i));
    }
    CHECK(bad == 0);
}

/* One TOKEN_MAJOR dispatch/combine with identity experts and weights summing to 1: every
 * holder's row is sum_k w_k * x over its experts, so the combined output equals x exactly. */
static void test_dispatch_combine(group_t *g, int rank) {
    moe_config_t c;
    a2a_t *a = NULL;
    dispatch_t o;
    const int64_t t = 3 + rank;
    float x[MAX_TOKENS * HIDDEN];
    int64_t ids[MAX_TOKENS * TOP_K];
    float w[MAX_TOKENS * TOP_K];
    float out[MAX_TOKENS * HIDDEN];
    int64_t x_shape[2] = {t, HIDDEN};
    int64_t k_shape[2] = {t, TOP_K};
    int64_t y_shape[2];
    tensor_t tx, tids, tw, ty, tout;
    float *y;
    int64_t rows, r;
    int i, k, bad = 0;

    if (!CHECK_ST(epcomm_moe_config_init(&c), EPCOMM_OK)) {
        return;
    }
    c.num_experts = NUM_EXPERTS;
    c.top_k = TOP_K;
    c.hidden_size = HIDDEN;
    c.hidden_dtype.code = DL_FLOAT;
    c.hidden_dtype.bits = 32;
    c.hidden_dtype.lanes = 1;
    c.expert_dtype = c.hidden_dtype;
    c.out_dtype = c.hidden_dtype;
    c.max_tokens_per_rank = MAX_TOKENS;
    if (!CHECK_ST(epcomm_all2all_create(g, "deepep_high_throughput", &c, &a), EPCOMM_OK)) {
        return;
    }
    for (i = 0; i < (int)t; i++) {
        for (k = 0; k < HIDDEN; k++) {
            x[i * HIDDEN + k] = (float)(rank * 100 + i * 10 + k);
        }
        ids[i * TOP_K] = (i + rank) % NUM_EXPERTS;
        ids[i * TOP_K + 1] = (i + rank + 1) % NUM_EXPERTS;
        w[i * TOP_K] = 0.75f;
        w[i * TOP_K + 1] = 0.25f;
    }
    tx = make_tensor(x, DL_FLOAT, 32, 2, x_shape);
    tids = make_tensor(ids, DL_INT, 64, 2, k_shape);
    tw = make_tensor(w, DL_FLOAT, 32, 2, k_shape);
    memset(&o, 0, sizeof o);
    if (!CHECK_ST(epcomm_all2all_dispatch(a, &tx, &tids, &tw, NULL, 0, &o), EPCOMM_OK)) {
        epcomm_all2all_destroy(a);
        return;
    }
    CHECK(o.layout == EPCOMM_LAYOUT_TOKEN_MAJOR && o.hidden.ndim == 2);
    rows = o.hidden.shape[0];
    y = (float *)malloc((size_t)(rows > 0 ? rows : 1) * HIDDEN * sizeof(float));
    if (y == NULL) {
        CHECK(y != NULL);
        epcomm_all2all_destroy(a);
        return;
    }
    for (r = 0; r < rows; r++) {
        const float *xr = (const float *)o.hidden.data + r * HIDDEN;
        const float *wr = (const float *)o.topk_weights.data + r * TOP_K;
        float s = 0.0f;
        for (k = 0; k < TOP_K; k++) {
            s += wr[k]; /* non-local entries have weight 0 */
        }
        for (i = 0; i < HIDDEN; i++) {
            y[r * HIDDEN + i] = s * xr[i];
        }
    }
    y_shape[0] = rows;
    y_shape[1] = HIDDEN;
    ty = make_tensor(y, DL_FLOAT, 32, 2, y_shape);
    tout = make_tensor(out, DL_FLOAT, 32, 2, x_shape);
    if (CHECK_ST(epcomm_all2all_combine(a, &ty, &tout), EPCOMM_OK)) {
        for (i = 0; i < (int)t * HIDDEN; i++) {
            bad += out[i] != x[i];
        }
        CHECK(bad == 0);
    }
    free(y);
    epcomm_all2all_destroy(a);
}

static group_t *create_group(const char *name, int rank) {
    options_t opts;
    group_t *g = NULL;
    if (!CHECK_ST(epcomm_group_options_init(&opts), EPCOMM_OK)) {
        return NULL;
    }
    /* Generous: everything runs many times slower under valgrind. */
    opts.timeout_s = 60.0;
    opts.initial_capacity_bytes = 1 << 16;
    if (!CHECK_ST(epcomm_group_create_shm(name, rank, WORLD, &opts, &g), EPCOMM_OK)) {
        return NULL;
    }
    return g;
}

static int child_main(const char *name, int rank) {
    char loop_name[200];
    group_t *g;
    int i;

    g = create_group(name, rank);
    if (g == NULL) {
        return 1;
    }
    CHECK_ST(epcomm_group_barrier(g), EPCOMM_OK);
    test_all_gatherv(g, rank);
    test_reduce_scatterv(g, rank);
    test_dispatch_combine(g, rank);
    CHECK_ST(epcomm_group_barrier(g), EPCOMM_OK);
    epcomm_group_destroy(g);

    /* Create/destroy cycles under one name (GROUP.l), each with a manager. */
    snprintf(loop_name, sizeof loop_name, "%s.l", name);
    for (i = 0; i < LOOPS && g_failed == 0; i++) {
        moe_config_t c;
        a2a_t *a = NULL;
        int32_t mine[2] = {rank, i};
        int32_t all[2 * WORLD];

        g = create_group(loop_name, rank);
        if (g == NULL) {
            break;
        }
        if (CHECK_ST(epcomm_moe_config_init(&c), EPCOMM_OK)) {
            c.num_experts = NUM_EXPERTS;
            c.top_k = TOP_K;
            c.hidden_size = HIDDEN;
            c.max_tokens_per_rank = MAX_TOKENS;
            CHECK_ST(epcomm_all2all_create(g, "deepep_low_latency", &c, &a), EPCOMM_OK);
        }
        CHECK_ST(epcomm_group_barrier(g), EPCOMM_OK);
        if (CHECK_ST(epcomm_group_all_gather(g, mine, sizeof mine, all), EPCOMM_OK)) {
            CHECK(all[0] == 0 && all[1] == i && all[2] == 1 && all[3] == i);
        }
        if (i % 10 == 0) {
            test_dispatch_combine(g, rank);
        }
        epcomm_all2all_destroy(a);
        epcomm_group_destroy(g);
    }
    CHECK(i == LOOPS);
    return g_failed == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    return test_ranks_main(argc, argv, "valgrind_test", WORLD, child_main,
                           TEST_RANKS_COUNT_RANKS);
}
