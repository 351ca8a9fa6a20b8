/*
 * mpi_alltoallv.c: the transport-only Open MPI baseline for `epcomm bench moe` (docs/performance.md).
 *
 * Reproduces the traffic of one epcomm dispatch + combine with two MPI_Alltoallv calls on
 * pre-packed buffers, and nothing else: no routing exchange, no packing, no reduction, no
 * dtype conversion. For the same T, H, E, K, element size and routing rule:
 *   - experts are owned contiguously: rank r owns [r*E/R, (r+1)*E/R);
 *   - a token goes once to every rank that owns at least one of its K experts, itself included
 *     (epcomm copies its own rows too, so MPI_Alltoallv's self block is timed here as well);
 *   - dispatch: the packed rows go out (MPI_Alltoallv); combine: the same amounts come back
 *     (a second MPI_Alltoallv with the counts swapped), from a separate "expert output" buffer.
 * The send buffer is packed once, before timing. Rows are moved as a contiguous datatype of
 * row_bytes bytes, so counts are in rows (no 2 GiB int overflow for large shapes).
 *
 * Timing mirrors `epcomm bench moe`: per iteration, barrier, time dispatch; barrier, time
 * combine; each phase's time is the slowest rank's (MPI_Reduce MAX), pair = dispatch + combine.
 * Warm-up iterations are not recorded. Then a memcpy of the bytes each rank receives in dispatch,
 * timed the same way (barrier, slowest rank). Reports median and p99.
 *
 * Build: mpicc -O2 -std=c11 -o mpi_alltoallv benches/mpi_alltoallv.c
 * Run:   mpirun -np 2 --bind-to core --map-by core ./mpi_alltoallv --tokens 128,4096 --json
 * --samples prints the per-iteration slowest-rank times (ms, in order) as JSON on stderr.
 */
#define _GNU_SOURCE
#include <mpi.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    size_t tokens[16];
    int ntokens;
    size_t hidden, experts, topk, dtype_bytes;
    int iters, warmup, json;
    const char *routing;
    int check, samples;
} params;

static int rank_, world_;

static void die(const char *fmt, const char *arg) {
    if (rank_ == 0) {
        fprintf(stderr, "mpi_alltoallv: error: ");
        fprintf(stderr, fmt, arg);
        fprintf(stderr,
                "\nusage: mpi_alltoallv [--tokens T[,T..]] [--hidden H] [--experts E] [--topk K] "
                "[--dtype-bytes B] [--routing uniform|skewed|top2] [--iters N] [--warmup N] "
                "[--no-check] [--samples] [--json]\n");
    }
    MPI_Abort(MPI_COMM_WORLD, 2);
    exit(2);
}

static size_t parse_num(const char *flag, const char *s) {
    char *end;
    if (!s || !*s) die("%s needs a value", flag);
    unsigned long long v = strtoull(s, &end, 10);
    if (*end != '\0' && *end != ',') die("'%s' is not a non-negative integer", s);
    return (size_t)v;
}

static void parse(int argc, char **argv, params *p) {
    p->ntokens = 2;
    p->tokens[0] = 128;
    p->tokens[1] = 4096;
    p->hidden = 7168;
    p->experts = 256;
    p->topk = 8;
    p->dtype_bytes = 2;
    p->iters = 50;
    p->warmup = 5;
    p->json = 0;
    p->routing = "uniform";
    p->check = 1;
    p->samples = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--json")) { p->json = 1; continue; }
        if (!strcmp(a, "--no-check")) { p->check = 0; continue; }
        if (!strcmp(a, "--samples")) { p->samples = 1; continue; }
        if (i + 1 >= argc) die("%s needs a value", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--tokens")) {
            p->ntokens = 0;
            for (const char *s = v; s && *s;) {
                if (p->ntokens == 16) die("%s: at most 16 values", a);
                p->tokens[p->ntokens++] = parse_num(a, s);
                s = strchr(s, ',');
                if (s) s++;
            }
        } else if (!strcmp(a, "--hidden")) p->hidden = parse_num(a, v);
        else if (!strcmp(a, "--experts")) p->experts = parse_num(a, v);
        else if (!strcmp(a, "--topk")) p->topk = parse_num(a, v);
        else if (!strcmp(a, "--dtype-bytes")) p->dtype_bytes = parse_num(a, v);
        else if (!strcmp(a, "--iters")) p->iters = (int)parse_num(a, v);
        else if (!strcmp(a, "--warmup")) p->warmup = (int)parse_num(a, v);
        else if (!strcmp(a, "--routing")) {
            if (strcmp(v, "uniform") && strcmp(v, "skewed") && strcmp(v, "top2"))
                die("--routing %s: expected uniform, skewed or top2", v);
            p->routing = v;
        } else die("unknown option '%s'", a);
    }
    if (p->iters <= 0) die("%s", "need --iters > 0");
    if (p->experts == 0 || p->experts % (size_t)world_ != 0)
        die("%s", "--experts must be a positive multiple of the number of ranks");
    if (p->topk == 0 || p->topk > p->experts) die("%s", "need 0 < --topk <= --experts");
    if (p->hidden == 0 || p->dtype_bytes == 0) die("%s", "need --hidden > 0 and --dtype-bytes > 0");
    if (p->hidden * p->dtype_bytes > (size_t)INT32_MAX) die("%s", "row too large");
}

