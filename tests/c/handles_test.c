/*
 * Handle lifetimes across threads and fork (issue 27 items 5 and 10): two forked ranks form a
 * shared-memory group. On rank 0, a second thread runs a barrier (then a dispatch) that waits
 * for rank 1, which is held back through a pipe until rank 0 has tried to destroy the handles
 * under the call: every destroy (checked and void, of the group and of the manager) is refused
 * with EPCOMM_ERROR_INVALID_STATE and frees nothing, the call completes normally, many
 * iterations, and ASan sees no use of freed memory. Then a forked child of rank 0 is refused
 * every call on its parent's group and manager (destroy included) naming the fork, and the
 * parent's and the peer's next barrier and dispatch work. Then calls on destroyed handles and
 * a second destroy are refused, and a manager keeps a destroyed group alive until it goes.
 */
#include "test_ranks.h" /* first: it selects POSIX for the system headers */

#include <pthread.h>
#include <stdint.h>

#include "epcomm.h"

typedef struct epcomm_tensor tensor_t;
typedef struct epcomm_group group_t;
typedef struct epcomm_group_options options_t;
typedef struct epcomm_all2all a2a_t;
typedef struct epcomm_moe_config moe_config_t;
typedef struct epcomm_dispatch_output dispatch_t;
typedef struct epcomm_all2all_stats stats_t;

#define WORLD 2
#define ITERS 40
#define TOKENS 2
#define HIDDEN 4
/* Bound on waiting for the other thread's call to be in flight. */
#define BUSY_WAIT_S 10.0

/* Rank 0 releases rank 1 into each collective by writing one byte (made before the fork). */
static int g_go[2] = {-1, -1};

/* The handles, global so a forked child still reaches them when it exits. */
static group_t *g_group = NULL;
static a2a_t *g_a2a = NULL;
static char g_name[256];

/* ---- rank 1's gate ------------------------------------------------------------------------- */

static void release_peer(void) {
    char b = 1;
    if (write(g_go[1], &b, 1) != 1) {
        test_fail_at(__FILE__, __LINE__);
        printf("cannot release rank 1: %s\n", strerror(errno));
    }
}

static void wait_released(void) {
    char b;
    ssize_t r;
    do {
        r = read(g_go[0], &b, 1);
    } while (r < 0 && errno == EINTR);
    if (r != 1) {
        test_fail_at(__FILE__, __LINE__);
        printf("rank 1 was not released (read returned %d)\n", (int)r);
    }
}

/* ---- one dispatch ---------------------------------------------------------------------------- */

struct input {
    float x[TOKENS * HIDDEN];
    int32_t ids[TOKENS];
    float w[TOKENS];
    int64_t x_shape[2], id_shape[2];
    tensor_t tx, tids, tw;
};

static void make_input(struct input *in, int rank) {
    int i;
    for (i = 0; i < TOKENS * HIDDEN; i++) {
        in->x[i] = (float)(rank * 100 + i);
    }
    for (i = 0; i < TOKENS; i++) {
        in->ids[i] = (int32_t)((rank + i) % 4);
        in->w[i] = 1.0f;
    }
    in->x_shape[0] = TOKENS;
    in->x_shape[1] = HIDDEN;
    in->id_shape[0] = TOKENS;
    in->id_shape[1] = 1;
    in->tx = test_cpu_tensor(in->x, DL_FLOAT, 32, 2, in->x_shape, NULL);
    in->tids = test_cpu_tensor(in->ids, DL_INT, 32, 2, in->id_shape, NULL);
    in->tw = test_cpu_tensor(in->w, DL_FLOAT, 32, 2, in->id_shape, NULL);
}

static int32_t dispatch(a2a_t *a, struct input *in, dispatch_t *o) {
    memset(o, 0, sizeof *o);
    return epcomm_all2all_dispatch(a, &in->tx, &in->tids, &in->tw, NULL, 0, o);
}

