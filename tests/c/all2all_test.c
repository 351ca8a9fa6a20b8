/*
 * MoE dispatch/combine through the C ABI: two real processes (forked ranks) form a shared-memory
 * group and run the worked example of docs/design.md (R=2, E=4, K=2, H=1, float32) through one
 * backend per layout, checking the dispatch output and the combined result exactly; then
 * the error paths: MoonEP unavailable, apply_router_weight_on_input with top_k 2, the one-sided
 * manager's heterogeneous-layer assertion, a bad expert id on one rank (both ranks fail, a
 * good dispatch follows), a wrong-shaped combine input on one rank (both ranks fail, a good
 * combine follows), per-peer statistics and buffer sizing; and FP8 dispatch (bf16 rows of
 * 256 whose float8 codes and power-of-two scales are known exactly) in every layout. Built as C11 and (with -x c++) as
 * C++17, under ASan+UBSan, by tests/c_all2all.rs.
 *
 * Usage: all2all_test GROUP_NAME
 *
 * The parent forks the ranks before it calls anything in epcomm, waits for them with a
 * deadline (killing them when it passes), prints one line per failed rank and, at the end,
 * "N passed, M failed" counting ranks; exits non-zero if any rank failed or the group left
 * anything in /dev/shm.
 */
#include "test_ranks.h" /* first: it selects POSIX for the system headers */

#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

#include "epcomm.h"

/* Structs are named by their tags (valid with and without cbindgen's typedefs). */
typedef struct epcomm_tensor tensor_t;
typedef struct epcomm_group group_t;
typedef struct epcomm_group_options options_t;
typedef struct epcomm_all2all a2a_t;
typedef struct epcomm_moe_config moe_config_t;
typedef struct epcomm_dispatch_output dispatch_t;
typedef struct epcomm_all2all_stats stats_t;

#define WORLD 2
#define NUM_EXPERTS 4
#define TOP_K 2
#define HIDDEN 1
#define MAX_TOKENS 3
/* Rows of the largest dispatch buffer in the example: EXPERT_MAJOR [2, M*R, 1]. */
#define MAX_ROWS 16


#define make_tensor(data, code, bits, ndim, shape) \
    test_cpu_tensor(data, code, bits, ndim, shape, NULL)

/* ---- array checks ----------------------------------------------------------------------------- */

static void check_f32s(const char *what, const float *got, const float *want, int n) {
    int i;
    for (i = 0; i < n; i++) {
        if (got[i] != want[i]) {
            g_failed++;
            printf("FAIL rank %d %s[%d] = %g, expected %g\n", g_rank, what, i, (double)got[i],
                   (double)want[i]);
            return;
        }
    }
}

static void check_i64s(const char *what, const int64_t *got, const int64_t *want, int n) {
    int i;
    for (i = 0; i < n; i++) {
        if (got[i] != want[i]) {
            g_failed++;
            printf("FAIL rank %d %s[%d] = %lld, expected %lld\n", g_rank, what, i,
                   (long long)got[i], (long long)want[i]);
            return;
        }
    }
}

static void check_i32s(const char *what, const int32_t *got, const int32_t *want, int n) {
    int i;
    for (i = 0; i < n; i++) {
        if (got[i] != want[i]) {
            g_failed++;
            printf("FAIL rank %d %s[%d] = %d, expected %d\n", g_rank, what, i, (int)got[i],
                   (int)want[i]);
            return;
        }
    }
}

static void check_u64s(const char *what, const uint64_t *got, const uint64_t *want, int n) {
    int i;
    for (i = 0; i < n; i++) {
        if (got[i] != want[i]) {
            g_failed++;
            printf("FAIL rank %d %s[%d] = %llu, expected %llu\n", g_rank, what, i,
                   (unsigned long long)got[i], (unsigned long long)want[i]);
            return;
        }
    }
}

/* A returned view has dtype (code, bits) and shape `dims` (ndim entries); 1 if so. */
static int check_view(const char *what, const tensor_t *t, uint8_t code, uint8_t bits, int ndim,
                      const int64_t *dims) {
    int i;
    int ok = t->ndim == ndim && t->dtype.code == code && t->dtype.bits == bits &&
             t->dtype.lanes == 1 && t->device.device_type == EPCOMM_DEVICE_CPU &&
             t->shape != NULL && t->byte_offset == 0;
    for (i = 0; ok && i < ndim; i++) {
        ok = t->shape[i] == dims[i];
    }
    if (ok && t->strides != NULL) {
        /* NULL strides mean compact; explicit ones must say so too. */
        int64_t acc = 1;
        for (i = ndim - 1; ok && i >= 0; i--) {
            ok = t->shape[i] <= 1 || t->strides[i] == acc;
            acc *= t->shape[i];
        }
    }
    if (!ok) {
        g_failed++;
        printf("FAIL rank %d view %s: ndim %d dtype (%d,%d,%d) shape [", g_rank, what,
               (int)t->ndim, (int)t->dtype.code, (int)t->dtype.bits, (int)t->dtype.lanes);
        for (i = 0; t->shape != NULL && i < t->ndim && i < 8; i++) {
            printf("%s%lld", i ? ", " : "", (long long)t->shape[i]);
        }
        printf("], expected ndim %d dtype (%d,%d,1) shape [", ndim, (int)code, (int)bits);
        for (i = 0; i < ndim; i++) {
            printf("%s%lld", i ? ", " : "", (long long)dims[i]);
        }
        printf("]\n");
    }
    return ok;
}

/* Elements of a view (product of its shape). */
static int64_t numel(const tensor_t *t) {
    int64_t n = 1;
    int i;
    for (i = 0; i < t->ndim; i++) {
        n *= t->shape[i];
    }
    return n;
}

/* ---- the worked example (docs/design.md) ------------------------------------------------------- */

static const int64_t EX_T[WORLD] = {3, 2};
static const float EX_X[WORLD][MAX_TOKENS] = {{10.0f, 11.0f, 12.0f}, {20.0f, 21.0f, 0.0f}};
static const int32_t EX_IDS[WORLD][MAX_TOKENS * TOP_K] = {{0, 2, 1, 0, 3, -1},
                                                          {2, 3, 1, -1, 0, 0}};
