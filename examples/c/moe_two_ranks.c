/* Two ranks (forked processes) dispatch and combine a small MoE step through any all2all backend
 * name, over shared memory: 4 experts (0, 1 on rank 0; 2, 3 on rank 1), top-2 routing, hidden
 * size 1, expert e computing (e + 1) * x. Every backend gives rank 0 "combined 20 13.75 48" and
 * rank 1 "combined 70 42" (the worked example of docs/design.md, section 3).
 *
 *   cc moe_two_ranks.c $(pkg-config --cflags --libs epcomm) -o moe_two_ranks
 *   cc -static moe_two_ranks.c $(pkg-config --static --cflags --libs epcomm) -o moe_two_ranks
 *   ./moe_two_ranks deepep_high_throughput
 *
 * or with CMake: see CMakeLists.txt next to this file.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <epcomm.h>

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

static int fail(const char *what, int32_t st) {
    fprintf(stderr, "%s: %s: %s\n", what, epcomm_status_exception(st), epcomm_last_error_message());
    return 1;
}

static int run_rank(int rank, const char *backend, const char *group_name) {
    /* Rank 0 has tokens 10, 11, 12; rank 1 has 20, 21. Experts 0,1 live on rank 0, 2,3 on 1. */
    float x[2][3] = {{10, 11, 12}, {20, 21, 0}};
    int32_t ids[2][6] = {{0, 2, 1, 0, 3, -1}, {2, 3, 1, -1, 0, 0}};
    float w[2][6] = {{0.5f, 0.5f, 0.25f, 0.75f, 1.0f, 0.0f}, {0.5f, 0.5f, 1.0f, 0.0f, 0, 0}};
    int64_t t = rank == 0 ? 3 : 2;
    epcomm_group *g = NULL;
    int32_t st = epcomm_group_create_shm(group_name, rank, 2, NULL, &g);
    if (st != EPCOMM_OK) return fail("group", st);

    epcomm_moe_config cfg;
    epcomm_moe_config_init(&cfg);
    cfg.num_experts = 4;
    cfg.top_k = 2;
    cfg.hidden_size = 1;
    cfg.max_tokens_per_rank = 3;
    cfg.hidden_dtype.code = cfg.expert_dtype.code = cfg.out_dtype.code = 2; /* float32 */
    cfg.hidden_dtype.bits = cfg.expert_dtype.bits = cfg.out_dtype.bits = 32;
    epcomm_all2all *a2a = NULL;
    st = epcomm_all2all_create(g, backend, &cfg, &a2a);
    if (st != EPCOMM_OK) return fail("create", st);

    int64_t xs[2] = {t, 1}, ks[2] = {t, 2};
    epcomm_tensor tx = tensor(x[rank], 2, 32, 2, xs);
    epcomm_tensor ti = tensor(ids[rank], 0, 32, 2, ks);
    epcomm_tensor tw = tensor(w[rank], 2, 32, 2, ks);
    epcomm_dispatch_output d;
    st = epcomm_all2all_dispatch(a2a, &tx, &ti, &tw, NULL, 0, &d);
    if (st != EPCOMM_OK) return fail("dispatch", st);

    /* The experts: expert e computes (e+1)*x; the layout says who applies the weights. */
    int64_t rows = 1;
    for (int i = 0; i < d.hidden.ndim; i++) rows *= d.hidden.shape[i];
    float *y = calloc((size_t)rows, sizeof(float));
    const float *rx = d.hidden.data;
    for (int64_t r = 0; r < rows; r++) {
        if (d.layout == EPCOMM_LAYOUT_EXPERT_MAJOR || d.layout == EPCOMM_LAYOUT_EXPERT_PACKED) {
            int64_t j = d.layout == EPCOMM_LAYOUT_EXPERT_MAJOR
                            ? r / d.hidden.shape[1]
                            : (r < ((int64_t *)d.expert_offsets.data)[1] ? 0 : 1);
            y[r] = (float)(rank * 2 + j + 1) * rx[r];
        } else {
            const int64_t *ri = d.topk_ids.data;
            const float *rw = d.topk_weights.data;
            for (int k = 0; k < 2; k++)
                if (ri[r * 2 + k] >= 0 && ri[r * 2 + k] / 2 == rank)
                    y[r] += rw[r * 2 + k] * (float)(ri[r * 2 + k] + 1) * rx[r];
        }
    }
    float out[3] = {0, 0, 0};
    epcomm_tensor ty = tensor(y, 2, 32, d.hidden.ndim, d.hidden.shape);
    epcomm_tensor to = tensor(out, 2, 32, 2, xs);
    st = epcomm_all2all_combine(a2a, &ty, &to);
    free(y);
    if (st != EPCOMM_OK) return fail("combine", st);
    printf("rank %d (%s, %s): combined", rank, backend, epcomm_all2all_layout_name(d.layout));
    for (int64_t i = 0; i < t; i++) printf(" %g", out[i]);
    printf("\n");
    epcomm_all2all_destroy(a2a);
    epcomm_group_destroy(g);
    return 0;
}

int main(int argc, char **argv) {
    const char *backend = argc > 1 ? argv[1] : "deepep_high_throughput";
    char name[64];
    snprintf(name, sizeof name, "example-c-%d", (int)getpid());
    pid_t kids[2];
    for (int r = 0; r < 2; r++) {
        kids[r] = fork();
        if (kids[r] == 0) {
            int rc = run_rank(r, backend, name);
            fflush(stdout);
            _exit(rc);
        }
    }
    int ok = 1;
    for (int r = 0; r < 2; r++) {
        int status = 0;
        waitpid(kids[r], &status, 0);
        ok &= WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    return ok ? 0 : 1;
}
