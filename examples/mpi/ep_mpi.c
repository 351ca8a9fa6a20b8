/* Expert parallelism over MPI: every rank of an MPI job forms an epcomm group over the host's own
 * transport (MPI_Send / MPI_Recv / MPI_Allgather / MPI_Alltoallv as the callbacks), then runs a MoE
 * dispatch/combine step through one backend name per buffer layout and an EPLB rearrangement of
 * two layers. Ranks may be on different machines: epcomm moves every byte through MPI.
 *
 * Each rank checks its own results against a single-process float32 reference (combine: the
 * top-k weighted sum of (e + 1) * x over the token's experts, relative error at most 1e-5;
 * EPLB: every slot holds exactly the rows of the expert the new map puts there) and the job
 * exits 0 only when every rank agrees.
 *
 *   mpicc -std=c11 ep_mpi.c $(pkg-config --cflags --libs epcomm) -o ep_mpi
 *   mpirun -np 4 --mca pml ob1 --mca btl tcp,self ./ep_mpi            # TCP only
 *   mpirun -np 2 ./ep_mpi deepep_low_latency                          # one backend
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

#include <epcomm.h>

#define EXPERTS_PER_RANK 2
#define TOP_K 2
#define HIDDEN 8
#define MAX_TOKENS 8
#define LAYERS 2
#define COLS 4

/* ---- the host transport: MPI (mpi_transport.h) ------------------------------------------ */

#include "mpi_transport.h"

/* ---- helpers ----------------------------------------------------------------------------- */

static int g_rank, g_world;

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

static int failed(const char *what, int32_t st) {
    fprintf(stderr, "rank %d: %s: %s: %s\n", g_rank, what, epcomm_status_exception(st),
            epcomm_last_error_message());
    return 1;
}