static const float EX_W[WORLD][MAX_TOKENS * TOP_K] = {{0.5f, 0.5f, 0.25f, 0.75f, 1.0f, 0.0f},
                                                      {0.5f, 0.5f, 1.0f, 0.0f, 0.0f, 0.0f}};
/* With expert e computing (e+1)*x, combine returns these in every layout. */
static const float EX_OUT[WORLD][MAX_TOKENS] = {{20.0f, 13.75f, 48.0f}, {70.0f, 42.0f, 0.0f}};

/* One rank's dispatch input: tensors over its own arrays. */
typedef struct {
    float x[MAX_TOKENS * HIDDEN];
    int32_t ids[MAX_TOKENS * TOP_K];
    float w[MAX_TOKENS * TOP_K];
    int64_t x_shape[2];
    int64_t ids_shape[2];
    int64_t w_shape[2];
    tensor_t tx;
    tensor_t tids;
    tensor_t tw;
} input_t;

static void example_input(input_t *in, int rank) {
    memset(in, 0, sizeof *in);
    memcpy(in->x, EX_X[rank], sizeof in->x);
    memcpy(in->ids, EX_IDS[rank], sizeof in->ids);
    memcpy(in->w, EX_W[rank], sizeof in->w);
    in->x_shape[0] = EX_T[rank];
    in->x_shape[1] = HIDDEN;
    in->ids_shape[0] = EX_T[rank];
    in->ids_shape[1] = TOP_K;
    in->w_shape[0] = EX_T[rank];
    in->w_shape[1] = TOP_K;
    in->tx = make_tensor(in->x, DL_FLOAT, 32, 2, in->x_shape);
    in->tids = make_tensor(in->ids, DL_INT, 32, 2, in->ids_shape);
    in->tw = make_tensor(in->w, DL_FLOAT, 32, 2, in->w_shape);
}

static moe_config_t example_config(void) {
    moe_config_t c;
    memset(&c, 0xab, sizeof c);
    if (!CHECK_ST(epcomm_moe_config_init(&c), EPCOMM_OK)) {
        memset(&c, 0, sizeof c);
        c.struct_size = (uint32_t)sizeof c;
    }
    CHECK(c.struct_size == sizeof(moe_config_t));
    CHECK(c.num_redundant_experts == 0 && c.extra_row_bytes == NULL && c.num_extras == 0);
    CHECK(!c.apply_router_weight_on_input);
    c.num_experts = NUM_EXPERTS;
    c.top_k = TOP_K;
    c.hidden_size = HIDDEN;
    c.hidden_dtype.code = DL_FLOAT;
    c.hidden_dtype.bits = 32;
    c.hidden_dtype.lanes = 1;
    c.expert_dtype = c.hidden_dtype;
    c.out_dtype = c.hidden_dtype;
    c.max_tokens_per_rank = MAX_TOKENS;
    return c;
}

static a2a_t *create_manager(group_t *g, const char *backend, const moe_config_t *c) {
    a2a_t *a = NULL;
    if (!CHECK_ST(epcomm_all2all_create(g, backend, c, &a), EPCOMM_OK)) {
        printf("  (backend %s)\n", backend);
        return NULL;
    }
    CHECK(a != NULL);
    return a;
}

static a2a_t *create_example(group_t *g, const char *backend) {
    moe_config_t c = example_config();
    return create_manager(g, backend, &c);
}

/* Per-peer statistics of one example dispatch: tokens sent / received by rank and peer. */
typedef struct {
    uint64_t sent[WORLD][WORLD];
    uint64_t received[WORLD][WORLD];
} example_stats_t;

static const example_stats_t ROWS_PER_TOKEN = {{{2, 2}, {1, 1}}, {{2, 1}, {2, 1}}};
static const example_stats_t ROWS_REPLICATED = {{{3, 3}, {2, 2}}, {{3, 2}, {3, 2}}};
static const example_stats_t ROWS_PER_EXPERT = {{{3, 2}, {1, 2}}, {{3, 1}, {2, 2}}};

static const example_stats_t *example_stats(int32_t layout) {
    switch (layout) {
    case EPCOMM_LAYOUT_REPLICATED:
        return &ROWS_REPLICATED;
    case EPCOMM_LAYOUT_EXPERT_MAJOR:
    case EPCOMM_LAYOUT_EXPERT_PACKED:
        return &ROWS_PER_EXPERT;
    default:
        return &ROWS_PER_TOKEN;
    }
}

