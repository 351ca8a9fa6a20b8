/* DLPack exports through the C ABI (src/ffi/dlpack.rs), as a C consumer uses them: the managed
 * tensors own their shape, each deleter (called here on other threads) calls the exporter's
 * release exactly once, failures allocate nothing. LeakSanitizer checks that every export and
 * its state are freed. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "epcomm.h"

static int passed, failed;
#define CHECK(cond)                                                              \
    do {                                                                         \
        if (cond) {                                                              \
            passed++;                                                            \
        } else {                                                                 \
            failed++;                                                            \
            fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n",        \
                    __FILE__, __LINE__, #cond,                                   \
                    epcomm_last_error_message() ? epcomm_last_error_message()    \
                                                : "none");                      \
        }                                                                        \
    } while (0)

enum { EXPORTS = 64, THREADS = 4 };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int released[EXPORTS]; /* release calls per context */

static void release(void *ctx) {
    int *slot = (int *)ctx;
    pthread_mutex_lock(&lock);
    (*slot)++;
    pthread_mutex_unlock(&lock);
}

static float data[6] = {0, 1, 2, 3, 4, 5};

static epcomm_tensor view(int64_t *shape) {
    epcomm_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.device.device_type = EPCOMM_DEVICE_CPU;
    t.ndim = 2;
    t.dtype.code = 2;
    t.dtype.bits = 32;
    t.dtype.lanes = 1;
    t.shape = shape;
    return t;
}

static void *managed[EXPORTS];

/* Each thread deletes every THREADS-th export: odd ones are versioned. */
static void *consume(void *arg) {
    int first = (int)(size_t)arg;
    for (int i = first; i < EXPORTS; i += THREADS) {
        if (i % 2) {
            epcomm_dlpack_managed_versioned *m = (epcomm_dlpack_managed_versioned *)managed[i];
            m->deleter(m);
        } else {
            epcomm_dlpack_managed *m = (epcomm_dlpack_managed *)managed[i];
            m->deleter(m);
        }
    }
    return NULL;
}

static void exports_on_threads(void) {
    int64_t shape[2] = {2, 3};
    epcomm_tensor t = view(shape);
    size_t before = epcomm_dlpack_live();
    for (int i = 0; i < EXPORTS; i++) {
        CHECK(epcomm_dlpack_export(&t, i % 2 == 1, release, &released[i], &managed[i]) ==
              EPCOMM_OK);
    }
    shape[0] = 9; /* the exports keep their own copies */
    CHECK(epcomm_dlpack_live() == before + EXPORTS);
    epcomm_dlpack_managed *m0 = (epcomm_dlpack_managed *)managed[0];
    epcomm_dlpack_managed_versioned *m1 = (epcomm_dlpack_managed_versioned *)managed[1];
    CHECK(m0->dl_tensor.data == data && m1->dl_tensor.data == data);
    CHECK(m0->dl_tensor.shape[0] == 2 && m0->dl_tensor.shape[1] == 3);
    CHECK(m1->dl_tensor.shape[0] == 2 && m1->dl_tensor.shape[1] == 3);
    CHECK(m0->dl_tensor.strides == NULL && m1->dl_tensor.strides == NULL);
    CHECK(m1->version.major == 1 && m1->version.minor == 0 && m1->flags == 0);
    pthread_t threads[THREADS];
    for (int i = 0; i < THREADS; i++) {
        CHECK(pthread_create(&threads[i], NULL, consume, (void *)(size_t)i) == 0);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(threads[i], NULL);
    }
    int once = 1;
    for (int i = 0; i < EXPORTS; i++) {
        once = once && released[i] == 1;
    }
    CHECK(once);
    CHECK(epcomm_dlpack_live() == before);
}

static void failures(void) {
    int64_t shape[2] = {2, 3};
    epcomm_tensor t = view(shape);
    void *out = data;
    int calls = 0;
    CHECK(epcomm_dlpack_export(NULL, false, release, &calls, &out) ==
          EPCOMM_ERROR_NULL_POINTER);
    CHECK(strcmp(epcomm_last_error_message(), "argument 'tensor' must not be NULL") == 0);
    t.ndim = -1;
    CHECK(epcomm_dlpack_export(&t, true, release, &calls, &out) ==
          EPCOMM_ERROR_INVALID_ARGUMENT);
    CHECK(strcmp(epcomm_last_error_message(),
                 "tensor->ndim is -1; expected 0 or more dimensions") == 0);
    CHECK(out == data && calls == 0);
    /* No release function: the deleter only frees. */
    t.ndim = 2;
    CHECK(epcomm_dlpack_export(&t, false, NULL, NULL, &out) == EPCOMM_OK);
    epcomm_dlpack_delete((epcomm_dlpack_managed *)out);
    epcomm_dlpack_delete(NULL);
    epcomm_dlpack_delete_versioned(NULL);
}

int main(void) {
    exports_on_threads();
    failures();
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
