/*
 * Process-group test for epcomm through the C ABI: four real processes (forked ranks) form a
 * shared-memory group and run the collectives with uneven sizes (zeros included), checking
 * every result exactly, plus argument errors that must not break the group, and a shrink (three
 * ranks form a smaller group without the fourth). Built as C11 and
 * (with -x c++) as C++17, under ASan+UBSan, by tests/c_group.rs.
 *
 * Usage: group_test GROUP_NAME
 *
 * The parent forks the ranks before it calls anything in epcomm, waits for them with a
 * deadline (killing them when it passes), prints one line per failed rank and, at the end,
 * "N passed, M failed" counting ranks; exits non-zero if any rank failed or the group left
 * anything in /dev/shm.
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
typedef struct epcomm_p2p_op p2p_op_t;

#define WORLD 4
#define COLS 5
#define TOTAL_ROWS 10
/* Rows per rank of the v-collectives: uneven, with a zero. Sums to TOTAL_ROWS. */
static const int64_t ROWS[WORLD] = {3, 0, 2, 5};

#define make_tensor test_cpu_tensor


static int64_t rows_before(int rank) {
    int64_t s = 0;
    int r;
    for (r = 0; r < rank; r++) {
        s += ROWS[r];
    }
    return s;
}

/* ---- bfloat16 by bit operations (exact for the values used here) ----------------------------- */

static uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)(bits >> 16);
}

static float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ---- deterministic data ---------------------------------------------------------------------- */

/* all_gatherv: element (row, col) of rank `rank`'s rows; exact in float32. */
static float gather_value(int rank, int row, int col) {
    return (float)(rank * 100 + row * 10 + col) + 0.5f;
}

/* reduce_scatterv: element (row, col) of rank `rank`'s full input; a multiple of 1/8 below 2,
 * exact in float32 and bfloat16, and so is any sum of four of them. */
static float reduce_value(int rank, int row, int col) {
    return (float)(((rank + 1) * (row * COLS + col) + 3 * rank) % 17) / 8.0f;
}

/* all_to_allv: rows rank `src` sends to rank `dst`, zero for some pairs. */
static int64_t a2a_count(int src, int dst) {
    return (int64_t)((src + 2 * dst) % 3);
}

#define A2A_COLS 3
#define A2A_MAX_ROWS (WORLD * 2)

static int32_t a2a_value(int src, int dst, int j, int col) {
    return (int32_t)(src * 1000 + dst * 100 + j * 10 + col);
}

/* ---- the collectives ------------------------------------------------------------------------- */

static void test_rank_size(group_t *g, int rank) {
    int32_t r = -1, s = -1;
    if (CHECK_ST(epcomm_group_rank(g, &r), EPCOMM_OK)) {
        CHECK(r == rank);
    }
    if (CHECK_ST(epcomm_group_size(g, &s), EPCOMM_OK)) {
        CHECK(s == WORLD);
    }
}

static void test_all_gatherv(group_t *g, int rank) {
    float in[5 * COLS];
    float out[TOTAL_ROWS * COLS];
    int64_t in_shape[2];
    int64_t out_shape[2] = {TOTAL_ROWS, COLS};
    tensor_t ti, to;
    int r, i, c, row;

    in_shape[0] = ROWS[rank];
    in_shape[1] = COLS;
    for (i = 0; i < (int)ROWS[rank]; i++) {
        for (c = 0; c < COLS; c++) {
            in[i * COLS + c] = gather_value(rank, i, c);
        }
    }
    for (i = 0; i < TOTAL_ROWS * COLS; i++) {
        out[i] = -1.0f;
    }
    ti = make_tensor(in, DL_FLOAT, 32, 2, in_shape, NULL);
    to = make_tensor(out, DL_FLOAT, 32, 2, out_shape, NULL);
    if (!CHECK_ST(epcomm_group_all_gatherv(g, &ti, ROWS, &to), EPCOMM_OK)) {
        return;
    }
    row = 0;
    for (r = 0; r < WORLD; r++) {
        for (i = 0; i < (int)ROWS[r]; i++, row++) {
            for (c = 0; c < COLS; c++) {
                float want = gather_value(r, i, c);
                if (out[row * COLS + c] != want) {
                    g_failed++;
                    printf("FAIL rank %d all_gatherv: out[%d][%d] = %g, expected %g\n", rank,
                           row, c, (double)out[row * COLS + c], (double)want);
                    return;
                }
            }
        }
    }
    CHECK(row == TOTAL_ROWS);
}