/* Checks the dispatch output of the example against docs/design.md, row by row. */
static void check_example_dispatch(int32_t layout, int rank, const dispatch_t *o) {
    const float *x = (const float *)o->hidden.data;
    int64_t dims[3];
    int64_t empty = 0;
    CHECK(o->layout == layout);
    if (o->layout != layout) {
        return;
    }
    CHECK(o->extras == NULL && o->num_extras == 0);
    switch (layout) {
    case EPCOMM_LAYOUT_REPLICATED: {
        static const float want_x[5] = {10.0f, 11.0f, 12.0f, 20.0f, 21.0f};
        static const int64_t want_ids[10] = {0, 2, 1, 0, 3, -1, 2, 3, 1, -1};
        static const float want_w[10] = {0.5f, 0.5f, 0.25f, 0.75f, 1.0f,
                                         0.0f, 0.5f, 0.5f,  1.0f,  0.0f};
        CHECK(o->received_rows == 5);
        dims[0] = 5;
        dims[1] = HIDDEN;
        if (check_view("hidden", &o->hidden, DL_FLOAT, 32, 2, dims)) {
            check_f32s("REPLICATED hidden", x, want_x, 5);
        }
        dims[1] = TOP_K;
        if (check_view("topk_ids", &o->topk_ids, DL_INT, 64, 2, dims)) {
            check_i64s("REPLICATED topk_ids", (const int64_t *)o->topk_ids.data, want_ids, 10);
        }
        if (check_view("topk_weights", &o->topk_weights, DL_FLOAT, 32, 2, dims)) {
            check_f32s("REPLICATED topk_weights", (const float *)o->topk_weights.data, want_w,
                       10);
        }
        check_view("counts", &o->counts, DL_INT, 32, 1, &empty);
        check_view("expert_offsets", &o->expert_offsets, DL_INT, 64, 1, &empty);
        break;
    }
    case EPCOMM_LAYOUT_TOKEN_MAJOR: {
        static const float want_x[WORLD][3] = {{10.0f, 11.0f, 21.0f}, {10.0f, 12.0f, 20.0f}};
        static const int64_t want_ids[WORLD][6] = {{0, -1, 1, 0, 1, -1}, {-1, 2, 3, -1, 2, 3}};
        static const float want_w[WORLD][6] = {{0.5f, 0.0f, 0.25f, 0.75f, 1.0f, 0.0f},
                                               {0.0f, 0.5f, 1.0f, 0.0f, 0.5f, 0.5f}};
        static const int32_t want_counts[2] = {2, 2};
        CHECK(o->received_rows == 3);
        dims[0] = 3;
        dims[1] = HIDDEN;
        if (check_view("hidden", &o->hidden, DL_FLOAT, 32, 2, dims)) {
            check_f32s("TOKEN_MAJOR hidden", x, want_x[rank], 3);
        }
        dims[1] = TOP_K;
        if (check_view("topk_ids", &o->topk_ids, DL_INT, 64, 2, dims)) {
            check_i64s("TOKEN_MAJOR topk_ids", (const int64_t *)o->topk_ids.data, want_ids[rank],
                       6);
        }
        if (check_view("topk_weights", &o->topk_weights, DL_FLOAT, 32, 2, dims)) {
            check_f32s("TOKEN_MAJOR topk_weights", (const float *)o->topk_weights.data,
                       want_w[rank], 6);
        }
        dims[0] = 2;
        if (check_view("tokens_per_local_expert", &o->counts, DL_INT, 32, 1, dims)) {
            check_i32s("TOKEN_MAJOR tokens_per_local_expert", (const int32_t *)o->counts.data,
                       want_counts, 2);
        }
        check_view("expert_offsets", &o->expert_offsets, DL_INT, 64, 1, &empty);
        break;
    }
    case EPCOMM_LAYOUT_EXPERT_MAJOR: {
        /* Buckets of capacity M*R = 6; rows past counts[j] are unspecified. */
        static const float want_b0[WORLD][2] = {{10.0f, 11.0f}, {10.0f, 20.0f}};
        static const float want_b1[WORLD][2] = {{11.0f, 21.0f}, {12.0f, 20.0f}};
        static const int32_t want_counts[2] = {2, 2};
        CHECK(o->received_rows == 4);
        dims[0] = NUM_EXPERTS / WORLD;
        dims[1] = MAX_TOKENS * WORLD;
        dims[2] = HIDDEN;
        if (check_view("hidden", &o->hidden, DL_FLOAT, 32, 3, dims)) {
            check_f32s("EXPERT_MAJOR bucket 0", x, want_b0[rank], 2);
            check_f32s("EXPERT_MAJOR bucket 1", x + MAX_TOKENS * WORLD, want_b1[rank], 2);
        }
        dims[0] = 2;
        if (check_view("counts", &o->counts, DL_INT, 32, 1, dims)) {
            check_i32s("EXPERT_MAJOR counts", (const int32_t *)o->counts.data, want_counts, 2);
        }
        check_view("topk_ids", &o->topk_ids, DL_INT, 64, 1, &empty);
        check_view("topk_weights", &o->topk_weights, DL_FLOAT, 32, 1, &empty);
        check_view("expert_offsets", &o->expert_offsets, DL_INT, 64, 1, &empty);
        break;
    }
    case EPCOMM_LAYOUT_EXPERT_PACKED: {
        static const float want_x[WORLD][4] = {{10.0f, 11.0f, 11.0f, 21.0f},
                                               {10.0f, 20.0f, 12.0f, 20.0f}};
        static const float want_w[WORLD][4] = {{0.5f, 0.75f, 0.25f, 1.0f},
                                               {0.5f, 0.5f, 1.0f, 0.5f}};
        static const int64_t want_offsets[3] = {0, 2, 4};
        static const int32_t want_src_rank[WORLD][4] = {{0, 0, 0, 1}, {0, 1, 0, 1}};
        static const int32_t want_src_token[WORLD][4] = {{0, 1, 1, 1}, {0, 0, 2, 0}};
        CHECK(o->received_rows == 4);
        dims[0] = 4;
        dims[1] = HIDDEN;
        if (check_view("hidden", &o->hidden, DL_FLOAT, 32, 2, dims)) {
            check_f32s("EXPERT_PACKED hidden", x, want_x[rank], 4);
        }
        if (check_view("topk_weights", &o->topk_weights, DL_FLOAT, 32, 1, dims)) {
            check_f32s("EXPERT_PACKED weights", (const float *)o->topk_weights.data,
                       want_w[rank], 4);
        }
        if (check_view("src_rank", &o->src_rank, DL_INT, 32, 1, dims)) {
            check_i32s("EXPERT_PACKED src_rank", (const int32_t *)o->src_rank.data,
                       want_src_rank[rank], 4);
        }
        if (check_view("src_token", &o->src_token, DL_INT, 32, 1, dims)) {
            check_i32s("EXPERT_PACKED src_token", (const int32_t *)o->src_token.data,
                       want_src_token[rank], 4);
        }
        dims[0] = 3;
        if (check_view("expert_offsets", &o->expert_offsets, DL_INT, 64, 1, dims)) {
            check_i64s("EXPERT_PACKED expert_offsets", (const int64_t *)o->expert_offsets.data,
                       want_offsets, 3);
        }
        check_view("topk_ids", &o->topk_ids, DL_INT, 64, 1, &empty);
        check_view("counts", &o->counts, DL_INT, 32, 1, &empty);
        break;
    }
    case EPCOMM_LAYOUT_RANK_MAJOR: {
        /* Regions of capacity M = 3 per source rank; rows past recv_counts[s] have ids -1. */
        static const float want_r0[WORLD][2] = {{10.0f, 11.0f}, {10.0f, 12.0f}};
        static const float want_r1[WORLD] = {21.0f, 20.0f};
        static const int64_t want_ids[WORLD][12] = {
            {0, 2, 1, 0, -1, -1, 1, -1, -1, -1, -1, -1},
            {0, 2, 3, -1, -1, -1, 2, 3, -1, -1, -1, -1},
        };
        static const float want_w[WORLD][12] = {
            {0.5f, 0.5f, 0.25f, 0.75f, 0.0f, 0.0f, 1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f},
            {0.5f, 0.5f, 1.0f, 0.0f, 0.0f, 0.0f, 0.5f, 0.5f, 0.0f, 0.0f, 0.0f, 0.0f},
        };
        static const int32_t want_counts[2] = {2, 1};
        CHECK(o->received_rows == 3);
        dims[0] = WORLD;
        dims[1] = MAX_TOKENS;
        dims[2] = HIDDEN;
        if (check_view("hidden", &o->hidden, DL_FLOAT, 32, 3, dims)) {
            check_f32s("RANK_MAJOR region 0", x, want_r0[rank], 2);
            check_f32s("RANK_MAJOR region 1", x + MAX_TOKENS, &want_r1[rank], 1);
        }
        dims[0] = WORLD * MAX_TOKENS;
        dims[1] = TOP_K;
        if (check_view("topk_ids", &o->topk_ids, DL_INT, 64, 2, dims)) {
            check_i64s("RANK_MAJOR topk_ids", (const int64_t *)o->topk_ids.data, want_ids[rank],
                       12);
        }
        if (check_view("topk_weights", &o->topk_weights, DL_FLOAT, 32, 2, dims)) {
            /* Padding rows' weights are not specified: compare the received rows only. */
            const float *w = (const float *)o->topk_weights.data;
            check_f32s("RANK_MAJOR topk_weights region 0", w, want_w[rank], 4);
            check_f32s("RANK_MAJOR topk_weights region 1", w + MAX_TOKENS * TOP_K,
                       want_w[rank] + MAX_TOKENS * TOP_K, 2);
        }
        dims[0] = WORLD;
        if (check_view("recv_counts", &o->counts, DL_INT, 32, 1, dims)) {
            check_i32s("RANK_MAJOR recv_counts", (const int32_t *)o->counts.data, want_counts, 2);
        }
        check_view("expert_offsets", &o->expert_offsets, DL_INT, 64, 1, &empty);
        break;
    }
    default:
        g_failed++;
        printf("FAIL rank %d unexpected layout %d\n", g_rank, (int)layout);
    }
}

