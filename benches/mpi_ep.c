/* Expert-parallel dispatch + combine over MPI, through epcomm (examples/mpi's host transport,
 * mpi_transport.h) against the same traffic written by hand with MPI, in the same run, same
 * inputs, alternating, with the results compared byte for byte.
 *
 * By hand (what a runtime writes with MPI alone): each token goes once to every rank holding
 * one of its top-k experts (MPI_Alltoall of the counts, pack, MPI_Alltoallv of the rows); the
 * expert side doubles the rows; MPI_Alltoallv brings them back and the source sums them in f32
 * in rank order, stored as bf16. Through epcomm: the deepep_high_throughput backend (the same
 * token-major traffic) over epcomm_group_create_host with MPI callbacks; the same expert side.
 *
 *   mpicc -O3 -march=native -std=c11 -Iinclude -Iexamples/mpi benches/mpi_ep.c -Ltarget/release -lepcomm \
 *         -Wl,-rpath,$PWD/target/release -o mpi_ep
 *   mpirun -np 2 --mca pml ob1 --mca btl tcp,self ./mpi_ep [--tokens 1,128,1024,4096]
 *          [--hidden 7168] [--experts 256] [--topk 8] [--iters 10] [--reps 5]
 *
 * EPCOMM_MPI_ALLTOALLV=0 leaves epcomm without the all_to_allv callback (send/recv only, as a
 * host built before it). Rank 0 prints one Markdown table row per T: the medians over the
 * repetitions of the mean time per iteration of dispatch + combine (the expert side, the same
 * loop in both, is timed and left out: it is neither one's communication), their ratio, and
 * whether every rank's result was identical.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mpi_transport.h"

static int g_rank, g_world;
/* Seconds spent on the expert side since the last reset (left out of the times). */
static double g_expert;