static void test_reduce_scatterv_f32(group_t *g, int rank) {
    float in[TOTAL_ROWS * COLS];
    float out[5 * COLS];
    int64_t in_shape[2] = {TOTAL_ROWS, COLS};
    int64_t out_shape[2];
    tensor_t ti, to;
    int i, c, r;
    int64_t first = rows_before(rank);

    for (i = 0; i < TOTAL_ROWS; i++) {
        for (c = 0; c < COLS; c++) {
            in[i * COLS + c] = reduce_value(rank, i, c);
        }
    }
    for (i = 0; i < 5 * COLS; i++) {
        out[i] = -1.0f;
    }
    out_shape[0] = ROWS[rank];
    out_shape[1] = COLS;
    ti = make_tensor(in, DL_FLOAT, 32, 2, in_shape, NULL);
    to = make_tensor(out, DL_FLOAT, 32, 2, out_shape, NULL);
    if (!CHECK_ST(epcomm_group_reduce_scatterv(g, &ti, ROWS, &to), EPCOMM_OK)) {
        return;
    }
    for (i = 0; i < (int)ROWS[rank]; i++) {
        for (c = 0; c < COLS; c++) {
            float want = 0.0f;
            for (r = 0; r < WORLD; r++) {
                want += reduce_value(r, (int)first + i, c);
            }
            if (out[i * COLS + c] != want) {
                g_failed++;
                printf("FAIL rank %d reduce_scatterv f32: out[%d][%d] = %g, expected %g\n", rank,
                       i, c, (double)out[i * COLS + c], (double)want);
                return;
            }
        }
    }
    /* Nothing past this rank's slice was written. */
    for (i = (int)ROWS[rank] * COLS; i < 5 * COLS; i++) {
        CHECK(out[i] == -1.0f);
    }
}

static void test_reduce_scatterv_bf16(group_t *g, int rank) {
    uint16_t in[TOTAL_ROWS * COLS];
    uint16_t out[5 * COLS];
    int64_t in_shape[2] = {TOTAL_ROWS, COLS};
    int64_t out_shape[2];
    tensor_t ti, to;
    int i, c, r;
    int64_t first = rows_before(rank);

    for (i = 0; i < TOTAL_ROWS; i++) {
        for (c = 0; c < COLS; c++) {
            float v = reduce_value(rank, i, c);
            in[i * COLS + c] = f32_to_bf16(v);
            /* The data really is exact in bfloat16. */
            CHECK(bf16_to_f32(in[i * COLS + c]) == v);
        }
    }
    for (i = 0; i < 5 * COLS; i++) {
        out[i] = 0xFFFFu;
    }
    out_shape[0] = ROWS[rank];
    out_shape[1] = COLS;
    ti = make_tensor(in, DL_BFLOAT, 16, 2, in_shape, NULL);
    to = make_tensor(out, DL_BFLOAT, 16, 2, out_shape, NULL);
    if (!CHECK_ST(epcomm_group_reduce_scatterv(g, &ti, ROWS, &to), EPCOMM_OK)) {
        return;
    }
    for (i = 0; i < (int)ROWS[rank]; i++) {
        for (c = 0; c < COLS; c++) {
            float want = 0.0f;
            float got = bf16_to_f32(out[i * COLS + c]);
            for (r = 0; r < WORLD; r++) {
                want += reduce_value(r, (int)first + i, c);
            }
            if (got != want || out[i * COLS + c] != f32_to_bf16(want)) {
                g_failed++;
                printf("FAIL rank %d reduce_scatterv bf16: out[%d][%d] = %g (0x%04x), expected "
                       "%g (0x%04x)\n",
                       rank, i, c, (double)got, (unsigned)out[i * COLS + c], (double)want,
                       (unsigned)f32_to_bf16(want));
                return;
            }
        }
    }
    for (i = (int)ROWS[rank] * COLS; i < 5 * COLS; i++) {
        CHECK(out[i] == 0xFFFFu);
    }
}