/* The expert side of the example per the layout's contract, expert e computing (e+1)*x. Writes
 * one float per buffer row of `o->hidden` into `y`; returns the row count (-1 on error). */
static int64_t example_expert_side(int rank, const dispatch_t *o, float *y) {
    const float *x = (const float *)o->hidden.data;
    int64_t rows = numel(&o->hidden) / HIDDEN;
    int64_t r;
    int k;
    if (rows > MAX_ROWS) {
        g_failed++;
        printf("FAIL rank %d dispatch buffer has %lld rows, more than %d\n", g_rank,
               (long long)rows, MAX_ROWS);
        return -1;
    }
    for (r = 0; r < rows; r++) {
        y[r] = 0.0f;
    }
    switch (o->layout) {
    case EPCOMM_LAYOUT_REPLICATED:
    case EPCOMM_LAYOUT_TOKEN_MAJOR:
    case EPCOMM_LAYOUT_RANK_MAJOR: {
        /* Weighted sum over the ids this rank owns. */
        const int64_t *ids = (const int64_t *)o->topk_ids.data;
        const float *w = (const float *)o->topk_weights.data;
        for (r = 0; r < rows; r++) {
            for (k = 0; k < TOP_K; k++) {
                int64_t e = ids[r * TOP_K + k];
                if (e >= 0 && e / (NUM_EXPERTS / WORLD) == rank) {
                    y[r] += w[r * TOP_K + k] * (float)(e + 1) * x[r];
                }
            }
        }
        break;
    }
    case EPCOMM_LAYOUT_EXPERT_MAJOR: {
        /* Raw outputs of bucket j (expert rank*2+j); rows past counts[j] stay 0. */
        const int32_t *counts = (const int32_t *)o->counts.data;
        int64_t cap = o->hidden.shape[1];
        for (r = 0; r < rows; r++) {
            int64_t j = r / cap;
            if (r % cap < counts[j]) {
                y[r] = (float)(rank * 2 + j + 1) * x[r];
            }
        }
        break;
    }
    case EPCOMM_LAYOUT_EXPERT_PACKED: {
        const int64_t *offsets = (const int64_t *)o->expert_offsets.data;
        for (r = 0; r < rows; r++) {
            int64_t j = r < offsets[1] ? 0 : 1;
            y[r] = (float)(rank * 2 + j + 1) * x[r];
        }
        break;
    }
    default:
        return -1;
    }
    return rows;
}

static int32_t dispatch_input(a2a_t *a, input_t *in, dispatch_t *o) {
    memset(o, 0, sizeof *o);
    return epcomm_all2all_dispatch(a, &in->tx, &in->tids, &in->tw, NULL, 0, o);
}

/* Combine of the example after a successful dispatch `o`; `extra_rows` > 0 makes the expert
 * output that many rows too long (an error). Checks the result when `check` is set. */
