/*
 * EPLB at run time through the C ABI: two real processes (forked ranks) form a shared-memory
 * group and use the EPLB communicator factory (vLLM's create_eplb_communicator rules and
 * messages), the communicator's add_send / add_recv / execute, a two-layer rearrangement of
 * expert weights (also batched as vLLM's migration scheduler orders it, with the options
 * struct; double-buffered into next weights with bad next weights refused on every rank),
 * a scale-down after a failure on the group of survivors (lost experts refused, or allowed and
 * reported; epcomm_eplb_lost_experts), the scheduler itself, the per-rank transfer plan
 * (vLLM's sender/receiver pairing),
 * and the load statistics (record, step with the balancedness log line, logical load). Built as C11
 * and (with -x c++) as C++17, under ASan+UBSan, by tests/c_eplb.rs.
 *
 * Usage: eplb_runtime_test GROUP_NAME
 *
 * The parent forks the ranks before it calls anything in epcomm, waits for them with a
 * deadline (killing them when it passes), collects each rank's check counts through a pipe and
 * prints "N passed, M failed" (a rank that crashed, hung or reported nothing counts as one
 * failure); exits non-zero if any check failed or the group left anything in /dev/shm.
 */
#include "test_ranks.h" /* first: it selects POSIX for the system headers */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epcomm.h"

/* Structs are named by their tags (valid with and without cbindgen's typedefs). */
typedef struct epcomm_tensor tensor_t;
typedef struct epcomm_group group_t;
typedef struct epcomm_group_options options_t;
typedef struct epcomm_eplb_select_request select_request_t;
typedef struct epcomm_eplb_communicator comm_t;
typedef struct epcomm_eplb_summary summary_t;
typedef struct epcomm_eplb_layer_plan plan_t;
typedef struct epcomm_eplb_plan_view plan_view_t;
typedef struct epcomm_eplb_state state_t;
typedef struct epcomm_eplb_rearrange_options rearrange_options_t;
typedef struct epcomm_eplb_lost_experts_options lost_options_t;
typedef struct epcomm_eplb_migration_schedule schedule_t;
typedef struct epcomm_eplb_schedule_view schedule_view_t;

#define WORLD 2


/* Checks a status and, when `want_message` is not NULL, the exact last error message; one
 * check either way. */
#define CHECK_ERR(st, want, want_message) \
    check_err((st), (want), (want_message), __FILE__, __LINE__, #st)

static int check_err(int32_t st, int32_t want, const char *want_message, const char *file,
                     int line, const char *expr) {
    const char *msg = epcomm_last_error_message();
    if (st != want) {
        return check_st(st, want, file, line, expr);
    }
    if (want_message != NULL && (msg == NULL || strcmp(msg, want_message) != 0)) {
        test_fail_at(file, line);
        printf("%s: message \"%s\", expected \"%s\"\n", expr, msg ? msg : "(NULL)", want_message);
        return 0;
    }
    g_passed++;
    return 1;
}

/* ---- log capture ----------------------------------------------------------------------------- */

#define MAX_LOGS 64
#define MAX_LOG_LEN 512

struct log_capture {
    int count;
    int levels[MAX_LOGS];
    char messages[MAX_LOGS][MAX_LOG_LEN];
};

static struct log_capture g_logs;

static void capture_log(int32_t level, const char *message, void *user_data) {
    struct log_capture *cap = (struct log_capture *)user_data;
    if (cap == NULL || cap->count >= MAX_LOGS) {
        return;
    }
    cap->levels[cap->count] = (int)level;
    snprintf(cap->messages[cap->count], MAX_LOG_LEN, "%s", message ? message : "(NULL)");
    cap->count++;
}

/* How many captured messages at `level` equal `text`. */
static int count_log(int level, const char *text) {
    int i, n = 0;
    for (i = 0; i < g_logs.count; i++) {
        if (g_logs.levels[i] == level && strcmp(g_logs.messages[i], text) == 0) {
            n++;
        }
    }
    return n;
}

/* The first captured message at `level` that starts with `prefix`, or NULL. */
static const char *find_log_prefix(int level, const char *prefix) {
    int i;
    size_t n = strlen(prefix);
    for (i = 0; i < g_logs.count; i++) {
        if (g_logs.levels[i] == level && strncmp(g_logs.messages[i], prefix, n) == 0) {
            return g_logs.messages[i];
        }
    }
    return NULL;
}

/* How many captured messages (any level) start with `prefix`. */
static int count_log_prefix(const char *prefix) {
    int i, n = 0;
    size_t len = strlen(prefix);
    for (i = 0; i < g_logs.count; i++) {
        if (strncmp(g_logs.messages[i], prefix, len) == 0) {
            n++;
        }
    }
    return n;
}

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + (a - b), suffix) == 0;
}

/* ---- helpers --------------------------------------------------------------------------------- */

#define make_tensor(data, code, bits, ndim, shape) \
    test_cpu_tensor(data, code, bits, ndim, shape, NULL)

static void init_request(select_request_t *req) {
    memset(req, 0, sizeof *req);
    req->struct_size = (uint32_t)sizeof *req;
    req->communicator = NULL;
    req->elastic = false;
    req->device_type = EPCOMM_DEVICE_CPU;
    req->weight_dtypes = NULL;
    req->num_weight_dtypes = 0;
    req->nccl_available = 0;
    req->nixl_available = 0;
}

/* ---- the factory ----------------------------------------------------------------------------- */

/* A create that must fail: status, exception class and exact message; `out` stays NULL. */
static void expect_create_error(group_t *g, const char *name, bool elastic, int32_t want_status,
                                const char *want_exception, const char *want_message) {
    select_request_t req;
    comm_t *c = NULL;
    int32_t st;

    init_request(&req);
    req.communicator = name;
    req.elastic = elastic;
    st = epcomm_eplb_communicator_create(g, &req, &c);
    if (CHECK_ERR(st, want_status, want_message)) {
        const char *exc = epcomm_status_exception(st);
        CHECK(exc != NULL && strcmp(exc, want_exception) == 0);
    }
    CHECK(c == NULL);
    epcomm_eplb_communicator_destroy(c);
}