static void test_all_to_allv(group_t *g, int rank) {
    int32_t in[A2A_MAX_ROWS * A2A_COLS];
    int32_t out[A2A_MAX_ROWS * A2A_COLS];
    int64_t send_counts[WORLD], recv_counts[WORLD];
    int64_t in_shape[2], out_shape[2];
    int64_t send_total = 0, recv_total = 0;
    tensor_t ti, to;
    int p, j, c, row;

    for (p = 0; p < WORLD; p++) {
        send_counts[p] = a2a_count(rank, p);
        recv_counts[p] = a2a_count(p, rank);
        send_total += send_counts[p];
        recv_total += recv_counts[p];
    }
    CHECK(send_total <= A2A_MAX_ROWS && recv_total <= A2A_MAX_ROWS);
    if (send_total > A2A_MAX_ROWS || recv_total > A2A_MAX_ROWS) {
        return;
    }
    row = 0;
    for (p = 0; p < WORLD; p++) {
        for (j = 0; j < (int)send_counts[p]; j++, row++) {
            for (c = 0; c < A2A_COLS; c++) {
                in[row * A2A_COLS + c] = a2a_value(rank, p, j, c);
            }
        }
    }
    for (j = 0; j < A2A_MAX_ROWS * A2A_COLS; j++) {
        out[j] = -1;
    }
    in_shape[0] = send_total;
    in_shape[1] = A2A_COLS;
    out_shape[0] = recv_total;
    out_shape[1] = A2A_COLS;
    ti = make_tensor(in, DL_INT, 32, 2, in_shape, NULL);
    to = make_tensor(out, DL_INT, 32, 2, out_shape, NULL);
    if (!CHECK_ST(epcomm_group_all_to_allv(g, &ti, send_counts, &to, recv_counts), EPCOMM_OK)) {
        return;
    }
    row = 0;
    for (p = 0; p < WORLD; p++) {
        for (j = 0; j < (int)recv_counts[p]; j++, row++) {
            for (c = 0; c < A2A_COLS; c++) {
                int32_t want = a2a_value(p, rank, j, c);
                if (out[row * A2A_COLS + c] != want) {
                    g_failed++;
                    printf("FAIL rank %d all_to_allv: out[%d][%d] = %d, expected %d\n", rank, row,
                           c, (int)out[row * A2A_COLS + c], (int)want);
                    return;
                }
            }
        }
    }
}

static void test_broadcast_all_gather(group_t *g, int rank) {
    int32_t data[4];
    int64_t shape[1] = {4};
    tensor_t t;
    int32_t mine[2];
    int32_t all[WORLD * 2];
    int i;

    for (i = 0; i < 4; i++) {
        data[i] = rank == 2 ? 7000 + i : -1;
    }
    t = make_tensor(data, DL_INT, 32, 1, shape, NULL);
    if (CHECK_ST(epcomm_group_broadcast(g, &t, 2), EPCOMM_OK)) {
        for (i = 0; i < 4; i++) {
            CHECK(data[i] == 7000 + i);
        }
    }

    mine[0] = rank;
    mine[1] = 10 * rank + 1;
    memset(all, 0, sizeof all);
    if (CHECK_ST(epcomm_group_all_gather(g, mine, sizeof mine, all), EPCOMM_OK)) {
        for (i = 0; i < WORLD; i++) {
            CHECK(all[2 * i] == i && all[2 * i + 1] == 10 * i + 1);
        }
    }
}