static int32_t combine_example(a2a_t *a, int rank, const dispatch_t *o, int extra_rows,
                               int check) {
    float y[MAX_ROWS + 4];
    float out[MAX_TOKENS * HIDDEN];
    int64_t y_shape[3];
    int64_t out_shape[2];
    tensor_t ty, to;
    int64_t rows = example_expert_side(rank, o, y);
    int32_t ndim = o->hidden.ndim;
    int32_t st;
    int i;
    if (rows < 0 || ndim < 1 || ndim > 3) {
        g_failed++;
        printf("FAIL rank %d cannot build the expert output (ndim %d)\n", g_rank, (int)ndim);
        return -1;
    }
    for (i = 0; i < ndim; i++) {
        y_shape[i] = o->hidden.shape[i];
    }
    if (extra_rows > 0) {
        /* [rows + extra, HIDDEN]: a shape that is not the dispatch output's. */
        ndim = 2;
        y_shape[0] = rows + extra_rows;
        y_shape[1] = HIDDEN;
        for (i = 0; i < extra_rows; i++) {
            y[rows + i] = 0.0f;
        }
    }
    for (i = 0; i < MAX_TOKENS * HIDDEN; i++) {
        out[i] = -1.0f;
    }
    out_shape[0] = EX_T[rank];
    out_shape[1] = HIDDEN;
    ty = make_tensor(y, DL_FLOAT, 32, ndim, y_shape);
    to = make_tensor(out, DL_FLOAT, 32, 2, out_shape);
    st = epcomm_all2all_combine(a, &ty, &to);
    if (check && CHECK_ST(st, EPCOMM_OK)) {
        check_f32s("combine output", out, EX_OUT[rank], (int)EX_T[rank]);
        /* Nothing past the rank's T rows was written. */
        for (i = (int)EX_T[rank]; i < MAX_TOKENS; i++) {
            CHECK(out[i] == -1.0f);
        }
    }
    return st;
}

static void check_example_stats(a2a_t *a, int rank, int32_t layout, int after_combine) {
    const example_stats_t *want = example_stats(layout);
    uint64_t bytes[WORLD];
    stats_t s;
    int p;
    memset(&s, 0, sizeof s);
    if (!CHECK_ST(epcomm_all2all_get_stats(a, &s), EPCOMM_OK)) {
        return;
    }
    CHECK(s.world_size == WORLD);
    if (s.world_size != WORLD || s.tokens_sent == NULL || s.tokens_received == NULL ||
        s.bytes_sent == NULL || s.bytes_received == NULL || s.combine_bytes_received == NULL) {
        g_failed++;
        printf("FAIL rank %d stats: world_size %d or a NULL array\n", g_rank,
               (int)s.world_size);
        return;
    }
    check_u64s("stats tokens_sent", s.tokens_sent, want->sent[rank], WORLD);
    check_u64s("stats tokens_received", s.tokens_received, want->received[rank], WORLD);
    for (p = 0; p < WORLD; p++) {
        bytes[p] = want->sent[rank][p] * HIDDEN * sizeof(float);
    }
    check_u64s("stats bytes_sent", s.bytes_sent, bytes, WORLD);
    for (p = 0; p < WORLD; p++) {
        bytes[p] = want->received[rank][p] * HIDDEN * sizeof(float);
    }
    check_u64s("stats bytes_received", s.bytes_received, bytes, WORLD);
    CHECK(s.dispatch_seconds >= 0.0);
    if (after_combine) {
        /* A source pulls back one row per row it sent (REPLICATED: every row it sent). */
        for (p = 0; p < WORLD; p++) {
            bytes[p] = want->sent[rank][p] * HIDDEN * sizeof(float);
        }
        check_u64s("stats combine_bytes_received", s.combine_bytes_received, bytes, WORLD);
        CHECK(s.combine_seconds >= 0.0);
    }
}

/* The example through one backend: dispatch, layout, expert side, combine, statistics. */
static void test_example(group_t *g, int rank, const char *backend, int32_t layout) {
    a2a_t *a = create_example(g, backend);
    input_t in;
    dispatch_t o;
    int round;
    if (a == NULL) {
        return;
    }
    /* Twice: the manager's buffers are reused by the second call. */
    for (round = 0; round < 2; round++) {
        example_input(&in, rank);
        if (!CHECK_ST(dispatch_input(a, &in, &o), EPCOMM_OK)) {
            printf("  (backend %s)\n", backend);
            break;
        }
        check_example_dispatch(layout, rank, &o);
        check_example_stats(a, rank, layout, 0);
        if (combine_example(a, rank, &o, 0, 1) != EPCOMM_OK) {
            printf("  (backend %s)\n", backend);
            break;
        }
        check_example_stats(a, rank, layout, 1);
    }
    epcomm_all2all_destroy(a);
}

/* ---- errors ------------------------------------------------------------------------------------ */

static void test_create_errors(group_t *g) {
    moe_config_t c = example_config();
    a2a_t *a = NULL;

    epcomm_clear_last_error();
    if (CHECK_ST(epcomm_all2all_create(g, "moonep", &c, &a), EPCOMM_ERROR_RUNTIME)) {
        CHECK_MSG_EQ("MoonEP not available. Install it from https://github.com/MoonshotAI/MoonEP.");
        CHECK(strcmp(epcomm_status_exception(EPCOMM_ERROR_RUNTIME), "RuntimeError") == 0);
    }
    CHECK(a == NULL);

    c.apply_router_weight_on_input = true;
    epcomm_clear_last_error();
    if (CHECK_ST(epcomm_all2all_create(g, "deepep_low_latency", &c, &a),
                 EPCOMM_ERROR_ASSERTION)) {
        CHECK_MSG_EQ("apply_router_weight_on_input is only implemented for topk=1");
    }
    CHECK(a == NULL);
    if (a != NULL) {
        epcomm_all2all_destroy(a);
        a = NULL;
    }

    /* A config of the first layout (struct_size ending before dispatch_fp8, as built against
     * a header without it) is accepted and dispatches bf16/f32 rows as they are. */
    c = example_config();
    c.struct_size = (uint32_t)offsetof(moe_config_t, dispatch_fp8);
    a = create_manager(g, "deepep_high_throughput", &c);
    CHECK(a != NULL);
    if (a != NULL) {
        epcomm_all2all_destroy(a);
        a = NULL;
    }
    c.struct_size = (uint32_t)offsetof(moe_config_t, dispatch_fp8) - 8;
    epcomm_clear_last_error();
    CHECK_ST(epcomm_all2all_create(g, "deepep_high_throughput", &c, &a),
             EPCOMM_ERROR_INVALID_ARGUMENT);
    CHECK(a == NULL);

    /* The one-sided manager is built for one top_k (vLLM's assertion). */
    c = example_config();
    a = create_manager(g, "flashinfer_nvlink_one_sided", &c);
    if (a != NULL) {
        CHECK_ST(epcomm_all2all_check_layer(a, TOP_K, NUM_EXPERTS), EPCOMM_OK);
        epcomm_clear_last_error();
        if (CHECK_ST(epcomm_all2all_check_layer(a, 6, NUM_EXPERTS), EPCOMM_ERROR_ASSERTION)) {
            CHECK_MSG_EQ("FlashInfer one-sided communication does not support heterogeneous top_k "
                         "(got 6, was built with 2)");
        }
        epcomm_all2all_destroy(a);
    }
}