/* Combines zeros of the dispatch output's shape (REPLICATED: [rows, HIDDEN]). */
static int32_t combine(a2a_t *a, const dispatch_t *o) {
    static float y[WORLD * TOKENS * HIDDEN];
    float out[TOKENS * HIDDEN];
    int64_t y_shape[2], out_shape[2] = {TOKENS, HIDDEN};
    tensor_t ty, to;
    if (o->hidden.ndim != 2 || o->hidden.shape[0] > WORLD * TOKENS) {
        test_fail_at(__FILE__, __LINE__);
        printf("unexpected dispatch output (ndim %d)\n", (int)o->hidden.ndim);
        return -1;
    }
    y_shape[0] = o->hidden.shape[0];
    y_shape[1] = HIDDEN;
    ty = test_cpu_tensor(y, DL_FLOAT, 32, 2, y_shape, NULL);
    to = test_cpu_tensor(out, DL_FLOAT, 32, 2, out_shape, NULL);
    return epcomm_all2all_combine(a, &ty, &to);
}

static a2a_t *create_manager(group_t *g) {
    moe_config_t c;
    a2a_t *a = NULL;
    if (!CHECK_ST(epcomm_moe_config_init(&c), EPCOMM_OK)) {
        return NULL;
    }
    c.num_experts = 4;
    c.top_k = 1;
    c.hidden_size = HIDDEN;
    c.hidden_dtype.code = DL_FLOAT;
    c.hidden_dtype.bits = 32;
    c.hidden_dtype.lanes = 1;
    c.expert_dtype = c.hidden_dtype;
    c.out_dtype = c.hidden_dtype;
    c.max_tokens_per_rank = TOKENS;
    CHECK_ST(epcomm_all2all_create(g, "allgather_reducescatter", &c, &a), EPCOMM_OK);
    return a;
}

/* Both ranks: one dispatch and combine, both OK. */
static void dispatch_combine(a2a_t *a, int rank) {
    struct input in;
    dispatch_t o;
    make_input(&in, rank);
    if (CHECK_ST(dispatch(a, &in, &o), EPCOMM_OK)) {
        CHECK_ST(combine(a, &o), EPCOMM_OK);
    }
}

/* ---- the call in flight on another thread ---------------------------------------------------- */

struct call {
    int is_dispatch;
    int rank;
    struct input in;
    dispatch_t o;
    int32_t st;
};

/* Whether the last call was refused because another thread held the handle for an instant. */
static int refused_as_in_use(int32_t st) {
    const char *msg = epcomm_last_error_message();
    return st == EPCOMM_ERROR_INVALID_STATE && msg != NULL &&
           strstr(msg, "in use by another thread") != NULL;
}

static void *run_call(void *arg) {
    struct call *c = (struct call *)arg;
    /* The probing thread may hold the handle as this call starts: retry until this call is
     * the one inside. */
    do {
        if (c->is_dispatch) {
            make_input(&c->in, c->rank);
            c->st = dispatch(g_a2a, &c->in, &c->o);
        } else {
            c->st = epcomm_group_barrier(g_group);
        }
    } while (c->rank == 0 && refused_as_in_use(c->st));
    return NULL;
}

/* Waits until a call on the group (and on the manager, with `a2a`) from the other thread holds
 * them: a probe on each is refused as busy. */
static int wait_in_flight(int a2a) {
    double until = test_now_s() + BUSY_WAIT_S;
    while (test_now_s() < until) {
        int32_t n = 0;
        stats_t s;
        int group_busy = epcomm_group_size(g_group, &n) == EPCOMM_ERROR_INVALID_STATE;
        int a2a_busy = !a2a || epcomm_all2all_get_stats(g_a2a, &s) == EPCOMM_ERROR_INVALID_STATE;
        if (group_busy && a2a_busy) {
            return 1;
        }
        test_sleep_ms(1);
    }
    test_fail_at(__FILE__, __LINE__);
    printf("the other thread's call was never seen in flight\n");
    return 0;
}

/* A destroy refused because a call is in flight: the checked form's status and message, then
 * the void form's recorded message. */
static void check_destroy_refused(int a2a, const char *busy) {
    if (a2a) {
        CHECK_ST(epcomm_all2all_destroy_checked(g_a2a), EPCOMM_ERROR_INVALID_STATE);
        CHECK_MSG_EQ(busy);
        epcomm_clear_last_error();
        epcomm_all2all_destroy(g_a2a);
        CHECK_MSG_EQ(busy);
    } else {
        CHECK_ST(epcomm_group_destroy_checked(g_group), EPCOMM_ERROR_INVALID_STATE);
        CHECK_MSG_EQ(busy);
        epcomm_clear_last_error();
        epcomm_group_destroy(g_group);
        CHECK_MSG_EQ(busy);
    }
}