/* A ring: every rank sends 3 int32 to rank+1 and receives from rank-1. */
static void test_send_recv(group_t *g, int rank) {
    int32_t send_buf[3], recv_buf[3];
    int64_t shape[1] = {3};
    tensor_t ts, tr;
    p2p_op_t ops[2];
    int prev = (rank + WORLD - 1) % WORLD;
    int i;

    for (i = 0; i < 3; i++) {
        send_buf[i] = rank * 10 + i;
        recv_buf[i] = -1;
    }
    ts = make_tensor(send_buf, DL_INT, 32, 1, shape, NULL);
    tr = make_tensor(recv_buf, DL_INT, 32, 1, shape, NULL);
    ops[0].kind = EPCOMM_P2P_SEND;
    ops[0].peer = (rank + 1) % WORLD;
    ops[0].tensor = &ts;
    ops[1].kind = EPCOMM_P2P_RECV;
    ops[1].peer = prev;
    ops[1].tensor = &tr;
    if (CHECK_ST(epcomm_group_send_recv(g, ops, 2), EPCOMM_OK)) {
        for (i = 0; i < 3; i++) {
            CHECK(recv_buf[i] == prev * 10 + i);
        }
    }
}

/* Argument errors are reported before any rank communicates, so the group stays usable. */
static void test_errors(group_t *g, int rank) {
    float in[5 * COLS];
    float out[TOTAL_ROWS * COLS];
    int64_t in_shape[2];
    int64_t bad_out_shape[2] = {TOTAL_ROWS - 1, COLS};
    int64_t strided_shape[2] = {2, COLS};
    int64_t bad_strides[2] = {2 * COLS, 1};
    int64_t even[WORLD] = {2, 2, 2, 2};
    int64_t even_out_shape[2] = {2 * WORLD, COLS};
    float wide[2 * 2 * COLS];
    tensor_t ti, to;

    memset(in, 0, sizeof in);
    memset(out, 0, sizeof out);
    memset(wide, 0, sizeof wide);

    /* Output with the wrong number of rows. */
    in_shape[0] = ROWS[rank];
    in_shape[1] = COLS;
    ti = make_tensor(in, DL_FLOAT, 32, 2, in_shape, NULL);
    to = make_tensor(out, DL_FLOAT, 32, 2, bad_out_shape, NULL);
    epcomm_clear_last_error();
    if (CHECK_ST(epcomm_group_all_gatherv(g, &ti, ROWS, &to), EPCOMM_ERROR_INVALID_ARGUMENT)) {
        CHECK_MSG_HAS("output");
    }
    CHECK_ST(epcomm_group_barrier(g), EPCOMM_OK);

    /* A non-contiguous input: rows 2 * COLS elements apart. */
    ti = make_tensor(wide, DL_FLOAT, 32, 2, strided_shape, bad_strides);
    to = make_tensor(out, DL_FLOAT, 32, 2, even_out_shape, NULL);
    epcomm_clear_last_error();
    if (CHECK_ST(epcomm_group_all_gatherv(g, &ti, even, &to), EPCOMM_ERROR_INVALID_ARGUMENT)) {
        CHECK_MSG_HAS("not contiguous");
    }
    CHECK_ST(epcomm_group_barrier(g), EPCOMM_OK);

    /* Compact strides are accepted explicitly too, and the group still gathers. */
    bad_strides[0] = COLS;
    ti = make_tensor(wide, DL_FLOAT, 32, 2, strided_shape, bad_strides);
    CHECK_ST(epcomm_group_all_gatherv(g, &ti, even, &to), EPCOMM_OK);
}

/* Shrink: rank 1 is excluded (it only checks that it is refused) and the others form a group of
 * three, renumbered in order (0, 2, 3 -> 0, 1, 2), that gathers correctly; the old handle stays
 * valid until destroyed. Nothing failed, so no rank is lost. */