/* Fault tolerance: vLLM's refusal for other backends, the queries on a healthy manager, NULL and
 * size checks, and a config of the second layout (built against a header without
 * enable_fault_tolerance) reading as off. Not collective: each rank alone. */
static void test_fault_tolerance(group_t *g) {
    moe_config_t c = example_config();
    a2a_t *a = NULL;
    int32_t mask[WORLD + 1];
    bool fault = true;
    uint64_t last = 7, total = 7;
    int r;

    c.enable_fault_tolerance = true;
    epcomm_clear_last_error();
    if (CHECK_ST(epcomm_all2all_create(g, "deepep_high_throughput", &c, &a),
                 EPCOMM_ERROR_INVALID_ARGUMENT)) {
        CHECK_MSG_EQ("Fault tolerance requires an FT-capable all2all backend (one of "
                     "['deepep_low_latency', 'nixl_ep']), but got 'deepep_high_throughput'.");
    }
    CHECK(a == NULL);
    a = create_manager(g, "deepep_low_latency", &c);
    CHECK(a != NULL);
    if (a == NULL) {
        return;
    }
    for (r = 0; r <= WORLD; r++) {
        mask[r] = -1;
    }
    CHECK_ST(epcomm_all2all_query_active_mask(a, mask, WORLD), EPCOMM_OK);
    for (r = 0; r < WORLD; r++) {
        CHECK(mask[r] == 0);
    }
    CHECK(mask[WORLD] == -1);
    epcomm_clear_last_error();
    if (CHECK_ST(epcomm_all2all_query_active_mask(a, mask, WORLD + 1),
                 EPCOMM_ERROR_INVALID_ARGUMENT)) {
        CHECK_MSG_EQ("mask_out has 3 entries; expected one per rank of the group (2)");
    }
    CHECK_ST(epcomm_all2all_query_active_mask(a, NULL, WORLD), EPCOMM_ERROR_NULL_POINTER);
    CHECK_ST(epcomm_all2all_query_active_mask(NULL, mask, WORLD), EPCOMM_ERROR_NULL_POINTER);
    CHECK_ST(epcomm_all2all_query_fault(a, &fault), EPCOMM_OK);
    CHECK(!fault);
    CHECK_ST(epcomm_all2all_query_fault(a, NULL), EPCOMM_ERROR_NULL_POINTER);
    CHECK_ST(epcomm_all2all_clean_buffers(a), EPCOMM_OK);
    CHECK_ST(epcomm_all2all_clean_buffers(NULL), EPCOMM_ERROR_NULL_POINTER);
    CHECK_ST(epcomm_all2all_dropped_pairs(a, &last, &total), EPCOMM_OK);
    CHECK(last == 0 && total == 0);
    CHECK_ST(epcomm_all2all_dropped_pairs(a, NULL, NULL), EPCOMM_OK);
    epcomm_all2all_destroy(a);
    a = NULL;

    /* The second layout ends at dispatch_fp8: fault tolerance reads as off, so even a backend
     * that refuses it is created. */
    c.struct_size = (uint32_t)offsetof(moe_config_t, enable_fault_tolerance);
    a = create_manager(g, "deepep_high_throughput", &c);
    CHECK(a != NULL);
    if (a != NULL) {
        epcomm_all2all_destroy(a);
    }
}

/* Rank 1 routes a token to expert 9: both ranks fail, nobody hangs, a good dispatch follows. */
static void test_bad_dispatch(group_t *g, int rank) {
    a2a_t *a = create_example(g, "deepep_high_throughput");
    input_t in;
    dispatch_t o;
    if (a == NULL) {
        return;
    }
    example_input(&in, rank);
    if (rank == 1) {
        in.ids[1] = 9;
    }
    epcomm_clear_last_error();
    if (CHECK_ST(dispatch_input(a, &in, &o), EPCOMM_ERROR_INVALID_ARGUMENT)) {
        if (rank == 1) {
            CHECK_MSG_EQ("topk_ids[0][1] = 9 is out of range: expected -1 (masked) or an expert "
                         "id in [0, 4)");
        } else {
            CHECK_MSG_EQ("dispatch: rank 1 rejected its input (see that rank's error); no data "
                         "was exchanged");
        }
    }
    /* Rank 1's ids of a type dispatch does not take: the message names the element types as C
     * writes an epcomm_dtype (the Python package's text has PyTorch's names). */
    example_input(&in, rank);
    if (rank == 1) {
        in.tids.dtype.bits = 16;
    }
    epcomm_clear_last_error();
    if (CHECK_ST(dispatch_input(a, &in, &o), EPCOMM_ERROR_INVALID_ARGUMENT)) {
        if (rank == 1) {
            CHECK_MSG_EQ("tensor 'topk_ids' has dtype int16 (kDLInt, 16 bits); expected int32 "
                         "(kDLInt, 32 bits) or int64 (kDLInt, 64 bits)");
            CHECK(strcmp(epcomm_last_error_message_torch(),
                         "tensor 'topk_ids' has dtype torch.int16; expected torch.int32 or "
                         "torch.int64") == 0);
        } else {
            CHECK_MSG_EQ("dispatch: rank 1 rejected its input (see that rank's error); no data "
                         "was exchanged");
        }
    }
    /* No dispatch succeeded, so combine has nothing to combine: InvalidState, on every rank. */
    {
        float y[MAX_TOKENS * HIDDEN] = {0.0f, 0.0f, 0.0f};
        float out[MAX_TOKENS * HIDDEN] = {0.0f, 0.0f, 0.0f};
        int64_t shape[2];
        tensor_t ty, to;
        shape[0] = EX_T[rank];
        shape[1] = HIDDEN;
        ty = make_tensor(y, DL_FLOAT, 32, 2, shape);
        to = make_tensor(out, DL_FLOAT, 32, 2, shape);
        epcomm_clear_last_error();
        if (CHECK_ST(epcomm_all2all_combine(a, &ty, &to), EPCOMM_ERROR_INVALID_STATE)) {
            CHECK_MSG_EQ("combine called without a successful dispatch: call dispatch first");
        }
    }
    example_input(&in, rank);
    if (CHECK_ST(dispatch_input(a, &in, &o), EPCOMM_OK)) {
        check_example_dispatch(EPCOMM_LAYOUT_TOKEN_MAJOR, rank, &o);
        combine_example(a, rank, &o, 0, 1);
    }
    epcomm_all2all_destroy(a);
}