/* splitmix64 */
static uint64_t next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static double unit01(uint64_t *s) { return (double)(next(s) >> 11) * 0x1.0p-53; }

/* The K experts of one token, same rules as `epcomm bench moe` (distribution, not values):
 * uniform: K distinct experts uniformly; skewed: u^3 * E (Zipf-like), distinct; top2: two
 * distinct experts on rank (rank + 1 + tok) % R, the rest masked (-1). */
static void route(const params *p, uint64_t *s, size_t tok, long *row) {
    size_t n = 0, el = p->experts / (size_t)world_;
    while (n < p->topk) {
        double u = unit01(s);
        long e;
        if (!strcmp(p->routing, "top2")) {
            if (n >= 2 || (el < 2 && n >= 1)) { row[n++] = -1; continue; }
            size_t dst = ((size_t)rank_ + 1 + tok) % (size_t)world_;
            size_t off = (size_t)(u * (double)el);
            if (off >= el) off = el - 1;
            e = (long)(dst * el + off);
        } else if (!strcmp(p->routing, "skewed")) {
            e = (long)(u * u * u * (double)p->experts);
        } else {
            e = (long)(u * (double)p->experts);
        }
        if (e >= (long)p->experts) e = (long)p->experts - 1;
        int dup = 0;
        for (size_t j = 0; j < n; j++) dup |= row[j] == e;
        if (!dup) row[n++] = e;
    }
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* median and p99 with the same index rule as epcomm (v sorted in place) */
static void stats(double *v, int n, double *med, double *p99) {
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    *med = v[n / 2];
    int i = (int)((double)n * 0.99 + 0.999999999);
    if (i < 1) i = 1;
    if (i > n) i = n;
    *p99 = v[i - 1];
}

static void *xmalloc(size_t n, const char *what) {
    void *b = malloc(n ? n : 1);
    if (!b) {
        char msg[128];
        snprintf(msg, sizeof msg, "%zu bytes", n);
        fprintf(stderr, "mpi_alltoallv: rank %d: out of memory allocating %s (%s)\n", rank_, what,
                msg);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return b;
}

static double max_over_ranks(double x) {
    double m = 0;
    MPI_Reduce(&x, &m, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    return m;
}

static void run(const params *p, size_t t, int first) {
    const int R = world_;
    const size_t row = p->hidden * p->dtype_bytes, el = p->experts / (size_t)R, k = p->topk;

    /* Routing, then each token's destination ranks (rank-deduplicated). */
    uint64_t seed = 0x6570636f6d6dULL ^ ((uint64_t)rank_ << 40) ^ (uint64_t)t;
    long *ids = xmalloc(t * k * sizeof(long), "routing");
    unsigned char *to = xmalloc(t * (size_t)R, "destinations");
    memset(to, 0, t * (size_t)R);
    int *scount = xmalloc((size_t)R * sizeof(int), "counts");
    int *rcount = xmalloc((size_t)R * sizeof(int), "counts");
    int *sdispl = xmalloc((size_t)R * sizeof(int), "displs");
    int *rdispl = xmalloc((size_t)R * sizeof(int), "displs");
    memset(scount, 0, (size_t)R * sizeof(int));
    unsigned long long per_expert_rows = 0;
    for (size_t tok = 0; tok < t; tok++) {
        route(p, &seed, tok, ids + tok * k);
        for (size_t j = 0; j < k; j++) {
            long e = ids[tok * k + j];
            if (e < 0) continue;
            per_expert_rows++;
            size_t d = (size_t)e / el;
            if (!to[tok * R + d]) {
                to[tok * R + d] = 1;
                scount[d]++;
            }
        }
    }
    MPI_Alltoall(scount, 1, MPI_INT, rcount, 1, MPI_INT, MPI_COMM_WORLD);
    size_t srows = 0, rrows = 0;
    for (int d = 0; d < R; d++) {
        sdispl[d] = (int)srows;
        rdispl[d] = (int)rrows;
        srows += (size_t)scount[d];
        rrows += (size_t)rcount[d];
    }

    /* Hidden states, packed by destination (untimed): row = [src rank, token, pattern...]. */
    unsigned char *x = xmalloc(t * row, "hidden");
    for (size_t i = 0; i < t * row; i++) x[i] = (unsigned char)((i % 251) & 0x3f);
    unsigned char *sendbuf = xmalloc(srows * row, "send buffer");
    {
        size_t *fill = xmalloc((size_t)R * sizeof(size_t), "fill");
        for (int d = 0; d < R; d++) fill[d] = (size_t)sdispl[d];
        for (size_t tok = 0; tok < t; tok++)
            for (int d = 0; d < R; d++)
                if (to[tok * R + d]) {
                    unsigned char *dst = sendbuf + fill[d]++ * row;
                    memcpy(dst, x + tok * row, row);
                    if (row >= 16) {
                        uint64_t tag[2] = {(uint64_t)rank_, (uint64_t)tok};
                        memcpy(dst, tag, 16);
                    }
                }
        free(fill);
    }
    unsigned char *recvbuf = xmalloc(rrows * row, "dispatch receive buffer");
    unsigned char *expert_out = xmalloc(rrows * row, "expert output");
    unsigned char *backbuf = xmalloc(srows * row, "combine receive buffer");
    /* First touch outside the timed region (epcomm's warm-up does the same for its buffers). */
    memset(recvbuf, 0, rrows * row);
    memset(expert_out, 1, rrows * row);
    memset(backbuf, 0, srows * row);

    MPI_Datatype rowtype;
    MPI_Type_contiguous((int)row, MPI_BYTE, &rowtype);
    MPI_Type_commit(&rowtype);

    int n = p->iters;
    double *dv = xmalloc((size_t)n * sizeof(double), "samples");
    double *cv = xmalloc((size_t)n * sizeof(double), "samples");
    double *mv = xmalloc((size_t)n * sizeof(double), "samples");
    for (int it = 0; it < p->warmup + n; it++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        MPI_Alltoallv(sendbuf, scount, sdispl, rowtype, recvbuf, rcount, rdispl, rowtype,
                      MPI_COMM_WORLD);
        double t1 = MPI_Wtime();
        MPI_Barrier(MPI_COMM_WORLD);
        double t2 = MPI_Wtime();
        MPI_Alltoallv(expert_out, rcount, rdispl, rowtype, backbuf, scount, sdispl, rowtype,
                      MPI_COMM_WORLD);
        double t3 = MPI_Wtime();
        double d = max_over_ranks(t1 - t0), c = max_over_ranks(t3 - t2);
        if (it >= p->warmup) {
            dv[it - p->warmup] = d;
            cv[it - p->warmup] = c;
        }
    }

    /* Check once (untimed) that every received row carries a tag of its source rank. */
    long bad = 0;
    if (p->check && row >= 16)
        for (int s = 0; s < R; s++)
            for (int i = 0; i < rcount[s]; i++) {
                uint64_t tag[2];
                memcpy(tag, recvbuf + ((size_t)rdispl[s] + (size_t)i) * row, 16);
                if (tag[0] != (uint64_t)s || tag[1] >= t) bad++;
            }
    long bad_all = 0;
    MPI_Reduce(&bad, &bad_all, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);

    /* memcpy of the bytes this rank received in dispatch, timed the same way. */
    size_t mbytes = rrows * row;
    unsigned char *msrc = xmalloc(mbytes, "memcpy source"), *mdst = xmalloc(mbytes, "memcpy dest");
    memset(msrc, 1, mbytes);
    memset(mdst, 0, mbytes);
    for (int it = 0; it < p->warmup + n; it++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        memcpy(mdst, msrc, mbytes);
        __asm__ volatile("" : : "r"(mdst) : "memory");
        double m = max_over_ranks(MPI_Wtime() - t0);
        if (it >= p->warmup) mv[it - p->warmup] = m;
    }

    /* Bytes per rank, averaged over ranks (as epcomm reports them). */
    double mine[3] = {(double)srows * (double)row, (double)per_expert_rows * (double)row,
                      (double)mbytes};
    double tot[3] = {0, 0, 0};
    MPI_Reduce(mine, tot, 3, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);

    /* Where each rank runs (to show the binding). */
    cpu_set_t set;
    int mycpu[2] = {-1, 0};
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        mycpu[1] = CPU_COUNT(&set);
        for (int c = 0; c < CPU_SETSIZE; c++)
            if (CPU_ISSET(c, &set)) { mycpu[0] = c; break; }
    }
    int *cpus = rank_ == 0 ? xmalloc(2 * (size_t)R * sizeof(int), "cpus") : NULL;
    MPI_Gather(mycpu, 2, MPI_INT, cpus, 2, MPI_INT, 0, MPI_COMM_WORLD);

    if (rank_ == 0) {
        double *pv = xmalloc((size_t)n * sizeof(double), "samples");
        for (int i = 0; i < n; i++) pv[i] = dv[i] + cv[i];
        if (p->samples) {
            /* Per-iteration slowest-rank times in ms, in order, before the statistics sort. */
            const double *ser[3] = {dv, cv, mv};
            const char *nm[3] = {"dispatch", "combine", "memcpy"};
            fprintf(stderr, "{\"tokens\":%zu", t);
            for (int s = 0; s < 3; s++) {
                fprintf(stderr, ",\"%s_samples_ms\":[", nm[s]);
                for (int i = 0; i < n; i++) fprintf(stderr, "%s%.3f", i ? "," : "", ser[s][i] * 1e3);
                fprintf(stderr, "]");
            }
            fprintf(stderr, "}\n");
        }
        double dm, dp, cm, cp, pm, pp, mm, mp;
        stats(dv, n, &dm, &dp);
        stats(cv, n, &cm, &cp);
        stats(pv, n, &pm, &pp);
        stats(mv, n, &mm, &mp);
        double dedup = tot[0] / R, perexp = tot[1] / R, memb = tot[2] / R;
        double gb_dedup = 2 * dedup / pm / 1e9, gb_perexp = 2 * perexp / pm / 1e9;
        double gb_mem = memb / mm / 1e9;
        int bound = 1;
        for (int r = 0; r < R; r++) bound &= cpus[2 * r + 1] == 1;
        if (bad_all)
            fprintf(stderr, "mpi_alltoallv: WARNING: %ld received rows carry a wrong tag\n",
                    bad_all);
        if (p->json) {
            printf("{\"impl\":\"mpi_alltoallv\",\"ranks\":%d,\"tokens\":%zu,\"hidden\":%zu,"
                   "\"experts\":%zu,\"topk\":%zu,\"dtype_bytes\":%zu,\"routing\":\"%s\","
                   "\"iters\":%d,\"warmup\":%d,\"bound_one_cpu_per_rank\":%s,\"first_cpu\":[",
                   R, t, p->hidden, p->experts, p->topk, p->dtype_bytes, p->routing, n,
                   p->warmup, bound ? "true" : "false");
            for (int r = 0; r < R; r++) printf("%s%d", r ? "," : "", cpus[2 * r]);
            printf("],\"dispatch_ms\":%.4f,\"dispatch_p99_ms\":%.4f,\"combine_ms\":%.4f,"
                   "\"combine_p99_ms\":%.4f,\"pair_ms\":%.4f,\"pair_p99_ms\":%.4f,"
                   "\"bytes_dedup\":%.0f,\"bytes_per_expert\":%.0f,\"gbps_dedup\":%.4f,"
                   "\"gbps_per_expert\":%.4f,\"memcpy_bytes\":%.0f,\"memcpy_ms\":%.4f,"
                   "\"memcpy_p99_ms\":%.4f,\"memcpy_gbps\":%.4f,\"bad_rows\":%ld}\n",
                   dm * 1e3, dp * 1e3, cm * 1e3, cp * 1e3, pm * 1e3, pp * 1e3, dedup, perexp,
                   gb_dedup, gb_perexp, memb, mm * 1e3, mp * 1e3, gb_mem, bad_all);
        } else {
            if (first) {
                printf("mpi_alltoallv (transport only): %d ranks%s, hidden %zu x %zu B, %zu "
                       "experts, top-%zu, %s routing, %d iterations (median / p99 of the "
                       "slowest rank)\n",
                       R, bound ? " bound one per core" : " NOT bound one per core", p->hidden,
                       p->dtype_bytes, p->experts, p->topk, p->routing, n);
                printf("%6s %11s %11s %11s %11s %10s %10s %10s %9s %11s\n", "T", "dispatch ms",
                       "combine ms", "pair ms", "pair p99", "MB/rank", "GB/s dedup",
                       "GB/s copy", "memcpy ms", "memcpy GB/s");
            }
            printf("%6zu %11.2f %11.2f %11.2f %11.2f %10.1f %10.2f %10.2f %9.2f %11.2f\n", t,
                   dm * 1e3, cm * 1e3, pm * 1e3, pp * 1e3, dedup / 1e6, gb_dedup, gb_perexp,
                   mm * 1e3, gb_mem);
        }
        fflush(stdout);
        free(pv);
        free(cpus);
    }
    MPI_Type_free(&rowtype);
    free(ids); free(to); free(scount); free(rcount); free(sdispl); free(rdispl);
    free(x); free(sendbuf); free(recvbuf); free(expert_out); free(backbuf);
    free(dv); free(cv); free(mv); free(msrc); free(mdst);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_);
    params p;
    parse(argc, argv, &p);
    for (int i = 0; i < p.ntokens; i++) run(&p, p.tokens[i], i == 0);
    MPI_Finalize();
    return 0;
}