/* Rank 0 destroys under a call of its other thread; rank 1 joins the call once released. */
static void destroy_during_calls(int rank, int is_dispatch) {
    char group_busy[512];
    const char *a2a_busy =
        "cannot destroy the epcomm_all2all handle: a call using it is in flight on another "
        "thread; nothing was freed: destroy it after that call returns";
    int i;
    snprintf(group_busy, sizeof group_busy,
             "cannot destroy group '%s': a call using it is in flight on another thread; "
             "nothing was freed: destroy it after that call returns",
             g_name);
    for (i = 0; i < ITERS; i++) {
        struct call c;
        memset(&c, 0, sizeof c);
        c.is_dispatch = is_dispatch;
        c.rank = rank;
        if (rank == 1) {
            wait_released();
            run_call(&c);
        } else {
            pthread_t t;
            if (pthread_create(&t, NULL, run_call, &c) != 0) {
                test_fail_at(__FILE__, __LINE__);
                printf("pthread_create failed\n");
                release_peer();
                return;
            }
            if (wait_in_flight(is_dispatch)) {
                if (is_dispatch) {
                    check_destroy_refused(1, a2a_busy);
                }
                /* The manager's dispatch uses the group: its destroy is refused too. */
                check_destroy_refused(0, group_busy);
            }
            release_peer();
            pthread_join(t, NULL);
        }
        /* The call completed normally and the handles still work. */
        if (CHECK_ST(c.st, EPCOMM_OK) && is_dispatch) {
            CHECK_ST(combine(g_a2a, &c.o), EPCOMM_OK);
        }
    }
    CHECK_ST(epcomm_group_barrier(g_group), EPCOMM_OK);
}

/* ---- fork ------------------------------------------------------------------------------------ */

/* In the child: every call on the parent's handles is refused naming the fork. */
static void child_calls(pid_t parent) {
    char group_msg[512], a2a_msg[512];
    struct input in;
    dispatch_t o;
    int32_t n = 0;
    pid_t me = getpid();
    snprintf(group_msg, sizeof group_msg,
             "group '%s' was created by pid %d; this process (pid %d) is a fork of it and "
             "cannot use it: create a new one in the child",
             g_name, (int)parent, (int)me);
    snprintf(a2a_msg, sizeof a2a_msg,
             "the epcomm_all2all handle was created by pid %d; this process (pid %d) is a fork "
             "of it and cannot use it: create a new one in the child",
             (int)parent, (int)me);
    CHECK_ST(epcomm_group_barrier(g_group), EPCOMM_ERROR_INVALID_STATE);
    CHECK_MSG_EQ(group_msg);
    CHECK_ST(epcomm_group_size(g_group, &n), EPCOMM_ERROR_INVALID_STATE);
    CHECK_MSG_EQ(group_msg);
    make_input(&in, 0);
    CHECK_ST(dispatch(g_a2a, &in, &o), EPCOMM_ERROR_INVALID_STATE);
    CHECK_MSG_EQ(a2a_msg);
    CHECK_ST(epcomm_all2all_destroy_checked(g_a2a), EPCOMM_ERROR_INVALID_STATE);
    CHECK_MSG_EQ(a2a_msg);
    CHECK_ST(epcomm_group_destroy_checked(g_group), EPCOMM_ERROR_INVALID_STATE);
    CHECK_MSG_EQ(group_msg);
    epcomm_clear_last_error();
    epcomm_group_destroy(g_group);
    CHECK_MSG_EQ(group_msg);
}

/* Rank 0 forks a child that tries its handles; then both ranks' next ops work. */
static void fork_child_refused(int rank) {
    if (rank == 0) {
        pid_t parent = getpid(), child;
        fflush(stdout);
        child = fork();
        if (child == 0) {
            g_passed = 0;
            g_failed = 0;
            child_calls(parent);
            fflush(stdout);
            /* A normal exit: whatever runs at exit must not touch the parent's group. */
            exit(g_failed == 0 ? 0 : 1);
        }
        CHECK(child > 0);
        if (child > 0) {
            double until = test_now_s() + 20.0;
            int status = 0;
            pid_t w = 0;
            while ((w = waitpid(child, &status, WNOHANG)) == 0 && test_now_s() < until) {
                test_sleep_ms(5);
            }
            if (w == 0) {
                kill(child, SIGKILL);
                waitpid(child, &status, 0);
            }
            CHECK(w == child && WIFEXITED(status) && WEXITSTATUS(status) == 0);
        }
    }
    /* The parent's and the peer's group and manager are untouched. */
    CHECK_ST(epcomm_group_barrier(g_group), EPCOMM_OK);
    dispatch_combine(g_a2a, rank);
    CHECK_ST(epcomm_group_barrier(g_group), EPCOMM_OK);
}

