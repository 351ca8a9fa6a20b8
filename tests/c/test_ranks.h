/*
 * Shared plumbing of the C test programs in tests/c: the check counters and CHECK macros, and,
 * for the programs whose ranks are forked processes of one shared-memory group, the parent
 * side: fork the ranks, wait for them with a deadline (killing the stragglers), count the
 * results, check that the group left nothing in /dev/shm, and print "N passed, M failed".
 *
 * Include it first (it selects POSIX before any system header is read). Everything here is
 * static or static inline, so it compiles as C11 and as C++17 (-x c++) with -Wall -Wextra
 * -Werror in a program that uses only part of it.
 */
#ifndef EPCOMM_TEST_RANKS_H
#define EPCOMM_TEST_RANKS_H

#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "epcomm.h"

/* ---- tensors ---------------------------------------------------------------------------------- */

/* DLPack dtype codes used by the tests. */
#define DL_INT 0
#define DL_UINT 1
#define DL_FLOAT 2
#define DL_BFLOAT 4

/* A CPU tensor over `data` (strides NULL = contiguous). */
static inline struct epcomm_tensor test_cpu_tensor(void *data, uint8_t code, uint8_t bits,
                                                   int32_t ndim, int64_t *shape,
                                                   int64_t *strides) {
    struct epcomm_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.device.device_type = EPCOMM_DEVICE_CPU;
    t.device.device_id = 0;
    t.ndim = ndim;
    t.dtype.code = code;
    t.dtype.bits = bits;
    t.dtype.lanes = 1;
    t.shape = shape;
    t.strides = strides;
    t.byte_offset = 0;
    return t;
}

/* ---- checks ---------------------------------------------------------------------------------- */

/* This process's rank; -1 outside a rank (in the parent, or in a single-process program). */
static int g_rank = -1;
/* Checks that passed and failed in this process. */
static int g_passed = 0;
static int g_failed = 0;

/* Counts a failed check and prints the start of its line: "FAIL rank R FILE:LINE: " inside a
 * rank, "FAIL FILE:LINE: " outside one. The caller prints the rest, up to the newline. */
static inline void test_fail_at(const char *file, int line) {
    g_failed++;
    if (g_rank >= 0) {
        printf("FAIL rank %d %s:%d: ", g_rank, file, line);
    } else {
        printf("FAIL %s:%d: ", file, line);
    }
}

#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (cond) {                                                                          \
            g_passed++;                                                                      \
        } else {                                                                             \
            test_fail_at(__FILE__, __LINE__);                                                \
            printf("%s\n", #cond);                                                           \
        }                                                                                    \
    } while (0)

/* Checks that a call returned `want`; prints the status and last error otherwise. Returns
 * whether it did. */
#define CHECK_ST(st, want) check_st((st), (want), __FILE__, __LINE__, #st)

static inline int check_st(int32_t st, int32_t want, const char *file, int line,
                           const char *expr) {
    const char *msg;
    if (st == want) {
        g_passed++;
        return 1;
    }
    msg = epcomm_last_error_message();
    test_fail_at(file, line);
    printf("%s returned %d, expected %d (last error: %s)\n", expr, (int)st, (int)want,
           msg ? msg : "(NULL)");
    return 0;
}

/* The last error message is exactly `want`. */
#define CHECK_MSG_EQ(want) check_msg((want), 1, __FILE__, __LINE__)
/* The last error message contains `needle`. */
#define CHECK_MSG_HAS(needle) check_msg((needle), 0, __FILE__, __LINE__)

static inline void check_msg(const char *want, int exact, const char *file, int line) {
    const char *msg = epcomm_last_error_message();
    if (msg != NULL && (exact ? strcmp(msg, want) == 0 : strstr(msg, want) != NULL)) {
        g_passed++;
        return;
    }
    test_fail_at(file, line);
    printf("last error \"%s\" %s \"%s\"\n", msg ? msg : "(NULL)",
           exact ? "is not" : "does not contain", want);
}

/* ---- forked ranks ---------------------------------------------------------------------------- */