static comm_t *test_factory(group_t *g) {
    static const char INITIALIZED[] =
        "Initialized EPLB communicator: TorchDistGlooStagedEplbCommunicator.";
    select_request_t req;
    comm_t *comm = NULL;
    int32_t sel = -77;

    /* Automatic selection on CPU without NIXL: torch_gloo, with vLLM's info line. */
    init_request(&req);
    g_logs.count = 0;
    if (CHECK_ERR(epcomm_eplb_communicator_create(g, &req, &comm), EPCOMM_OK, NULL)) {
        CHECK(comm != NULL);
    }
    CHECK(count_log(EPCOMM_LOG_INFO, INITIALIZED) == 1);
    if (CHECK_ERR(epcomm_eplb_communicator_select(&req, &sel), EPCOMM_OK, NULL)) {
        CHECK(sel == EPCOMM_EPLB_TORCH_GLOO);
    }
    /* Selecting does not build anything, so it does not log the info line again. */
    CHECK(count_log(EPCOMM_LOG_INFO, INITIALIZED) == 1);

    /* The factory's errors, with vLLM's wording; nothing is built or logged as initialized. */
    g_logs.count = 0;
    expect_create_error(g, "pynccl", false, EPCOMM_ERROR_RUNTIME, "RuntimeError",
                        "EPLB communicator 'pynccl' supports only cuda-like devices (got cpu).");
    expect_create_error(g, "nixl", false, EPCOMM_ERROR_UNAVAILABLE, "RuntimeError",
                        "EPLB communicator 'nixl' requested but NIXL is unavailable.");
    expect_create_error(g, "torch_gloo", true, EPCOMM_ERROR_INVALID_ARGUMENT, "ValueError",
                        "Elastic EP requires 'torch_nccl', 'pynccl', or 'nixl' EPLB communicator "
                        "(got 'torch_gloo').");
    expect_create_error(g, "bogus", false, EPCOMM_ERROR_INVALID_ARGUMENT, "ValueError",
                        "Unknown EPLB communicator backend: bogus");
    CHECK(count_log_prefix("Initialized EPLB communicator") == 0);

    /* NULL arguments. */
    init_request(&req);
    CHECK_ERR(epcomm_eplb_communicator_create(g, NULL, &comm), EPCOMM_ERROR_NULL_POINTER, NULL);
    CHECK_ERR(epcomm_eplb_communicator_create(g, &req, NULL), EPCOMM_ERROR_NULL_POINTER, NULL);
    return comm;
}

/* ---- add_send / add_recv / execute ----------------------------------------------------------- */

/* Element i of tensor a (float32 [1, 4]) / b (uint8 [1, 3]) of expert `e` held by `rank`. */
static float send_a(int rank, int e, int i) {
    return (float)(rank * 1000 + e * 10 + i) + 0.25f;
}

static uint8_t send_b(int rank, int e, int i) {
    return (uint8_t)(rank * 100 + e * 10 + i);
}