/* ---- after destroy --------------------------------------------------------------------------- */

/* A destroyed manager: calls and a second destroy are refused, nothing freed twice. */
static void calls_after_destroy(int rank) {
    char msg[512];
    struct input in;
    dispatch_t o;
    a2a_t *stale = g_a2a;
    CHECK_ST(epcomm_all2all_destroy_checked(g_a2a), EPCOMM_OK);
    g_a2a = NULL;
    snprintf(msg, sizeof msg,
             "a2a (%p) is not a live epcomm_all2all handle: it was destroyed already, or was not "
             "made by epcomm",
             (void *)stale);
    make_input(&in, rank);
    CHECK_ST(dispatch(stale, &in, &o), EPCOMM_ERROR_INVALID_STATE);
    CHECK_MSG_EQ(msg);
    CHECK_ST(epcomm_all2all_destroy_checked(stale), EPCOMM_ERROR_INVALID_STATE);
    CHECK_MSG_EQ(msg);
    /* A group pointer is not a manager. */
    CHECK_ST(dispatch((a2a_t *)(void *)g_group, &in, &o), EPCOMM_ERROR_INVALID_STATE);
    CHECK_MSG_HAS("is not a live epcomm_all2all handle");
    CHECK_ST(epcomm_all2all_destroy_checked(NULL), EPCOMM_ERROR_NULL_POINTER);
    epcomm_all2all_destroy(NULL);
}

/* A manager keeps a destroyed group alive: the group's handle is gone, the manager still runs
 * over the group, and its destroy frees the group (nothing is left in /dev/shm). */
static void manager_keeps_group(int rank) {
    char msg[512];
    group_t *stale = g_group;
    a2a_t *a = create_manager(g_group);
    int32_t n = 0;
    if (a == NULL) {
        return;
    }
    CHECK_ST(epcomm_group_destroy_checked(g_group), EPCOMM_OK);
    g_group = NULL;
    snprintf(msg, sizeof msg,
             "group (%p) is not a live epcomm_group handle: it was destroyed already, or was not "
             "made by epcomm",
             (void *)stale);
    CHECK_ST(epcomm_group_barrier(stale), EPCOMM_ERROR_INVALID_STATE);
    CHECK_MSG_EQ(msg);
    CHECK_ST(epcomm_group_size(stale, &n), EPCOMM_ERROR_INVALID_STATE);
    CHECK_MSG_EQ(msg);
    CHECK_ST(epcomm_group_destroy_checked(stale), EPCOMM_ERROR_INVALID_STATE);
    CHECK_MSG_EQ(msg);
    dispatch_combine(a, rank);
    CHECK_ST(epcomm_all2all_destroy_checked(a), EPCOMM_OK);
}

/* ---- one rank -------------------------------------------------------------------------------- */

static int rank_main(const char *name, int rank) {
    options_t opts;
    if (rank == 0) {
        close(g_go[0]);
    } else {
        close(g_go[1]);
    }
    snprintf(g_name, sizeof g_name, "%s", name);
    if (!CHECK_ST(epcomm_group_options_init(&opts), EPCOMM_OK)) {
        return 1;
    }
    opts.timeout_s = 20.0;
    if (!CHECK_ST(epcomm_group_create_shm(name, rank, WORLD, &opts, &g_group), EPCOMM_OK)) {
        return 1;
    }
    g_a2a = create_manager(g_group);
    if (g_a2a == NULL) {
        epcomm_group_destroy(g_group);
        return 1;
    }
    destroy_during_calls(rank, 0);
    destroy_during_calls(rank, 1);
    fork_child_refused(rank);
    calls_after_destroy(rank);
    manager_keeps_group(rank);
    return g_failed == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    if (pipe(g_go) != 0) {
        printf("FAIL pipe: %s\n", strerror(errno));
        return 1;
    }
    return test_ranks_main(argc, argv, "handles_test", WORLD, rank_main,
                           TEST_RANKS_COUNT_CHECKS);
}