static int64_t numel(const epcomm_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

/* ---- the MoE step ------------------------------------------------------------------------ */

/* This rank's tokens: 3 + rank % 4 of them (ranks differ), values and routing from the rank. */
typedef struct {
    int64_t tokens;
    float x[MAX_TOKENS * HIDDEN];
    int32_t ids[MAX_TOKENS * TOP_K];
    float w[MAX_TOKENS * TOP_K];
} Tokens;

static void make_tokens(Tokens *in, int num_experts) {
    in->tokens = 3 + g_rank % 4;
    for (int64_t t = 0; t < in->tokens; t++) {
        for (int h = 0; h < HIDDEN; h++)
            in->x[t * HIDDEN + h] = (float)(g_rank + 1) * 0.25f + (float)t - 0.125f * (float)h;
        int e0 = (g_rank * 7 + (int)t * 3) % num_experts;
        int e1 = (e0 + 1 + (int)t % (num_experts - 1)) % num_experts;
        in->ids[t * TOP_K] = e0;
        in->ids[t * TOP_K + 1] = e1;
        in->w[t * TOP_K] = 0.625f;
        in->w[t * TOP_K + 1] = 0.375f;
    }
}

/* The local experts on the dispatched rows: expert e computes (e + 1) * x. The layout says who
 * applies the top-k weights: the holder (REPLICATED, TOKEN_MAJOR, RANK_MAJOR: weighted sum over
 * the row's ids held here) or the source (EXPERT_MAJOR, EXPERT_PACKED: one expert per row). */
static void run_experts(const epcomm_dispatch_output *d, float *y) {
    int64_t rows = numel(&d->hidden) / HIDDEN;
    const float *x = d->hidden.data;
    for (int64_t r = 0; r < rows; r++) {
        float scale = 0;
        if (d->layout == EPCOMM_LAYOUT_EXPERT_MAJOR || d->layout == EPCOMM_LAYOUT_EXPERT_PACKED) {
            int64_t j = 0;
            if (d->layout == EPCOMM_LAYOUT_EXPERT_MAJOR) {
                j = r / d->hidden.shape[1];
            } else {
                const int64_t *off = d->expert_offsets.data;
                while (j + 1 < EXPERTS_PER_RANK && r >= off[j + 1]) j++;
            }
            scale = (float)(g_rank * EXPERTS_PER_RANK + j + 1);
        } else {
            const int64_t *ids = d->topk_ids.data;
            const float *w = d->topk_weights.data;
            for (int k = 0; k < TOP_K; k++) {
                int64_t e = ids[r * TOP_K + k];
                if (e >= 0 && e / EXPERTS_PER_RANK == g_rank) scale += w[r * TOP_K + k] * (float)(e + 1);
            }
        }
        for (int h = 0; h < HIDDEN; h++) y[r * HIDDEN + h] = scale * x[r * HIDDEN + h];
    }
}

/* Worst relative error of `out` against the float32 reference. */
static double check_combined(const Tokens *in, const float *out) {
    double worst = 0;
    for (int64_t t = 0; t < in->tokens; t++)
        for (int h = 0; h < HIDDEN; h++) {
            float want = 0;
            for (int k = 0; k < TOP_K; k++)
                want += in->w[t * TOP_K + k] * (float)(in->ids[t * TOP_K + k] + 1) *
                        in->x[t * HIDDEN + h];
            double err = fabs((double)out[t * HIDDEN + h] - want) / (fabs(want) + 1e-6);
            if (err > worst) worst = err;
        }
    return worst;
}

static int moe_step(epcomm_group *g, const char *backend) {
    int num_experts = EXPERTS_PER_RANK * g_world;
    epcomm_moe_config cfg;
    epcomm_moe_config_init(&cfg);
    cfg.num_experts = num_experts;
    cfg.top_k = TOP_K;
    cfg.hidden_size = HIDDEN;
    cfg.max_tokens_per_rank = MAX_TOKENS;
    cfg.hidden_dtype.code = cfg.expert_dtype.code = cfg.out_dtype.code = 2; /* float32 */
    cfg.hidden_dtype.bits = cfg.expert_dtype.bits = cfg.out_dtype.bits = 32;
    epcomm_all2all *a2a = NULL;
    int32_t st = epcomm_all2all_create(g, backend, &cfg, &a2a);
    if (st != EPCOMM_OK) return failed(backend, st);

    Tokens in;
    make_tokens(&in, num_experts);
    int64_t xs[2] = {in.tokens, HIDDEN}, ks[2] = {in.tokens, TOP_K};
    epcomm_tensor tx = tensor(in.x, 2, 32, 2, xs);
    epcomm_tensor ti = tensor(in.ids, 0, 32, 2, ks);
    epcomm_tensor tw = tensor(in.w, 2, 32, 2, ks);
    epcomm_dispatch_output d;
    st = epcomm_all2all_dispatch(a2a, &tx, &ti, &tw, NULL, 0, &d);
    if (st != EPCOMM_OK) {
        epcomm_all2all_destroy(a2a);
        return failed("dispatch", st);
    }
    float *y = calloc((size_t)numel(&d.hidden) + 1, sizeof(float));
    run_experts(&d, y);
    float out[MAX_TOKENS * HIDDEN];
    epcomm_tensor ty = tensor(y, 2, 32, d.hidden.ndim, d.hidden.shape);
    epcomm_tensor to = tensor(out, 2, 32, 2, xs);
    st = epcomm_all2all_combine(a2a, &ty, &to);
    free(y);
    const char *layout = epcomm_all2all_layout_name(d.layout);
    epcomm_all2all_destroy(a2a);
    if (st != EPCOMM_OK) return failed("combine", st);
    double err = check_combined(&in, out);
    printf("rank %d: %-28s %-13s %lld tokens, max relative error %.1e\n", g_rank, backend, layout,
           (long long)in.tokens, err);
    return err > 1e-5;
}

/* ---- EPLB -------------------------------------------------------------------------------- */

static float row_value(int64_t expert, int layer, int col) {
    return (float)(expert * 100 + layer * 10 + col);
}

/* Layer 0 moves every expert to the next rank; layer 1 swaps the two slots of each rank. */
static int64_t new_expert(int layer, int64_t slot, int64_t slots) {
    if (layer == 0) return (slot + slots - EXPERTS_PER_RANK) % slots;
    return slot ^ 1;
}

static int eplb_step(epcomm_group *g) {
    int64_t slots = (int64_t)EXPERTS_PER_RANK * g_world;
    int64_t *old_map = malloc(sizeof(int64_t) * (size_t)(LAYERS * slots));
    int64_t *new_map = malloc(sizeof(int64_t) * (size_t)(LAYERS * slots));
    float w[LAYERS][EXPERTS_PER_RANK * COLS];
    int64_t shape[2] = {EXPERTS_PER_RANK, COLS};
    epcomm_tensor weights[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        for (int64_t s = 0; s < slots; s++) {
            old_map[l * slots + s] = s;
            new_map[l * slots + s] = new_expert(l, s, slots);
        }
        for (int s = 0; s < EXPERTS_PER_RANK; s++)
            for (int c = 0; c < COLS; c++)
                w[l][s * COLS + c] = row_value(old_map[l * slots + g_rank * EXPERTS_PER_RANK + s], l, c);
        weights[l] = tensor(w[l], 2, 32, 2, shape);
    }
    epcomm_eplb_select_request req;
    memset(&req, 0, sizeof req);
    req.struct_size = (uint32_t)sizeof req;
    req.communicator = "torch_gloo"; /* host-staged: host memory over the group's transport */
    req.device_type = EPCOMM_DEVICE_CPU;
    epcomm_eplb_communicator *comm = NULL;
    int32_t st = epcomm_eplb_communicator_create(g, &req, &comm);
    epcomm_eplb_summary summary;
    if (st == EPCOMM_OK)
        st = epcomm_eplb_rearrange(comm, old_map, new_map, LAYERS, slots, slots, weights, 1, NULL,
                                   0, &summary);
    epcomm_eplb_communicator_destroy(comm);
    int bad = 0;
    if (st != EPCOMM_OK) {
        bad = failed("eplb", st);
    } else {
        for (int l = 0; l < LAYERS; l++)
            for (int s = 0; s < EXPERTS_PER_RANK; s++)
                for (int c = 0; c < COLS; c++) {
                    int64_t e = new_map[l * slots + g_rank * EXPERTS_PER_RANK + s];
                    bad += w[l][s * COLS + c] != row_value(e, l, c);
                }
        printf("rank %d: eplb rearrange: %lld layers changed, %lld rows sent, %lld received, %lld "
               "copied locally, %d wrong values\n",
               g_rank, (long long)summary.layers_changed, (long long)summary.rows_sent,
               (long long)summary.rows_received, (long long)summary.rows_copied_locally, bad);
    }
    free(old_map);
    free(new_map);
    return bad != 0;
}

/* ---- main -------------------------------------------------------------------------------- */

/* One name per buffer layout. */
static const char *const BACKENDS[] = {
    "allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
    "flashinfer_nvlink_two_sided",
};

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm comm = MPI_COMM_WORLD;
    MPI_Comm_rank(comm, &g_rank);
    MPI_Comm_size(comm, &g_world);

    /* EPCOMM_MPI_ALLTOALLV=0: no all_to_allv callback (send/recv carry the data). */
    const char *a2a = getenv("EPCOMM_MPI_ALLTOALLV");
    epcomm_host_callbacks cb = mpi_callbacks(&comm, !(a2a && strcmp(a2a, "0") == 0));
    epcomm_group *g = NULL;
    int failures = 0;
    int32_t st = epcomm_group_create_host(&cb, "mpi", g_rank, g_world, NULL, &g);
    if (st != EPCOMM_OK) {
        failures = failed("group", st);
    } else {
        if (argc > 1) {
            for (int i = 1; i < argc; i++) failures += moe_step(g, argv[i]);
        } else {
            for (size_t i = 0; i < sizeof BACKENDS / sizeof BACKENDS[0]; i++)
                failures += moe_step(g, BACKENDS[i]);
        }
        failures += eplb_step(g);
        epcomm_group_destroy(g);
    }
    fflush(stdout);
    int total = 0;
    MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, comm);
    if (g_rank == 0) printf("ep_mpi: %d ranks, %d failure(s)\n", g_world, total);
    MPI_Finalize();
    return total != 0;
}