static void test_shrink(group_t *g, int rank) {
    static const int32_t excluded[1] = {1};
    int32_t mask[WORLD];
    group_t *s = NULL;
    int32_t new_rank = -1, new_size = -1;
    int32_t mine, all[WORLD - 1];
    int i;

    for (i = 0; i < WORLD; i++) {
        mask[i] = 7;
    }
    if (CHECK_ST(epcomm_group_lost_ranks(g, mask, WORLD), EPCOMM_OK)) {
        for (i = 0; i < WORLD; i++) {
            CHECK(mask[i] == 0);
        }
    }
    CHECK_ST(epcomm_group_lost_ranks(g, mask, WORLD - 1), EPCOMM_ERROR_INVALID_ARGUMENT);
    CHECK_ST(epcomm_group_lost_ranks(g, NULL, WORLD), EPCOMM_ERROR_NULL_POINTER);
    CHECK_ST(epcomm_group_shrink(g, excluded, 1, NULL), EPCOMM_ERROR_NULL_POINTER);
    CHECK_ST(epcomm_group_shrink(g, NULL, 1, &s), EPCOMM_ERROR_NULL_POINTER);
    if (rank == 1) {
        if (CHECK_ST(epcomm_group_shrink(g, excluded, 1, &s), EPCOMM_ERROR_INVALID_ARGUMENT)) {
            CHECK_MSG_HAS("shrink: excluded [1] holds rank 1, the calling rank of group '");
        }
        CHECK(s == NULL);
        return;
    }
    if (!CHECK_ST(epcomm_group_shrink(g, excluded, 1, &s), EPCOMM_OK) || s == NULL) {
        return;
    }
    CHECK_ST(epcomm_group_rank(s, &new_rank), EPCOMM_OK);
    CHECK_ST(epcomm_group_size(s, &new_size), EPCOMM_OK);
    CHECK(new_rank == (rank == 0 ? 0 : rank - 1));
    CHECK(new_size == WORLD - 1);
    mine = 100 + rank;
    if (CHECK_ST(epcomm_group_all_gather(s, &mine, sizeof mine, all), EPCOMM_OK)) {
        CHECK(all[0] == 100 && all[1] == 102 && all[2] == 103);
    }
    CHECK_ST(epcomm_group_barrier(s), EPCOMM_OK);
    epcomm_group_destroy(s);
}

static int child_main(const char *name, int rank) {
    options_t opts;
    group_t *g = NULL;

    memset(&opts, 0, sizeof opts);
    if (!CHECK_ST(epcomm_group_options_init(&opts), EPCOMM_OK)) {
        return 1;
    }
    CHECK(opts.struct_size == sizeof(options_t));
    opts.timeout_s = 20.0;
    if (!CHECK_ST(epcomm_group_create_shm(name, rank, WORLD, &opts, &g), EPCOMM_OK)) {
        return 1;
    }
    CHECK(g != NULL);
    if (g == NULL) {
        return 1;
    }

    test_rank_size(g, rank);
    CHECK_ST(epcomm_group_barrier(g), EPCOMM_OK);
    test_all_gatherv(g, rank);
    test_reduce_scatterv_f32(g, rank);
    test_reduce_scatterv_bf16(g, rank);
    test_all_to_allv(g, rank);
    test_broadcast_all_gather(g, rank);
    test_send_recv(g, rank);
    test_errors(g, rank);
    CHECK_ST(epcomm_group_barrier(g), EPCOMM_OK);
    test_shrink(g, rank);

    epcomm_group_destroy(g);
    return g_failed == 0 ? 0 : 1;
}

/* ---- the parent ------------------------------------------------------------------------------ */

int main(int argc, char **argv) {
    return test_ranks_main(argc, argv, "group_test", WORLD, child_main, TEST_RANKS_COUNT_RANKS);
}