static uint16_t f32_to_bf16(float f) { /* round to nearest even (epcomm's num::f32_to_bf16) */
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

static float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct {
    int64_t t, h, e, k;
    uint16_t *x;  /* [t, h] bf16 */
    int32_t *ids; /* [t, k], k distinct experts */
    float *w;     /* [t, k] */
} Inputs;

static void make_inputs(Inputs *in) {
    uint64_t s = 1000 + (uint64_t)g_rank;
    in->x = malloc((size_t)(in->t * in->h + 1) * 2);
    in->ids = malloc((size_t)(in->t * in->k + 1) * 4);
    in->w = malloc((size_t)(in->t * in->k + 1) * 4);
    for (int64_t i = 0; i < in->t * in->h; i++)
        in->x[i] = f32_to_bf16((float)((double)(rng_next(&s) >> 11) / 9007199254740992.0 - 0.5));
    for (int64_t t = 0; t < in->t; t++)
        for (int64_t j = 0; j < in->k; j++) {
            int32_t e;
            int dup;
            do {
                e = (int32_t)(rng_next(&s) % (uint64_t)in->e);
                dup = 0;
                for (int64_t q = 0; q < j; q++) dup |= in->ids[t * in->k + q] == e;
            } while (dup);
            in->ids[t * in->k + j] = e;
            in->w[t * in->k + j] = 1.0f / (float)in->k;
        }
}

static double now(void);

/* The expert side of both: every row doubled (bf16 -> f32 -> bf16), timed into g_expert. */
static void expert(const uint16_t *in, uint16_t *out, int64_t n) {
    double t0 = now();
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(2.0f * bf16_to_f32(in[i]));
    g_expert += now() - t0;
}

/* ---- by hand ------------------------------------------------------------------------------ */

typedef struct {
    int *send_counts, *recv_counts, *sd, *rd, *sc_rows, *rc_rows;
    int32_t *order; /* tokens, grouped by destination rank */
    uint16_t *send, *recv, *back;
    float *acc;
} Hand;

static void hand_alloc(Hand *m, const Inputs *in) {
    int R = g_world;
    size_t row = (size_t)in->h * 2, rows = (size_t)in->t * (size_t)R + 1;
    m->send_counts = calloc((size_t)R * 6, sizeof(int));
    m->recv_counts = m->send_counts + R;
    m->sd = m->send_counts + 2 * R;
    m->rd = m->send_counts + 3 * R;
    m->sc_rows = m->send_counts + 4 * R;
    m->rc_rows = m->send_counts + 5 * R;
    m->order = malloc(rows * sizeof(int32_t));
    m->send = malloc(rows * row);
    m->recv = malloc(rows * row);
    m->back = malloc(rows * row);
    m->acc = malloc(((size_t)in->t * (size_t)in->h + 1) * sizeof(float));
}

static int by_hand(Hand *m, const Inputs *in, uint16_t *out) {
    int R = g_world;
    int64_t per = in->e / R, h = in->h;
    int n = 0;
    for (int r = 0; r < R; r++) {
        int c = 0;
        for (int64_t t = 0; t < in->t; t++) {
            int held = 0;
            for (int64_t j = 0; j < in->k; j++) held |= in->ids[t * in->k + j] / per == r;
            if (held) m->order[n + c++] = (int32_t)t;
        }
        m->sc_rows[r] = c;
        n += c;
    }
    if (MPI_Alltoall(m->sc_rows, 1, MPI_INT, m->rc_rows, 1, MPI_INT, MPI_COMM_WORLD)) return 1;
    int so = 0, ro = 0;
    for (int r = 0; r < R; r++) {
        m->send_counts[r] = m->sc_rows[r] * (int)h * 2;
        m->recv_counts[r] = m->rc_rows[r] * (int)h * 2;
        m->sd[r] = so;
        m->rd[r] = ro;
        so += m->send_counts[r];
        ro += m->recv_counts[r];
    }
    for (int i = 0; i < n; i++) memcpy(m->send + (size_t)i * h, in->x + (size_t)m->order[i] * h, h * 2);
    if (MPI_Alltoallv(m->send, m->send_counts, m->sd, MPI_BYTE, m->recv, m->recv_counts, m->rd,
                      MPI_BYTE, MPI_COMM_WORLD))
        return 1;
    /* The expert side: every received row doubled. */
    int64_t got = ro / (int64_t)(h * 2);
    expert(m->recv, m->recv, got * h);
    if (MPI_Alltoallv(m->recv, m->recv_counts, m->rd, MPI_BYTE, m->back, m->send_counts, m->sd,
                      MPI_BYTE, MPI_COMM_WORLD))
        return 1;
    /* Sum in f32 in rank order (the order of `order`), store bf16. */
    memset(m->acc, 0, (size_t)(in->t * h) * sizeof(float));
    for (int i = 0; i < n; i++) {
        float *a = m->acc + (size_t)m->order[i] * h;
        const uint16_t *b = m->back + (size_t)i * h;
        for (int64_t j = 0; j < h; j++) a[j] += bf16_to_f32(b[j]);
    }
    for (int64_t i = 0; i < in->t * h; i++) out[i] = f32_to_bf16(m->acc[i]);
    return 0;
}

/* ---- through epcomm ----------------------------------------------------------------------- */

static epcomm_tensor tensor(void *data, uint8_t code, uint8_t bits, int32_t ndim, int64_t *shape) {
    epcomm_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.device.device_type = EPCOMM_DEVICE_CPU;
    t.ndim = ndim;
    t.dtype.code = code;
    t.dtype.bits = bits;
    t.dtype.lanes = 1;
    t.shape = shape;
    return t;
}

static int by_epcomm(epcomm_all2all *a, const Inputs *in, uint16_t *y, uint16_t *out) {
    int64_t xs[2] = {in->t, in->h}, ks[2] = {in->t, in->k};
    epcomm_tensor tx = tensor(in->x, 4, 16, 2, xs); /* kDLBfloat */
    epcomm_tensor ti = tensor(in->ids, 0, 32, 2, ks);
    epcomm_tensor tw = tensor(in->w, 2, 32, 2, ks);
    epcomm_dispatch_output d;
    if (epcomm_all2all_dispatch(a, &tx, &ti, &tw, NULL, 0, &d) != EPCOMM_OK) return 1;
    int64_t n = 1;
    for (int i = 0; i < d.hidden.ndim; i++) n *= d.hidden.shape[i];
    expert(d.hidden.data, y, n);
    epcomm_tensor ty = tensor(y, 4, 16, d.hidden.ndim, d.hidden.shape);
    epcomm_tensor to = tensor(out, 4, 16, 2, xs);
    return epcomm_all2all_combine(a, &ty, &to) != EPCOMM_OK;
}

/* ---- the run ------------------------------------------------------------------------------ */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void die(const char *what) {
    fprintf(stderr, "rank %d: %s failed: %s\n", g_rank, what, epcomm_last_error_message());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm comm = MPI_COMM_WORLD;
    MPI_Comm_rank(comm, &g_rank);
    MPI_Comm_size(comm, &g_world);
    const char *tokens = "1,128,1024,4096";
    int64_t hidden = 7168, experts = 256, topk = 8;
    int iters = 10, reps = 5;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--tokens")) tokens = argv[i + 1];
        else if (!strcmp(argv[i], "--hidden")) hidden = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--experts")) experts = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--topk")) topk = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else {
            if (g_rank == 0) fprintf(stderr, "mpi_ep: unknown option %s\n", argv[i]);
            MPI_Abort(comm, 2);
        }
    }
    if (iters < 1 || reps < 1 || reps > 64) die("arguments (iters >= 1, 1 <= reps <= 64)");
    const char *a2a_env = getenv("EPCOMM_MPI_ALLTOALLV");
    int with_a2a = !(a2a_env && !strcmp(a2a_env, "0"));
    epcomm_host_callbacks cb = mpi_callbacks(&comm, with_a2a);
    epcomm_group *g = NULL;
    if (epcomm_group_create_host(&cb, "mpi", g_rank, g_world, NULL, &g) != EPCOMM_OK) die("group");
    if (g_rank == 0) {
        printf("%d ranks over MPI, H=%lld bf16, top-%lld of %lld experts, %d iterations x %d "
               "repetitions (medians), epcomm %s the all_to_allv callback, libepcomm %s\n\n",
               g_world, (long long)hidden, (long long)topk, (long long)experts, iters, reps,
               with_a2a ? "with" : "without", epcomm_version());
        printf("| T | R | epcomm (ms) | by hand (ms) | ratio | same result |\n");
        printf("|---:|---:|---:|---:|---:|:---:|\n");
    }
    char *list = strdup(tokens);
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        Inputs in = {atoll(tok), hidden, experts, topk, NULL, NULL, NULL};
        make_inputs(&in);
        epcomm_moe_config cfg;
        epcomm_moe_config_init(&cfg);
        cfg.num_experts = experts;
        cfg.top_k = topk;
        cfg.hidden_size = hidden;
        cfg.max_tokens_per_rank = in.t;
        cfg.hidden_dtype.code = cfg.expert_dtype.code = cfg.out_dtype.code = 4;
        cfg.hidden_dtype.bits = cfg.expert_dtype.bits = cfg.out_dtype.bits = 16;
        epcomm_all2all *a = NULL;
        if (epcomm_all2all_create(g, "deepep_high_throughput", &cfg, &a) != EPCOMM_OK)
            die("all2all_create");
        size_t out_bytes = (size_t)(in.t * hidden + 1) * 2;
        uint16_t *y = malloc((size_t)(in.t * g_world + 1) * (size_t)hidden * 2);
        uint16_t *out_ep = malloc(out_bytes), *out_hand = malloc(out_bytes);
        Hand m;
        hand_alloc(&m, &in);
        /* Warm-up, and the results compared. */
        if (by_epcomm(a, &in, y, out_ep)) die("epcomm dispatch/combine");
        if (by_hand(&m, &in, out_hand)) die("MPI by hand");
        int same = !memcmp(out_ep, out_hand, (size_t)(in.t * hidden) * 2), all_same = 0;
        MPI_Allreduce(&same, &all_same, 1, MPI_INT, MPI_MIN, comm);
        double ep[64], hand[64];
        for (int r = 0; r < reps; r++) {
            MPI_Barrier(comm);
            g_expert = 0;
            double t0 = now();
            for (int i = 0; i < iters; i++)
                if (by_epcomm(a, &in, y, out_ep)) die("epcomm dispatch/combine");
            MPI_Barrier(comm);
            double t1 = now(), ep_expert = g_expert;
            g_expert = 0;
            for (int i = 0; i < iters; i++)
                if (by_hand(&m, &in, out_hand)) die("MPI by hand");
            MPI_Barrier(comm);
            double t2 = now();
            ep[r] = (t1 - t0 - ep_expert) / iters;
            hand[r] = (t2 - t1 - g_expert) / iters;
        }
        double e = median(ep, reps), h = median(hand, reps);
        if (g_rank == 0)
            printf("| %lld | %d | %.3f | %.3f | %.2f | %s |\n", (long long)in.t, g_world, e * 1e3,
                   h * 1e3, e / h, all_same ? "yes" : "NO");
        fflush(stdout);
        epcomm_all2all_destroy(a);
        free(y);
        free(out_ep);
        free(out_hand);
        free(m.send_counts);
        free(m.order);
        free(m.send);
        free(m.recv);
        free(m.back);
        free(m.acc);
        free(in.x);
        free(in.ids);
        free(in.w);
    }
    free(list);
    epcomm_group_destroy(g);
    MPI_Finalize();
    return 0;
}