/* Rank 0 gives combine an expert output of the wrong shape: both ranks fail, a good combine of
 * the same dispatch follows. */
static void test_bad_combine(group_t *g, int rank, const char *backend, int32_t layout) {
    a2a_t *a = create_example(g, backend);
    input_t in;
    dispatch_t o;
    int32_t st;
    if (a == NULL) {
        return;
    }
    example_input(&in, rank);
    if (!CHECK_ST(dispatch_input(a, &in, &o), EPCOMM_OK)) {
        epcomm_all2all_destroy(a);
        return;
    }
    check_example_dispatch(layout, rank, &o);
    epcomm_clear_last_error();
    st = combine_example(a, rank, &o, rank == 0 ? 1 : 0, 0);
    if (CHECK_ST(st, EPCOMM_ERROR_INVALID_ARGUMENT)) {
        if (rank == 0) {
            CHECK_MSG_HAS("expert_output");
        } else {
            CHECK_MSG_EQ("combine: rank 0 rejected its input (see that rank's error); no data "
                         "was exchanged");
        }
    } else {
        printf("  (backend %s)\n", backend);
    }
    if (combine_example(a, rank, &o, 0, 1) != EPCOMM_OK) {
        printf("  (backend %s, combine after a rejected combine)\n", backend);
    }
    epcomm_all2all_destroy(a);
}

static void test_buffer_bytes(const char *backend) {
    moe_config_t c = example_config();
    uint64_t bytes = 0;
    if (CHECK_ST(epcomm_all2all_buffer_bytes(backend, &c, WORLD, MAX_TOKENS, &bytes),
                 EPCOMM_OK)) {
        if (bytes == 0) {
            g_failed++;
            printf("FAIL rank %d buffer_bytes(%s) = 0\n", g_rank, backend);
        }
    }
}

/* ---- FP8 dispatch ------------------------------------------------------------------------------ */

#define FP8_H 256
#define FP8_T 2