/* Seconds the parent waits for all ranks before killing them. */
#define TEST_RANKS_DEADLINE_S 45
/* The most ranks a program may fork. */
#define TEST_RANKS_MAX 16

/* What "N passed, M failed" counts. */
enum test_ranks_count {
    /* Ranks: one that exits 0 passed; any other end (status, signal, deadline) failed. */
    TEST_RANKS_COUNT_RANKS = 0,
    /* Checks: each rank reports its g_passed and g_failed through a pipe; a rank that crashed,
     * hung or reported nothing counts as one failure. */
    TEST_RANKS_COUNT_CHECKS = 1,
};

/* A rank's body: runs in the forked process, after g_rank is set; returns its exit status. */
typedef int (*test_rank_main_fn)(const char *group, int rank);

static inline double test_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static inline void test_sleep_ms(long ms) {
    struct timespec ts;
    ts.tv_sec = ms / 1000;
    ts.tv_nsec = (ms % 1000) * 1000000L;
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Counts entries of /dev/shm that belong to group `name` ("epcomm.NAME" or "epcomm.NAME.*"),
 * printing each; -1 if /dev/shm cannot be read. */
static inline int test_count_shm_leftovers(const char *name) {
    char prefix[256];
    size_t n;
    int count = 0;
    DIR *dir;
    struct dirent *e;

    snprintf(prefix, sizeof prefix, "epcomm.%s", name);
    n = strlen(prefix);
    dir = opendir("/dev/shm");
    if (dir == NULL) {
        printf("cannot open /dev/shm: %s\n", strerror(errno));
        return -1;
    }
    while ((e = readdir(dir)) != NULL) {
        if (strncmp(e->d_name, prefix, n) == 0 && (e->d_name[n] == '\0' || e->d_name[n] == '.')) {
            printf("FAIL leftover shared memory: /dev/shm/%s\n", e->d_name);
            count++;
        }
    }
    closedir(dir);
    return count;
}

/* Reads a rank's two counts from its pipe; 0 if it reported nothing complete. */
static inline int test_read_counts(int fd, int counts[2]) {
    char *p = (char *)counts;
    size_t want = 2 * sizeof(int), got = 0;
    while (got < want) {
        ssize_t r = read(fd, p + got, want - got);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return 0;
        }
        got += (size_t)r;
    }
    return 1;
}

/* The forked rank: runs `rank_main`, reports its counts when asked to, and exits. */
static inline void test_rank_process(const char *name, int rank, test_rank_main_fn rank_main,
                                     int report_fd) {
    int rc;
    g_rank = rank;
    rc = rank_main(name, rank);
    if (report_fd >= 0) {
        int counts[2];
        counts[0] = g_passed;
        counts[1] = g_failed;
        if (write(report_fd, counts, sizeof counts) != (ssize_t)sizeof counts) {
            printf("FAIL rank %d could not report its counts\n", rank);
        }
        close(report_fd);
    }
    fflush(stdout);
    exit(rc);
}

/*
 * The whole parent: `argv[1]` names the group; forks `world` ranks that each run
 * rank_main(group, rank) before the parent calls anything in epcomm, waits for them for
 * TEST_RANKS_DEADLINE_S seconds (killing those still running), prints one line per failed rank,
 * checks /dev/shm for the group's leftovers and prints "N passed, M failed" (ranks or checks, as
 * `count` says). Returns main's exit status: 0 when nothing failed and nothing was left, 1
 * otherwise, 2 for a usage error (`program` names the program in its message).
 */