static void test_communicator(comm_t *comm) {
    /* Two experts each way: the j-th send from a to b fills the j-th receive on b from a. */
    float sa[2][4], ra[2][4];
    uint8_t sb[2][3], rb[2][3];
    int64_t shape_a[2] = {1, 4};
    int64_t shape_b[2] = {1, 3};
    tensor_t st[2][2], rt[2][2];
    int peer = 1 - g_rank;
    int e, i;

    for (e = 0; e < 2; e++) {
        for (i = 0; i < 4; i++) {
            sa[e][i] = send_a(g_rank, e, i);
            ra[e][i] = -1.0f;
        }
        for (i = 0; i < 3; i++) {
            sb[e][i] = send_b(g_rank, e, i);
            rb[e][i] = 0xEE;
        }
        st[e][0] = make_tensor(sa[e], DL_FLOAT, 32, 2, shape_a);
        st[e][1] = make_tensor(sb[e], DL_UINT, 8, 2, shape_b);
        rt[e][0] = make_tensor(ra[e], DL_FLOAT, 32, 2, shape_a);
        rt[e][1] = make_tensor(rb[e], DL_UINT, 8, 2, shape_b);
    }
    /* Receives queued before sends on one rank and after on the other: order per peer pair is
     * what matters. */
    if (g_rank == 0) {
        CHECK_ERR(epcomm_eplb_communicator_add_recv(comm, rt[0], 2, peer, 10), EPCOMM_OK, NULL);
        CHECK_ERR(epcomm_eplb_communicator_add_recv(comm, rt[1], 2, peer, 11), EPCOMM_OK, NULL);
        CHECK_ERR(epcomm_eplb_communicator_add_send(comm, st[0], 2, peer, 0), EPCOMM_OK, NULL);
        CHECK_ERR(epcomm_eplb_communicator_add_send(comm, st[1], 2, peer, 1), EPCOMM_OK, NULL);
    } else {
        CHECK_ERR(epcomm_eplb_communicator_add_send(comm, st[0], 2, peer, 10), EPCOMM_OK, NULL);
        CHECK_ERR(epcomm_eplb_communicator_add_send(comm, st[1], 2, peer, 11), EPCOMM_OK, NULL);
        CHECK_ERR(epcomm_eplb_communicator_add_recv(comm, rt[0], 2, peer, 0), EPCOMM_OK, NULL);
        CHECK_ERR(epcomm_eplb_communicator_add_recv(comm, rt[1], 2, peer, 1), EPCOMM_OK, NULL);
    }
    if (CHECK_ERR(epcomm_eplb_communicator_execute(comm), EPCOMM_OK, NULL)) {
        int bad = 0;
        for (e = 0; e < 2; e++) {
            for (i = 0; i < 4; i++) {
                if (ra[e][i] != send_a(peer, e, i)) {
                    bad++;
                    printf("FAIL rank %d execute: expert %d a[%d] = %g, expected %g\n", g_rank,
                           e, i, (double)ra[e][i], (double)send_a(peer, e, i));
                }
            }
            for (i = 0; i < 3; i++) {
                if (rb[e][i] != send_b(peer, e, i)) {
                    bad++;
                    printf("FAIL rank %d execute: expert %d b[%d] = %u, expected %u\n", g_rank,
                           e, i, (unsigned)rb[e][i], (unsigned)send_b(peer, e, i));
                }
            }
        }
        CHECK(bad == 0);
        /* The sent buffers are untouched. */
        CHECK(sa[0][0] == send_a(g_rank, 0, 0) && sb[1][2] == send_b(g_rank, 1, 2));
    }

    /* Nothing queued (the queue was cleared by the last execute): succeeds on both ranks. */
    CHECK_ERR(epcomm_eplb_communicator_execute(comm), EPCOMM_OK, NULL);

    /* Argument errors, reported before anything is queued. */
    CHECK_ERR(epcomm_eplb_communicator_add_send(comm, NULL, 1, peer, 0),
              EPCOMM_ERROR_NULL_POINTER, NULL);
    CHECK_ERR(epcomm_eplb_communicator_add_recv(comm, rt[0], 2, -1, 0),
              EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
    CHECK_ERR(epcomm_eplb_communicator_add_send(NULL, st[0], 2, peer, 0),
              EPCOMM_ERROR_NULL_POINTER, NULL);
    CHECK_ERR(epcomm_eplb_communicator_execute(NULL), EPCOMM_ERROR_NULL_POINTER, NULL);
    /* And the communicator still works: a second empty, collective execute. */
    CHECK_ERR(epcomm_eplb_communicator_execute(comm), EPCOMM_OK, NULL);
}

/* ---- rearrange ------------------------------------------------------------------------------- */

#define RA_LAYERS 2
#define RA_SLOTS 4
#define RA_LOCAL 2
#define RA_COLS 3

static float row_value(int expert, int layer, int col) {
    return (float)(expert * 100 + layer * 10 + col);
}

static void test_rearrange(comm_t *comm) {
    static const int64_t old_map[RA_LAYERS * RA_SLOTS] = {0, 1, 2, 3, 0, 1, 2, 3};
    static const int64_t new_map[RA_LAYERS * RA_SLOTS] = {2, 3, 0, 1, 0, 1, 2, 3};
    float w[RA_LAYERS][RA_LOCAL * RA_COLS];
    int64_t shape[2] = {RA_LOCAL, RA_COLS};
    tensor_t weights[RA_LAYERS];
    summary_t summary;
    int l, s, c;

    for (l = 0; l < RA_LAYERS; l++) {
        for (s = 0; s < RA_LOCAL; s++) {
            int expert = (int)old_map[l * RA_SLOTS + g_rank * RA_LOCAL + s];
            for (c = 0; c < RA_COLS; c++) {
                w[l][s * RA_COLS + c] = row_value(expert, l, c);
            }
        }
        weights[l] = make_tensor(w[l], DL_FLOAT, 32, 2, shape);
    }
    memset(&summary, 0xAB, sizeof summary);
    if (!CHECK_ERR(epcomm_eplb_rearrange(comm, old_map, new_map, RA_LAYERS, RA_SLOTS, RA_SLOTS,
                                         weights, 1, NULL, 0, &summary),
                   EPCOMM_OK, NULL)) {
        return;
    }
    {
        int bad = 0;
        for (l = 0; l < RA_LAYERS; l++) {
            for (s = 0; s < RA_LOCAL; s++) {
                int expert = (int)new_map[l * RA_SLOTS + g_rank * RA_LOCAL + s];
                for (c = 0; c < RA_COLS; c++) {
                    float want = row_value(expert, l, c);
                    if (w[l][s * RA_COLS + c] != want) {
                        bad++;
                        printf("FAIL rank %d rearrange: layer %d slot %d col %d = %g, expected "
                               "%g (expert %d)\n",
                               g_rank, l, s, c, (double)w[l][s * RA_COLS + c], (double)want,
                               expert);
                    }
                }
            }
        }
        CHECK(bad == 0);
    }
    /* Spelled out: rank 0 holds experts 2, 3 in layer 0 and 0, 1 in layer 1; rank 1 the
     * opposite in layer 0. */
    if (g_rank == 0) {
        CHECK(w[0][0] == 200.0f && w[0][RA_COLS] == 300.0f);
        CHECK(w[1][0] == 10.0f && w[1][RA_COLS] == 110.0f);
    } else {
        CHECK(w[0][0] == 0.0f && w[0][RA_COLS] == 100.0f);
        CHECK(w[1][0] == 210.0f && w[1][RA_COLS] == 310.0f);
    }
    CHECK(summary.layers_changed == 1);
    CHECK(summary.rows_sent == 2);
    CHECK(summary.rows_received == 2);
    CHECK(summary.rows_copied_locally == 0);

    /* Rearranging from the new placement to itself moves nothing; summary may be NULL. */
    CHECK_ERR(epcomm_eplb_rearrange(comm, new_map, new_map, RA_LAYERS, RA_SLOTS, RA_SLOTS,
                                    weights, 1, NULL, 0, &summary),
              EPCOMM_OK, NULL);
    CHECK(summary.layers_changed == 0 && summary.rows_sent == 0 && summary.rows_received == 0);
    CHECK(w[0][0] == row_value((int)new_map[g_rank * RA_LOCAL], 0, 0));
    CHECK_ERR(epcomm_eplb_rearrange(comm, new_map, new_map, RA_LAYERS, RA_SLOTS, RA_SLOTS,
                                    weights, 1, NULL, 0, NULL),
              EPCOMM_OK, NULL);

    /* The ranks disagree on the weight dtype (same bytes: float32 on rank 0, int32 on rank 1):
     * the same error on both ranks before any data moves, the weights unchanged. */
    {
        float before[RA_LAYERS][RA_LOCAL * RA_COLS];
        tensor_t typed[RA_LAYERS];
        memcpy(before, w, sizeof before);
        for (l = 0; l < RA_LAYERS; l++) {
            typed[l] = make_tensor(w[l], g_rank == 0 ? DL_FLOAT : DL_INT, 32, 2, shape);
        }
        CHECK_ERR(epcomm_eplb_rearrange(comm, new_map, old_map, RA_LAYERS, RA_SLOTS, RA_SLOTS,
                                        typed, 1, NULL, 0, NULL),
                  EPCOMM_ERROR_INVALID_ARGUMENT,
                  "rearrange: ranks disagree on the weight dtypes: rank 0 and rank 1 pass "
                  "different ones; every rank must pass the same (EPLB rearrangement: no layer "
                  "was changed)");
        CHECK(memcmp(before, w, sizeof before) == 0);
    }

    /* Argument errors (before any communication). */
    CHECK_ERR(epcomm_eplb_rearrange(comm, NULL, new_map, RA_LAYERS, RA_SLOTS, RA_SLOTS, weights,
                                    1, NULL, 0, NULL),
              EPCOMM_ERROR_NULL_POINTER, NULL);
    CHECK_ERR(epcomm_eplb_rearrange(comm, old_map, new_map, RA_LAYERS, RA_SLOTS, RA_SLOTS,
                                    weights, 0, NULL, 0, NULL),
              EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
}

/* ---- rearrange with migration batching ------------------------------------------------------- */

/* 1 when rank g_rank's weights hold placement `map` (RA_LAYERS layers of RA_SLOTS slots). */
static int holds(float w[RA_LAYERS][RA_LOCAL * RA_COLS], const int64_t *map) {
    int l, s, c;
    for (l = 0; l < RA_LAYERS; l++) {
        for (s = 0; s < RA_LOCAL; s++) {
            int expert = (int)map[l * RA_SLOTS + g_rank * RA_LOCAL + s];
            for (c = 0; c < RA_COLS; c++) {
                if (w[l][s * RA_COLS + c] != row_value(expert, l, c)) {
                    printf("  rank %d: layer %d slot %d col %d = %g, expected expert %d\n",
                           g_rank, l, s, c, (double)w[l][s * RA_COLS + c], expert);
                    return 0;
                }
            }
        }
    }
    return 1;
}

/* ---- double-buffered rearrangement ---------------------------------------------------------- */

static void fill(float w[RA_LAYERS][RA_LOCAL * RA_COLS], const int64_t *map) {
    int l, s, c;
    for (l = 0; l < RA_LAYERS; l++) {
        for (s = 0; s < RA_LOCAL; s++) {
            int expert = (int)map[l * RA_SLOTS + g_rank * RA_LOCAL + s];
            for (c = 0; c < RA_COLS; c++) {
                w[l][s * RA_COLS + c] = row_value(expert, l, c);
            }
        }
    }
}

/* Rank `bad_rank` passes bad next weights: it gets `status` and `mine`, its peer the message
 * naming the rejecting rank; nothing is written on either rank and no layer is valid. */
static void check_bad_next(comm_t *comm, const int64_t *old_map, const int64_t *new_map,
                           const tensor_t *weights, const tensor_t *next, int bad_rank,
                           int32_t status, const char *mine,
                           float n[RA_LAYERS][RA_LOCAL * RA_COLS]) {
    float before[RA_LAYERS][RA_LOCAL * RA_COLS];
    char theirs[160];
    int64_t valid = 77;
    memcpy(before, n, sizeof before);
    snprintf(theirs, sizeof theirs,
             "rearrange: rank %d rejected its arguments (see that rank's error) (EPLB "
             "rearrangement: no layer was changed)",
             bad_rank);
    CHECK_ERR(epcomm_eplb_rearrange_into(comm, old_map, new_map, RA_LAYERS, RA_SLOTS, RA_SLOTS,
                                         weights, next, 1, NULL, NULL, &valid),
              g_rank == bad_rank ? status : EPCOMM_ERROR_INVALID_ARGUMENT,
              g_rank == bad_rank ? mine : theirs);
    CHECK(valid == 0);
    CHECK(memcmp(before, n, sizeof before) == 0);
}

static void test_rearrange_into(comm_t *comm) {
    static const int64_t old_map[RA_LAYERS * RA_SLOTS] = {0, 1, 2, 3, 0, 1, 2, 3};
    static const int64_t new_map[RA_LAYERS * RA_SLOTS] = {2, 3, 0, 1, 1, 0, 2, 3};
    float w[RA_LAYERS][RA_LOCAL * RA_COLS];
    float n[RA_LAYERS][RA_LOCAL * RA_COLS];
    int64_t shape[2] = {RA_LOCAL, RA_COLS};
    int64_t short_shape[2] = {RA_LOCAL - 1, RA_COLS};
    tensor_t weights[RA_LAYERS], next[RA_LAYERS], bad[RA_LAYERS];
    rearrange_options_t opts;
    summary_t summary;
    int64_t valid = -1;
    int l, batched;

    fill(w, old_map);
    for (l = 0; l < RA_LAYERS; l++) {
        weights[l] = make_tensor(w[l], DL_FLOAT, 32, 2, shape);
        next[l] = make_tensor(n[l], DL_FLOAT, 32, 2, shape);
    }
    if (!CHECK_ERR(epcomm_eplb_rearrange_options_init(&opts), EPCOMM_OK, NULL)) {
        return;
    }
    /* Unbatched, then batched: next (garbage before) holds the new placement, live the old. */
    for (batched = 0; batched < 2; batched++) {
        opts.migration_batching = batched != 0;
        memset(n, 0xA5, sizeof n);
        memset(&summary, 0xAB, sizeof summary);
        if (CHECK_ERR(epcomm_eplb_rearrange_into(comm, old_map, new_map, RA_LAYERS, RA_SLOTS,
                                                 RA_SLOTS, weights, next, 1, &opts, &summary,
                                                 &valid),
                      EPCOMM_OK, NULL)) {
            CHECK(valid == RA_LAYERS);
            CHECK(holds(n, new_map));
            CHECK(holds(w, old_map));
            /* Layer 0 swaps experts between the ranks, layer 1 swaps rank 0's two slots. */
            CHECK(summary.layers_changed == (g_rank == 0 ? 2 : 1));
            CHECK(summary.rows_sent == 2 && summary.rows_received == 2);
            CHECK(summary.rows_copied_locally == (g_rank == 0 ? 2 : 0));
        }
    }
    /* NULL next weights on rank 1. */
    memset(n, 0xA5, sizeof n);
    {
        int64_t v = 77;
        float before[RA_LAYERS][RA_LOCAL * RA_COLS];
        memcpy(before, n, sizeof before);
        CHECK_ERR(epcomm_eplb_rearrange_into(comm, old_map, new_map, RA_LAYERS, RA_SLOTS,
                                             RA_SLOTS, weights, g_rank == 1 ? NULL : next, 1,
                                             NULL, NULL, &v),
                  g_rank == 1 ? EPCOMM_ERROR_NULL_POINTER : EPCOMM_ERROR_INVALID_ARGUMENT,
                  g_rank == 1 ? "argument 'next_weights' must not be NULL"
                              : "rearrange: rank 1 rejected its arguments (see that rank's "
                                "error) (EPLB rearrangement: no layer was changed)");
        CHECK(v == 0);
        CHECK(memcmp(before, n, sizeof before) == 0);
    }
    /* Rank 0's next layer 1 is its live layer 0. */
    bad[0] = next[0];
    bad[1] = weights[0];
    check_bad_next(comm, old_map, new_map, weights, g_rank == 0 ? bad : next, 0,
                   EPCOMM_ERROR_INVALID_ARGUMENT,
                   "next_weights layer 1 tensor 0 overlaps live layer 0 tensor 0; the next "
                   "weights must be buffers of their own",
                   n);
    /* Rank 1's next layer 0 is a row short. */
    bad[0] = make_tensor(n[0], DL_FLOAT, 32, 2, short_shape);
    bad[1] = next[1];
    check_bad_next(comm, old_map, new_map, weights, g_rank == 1 ? bad : next, 1,
                   EPCOMM_ERROR_INVALID_ARGUMENT,
                   "next_weights layer 0 tensor 0 has 12 bytes; expected 24 (the size of live "
                   "layer 0 tensor 0)",
                   n);
    CHECK(holds(w, old_map));
}

static void test_rearrange_batched(comm_t *comm) {
    /* Layer 0 swaps the ranks' experts: vLLM's scheduler makes two batches (flow 0->1 with
     * experts 0, 1, then flow 1->0 with experts 2, 3); layer 1 stays (no batch). */
    static const int64_t old_map[RA_LAYERS * RA_SLOTS] = {0, 1, 2, 3, 0, 1, 2, 3};
    static const int64_t new_map[RA_LAYERS * RA_SLOTS] = {2, 3, 0, 1, 0, 1, 2, 3};
    static const int64_t identity[WORLD] = {0, 1};
    float w[RA_LAYERS][RA_LOCAL * RA_COLS];
    int64_t shape[2] = {RA_LOCAL, RA_COLS};
    tensor_t weights[RA_LAYERS];
    rearrange_options_t opts;
    summary_t summary;
    char want[256];
    int l, s, c;

    for (l = 0; l < RA_LAYERS; l++) {
        for (s = 0; s < RA_LOCAL; s++) {
            int expert = (int)old_map[l * RA_SLOTS + g_rank * RA_LOCAL + s];
            for (c = 0; c < RA_COLS; c++) {
                w[l][s * RA_COLS + c] = row_value(expert, l, c);
            }
        }
        weights[l] = make_tensor(w[l], DL_FLOAT, 32, 2, shape);
    }
    memset(&opts, 0x5A, sizeof opts);
    if (!CHECK_ERR(epcomm_eplb_rearrange_options_init(&opts), EPCOMM_OK, NULL)) {
        return;
    }
    CHECK(opts.struct_size == sizeof opts);
    CHECK(opts.rank_mapping == NULL && opts.rank_mapping_len == 0 && !opts.migration_batching);
    opts.migration_batching = true;
    memset(&summary, 0xAB, sizeof summary);
    if (CHECK_ERR(epcomm_eplb_rearrange_with(comm, old_map, new_map, RA_LAYERS, RA_SLOTS,
                                             RA_SLOTS, weights, 1, &opts, &summary),
                  EPCOMM_OK, NULL)) {
        CHECK(holds(w, new_map));
        CHECK(summary.layers_changed == 1 && summary.rows_sent == 2);
        CHECK(summary.rows_received == 2 && summary.rows_copied_locally == 0);
    }
    /* Back, batched, with the identity rank mapping in the options. */
    opts.rank_mapping = identity;
    opts.rank_mapping_len = WORLD;
    if (CHECK_ERR(epcomm_eplb_rearrange_with(comm, new_map, old_map, RA_LAYERS, RA_SLOTS,
                                             RA_SLOTS, weights, 1, &opts, NULL),
                  EPCOMM_OK, NULL)) {
        CHECK(holds(w, old_map));
    }
    /* NULL options: the defaults (unbatched, no mapping). */
    if (CHECK_ERR(epcomm_eplb_rearrange_with(comm, old_map, new_map, RA_LAYERS, RA_SLOTS,
                                             RA_SLOTS, weights, 1, NULL, NULL),
                  EPCOMM_OK, NULL)) {
        CHECK(holds(w, new_map));
    }
    /* The ranks disagree on batching: the same error on both, nothing moves. */
    opts.rank_mapping = NULL;
    opts.rank_mapping_len = 0;
    opts.migration_batching = g_rank == 0;
    CHECK_ERR(epcomm_eplb_rearrange_with(comm, new_map, old_map, RA_LAYERS, RA_SLOTS, RA_SLOTS,
                                         weights, 1, &opts, NULL),
              EPCOMM_ERROR_INVALID_ARGUMENT,
              "rearrange: ranks disagree on migration batching: rank 0 turns it on but rank 1 "
              "turns it off; every rank must pass the same (EPLB rearrangement: no layer was "
              "changed)");
    CHECK(holds(w, new_map));
    /* Options from an older, smaller struct are refused (on every rank: both pass it). */
    opts.struct_size = 0;
    snprintf(want, sizeof want,
             "options->struct_size is 0: expected sizeof(epcomm_eplb_rearrange_options) = %u "
             "(call epcomm_eplb_rearrange_options_init)",
             (unsigned)sizeof opts);
    CHECK_ERR(epcomm_eplb_rearrange_with(comm, new_map, old_map, RA_LAYERS, RA_SLOTS, RA_SLOTS,
                                         weights, 1, &opts, NULL),
              EPCOMM_ERROR_INVALID_ARGUMENT, want);
    CHECK(holds(w, new_map));
    CHECK_ERR(epcomm_eplb_rearrange_options_init(NULL), EPCOMM_ERROR_NULL_POINTER, NULL);
}

/* ---- scale-down after a failure ------------------------------------------------------------ */

/* Old rank 1 of 3 died: the 2 ranks of this group are the survivors (old ranks 0 and 2). */
#define SD_OLD_SLOTS 6
static const int64_t SD_MAPPING[3] = {0, -1, 1};

/* The weights survivor g_rank holds under `old` (RA_LAYERS layers of SD_OLD_SLOTS slots). */
static void fill_survivor(float w[RA_LAYERS][RA_LOCAL * RA_COLS], const int64_t *old) {
    int old_rank = g_rank == 0 ? 0 : 2;
    int l, s, c;
    for (l = 0; l < RA_LAYERS; l++) {
        for (s = 0; s < RA_LOCAL; s++) {
            int expert = (int)old[l * SD_OLD_SLOTS + old_rank * RA_LOCAL + s];
            for (c = 0; c < RA_COLS; c++) {
                w[l][s * RA_COLS + c] = row_value(expert, l, c);
            }
        }
    }
}

static void test_lost_experts(void) {
    /* Experts 2 and 4 lived only on the dead rank 1; 0 has a replica on rank 2 too. */
    static const int64_t old[SD_OLD_SLOTS] = {0, 1, 2, 4, 3, 0};
    int64_t lost[SD_OLD_SLOTS] = {-7, -7, -7, -7, -7, -7};
    int64_t n = -1;
    if (CHECK_ERR(epcomm_eplb_lost_experts(old, SD_OLD_SLOTS, RA_LOCAL, SD_MAPPING, 3, lost,
                                           SD_OLD_SLOTS, &n),
                  EPCOMM_OK, NULL)) {
        CHECK(n == 2 && lost[0] == 2 && lost[1] == 4 && lost[2] == -7);
    }
    n = -1;
    CHECK_ERR(epcomm_eplb_lost_experts(old, SD_OLD_SLOTS, RA_LOCAL, SD_MAPPING, 3, NULL, 0, &n),
              EPCOMM_OK, NULL);
    CHECK(n == 2);
    n = -1;
    CHECK_ERR(epcomm_eplb_lost_experts(old, SD_OLD_SLOTS, RA_LOCAL, SD_MAPPING, 3, lost, 1, &n),
              EPCOMM_ERROR_INVALID_ARGUMENT,
              "lost_capacity is 1 but 2 experts are lost; pass room for *num_lost_out ids "
              "(num_slots always suffice)");
    CHECK(n == 2);
    CHECK_ERR(epcomm_eplb_lost_experts(old, SD_OLD_SLOTS, RA_LOCAL, SD_MAPPING, 2, lost,
                                       SD_OLD_SLOTS, &n),
              EPCOMM_ERROR_INVALID_ARGUMENT,
              "the old placement has 6 slots; expected one block of 2 slots per entry of the "
              "rank mapping (2 entries)");
    CHECK_ERR(epcomm_eplb_lost_experts(old, SD_OLD_SLOTS, RA_LOCAL, SD_MAPPING, 3, lost,
                                       SD_OLD_SLOTS, NULL),
              EPCOMM_ERROR_NULL_POINTER, NULL);
}

static const char SD_REFUSAL[] =
    "rearrange: layer 0 needs logical experts [2], which have no replica on a surviving rank "
    "(rank_mapping removes ranks [1]); their weights are gone: allow lost experts to rearrange "
    "the others and leave their slots unwritten (the call reports them; load their weights "
    "there afterwards), or choose a new placement without them";

static void test_rearrange_after_failure(comm_t *comm) {
    /* Every expert of the dead rank (2, 1) has a surviving replica. */
    static const int64_t redundant[RA_LAYERS * SD_OLD_SLOTS] = {0, 1, 2, 1, 3, 2,
                                                                0, 1, 2, 1, 3, 2};
    /* Expert 2 (and 4) only on the dead rank. */
    static const int64_t exposed[RA_LAYERS * SD_OLD_SLOTS] = {0, 1, 2, 4, 3, 0,
                                                              0, 1, 2, 4, 3, 0};
    static const int64_t new_map[RA_LAYERS * RA_SLOTS] = {2, 3, 1, 0, 2, 3, 1, 0};
    /* `new_map` with expert 2's slot keeping what the survivor held there (expert 0). */
    static const int64_t kept[RA_LAYERS * RA_SLOTS] = {0, 3, 1, 0, 0, 3, 1, 0};
    float w[RA_LAYERS][RA_LOCAL * RA_COLS], before[RA_LAYERS][RA_LOCAL * RA_COLS];
    float n[RA_LAYERS][RA_LOCAL * RA_COLS];
    int64_t shape[2] = {RA_LOCAL, RA_COLS};
    tensor_t weights[RA_LAYERS], next[RA_LAYERS];
    int64_t pairs[2 * RA_LAYERS * RA_SLOTS];
    int64_t num_lost = -1, valid = -1;
    rearrange_options_t opts;
    lost_options_t lost;
    char want[320];
    int l;

    for (l = 0; l < RA_LAYERS; l++) {
        weights[l] = make_tensor(w[l], DL_FLOAT, 32, 2, shape);
        next[l] = make_tensor(n[l], DL_FLOAT, 32, 2, shape);
    }
    memset(&lost, 0x5A, sizeof lost);
    if (!CHECK_ERR(epcomm_eplb_rearrange_options_init(&opts), EPCOMM_OK, NULL) ||
        !CHECK_ERR(epcomm_eplb_lost_experts_options_init(&lost), EPCOMM_OK, NULL)) {
        return;
    }
    CHECK(lost.struct_size == sizeof lost && !lost.allow_lost_experts);
    CHECK(lost.lost_experts_out == NULL && lost.lost_experts_capacity == 0);
    CHECK(lost.num_lost_experts_out == NULL);
    opts.rank_mapping = SD_MAPPING;
    opts.rank_mapping_len = 3;
    lost.num_lost_experts_out = &num_lost;
    /* Sourced from surviving replicas only: the new placement, nothing lost. */
    fill_survivor(w, redundant);
    if (CHECK_ERR(epcomm_eplb_rearrange_with_lost(comm, redundant, new_map, RA_LAYERS,
                                                  SD_OLD_SLOTS, RA_SLOTS, weights, 1, &opts,
                                                  &lost, NULL),
                  EPCOMM_OK, NULL)) {
        CHECK(holds(w, new_map));
        CHECK(num_lost == 0);
    }
    /* The plain entry points take the same path (lost experts refused). */
    fill_survivor(w, redundant);
    if (CHECK_ERR(epcomm_eplb_rearrange(comm, redundant, new_map, RA_LAYERS, SD_OLD_SLOTS,
                                        RA_SLOTS, weights, 1, SD_MAPPING, 3, NULL),
                  EPCOMM_OK, NULL)) {
        CHECK(holds(w, new_map));
    }
    /* Expert 2 is gone: refused on both ranks, nothing moves; the count is still reported. */
    fill_survivor(w, exposed);
    memcpy(before, w, sizeof before);
    num_lost = -1;
    CHECK_ERR(epcomm_eplb_rearrange_with_lost(comm, exposed, new_map, RA_LAYERS, SD_OLD_SLOTS,
                                              RA_SLOTS, weights, 1, &opts, &lost, NULL),
              EPCOMM_ERROR_INVALID_ARGUMENT, SD_REFUSAL);
    CHECK(memcmp(before, w, sizeof before) == 0);
    CHECK(num_lost == 2);
    CHECK_ERR(epcomm_eplb_rearrange_with(comm, exposed, new_map, RA_LAYERS, SD_OLD_SLOTS,
                                         RA_SLOTS, weights, 1, &opts, NULL),
              EPCOMM_ERROR_INVALID_ARGUMENT, SD_REFUSAL);
    CHECK(memcmp(before, w, sizeof before) == 0);
    /* Allowed but no room to report them: refused before any data moves. */
    lost.allow_lost_experts = true;
    lost.lost_experts_out = pairs;
    lost.lost_experts_capacity = 1;
    CHECK_ERR(epcomm_eplb_rearrange_with_lost(comm, exposed, new_map, RA_LAYERS, SD_OLD_SLOTS,
                                              RA_SLOTS, weights, 1, &opts, &lost, NULL),
              EPCOMM_ERROR_INVALID_ARGUMENT,
              "lost_options->allow_lost_experts leaves 2 (layer, logical expert) pairs "
              "unwritten but lost_options->lost_experts_out has room for 1; pass room for them "
              "(num_layers * new_slots pairs always suffice)");
    CHECK(memcmp(before, w, sizeof before) == 0);
    /* Double-buffered, allowed: next holds the new placement, expert 2's slot the live row. */
    lost.lost_experts_capacity = RA_LAYERS * RA_SLOTS;
    memset(pairs, 0xFF, sizeof pairs);
    memset(n, 0xA5, sizeof n);
    if (CHECK_ERR(epcomm_eplb_rearrange_into_with_lost(comm, exposed, new_map, RA_LAYERS,
                                                       SD_OLD_SLOTS, RA_SLOTS, weights, next, 1,
                                                       &opts, &lost, NULL, &valid),
                  EPCOMM_OK, NULL)) {
        CHECK(valid == RA_LAYERS && holds(n, kept) && memcmp(before, w, sizeof before) == 0);
        CHECK(num_lost == 2 && pairs[0] == 0 && pairs[1] == 2 && pairs[2] == 1 && pairs[3] == 2);
    }
    /* Staged, allowed: the same in the live weights. */
    num_lost = -1;
    if (CHECK_ERR(epcomm_eplb_rearrange_with_lost(comm, exposed, new_map, RA_LAYERS,
                                                  SD_OLD_SLOTS, RA_SLOTS, weights, 1, &opts,
                                                  &lost, NULL),
                  EPCOMM_OK, NULL)) {
        CHECK(holds(w, kept) && num_lost == 2);
    }
    /* A lost-options struct smaller than this header's is refused (on both ranks alike). */
    fill_survivor(w, exposed);
    lost.struct_size = 4;
    snprintf(want, sizeof want,
             "lost_options->struct_size is 4: expected sizeof(epcomm_eplb_lost_experts_options) "
             "= %u (call epcomm_eplb_lost_experts_options_init)",
             (unsigned)sizeof lost);
    CHECK_ERR(epcomm_eplb_rearrange_with_lost(comm, exposed, new_map, RA_LAYERS, SD_OLD_SLOTS,
                                              RA_SLOTS, weights, 1, &opts, &lost, NULL),
              EPCOMM_ERROR_INVALID_ARGUMENT, want);
    CHECK(memcmp(before, w, sizeof before) == 0);
    CHECK_ERR(epcomm_eplb_lost_experts_options_init(NULL), EPCOMM_ERROR_NULL_POINTER, NULL);
}

/* ---- the migration scheduler ----------------------------------------------------------------- */

static void test_schedule(void) {
    /* vLLM's test_schedule_migration_batches_is_deterministic: transfers (src, dst, expert)
     * (1,3,0) (2,4,1) (0,1,2) (0,2,3) (0,3,4) (0,4,5) placed by its _placements_for_transfers
     * on 5 ranks of 4 slots. */
    static const int64_t old_map[20] = {2, 3, 4, 5, 0, -1, -1, -1, 1, -1,
                                        -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    static const int64_t new_map[20] = {-1, -1, -1, -1, 2, -1, -1, -1, 3, -1,
                                        -1, -1, 0, 4, -1, -1, 1, 5, -1, -1};
    static const int64_t batch_starts[6] = {0, 2, 3, 4, 5, 6};
    static const int64_t flows[12] = {1, 3, 2, 4, 0, 1, 0, 2, 0, 3, 0, 4};
    static const int64_t expert_starts[7] = {0, 1, 2, 3, 4, 5, 6};
    static const int64_t expert_ids[6] = {0, 1, 2, 3, 4, 5};
    schedule_t *sch = NULL, *bad = NULL;
    schedule_view_t v;

    if (CHECK_ERR(epcomm_eplb_schedule_migration_batches(old_map, new_map, 20, 4, &sch),
                  EPCOMM_OK, NULL)) {
        memset(&v, 0, sizeof v);
        if (CHECK_ERR(epcomm_eplb_migration_schedule_view(sch, &v), EPCOMM_OK, NULL)) {
            CHECK(v.num_batches == 5 && v.num_flows == 6 && v.num_expert_ids == 6);
            if (v.num_batches == 5 && v.num_flows == 6 && v.num_expert_ids == 6) {
                CHECK(memcmp(v.batch_starts, batch_starts, sizeof batch_starts) == 0);
                CHECK(memcmp(v.flows, flows, sizeof flows) == 0);
                CHECK(memcmp(v.expert_starts, expert_starts, sizeof expert_starts) == 0);
                CHECK(memcmp(v.expert_ids, expert_ids, sizeof expert_ids) == 0);
            }
        }
    }
    CHECK_ERR(epcomm_eplb_schedule_migration_batches(old_map, new_map, 20, 3, &bad),
              EPCOMM_ERROR_INVALID_ARGUMENT,
              "cannot reshape a map of 20 slots into blocks of 3 slots per rank");
    CHECK(bad == NULL);
    CHECK_ERR(epcomm_eplb_schedule_migration_batches(NULL, new_map, 20, 4, &bad),
              EPCOMM_ERROR_NULL_POINTER, NULL);
    CHECK_ERR(epcomm_eplb_migration_schedule_view(NULL, &v), EPCOMM_ERROR_NULL_POINTER, NULL);
    epcomm_eplb_migration_schedule_destroy(sch);
    epcomm_eplb_migration_schedule_destroy(NULL);
}

/* ---- plan_layer ------------------------------------------------------------------------------ */

static void test_plan_layer(void) {
    /* A pairing example: expert 0 held by ranks 0 and 1, needed also on 2, 3, 4. */
    static const int64_t old_map[10] = {0, 5, 0, 6, 7, 8, 9, 10, 11, 12};
    static const int64_t new_map[10] = {0, 5, 0, 6, 0, 8, 0, 10, 0, 12};
    plan_t *p0 = NULL, *p3 = NULL, *bad = NULL;
    plan_view_t v;

    if (CHECK_ERR(epcomm_eplb_plan_layer(old_map, new_map, 10, 2, 0, &p0), EPCOMM_OK, NULL)) {
        memset(&v, 0, sizeof v);
        if (CHECK_ERR(epcomm_eplb_layer_plan_view(p0, &v), EPCOMM_OK, NULL)) {
            CHECK(v.num_slots == 2);
            CHECK(v.unchanged != NULL && v.unchanged[0] == 1 && v.unchanged[1] == 1);
            CHECK(v.num_sends == 2);
            if (v.num_sends == 2) {
                CHECK(v.sends[0] == 0 && v.sends[1] == 0 && v.sends[2] == 2);
                CHECK(v.sends[3] == 0 && v.sends[4] == 0 && v.sends[5] == 4);
            }
            CHECK(v.num_recvs == 0);
            CHECK(v.num_local_copies == 0);
            CHECK(v.num_duplicates == 0);
        }
    }
    /* Rank 3 (planned here: plan_layer is pure and needs no group). */
    if (CHECK_ERR(epcomm_eplb_plan_layer(old_map, new_map, 10, 2, 3, &p3), EPCOMM_OK, NULL)) {
        memset(&v, 0, sizeof v);
        if (CHECK_ERR(epcomm_eplb_layer_plan_view(p3, &v), EPCOMM_OK, NULL)) {
            CHECK(v.num_slots == 2);
            CHECK(v.unchanged != NULL && v.unchanged[0] == 0 && v.unchanged[1] == 1);
            CHECK(v.num_recvs == 1);
            if (v.num_recvs == 1) {
                CHECK(v.recvs[0] == 0 && v.recvs[1] == 0 && v.recvs[2] == 1);
            }
            CHECK(v.num_sends == 0);
            CHECK(v.num_local_copies == 0);
            CHECK(v.num_duplicates == 0);
        }
    }
    /* A rank beyond the map; NULL handles. */
    CHECK_ERR(epcomm_eplb_plan_layer(old_map, new_map, 10, 2, 5, &bad),
              EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
    CHECK(bad == NULL);
    CHECK_ERR(epcomm_eplb_layer_plan_view(NULL, &v), EPCOMM_ERROR_NULL_POINTER, NULL);
    epcomm_eplb_layer_plan_destroy(p0);
    epcomm_eplb_layer_plan_destroy(p3);
    epcomm_eplb_layer_plan_destroy(NULL);
}

/* ---- load statistics ------------------------------------------------------------------------- */

static void test_state(group_t *g) {
    static const char CONFIG[] =
        "{\"window_size\": 4, \"step_interval\": 8, \"log_balancedness\": true}";
    static const char PREFIX[] = "EPLB step: 6 for model toy: avg_tokens=";
    static const int64_t phy2log[4] = {0, 1, 2, 3};
    /* Rank 0 routes 3 tokens (K = 2, one masked id), rank 1 routes 2. Per physical expert:
     * rank 0 [2, 1, 1, 1], rank 1 [0, 0, 1, 2]; summed [2, 1, 2, 3]. */
    int32_t ids0[3 * 2] = {0, 1, 2, 3, 0, -1};
    int32_t ids1[2 * 2] = {3, 2, 3, -1};
    int64_t shape[2];
    tensor_t ids;
    state_t *s = NULL, *bad = NULL;
    bool rearrange = true;
    float load[4] = {-1.0f, -1.0f, -1.0f, -1.0f};

    if (!CHECK_ERR(epcomm_eplb_state_create(CONFIG, "toy", 1, 4, &s), EPCOMM_OK, NULL)) {
        return;
    }
    CHECK(s != NULL);
    shape[0] = g_rank == 0 ? 3 : 2;
    shape[1] = 2;
    ids = make_tensor(g_rank == 0 ? (void *)ids0 : (void *)ids1, DL_INT, 32, 2, shape);
    CHECK_ERR(epcomm_eplb_state_record(s, 0, &ids), EPCOMM_OK, NULL);

    g_logs.count = 0;
    if (CHECK_ERR(epcomm_eplb_state_step(s, g, false, true, &rearrange), EPCOMM_OK, NULL)) {
        /* Step 6 of 8: the first rearrangement comes after step_interval / 4 steps. */
        CHECK(rearrange == false);
    }
    if (g_rank == 0) {
        const char *line = find_log_prefix(EPCOMM_LOG_INFO, PREFIX);
        CHECK(line != NULL);
        if (line != NULL) {
            CHECK(ends_with(line, ", steps until the next rearrangement: 2"));
            CHECK(strstr(line, ", max_tokens=") != NULL);
            CHECK(strstr(line, ", balancedness=") != NULL);
        } else {
            int i;
            for (i = 0; i < g_logs.count; i++) {
                printf("  rank %d log[%d] level %d: %s\n", g_rank, i, g_logs.levels[i],
                       g_logs.messages[i]);
            }
        }
    } else {
        /* Only rank 0 logs the line. */
        CHECK(count_log_prefix("EPLB step:") == 0);
    }

    if (CHECK_ERR(epcomm_eplb_state_logical_load(s, g, phy2log, 1, 4, 4, load), EPCOMM_OK,
                  NULL)) {
        CHECK(load[0] == 2.0f && load[1] == 1.0f && load[2] == 2.0f && load[3] == 3.0f);
        if (!(load[0] == 2.0f && load[1] == 1.0f && load[2] == 2.0f && load[3] == 3.0f)) {
            printf("  rank %d logical load [%g, %g, %g, %g], expected [2, 1, 2, 3]\n", g_rank,
                   (double)load[0], (double)load[1], (double)load[2], (double)load[3]);
        }
    }

    /* Argument errors, local to this rank. */
    CHECK_ERR(epcomm_eplb_state_record(s, 1, &ids), EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
    CHECK_ERR(epcomm_eplb_state_record(NULL, 0, &ids), EPCOMM_ERROR_NULL_POINTER, NULL);

    /* A bad config: str(ValidationError) as pydantic 2.13 prints it for EPLBConfig(**config);
     * nothing created. */
    {
        int32_t st = epcomm_eplb_state_create("{\"window_size\": 0}", "toy", 1, 4, &bad);
        if (CHECK_ERR(st, EPCOMM_ERROR_INVALID_ARGUMENT,
                      "1 validation error for EPLBConfig\nwindow_size\n"
                      "  Input should be greater than 0 [type=greater_than, input_value=0, "
                      "input_type=int]\n"
                      "    For further information visit "
                      "https://errors.pydantic.dev/2.13/v/greater_than")) {
            const char *exc = epcomm_status_exception(st);
            CHECK(exc != NULL && strcmp(exc, "ValueError") == 0);
        }
        CHECK(bad == NULL);
    }
    /* NULL config = vLLM's defaults: migration batching off. */
    if (CHECK_ERR(epcomm_eplb_state_create(NULL, "toy", 1, 4, &bad), EPCOMM_OK, NULL)) {
        bool on = true;
        CHECK(bad != NULL);
        if (CHECK_ERR(epcomm_eplb_state_migration_batching(bad, &on), EPCOMM_OK, NULL)) {
            CHECK(!on);
        }
        CHECK_ERR(epcomm_eplb_state_migration_batching(bad, NULL), EPCOMM_ERROR_NULL_POINTER,
                  NULL);
    }
    epcomm_eplb_state_destroy(bad);
    /* vLLM's migration_batching_enabled: use_async (default true) and
     * enable_migration_batching. */
    {
        static const char *configs[3] = {
            "{\"enable_migration_batching\": true}",
            "{\"use_async\": false, \"enable_migration_batching\": true}",
            "{\"use_async\": true, \"enable_migration_batching\": false}",
        };
        static const bool expected[3] = {true, false, false};
        int i;
        for (i = 0; i < 3; i++) {
            state_t *t = NULL;
            bool on = !expected[i];
            if (CHECK_ERR(epcomm_eplb_state_create(configs[i], "toy", 1, 4, &t), EPCOMM_OK,
                          NULL) &&
                CHECK_ERR(epcomm_eplb_state_migration_batching(t, &on), EPCOMM_OK, NULL)) {
                CHECK(on == expected[i]);
            }
            epcomm_eplb_state_destroy(t);
        }
    }
    /* epcomm_eplb_state_new: the order C++ and Python share (layers, physical, model, config). */
    {
        state_t *t = NULL;
        bool on = false;
        if (CHECK_ERR(epcomm_eplb_state_new(1, 4, "toy", "{\"enable_migration_batching\": true}",
                                            &t),
                      EPCOMM_OK, NULL) &&
            CHECK_ERR(epcomm_eplb_state_migration_batching(t, &on), EPCOMM_OK, NULL)) {
            CHECK(on);
        }
        epcomm_eplb_state_destroy(t);
        t = NULL;
        CHECK_ERR(epcomm_eplb_state_new(1, 4, NULL, NULL, &t), EPCOMM_ERROR_NULL_POINTER,
                  "argument 'model_name' must not be NULL");
        CHECK(t == NULL);
        CHECK_ERR(epcomm_eplb_state_new(1, 0, "toy", NULL, &t), EPCOMM_ERROR_INVALID_ARGUMENT,
                  "num_physical is 0; expected a positive value");
        CHECK(t == NULL);
    }
    CHECK_ERR(epcomm_eplb_state_migration_batching(NULL, NULL), EPCOMM_ERROR_NULL_POINTER, NULL);
    epcomm_eplb_state_destroy(s);
    epcomm_eplb_state_destroy(NULL);
}

/* ---- one rank -------------------------------------------------------------------------------- */

static int child_main(const char *name, int rank) {
    options_t opts;
    group_t *g = NULL;
    comm_t *comm;

    memset(&g_logs, 0, sizeof g_logs);
    epcomm_set_log_callback(capture_log, &g_logs);

    memset(&opts, 0, sizeof opts);
    if (!CHECK_ERR(epcomm_group_options_init(&opts), EPCOMM_OK, NULL)) {
        return 1;
    }
    opts.timeout_s = 20.0;
    if (!CHECK_ERR(epcomm_group_create_shm(name, rank, WORLD, &opts, &g), EPCOMM_OK, NULL)) {
        return 1;
    }
    CHECK(g != NULL);
    if (g == NULL) {
        return 1;
    }

    comm = test_factory(g);
    if (comm != NULL) {
        test_communicator(comm);
        CHECK_ERR(epcomm_group_barrier(g), EPCOMM_OK, NULL);
        test_rearrange(comm);
        CHECK_ERR(epcomm_group_barrier(g), EPCOMM_OK, NULL);
        test_rearrange_batched(comm);
        CHECK_ERR(epcomm_group_barrier(g), EPCOMM_OK, NULL);
        test_rearrange_into(comm);
        CHECK_ERR(epcomm_group_barrier(g), EPCOMM_OK, NULL);
        test_rearrange_after_failure(comm);
    }
    CHECK_ERR(epcomm_group_barrier(g), EPCOMM_OK, NULL);
    test_plan_layer();
    test_lost_experts();
    test_schedule();
    test_state(g);
    CHECK_ERR(epcomm_group_barrier(g), EPCOMM_OK, NULL);

    epcomm_eplb_communicator_destroy(comm);
    epcomm_eplb_communicator_destroy(NULL);
    epcomm_group_destroy(g);
    epcomm_set_log_callback(NULL, NULL);
    return g_failed == 0 ? 0 : 1;
}

/* ---- the parent ------------------------------------------------------------------------------ */

int main(int argc, char **argv) {
    return test_ranks_main(argc, argv, "eplb_runtime_test", WORLD, child_main,
                           TEST_RANKS_COUNT_CHECKS);
}