/* 2^k for a normal float (no libm). */
static float pow2f(int k) {
    uint32_t bits = (uint32_t)(k + 127) << 23;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

/* e4m3fn code -> value (bias 7, 3 mantissa bits; codes here are finite). */
static float e4m3_value(uint8_t c) {
    int e = (c >> 3) & 15, m = c & 7;
    float v = e == 0 ? (float)m / 512.0f : (1.0f + (float)m / 8.0f) * pow2f(e - 7);
    return (c & 0x80) ? -v : v;
}

/* Element j of token t of rank r: an e4m3 code (each block's first element 448), so with
 * the block's amax 448 * 2^k the quantised code is exactly this and the scale exactly 2^k,
 * k = 2r + t naming the token. */
static uint8_t fp8_code(int r, int t, int j) {
    return (j % 128 == 0) ? 0x7e : (uint8_t)(((j * 5 + t + r) % 0x7e) | ((j & 1) << 7));
}

static void fp8_input(int r, uint16_t *x, int32_t *ids, float *w) {
    int t, j;
    for (t = 0; t < FP8_T; t++) {
        for (j = 0; j < FP8_H; j++) {
            float v = e4m3_value(fp8_code(r, t, j)) * pow2f(2 * r + t);
            uint32_t bits;
            memcpy(&bits, &v, 4);
            x[t * FP8_H + j] = (uint16_t)(bits >> 16); /* exact: 4 significant bits */
        }
        ids[t * 2] = t;
        ids[t * 2 + 1] = t + 2;
        w[t * 2] = w[t * 2 + 1] = 0.5f;
    }
}

/* Every row whose scales name a token carries that token's codes; returns the rows matched. */
static int64_t fp8_check_rows(const dispatch_t *o, const tensor_t *sc) {
    const uint8_t *q = (const uint8_t *)o->hidden.data;
    const float *s = (const float *)sc->data;
    int64_t rows = numel(&o->hidden) / FP8_H, i, matched = 0;
    int r, t, j;
    for (i = 0; i < rows; i++) {
        for (r = 0; r < WORLD; r++) {
            for (t = 0; t < FP8_T; t++) {
                int ok = 1;
                if (s[i * 2] != pow2f(2 * r + t) || s[i * 2 + 1] != s[i * 2]) {
                    continue;
                }
                for (j = 0; j < FP8_H; j++) {
                    ok = ok && q[i * FP8_H + j] == fp8_code(r, t, j);
                }
                if (!ok) {
                    g_failed++;
                    printf("FAIL rank %d fp8 row %lld: codes of rank %d token %d differ\n", g_rank,
                           (long long)i, r, t);
                }
                matched++;
            }
        }
    }
    return matched;
}

static void test_fp8(group_t *g, int rank, const char *backend, int64_t mode) {
    moe_config_t c = example_config();
    uint16_t x[FP8_T * FP8_H];
    int32_t ids[FP8_T * 2];
    float w[FP8_T * 2];
    int64_t xs[2] = {FP8_T, FP8_H}, is[2] = {FP8_T, 2};
    tensor_t tx, tids, tw, sc;
    dispatch_t o;
    stats_t st;
    a2a_t *a;
    c.hidden_size = FP8_H;
    c.hidden_dtype.code = DL_BFLOAT;
    c.hidden_dtype.bits = 16;
    c.expert_dtype = c.out_dtype = c.hidden_dtype;
    c.dispatch_fp8 = mode;
    fp8_input(rank, x, ids, w);
    tx = make_tensor(x, DL_BFLOAT, 16, 2, xs);
    tids = make_tensor(ids, DL_INT, 32, 2, is);
    tw = make_tensor(w, DL_FLOAT, 32, 2, is);
    a = create_manager(g, backend, &c);
    if (a == NULL) {
        return;
    }
    CHECK_ST(epcomm_all2all_dispatch_scales(a, &sc), EPCOMM_OK);
    CHECK(sc.ndim == 1 && sc.shape[0] == 0);
    if (CHECK_ST(epcomm_all2all_dispatch(a, &tx, &tids, &tw, NULL, 0, &o), EPCOMM_OK) &&
        CHECK_ST(epcomm_all2all_dispatch_scales(a, &sc), EPCOMM_OK) &&
        CHECK_ST(epcomm_all2all_get_stats(a, &st), EPCOMM_OK)) {
        int64_t dims[4];
        int i, nd = o.hidden.ndim;
        uint64_t rows = 0, bytes = 0;
        for (i = 0; i < nd; i++) {
            dims[i] = o.hidden.shape[i];
        }
        check_view("fp8 hidden", &o.hidden, 10 /* kDLFloat8_e4m3fn */, 8, nd, dims);
        dims[nd - 1] = FP8_H / 128;
        check_view("fp8 scales", &sc, DL_FLOAT, 32, nd, dims);
        for (i = 0; i < WORLD; i++) {
            rows += st.tokens_received[i];
            bytes += st.bytes_received[i];
        }
        CHECK(rows > 0 && (uint64_t)fp8_check_rows(&o, &sc) == rows);
        CHECK(bytes == rows * (FP8_H + FP8_H / 128 * 4));
    }
    CHECK_ST(epcomm_all2all_set_dispatch_fp8(a, 3), EPCOMM_ERROR_INVALID_ARGUMENT);
    CHECK_ST(epcomm_all2all_set_dispatch_fp8(a, EPCOMM_DISPATCH_FP8_OFF), EPCOMM_OK);
    if (CHECK_ST(epcomm_all2all_dispatch(a, &tx, &tids, &tw, NULL, 0, &o), EPCOMM_OK)) {
        CHECK(o.hidden.dtype.code == DL_BFLOAT && o.hidden.dtype.bits == 16);
        CHECK_ST(epcomm_all2all_dispatch_scales(a, &sc), EPCOMM_OK);
        CHECK(sc.ndim == 1 && sc.shape[0] == 0);
    }
    epcomm_all2all_destroy(a);
    c.dispatch_fp8 = 7;
    a = NULL;
    CHECK_ST(epcomm_all2all_create(g, backend, &c, &a), EPCOMM_ERROR_INVALID_ARGUMENT);
    CHECK(a == NULL);
}

/* ---- one rank ---------------------------------------------------------------------------------- */

static const char *const BACKENDS[5] = {
    "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
    "flashinfer_nvlink_two_sided",
};
static const int32_t LAYOUTS[5] = {
    EPCOMM_LAYOUT_REPLICATED,    EPCOMM_LAYOUT_TOKEN_MAJOR,  EPCOMM_LAYOUT_EXPERT_MAJOR,
    EPCOMM_LAYOUT_EXPERT_PACKED, EPCOMM_LAYOUT_RANK_MAJOR,
};

static int child_main(const char *name, int rank) {
    options_t opts;
    group_t *g = NULL;
    int i;

    memset(&opts, 0, sizeof opts);
    if (!CHECK_ST(epcomm_group_options_init(&opts), EPCOMM_OK)) {
        return 1;
    }
    opts.timeout_s = 20.0;
    if (!CHECK_ST(epcomm_group_create_shm(name, rank, WORLD, &opts, &g), EPCOMM_OK)) {
        return 1;
    }
    CHECK(g != NULL);
    if (g == NULL) {
        return 1;
    }

    for (i = 0; i < 5; i++) {
        int32_t layout = -1;
        int32_t backend = -1;
        CHECK_ST(epcomm_all2all_backend_resolve(BACKENDS[i], &backend), EPCOMM_OK);
        CHECK_ST(epcomm_all2all_backend_layout(backend, &layout), EPCOMM_OK);
        CHECK(layout == LAYOUTS[i]);
        test_example(g, rank, BACKENDS[i], LAYOUTS[i]);
        test_buffer_bytes(BACKENDS[i]);
        test_fp8(g, rank, BACKENDS[i], EPCOMM_DISPATCH_FP8_E4M3);
        test_fp8(g, rank, BACKENDS[i], EPCOMM_DISPATCH_FP8_E4M3_UE8M0);
        CHECK_ST(epcomm_group_barrier(g), EPCOMM_OK);
    }
    test_create_errors(g);
    test_fault_tolerance(g);
    test_bad_dispatch(g, rank);
    CHECK_ST(epcomm_group_barrier(g), EPCOMM_OK);
    for (i = 0; i < 5; i++) {
        test_bad_combine(g, rank, BACKENDS[i], LAYOUTS[i]);
    }
    CHECK_ST(epcomm_group_barrier(g), EPCOMM_OK);

    epcomm_group_destroy(g);
    return g_failed == 0 ? 0 : 1;
}

/* ---- the parent -------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    return test_ranks_main(argc, argv, "all2all_test", WORLD, child_main, TEST_RANKS_COUNT_RANKS);
}