static inline int test_ranks_main(int argc, char **argv, const char *program, int world,
                                  test_rank_main_fn rank_main, enum test_ranks_count count) {
    const int by_checks = count == TEST_RANKS_COUNT_CHECKS;
    const char *name;
    pid_t pids[TEST_RANKS_MAX];
    int fds[TEST_RANKS_MAX];
    int done[TEST_RANKS_MAX];
    int exited[TEST_RANKS_MAX];
    int passed = 0, failed = 0, remaining = 0;
    int rank, leftovers;
    double deadline;

    if (argc != 2 || argv[1][0] == '\0') {
        fprintf(stderr, "usage: %s GROUP_NAME\n", argc > 0 ? argv[0] : program);
        return 2;
    }
    if (world < 1 || world > TEST_RANKS_MAX) {
        fprintf(stderr, "%s: %d ranks, expected 1 to %d\n", program, world, TEST_RANKS_MAX);
        return 2;
    }
    name = argv[1];

    /* Nothing buffered may be duplicated into the children. */
    fflush(stdout);
    fflush(stderr);
    for (rank = 0; rank < world; rank++) {
        int p[2] = {-1, -1};
        pid_t pid;
        pids[rank] = -1;
        fds[rank] = -1;
        done[rank] = 1;
        exited[rank] = 0;
        if (by_checks && pipe(p) != 0) {
            printf("FAIL pipe for rank %d: %s\n", rank, strerror(errno));
            failed++;
            continue;
        }
        pid = fork();
        if (pid < 0) {
            printf("FAIL fork for rank %d: %s\n", rank, strerror(errno));
            if (by_checks) {
                close(p[0]);
                close(p[1]);
            }
            failed++;
            continue;
        }
        if (pid == 0) {
            int r;
            if (by_checks) {
                close(p[0]);
            }
            for (r = 0; r < rank; r++) {
                if (fds[r] >= 0) {
                    close(fds[r]);
                }
            }
            test_rank_process(name, rank, rank_main, p[1]);
        }
        if (by_checks) {
            close(p[1]);
        }
        pids[rank] = pid;
        fds[rank] = p[0];
        done[rank] = 0;
        remaining++;
    }

    deadline = test_now_s() + TEST_RANKS_DEADLINE_S;
    while (remaining > 0) {
        int progressed = 0;
        for (rank = 0; rank < world; rank++) {
            int status = 0;
            pid_t w;
            if (done[rank]) {
                continue;
            }
            w = waitpid(pids[rank], &status, WNOHANG);
            if (w == 0) {
                continue;
            }
            done[rank] = 1;
            remaining--;
            progressed = 1;
            if (w < 0) {
                printf("FAIL rank %d: waitpid: %s\n", rank, strerror(errno));
            } else if (WIFEXITED(status)) {
                exited[rank] = 1;
                if (WEXITSTATUS(status) != 0) {
                    /* Counting checks, the rank's own FAIL lines already name them. */
                    printf("%srank %d exited with status %d\n", by_checks ? "" : "FAIL ", rank,
                           WEXITSTATUS(status));
                }
            } else if (WIFSIGNALED(status)) {
                printf("FAIL rank %d killed by signal %d\n", rank, WTERMSIG(status));
            } else {
                printf("FAIL rank %d ended with wait status 0x%x\n", rank, (unsigned)status);
            }
            if (!by_checks) {
                if (exited[rank] && WEXITSTATUS(status) == 0) {
                    passed++;
                } else {
                    failed++;
                }
            }
        }
        if (remaining > 0 && test_now_s() > deadline) {
            for (rank = 0; rank < world; rank++) {
                if (!done[rank]) {
                    printf("FAIL rank %d still running after %d s; killing it\n", rank,
                           TEST_RANKS_DEADLINE_S);
                    kill(pids[rank], SIGKILL);
                    waitpid(pids[rank], NULL, 0);
                    done[rank] = 1;
                    if (!by_checks) {
                        failed++;
                    }
                }
            }
            remaining = 0;
        } else if (remaining > 0 && !progressed) {
            test_sleep_ms(10);
        }
    }

    for (rank = 0; rank < world; rank++) {
        int counts[2] = {0, 0};
        if (fds[rank] < 0) {
            continue;
        }
        if (exited[rank] && test_read_counts(fds[rank], counts)) {
            passed += counts[0];
            failed += counts[1];
        } else {
            printf("FAIL rank %d reported no check counts\n", rank);
            failed++;
        }
        close(fds[rank]);
    }

    leftovers = test_count_shm_leftovers(name);
    if (leftovers != 0) {
        printf("FAIL group '%s' left %d shared-memory object(s) in /dev/shm\n", name, leftovers);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return (failed == 0 && leftovers == 0) ? 0 : 1;
}

#endif /* EPCOMM_TEST_RANKS_H */
