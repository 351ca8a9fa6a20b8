/*
 * C ABI test for epcomm: exercises every function of include/epcomm.h through the C header,
 * as a C11 program and (compiled with -x c++) as a C++17 program. Run by tests/c_abi.rs.
 *
 * Prints one line per failed check and, at the end, "N passed, M failed"; exits non-zero if
 * any check failed.
 */
#include "test_ranks.h" /* first: it selects POSIX for the system headers */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epcomm.h"

/* Test-only, so not in the header: only debug builds of the library (what the tests load) export
 * it; the installed release library does not. */
#ifdef __cplusplus
extern "C" int32_t epcomm_test_panic(const char *message);
#else
int32_t epcomm_test_panic(const char *message);
#endif

/* The version macros agree with each other at compile time. */
#if EPCOMM_VERSION_NUMBER != EPCOMM_VERSION_MAJOR * 10000 + EPCOMM_VERSION_MINOR * 100 + EPCOMM_VERSION_PATCH
#error "EPCOMM_VERSION_NUMBER does not match EPCOMM_VERSION_MAJOR/MINOR/PATCH"
#endif

/* Structs are named by their tags (valid with and without cbindgen's typedefs). */
typedef struct epcomm_all2all_name_desc name_info_t;
typedef struct epcomm_eplb_select_request select_request_t;
typedef struct epcomm_dtype dtype_t;

/* CHECK, CHECK_ST and the counters g_passed and g_failed come from test_ranks.h; this program
 * has no ranks, so its FAIL lines name no rank. */

/* Compares two possibly-NULL strings; prints both on mismatch. */
#define CHECK_STR(actual, expected) check_str((actual), (expected), __LINE__, #actual)

/* Checks a status and, when it is not EPCOMM_OK, the last error message (NULL = don't care). */
#define CHECK_ERR(st, want_status, want_message) \
    check_err((st), (want_status), (want_message), __LINE__, #st)

static int str_eq(const char *a, const char *b) {
    if (a == NULL || b == NULL) {
        return a == b;
    }
    return strcmp(a, b) == 0;
}

static void check_str(const char *actual, const char *expected, int line, const char *expr) {
    if (str_eq(actual, expected)) {
        g_passed++;
    } else {
        test_fail_at(__FILE__, line);
        printf("%s is \"%s\", expected \"%s\"\n", expr, actual ? actual : "(NULL)",
               expected ? expected : "(NULL)");
    }
}

static void check_err(int32_t st, int32_t want_status, const char *want_message, int line,
                      const char *expr) {
    if (!check_st(st, want_status, __FILE__, line, expr)) {
        return;
    }
    if (want_message != NULL) {
        check_str(epcomm_last_error_message(), want_message, line, "epcomm_last_error_message()");
    }
}

/* ---- log capture ------------------------------------------------------------------------- */

#define MAX_LOGS 64
#define MAX_LOG_LEN 512

struct log_capture {
    int count;
    int levels[MAX_LOGS];
    char messages[MAX_LOGS][MAX_LOG_LEN];
};

static void capture_log(int32_t level, const char *message, void *user_data) {
    struct log_capture *cap = (struct log_capture *)user_data;
    if (cap == NULL || cap->count >= MAX_LOGS) {
        return;
    }
    cap->levels[cap->count] = (int)level;
    snprintf(cap->messages[cap->count], MAX_LOG_LEN, "%s", message ? message : "(NULL)");
    cap->count++;
}

/* Whether `cap` holds a message at `level` equal to `text`. */
static int has_log(const struct log_capture *cap, int level, const char *text) {
    int i;
    for (i = 0; i < cap->count; i++) {
        if (cap->levels[i] == level && strcmp(cap->messages[i], text) == 0) {
            return 1;
        }
    }
    return 0;
}

/* ---- all2all names ----------------------------------------------------------------------- */

struct expected_name {
    const char *name;
    int32_t backend;
    int32_t kind;
    int32_t layout;
    const char *manager_class;
};

/* Every all2all backend name vLLM accepts, in vLLM's order (the order of
 * epcomm_all2all_name_info). */
static const struct expected_name EXPECTED_NAMES[] = {
    {"naive", EPCOMM_ALL2ALL_ALLGATHER_REDUCESCATTER, EPCOMM_NAME_REMOVED,
     EPCOMM_LAYOUT_REPLICATED, "AgRsAll2AllManager"},
    {"pplx", EPCOMM_ALL2ALL_ALLGATHER_REDUCESCATTER, EPCOMM_NAME_REMOVED,
     EPCOMM_LAYOUT_REPLICATED, "AgRsAll2AllManager"},
    {"deepep_high_throughput", EPCOMM_ALL2ALL_DEEPEP_HIGH_THROUGHPUT, EPCOMM_NAME_CANONICAL,
     EPCOMM_LAYOUT_TOKEN_MAJOR, "DeepEPHTAll2AllManager"},
    {"deepep_low_latency", EPCOMM_ALL2ALL_DEEPEP_LOW_LATENCY, EPCOMM_NAME_CANONICAL,
     EPCOMM_LAYOUT_EXPERT_MAJOR, "DeepEPLLAll2AllManager"},
    {"deepep_v2", EPCOMM_ALL2ALL_DEEPEP_V2, EPCOMM_NAME_CANONICAL, EPCOMM_LAYOUT_EXPERT_PACKED,
     "DeepEPV2All2AllManager"},
    {"mori_high_throughput", EPCOMM_ALL2ALL_MORI_HIGH_THROUGHPUT, EPCOMM_NAME_ALIAS,
     EPCOMM_LAYOUT_TOKEN_MAJOR, "MoriAll2AllManager"},
    {"mori_low_latency", EPCOMM_ALL2ALL_MORI_LOW_LATENCY, EPCOMM_NAME_ALIAS,
     EPCOMM_LAYOUT_TOKEN_MAJOR, "MoriAll2AllManager"},
    {"moonep", EPCOMM_ALL2ALL_MOONEP, EPCOMM_NAME_CANONICAL, EPCOMM_LAYOUT_MOONEP_SLOTS,
     "MoonEPAll2AllManager"},
    {"mori", EPCOMM_ALL2ALL_MORI, EPCOMM_NAME_CANONICAL, EPCOMM_LAYOUT_TOKEN_MAJOR,
     "MoriAll2AllManager"},
    {"nixl_ep", EPCOMM_ALL2ALL_NIXL_EP, EPCOMM_NAME_CANONICAL, EPCOMM_LAYOUT_EXPERT_MAJOR,
     "NixlEPAll2AllManager"},
    {"allgather_reducescatter", EPCOMM_ALL2ALL_ALLGATHER_REDUCESCATTER, EPCOMM_NAME_CANONICAL,
     EPCOMM_LAYOUT_REPLICATED, "AgRsAll2AllManager"},
    {"flashinfer_all2allv", EPCOMM_ALL2ALL_FLASHINFER_NVLINK_TWO_SIDED, EPCOMM_NAME_ALIAS,
     EPCOMM_LAYOUT_RANK_MAJOR, "FlashInferNVLinkTwoSidedManager"},
    {"flashinfer_nvlink_two_sided", EPCOMM_ALL2ALL_FLASHINFER_NVLINK_TWO_SIDED,
     EPCOMM_NAME_CANONICAL, EPCOMM_LAYOUT_RANK_MAJOR, "FlashInferNVLinkTwoSidedManager"},
    {"flashinfer_nvlink_one_sided", EPCOMM_ALL2ALL_FLASHINFER_NVLINK_ONE_SIDED,
     EPCOMM_NAME_CANONICAL, EPCOMM_LAYOUT_RANK_MAJOR, "FlashInferNVLinkOneSidedManager"},
};

#define NUM_EXPECTED_NAMES (sizeof(EXPECTED_NAMES) / sizeof(EXPECTED_NAMES[0]))

static const char *const W1 =
    "'flashinfer_all2allv' is deprecated and has been renamed to'flashinfer_nvlink_two_sided'. "
    "It will be removed in a futurerelease.";
static const char *const W2_NAIVE =
    "The 'naive' all2all backend has been removed. Falling back to 'allgather_reducescatter'.";
static const char *const W_MORI_HT =
    "'mori_high_throughput' is deprecated and will be removed in a future release. Use 'mori', "
    "which picks the MoRI kernels automatically.";
static const char *const W_MORI_LL =
    "'mori_low_latency' is deprecated and will be removed in a future release. Use 'mori', "
    "which picks the MoRI kernels automatically.";
static const char *const W2_PPLX =
    "The 'pplx' all2all backend has been removed. Falling back to 'allgather_reducescatter'.";

static void test_resolve_and_logging(void) {
    struct log_capture cap;
    size_t i;
    int32_t out;

    memset(&cap, 0, sizeof cap);
    epcomm_set_log_callback(capture_log, &cap);

    /* Every accepted name resolves to its EPCOMM_ALL2ALL_* value. */
    for (i = 0; i < NUM_EXPECTED_NAMES; i++) {
        out = -77;
        CHECK_ERR(epcomm_all2all_backend_resolve(EXPECTED_NAMES[i].name, &out), EPCOMM_OK, NULL);
        if (out != EXPECTED_NAMES[i].backend) {
            printf("  resolve(\"%s\") gave %d, expected %d\n", EXPECTED_NAMES[i].name, (int)out,
                   (int)EXPECTED_NAMES[i].backend);
        }
        CHECK(out == EXPECTED_NAMES[i].backend);
        CHECK(epcomm_all2all_backend_is_known(EXPECTED_NAMES[i].name));
    }
    /* W2 for each removed name, W1 for the alias (first resolution in this process). */
    CHECK(has_log(&cap, EPCOMM_LOG_WARN, W2_NAIVE));
    CHECK(has_log(&cap, EPCOMM_LOG_WARN, W2_PPLX));
    CHECK(has_log(&cap, EPCOMM_LOG_WARN, W1));
    /* vLLM 0.34.0's MoRI deprecations (once per process each). */
    CHECK(has_log(&cap, EPCOMM_LOG_WARN, W_MORI_HT));
    CHECK(has_log(&cap, EPCOMM_LOG_WARN, W_MORI_LL));
    /* Canonical names log nothing: exactly the five warnings above. */
    CHECK(cap.count == 5);

    /* W1 is logged once per process; W2 every time. */
    memset(&cap, 0, sizeof cap);
    out = -77;
    CHECK_ERR(epcomm_all2all_backend_resolve("flashinfer_all2allv", &out), EPCOMM_OK, NULL);
    CHECK(out == EPCOMM_ALL2ALL_FLASHINFER_NVLINK_TWO_SIDED);
    CHECK(!has_log(&cap, EPCOMM_LOG_WARN, W1));
    out = -77;
    CHECK_ERR(epcomm_all2all_backend_resolve("naive", &out), EPCOMM_OK, NULL);
    CHECK(out == EPCOMM_ALL2ALL_ALLGATHER_REDUCESCATTER);
    CHECK(cap.count == 1);
    CHECK(cap.levels[0] == EPCOMM_LOG_WARN);
    CHECK_STR(cap.messages[0], W2_NAIVE);

    /* is_known logs nothing. */
    memset(&cap, 0, sizeof cap);
    CHECK(epcomm_all2all_backend_is_known("naive"));
    CHECK(cap.count == 0);

    /* Default (NULL) callback again: nothing reaches `cap` any more. */
    epcomm_set_log_callback(NULL, NULL);
    memset(&cap, 0, sizeof cap);
    CHECK_ERR(epcomm_all2all_backend_resolve("pplx", &out), EPCOMM_OK, NULL);
    CHECK(cap.count == 0);
}

static void test_unknown_names(void) {
    static const char *const unknown[] = {"flashinfer-nvlink-2s", "mori_ep", "one_sided", "",
                                          "Naive", "DEEPEP_LOW_LATENCY", "bogus"};
    size_t i;
    int32_t out = -77;
    const char *hint;
    char expected[256];

    CHECK_ERR(epcomm_all2all_backend_resolve("flashinfer-nvlink-2s", &out),
              EPCOMM_ERROR_INVALID_ARGUMENT, "Unknown all2all backend: flashinfer-nvlink-2s");
    CHECK(out == -77); /* outputs are written only on success */
    hint = epcomm_last_error_hint();
    CHECK(hint != NULL);
    CHECK(hint != NULL && strstr(hint, "flashinfer_nvlink_two_sided") != NULL);
    /* The hint is never part of the message. */
    CHECK(strstr(epcomm_last_error_message(), "did you mean") == NULL);
    CHECK(!epcomm_all2all_backend_is_known("flashinfer-nvlink-2s"));

    for (i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
        snprintf(expected, sizeof expected, "Unknown all2all backend: %s", unknown[i]);
        out = -77;
        CHECK_ERR(epcomm_all2all_backend_resolve(unknown[i], &out), EPCOMM_ERROR_INVALID_ARGUMENT,
                  expected);
        CHECK(out == -77);
        CHECK(!epcomm_all2all_backend_is_known(unknown[i]));
    }

    /* Invalid UTF-8 is an invalid argument, not a crash. */
    out = -77;
    CHECK_ERR(epcomm_all2all_backend_resolve("\xff\xfe", &out), EPCOMM_ERROR_INVALID_ARGUMENT,
              NULL);
    CHECK(out == -77);
    CHECK(!epcomm_all2all_backend_is_known("\xff\xfe"));
}

static void test_backend_queries(void) {
    static const char *const canonical[] = {"allgather_reducescatter",
                                            "deepep_high_throughput",
                                            "deepep_low_latency",
                                            "deepep_v2",
                                            "mori_high_throughput",
                                            "mori_low_latency",
                                            "nixl_ep",
                                            "flashinfer_nvlink_two_sided",
                                            "flashinfer_nvlink_one_sided",
                                            "moonep",
                                            "mori"};
    static const char *const layouts[] = {"REPLICATED",    "TOKEN_MAJOR", "EXPERT_MAJOR",
                                          "EXPERT_PACKED", "RANK_MAJOR",  "MOONEP_SLOTS"};
    int32_t b;
    int32_t layout;
    size_t i;
    size_t count;
    name_info_t info;

    for (b = 0; b < 11; b++) {
        int32_t resolved = -77;
        CHECK_STR(epcomm_all2all_backend_name(b), canonical[b]);
        CHECK(epcomm_all2all_backend_manager_class(b) != NULL);
        CHECK_ERR(epcomm_all2all_backend_resolve(canonical[b], &resolved), EPCOMM_OK, NULL);
        CHECK(resolved == b);
    }
    CHECK(epcomm_all2all_backend_name(12) == NULL);
    CHECK(epcomm_all2all_backend_name(-1) == NULL);
    CHECK(epcomm_all2all_backend_manager_class(12) == NULL);
    CHECK(epcomm_all2all_backend_manager_class(-1) == NULL);
    CHECK_STR(epcomm_all2all_backend_manager_class(EPCOMM_ALL2ALL_DEEPEP_LOW_LATENCY),
              "DeepEPLLAll2AllManager");

    for (layout = 0; layout < 6; layout++) {
        CHECK_STR(epcomm_all2all_layout_name(layout), layouts[layout]);
    }
    CHECK(epcomm_all2all_layout_name(6) == NULL);
    CHECK(epcomm_all2all_layout_name(-1) == NULL);

    layout = -77;
    CHECK_ERR(epcomm_all2all_backend_layout(EPCOMM_ALL2ALL_DEEPEP_V2, &layout), EPCOMM_OK, NULL);
    CHECK(layout == EPCOMM_LAYOUT_EXPERT_PACKED);
    layout = -77;
    CHECK_ERR(epcomm_all2all_backend_layout(12, &layout), EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
    CHECK(layout == -77);
    CHECK_ERR(epcomm_all2all_backend_layout(-1, &layout), EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
    CHECK(layout == -77);

    count = epcomm_all2all_name_count();
    CHECK(count == NUM_EXPECTED_NAMES);
    for (i = 0; i < count && i < NUM_EXPECTED_NAMES; i++) {
        const struct expected_name *e = &EXPECTED_NAMES[i];
        memset(&info, 0, sizeof info);
        CHECK_ERR(epcomm_all2all_name_info(i, &info), EPCOMM_OK, NULL);
        CHECK_STR(info.name, e->name);
        CHECK(info.backend == e->backend);
        CHECK(info.kind == e->kind);
        CHECK(info.layout == e->layout);
        CHECK_STR(info.manager_class, e->manager_class);
        /* Consistent with the per-backend queries. */
        CHECK_STR(info.manager_class, epcomm_all2all_backend_manager_class(info.backend));
        layout = -77;
        CHECK_ERR(epcomm_all2all_backend_layout(info.backend, &layout), EPCOMM_OK, NULL);
        CHECK(layout == info.layout);
        CHECK(epcomm_all2all_backend_is_known(info.name));
    }
    memset(&info, 0, sizeof info);
    info.backend = -77;
    CHECK_ERR(epcomm_all2all_name_info(count, &info), EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
    CHECK(info.backend == -77 && info.name == NULL);
    CHECK_ERR(epcomm_all2all_name_info((size_t)-1, &info), EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
    CHECK(info.backend == -77 && info.name == NULL);
}

static const char *const DBO_MESSAGE =
    "Microbatching currently only supports the deepep_low_latency, deepep_high_throughput, "
    "nixl_ep all2all backends on this platform. allgather_reducescatter is not supported. To fix "
    "use one of --all2all-backend=deepep_low_latency, --all2all-backend=deepep_high_throughput, "
    "--all2all-backend=nixl_ep and install the matching kernels.";

static void test_config_check(void) {
    size_t len = 0;
    size_t len2 = 0;
    char *buf;
    char small[4];

    CHECK_ERR(epcomm_config_check("{}"), EPCOMM_OK, NULL);
    CHECK_ERR(epcomm_config_check("{\"all2all_backend\":\"deepep_low_latency\"}"), EPCOMM_OK,
              NULL);
    CHECK_ERR(epcomm_config_check("{\"all2all_backend\":\"deepep_low_latency\","
                                  "\"enable_dbo\":false,\"enable_fault_tolerance\":true}"),
              EPCOMM_OK, NULL);
    CHECK_ERR(epcomm_config_check("{\"all2all_backend\":\"deepep_high_throughput\","
                                  "\"enable_dbo\":true}"),
              EPCOMM_OK, NULL);
    CHECK_ERR(epcomm_config_check("{\"enable_elastic_ep\":true}"), EPCOMM_ERROR_INVALID_ARGUMENT,
              "Elastic EP is only supported with enable_eplb=True.");
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_INVALID_ARGUMENT), "ValueError");
    CHECK_ERR(epcomm_config_check("{\"enable_dbo\":true}"), EPCOMM_ERROR_ASSERTION, DBO_MESSAGE);
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_ASSERTION), "AssertionError");
    /* A removed name is reported by its replacement's name. */
    CHECK_ERR(epcomm_config_check("{\"all2all_backend\":\"naive\",\"enable_dbo\":true}"),
              EPCOMM_ERROR_ASSERTION, DBO_MESSAGE);
    CHECK_ERR(epcomm_config_check("{\"enable_fault_tolerance\":true}"),
              EPCOMM_ERROR_INVALID_ARGUMENT,
              "Fault tolerance requires an FT-capable all2all backend (one of "
              "['deepep_low_latency', 'nixl_ep']), but got 'allgather_reducescatter'.");
    /* An unknown name is refused by ParallelConfig's All2AllBackend literal (pydantic 2.13). */
    CHECK_ERR(epcomm_config_check("{\"all2all_backend\":\"bogus\"}"),
              EPCOMM_ERROR_INVALID_ARGUMENT,
              "1 validation error for ParallelConfig\nall2all_backend\n"
              "  Input should be 'naive', 'pplx', 'deepep_high_throughput', 'deepep_low_latency', "
              "'deepep_v2', 'mori_high_throughput', 'mori_low_latency', 'moonep', 'mori', "
              "'nixl_ep', 'allgather_reducescatter', 'flashinfer_all2allv', "
              "'flashinfer_nvlink_two_sided', "
              "'flashinfer_nvlink_one_sided' or 'passthrough' [type=literal_error, "
              "input_value='bogus', input_type=str]\n"
              "    For further information visit https://errors.pydantic.dev/2.13/v/literal_error");
    CHECK_ERR(epcomm_config_check("not json"), EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
    CHECK_ERR(epcomm_config_check("[]"), EPCOMM_ERROR_INVALID_ARGUMENT, NULL);

    /* The report: size query, then fill. */
    CHECK_ERR(epcomm_config_check_report("{\"all2all_backend\":\"deepep_low_latency\"}", NULL, 0,
                                         &len),
              EPCOMM_OK, NULL);
    CHECK(len > 0);
    buf = (char *)malloc(len + 1);
    CHECK(buf != NULL);
    if (buf != NULL) {
        memset(buf, 'x', len + 1);
        CHECK_ERR(epcomm_config_check_report("{\"all2all_backend\":\"deepep_low_latency\"}", buf,
                                             len + 1, &len2),
                  EPCOMM_OK, NULL);
        CHECK(len2 == len);
        CHECK(buf[len] == '\0');
        CHECK(strlen(buf) == len);
        CHECK(strstr(buf, "\"ok\":true") != NULL);
        CHECK(strstr(buf, "\"deepep_low_latency\"") != NULL);
        CHECK(strstr(buf, "\"DeepEPLLAll2AllManager\"") != NULL);
        CHECK(strstr(buf, "\"EXPERT_MAJOR\"") != NULL);
        if (strstr(buf, "\"ok\":true") == NULL) {
            printf("  report: %s\n", buf);
        }

        /* Too small a buffer: an error, and nothing written. */
        memset(small, 'x', sizeof small);
        len2 = 12345;
        CHECK_ERR(epcomm_config_check_report("{}", small, sizeof small, &len2),
                  EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
        CHECK(small[0] == 'x' && small[3] == 'x');
        CHECK(len2 == 12345);
        /* A buffer exactly one byte short. */
        CHECK_ERR(epcomm_config_check_report("{\"all2all_backend\":\"deepep_low_latency\"}", buf,
                                             len, &len2),
                  EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
        free(buf);
    }

    /* A failing configuration still produces a report (status OK, verdict inside). */
    len = 0;
    CHECK_ERR(epcomm_config_check_report("{\"enable_dbo\":true}", NULL, 0, &len), EPCOMM_OK, NULL);
    CHECK(len > 0);
    buf = (char *)malloc(len + 1);
    CHECK(buf != NULL);
    if (buf != NULL) {
        CHECK_ERR(epcomm_config_check_report("{\"enable_dbo\":true}", buf, len + 1, &len2),
                  EPCOMM_OK, NULL);
        CHECK(strstr(buf, "\"ok\":false") != NULL);
        CHECK(strstr(buf, "\"exception\":\"AssertionError\"") != NULL);
        CHECK(strstr(buf, "Microbatching currently only supports") != NULL);
        free(buf);
    }
}

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

static void test_eplb_select(void) {
    select_request_t req;
    dtype_t dtypes[2];
    struct log_capture cap;
    int32_t out;
    int32_t c;
    static const char *const names[] = {"torch_nccl", "torch_gloo", "pynccl",
                                        "nixl",       "torch_xccl", "symm_mem"};
    static const char *const classes[] = {
        "TorchDistNcclEplbCommunicator", "TorchDistGlooStagedEplbCommunicator",
        "PyNcclEplbCommunicator",        "NixlEplbCommunicator",
        "TorchDistXCCLStagedEplbCommunicator", "SymmMemEplbCommunicator"};

    for (c = 0; c < 6; c++) {
        CHECK_STR(epcomm_eplb_communicator_name(c), names[c]);
        CHECK_STR(epcomm_eplb_communicator_class(c), classes[c]);
    }
    CHECK(EPCOMM_EPLB_TORCH_XCCL == 4);
    CHECK(EPCOMM_EPLB_SYMM_MEM == 5);
    CHECK(epcomm_eplb_communicator_name(6) == NULL);
    CHECK(epcomm_eplb_communicator_name(-1) == NULL);
    CHECK(epcomm_eplb_communicator_class(6) == NULL);
    CHECK(epcomm_eplb_communicator_class(-1) == NULL);

    /* Automatic selection on CPU without NIXL: torch_gloo. */
    init_request(&req);
    out = -77;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_OK, NULL);
    CHECK(out == EPCOMM_EPLB_TORCH_GLOO);
    /* ... with NIXL: nixl (on a CUDA device). */
    req.device_type = EPCOMM_DEVICE_CUDA;
    req.nixl_available = 1;
    out = -77;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_OK, NULL);
    CHECK(out == EPCOMM_EPLB_NIXL);
    /* ... elastic without NIXL: pynccl. */
    req.nixl_available = 0;
    req.nccl_available = 1;
    req.elastic = true;
    out = -77;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_OK, NULL);
    CHECK(out == EPCOMM_EPLB_PYNCCL);

    /* pynccl on CPU. */
    init_request(&req);
    req.communicator = "pynccl";
    req.nccl_available = 1;
    out = -77;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_ERROR_RUNTIME,
              "EPLB communicator 'pynccl' supports only cuda-like devices (got cpu).");
    CHECK(out == -77);
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_RUNTIME), "RuntimeError");

    /* pynccl on CUDA without NCCL. */
    req.device_type = EPCOMM_DEVICE_CUDA;
    req.nccl_available = 0;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_ERROR_UNAVAILABLE,
              "EPLB communicator 'pynccl' requested but unavailable.");
    CHECK(out == -77);

    /* pynccl on CUDA with an unsupported dtype. */
    memset(dtypes, 0, sizeof dtypes);
    dtypes[0].code = 2; /* float32 */
    dtypes[0].bits = 32;
    dtypes[0].lanes = 1;
    dtypes[1].code = 6; /* bool */
    dtypes[1].bits = 8;
    dtypes[1].lanes = 1;
    req.weight_dtypes = dtypes;
    req.num_weight_dtypes = 2;
    req.nccl_available = 1;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_ERROR_RUNTIME,
              "EPLB communicator 'pynccl' requested but expert weights contain unsupported "
              "dtypes: (bool (kDLBool, 8 bits)).");
    /* The Python package's text names PyTorch's dtypes, as vLLM's message does. */
    CHECK(strcmp(epcomm_last_error_message_torch(),
                 "EPLB communicator 'pynccl' requested but expert weights contain unsupported "
                 "dtypes: (torch.bool).") == 0);
    CHECK(out == -77);
    req.num_weight_dtypes = 1;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_OK, NULL);
    CHECK(out == EPCOMM_EPLB_PYNCCL);

    /* Elastic EP with torch_gloo. */
    init_request(&req);
    req.communicator = "torch_gloo";
    req.elastic = true;
    out = -77;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_ERROR_INVALID_ARGUMENT,
              "Elastic EP requires 'torch_nccl', 'pynccl', or 'nixl' EPLB communicator (got "
              "'torch_gloo').");
    CHECK(out == -77);
    CHECK(epcomm_last_error_hint() != NULL);

    /* Elastic EP with torch_nccl: forced to pynccl with vLLM's warning. */
    memset(&cap, 0, sizeof cap);
    epcomm_set_log_callback(capture_log, &cap);
    req.communicator = "torch_nccl";
    req.device_type = EPCOMM_DEVICE_CUDA;
    req.nccl_available = 1;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_OK, NULL);
    CHECK(out == EPCOMM_EPLB_PYNCCL);
    CHECK(has_log(&cap, EPCOMM_LOG_WARN,
                  "Stateless elastic EP requires PyNCCL backend. Forcing EPLB communicator to "
                  "'pynccl'."));
    epcomm_set_log_callback(NULL, NULL);

    /* nixl without NIXL; nixl on CPU. */
    init_request(&req);
    req.communicator = "nixl";
    out = -77;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_ERROR_UNAVAILABLE,
              "EPLB communicator 'nixl' requested but NIXL is unavailable.");
    req.nixl_available = 1;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_ERROR_RUNTIME,
              "EPLB communicator 'nixl' supports only cuda-like devices (got cpu).");
    CHECK(out == -77);

    /* Unknown name. */
    init_request(&req);
    req.communicator = "mpi";
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_ERROR_INVALID_ARGUMENT,
              "Unknown EPLB communicator backend: mpi");
    CHECK(out == -77);

    /* struct_size too small; availability out of range; dtypes NULL with a count. */
    init_request(&req);
    req.struct_size = 4;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
    init_request(&req);
    req.nccl_available = 5;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
    init_request(&req);
    req.num_weight_dtypes = 3;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_ERROR_NULL_POINTER, NULL);
    CHECK(out == -77);
}

static void test_status_and_errors(void) {
    int32_t s;
    int32_t st;
    const char *v;
    int major = -1, minor = -1, patch = -1;
    char tail = 0;

    for (s = 0; s <= EPCOMM_ERROR_INTERNAL; s++) {
        const char *str = epcomm_status_string(s);
        CHECK(str != NULL && str[0] != '\0');
        CHECK(str != NULL && strcmp(str, "unknown status") != 0);
    }
    CHECK_STR(epcomm_status_string(12345), "unknown status");
    CHECK_STR(epcomm_status_string(-1), "unknown status");
    CHECK(epcomm_status_string(EPCOMM_OK) != NULL);

    CHECK(epcomm_status_exception(EPCOMM_OK) == NULL);
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_NULL_POINTER), "ValueError");
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_INVALID_ARGUMENT), "ValueError");
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_ASSERTION), "AssertionError");
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_NOT_IMPLEMENTED), "NotImplementedError");
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_RUNTIME), "RuntimeError");
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_UNAVAILABLE), "RuntimeError");
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_TIMEOUT), "TimeoutError");
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_PEER_FAILURE), "RuntimeError");
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_INVALID_STATE), "RuntimeError");
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_SYSTEM), "RuntimeError");
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_INTERNAL), "RuntimeError");
    CHECK_STR(epcomm_status_exception(12345), "RuntimeError");

    /* Last error: cleared, set by a failure, kept by successes, cleared again. */
    epcomm_clear_last_error();
    CHECK(epcomm_last_error_message() == NULL);
    CHECK(epcomm_last_error_hint() == NULL);
    CHECK_ERR(epcomm_config_check("{\"enable_elastic_ep\":true}"), EPCOMM_ERROR_INVALID_ARGUMENT,
              "Elastic EP is only supported with enable_eplb=True.");
    CHECK(epcomm_last_error_hint() != NULL);
    CHECK_ERR(epcomm_config_check("{}"), EPCOMM_OK, NULL);
    CHECK_STR(epcomm_last_error_message(), "Elastic EP is only supported with enable_eplb=True.");
    epcomm_clear_last_error();
    CHECK(epcomm_last_error_message() == NULL);
    CHECK(epcomm_last_error_hint() == NULL);

    /* Versions. */
    v = epcomm_version();
    CHECK(v != NULL);
    if (v != NULL) {
        CHECK(sscanf(v, "%d.%d.%d%c", &major, &minor, &patch, &tail) == 3);
        /* The header's version macros are the library's version. */
        CHECK(major == EPCOMM_VERSION_MAJOR);
        CHECK(minor == EPCOMM_VERSION_MINOR);
        CHECK(patch == EPCOMM_VERSION_PATCH);
        CHECK_STR(v, EPCOMM_VERSION_STRING);
    }
    CHECK(epcomm_abi_version() == EPCOMM_ABI_VERSION);

    /* A panic inside epcomm is caught. */
    CHECK_ERR(epcomm_test_panic("boom"), EPCOMM_ERROR_INTERNAL, "boom");
    CHECK(epcomm_last_error_hint() == NULL);
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_INTERNAL), "RuntimeError");
    /* ... and the library keeps working afterwards. */
    st = epcomm_config_check("{}");
    CHECK(st == EPCOMM_OK);

    /* Log level. */
    CHECK_ERR(epcomm_set_log_level(0), EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
    CHECK_ERR(epcomm_set_log_level(5), EPCOMM_ERROR_INVALID_ARGUMENT, NULL);
    CHECK_ERR(epcomm_set_log_level(EPCOMM_LOG_DEBUG), EPCOMM_OK, NULL);
    CHECK_ERR(epcomm_set_log_level(EPCOMM_LOG_WARN), EPCOMM_OK, NULL);
}

static void test_runtime_probes(void) {
    int32_t version = -77;
    int32_t st = epcomm_nccl_version(&version);
    CHECK(st == EPCOMM_OK || st == EPCOMM_ERROR_UNAVAILABLE);
    if (st == EPCOMM_OK) {
        CHECK(version > 0);
    } else {
        CHECK(version == -77);
        CHECK(epcomm_last_error_message() != NULL);
    }
    st = epcomm_cuda_check();
    CHECK(st == EPCOMM_OK || st == EPCOMM_ERROR_UNAVAILABLE);
    (void)epcomm_nixl_available();
}

static void test_config_logging(void) {
    struct log_capture cap;
    memset(&cap, 0, sizeof cap);
    epcomm_set_log_callback(capture_log, &cap);
    CHECK_ERR(epcomm_config_check("{\"all2all_backend\":\"pplx\"}"), EPCOMM_OK, NULL);
    CHECK(has_log(&cap, EPCOMM_LOG_WARN, W2_PPLX));
    CHECK(has_log(&cap, EPCOMM_LOG_INFO, "Using AgRsAll2AllManager all2all manager."));
    /* The report does not log. */
    cap.count = 0;
    {
        size_t len = 0;
        CHECK_ERR(epcomm_config_check_report("{\"all2all_backend\":\"pplx\"}", NULL, 0, &len),
                  EPCOMM_OK, NULL);
    }
    CHECK(cap.count == 0);
    epcomm_set_log_callback(NULL, NULL);
}

static void test_null_arguments(void) {
    int32_t out = -77;
    size_t len = 777;
    select_request_t req;

    CHECK_ERR(epcomm_config_check(NULL), EPCOMM_ERROR_NULL_POINTER,
              "argument 'config_json' must not be NULL");
    CHECK_STR(epcomm_status_exception(EPCOMM_ERROR_NULL_POINTER), "ValueError");

    CHECK_ERR(epcomm_config_check_report(NULL, NULL, 0, &len), EPCOMM_ERROR_NULL_POINTER, NULL);
    CHECK(len == 777);
    CHECK_ERR(epcomm_config_check_report("{}", NULL, 0, NULL), EPCOMM_ERROR_NULL_POINTER, NULL);
    CHECK_ERR(epcomm_config_check_report("{}", NULL, 16, &len), EPCOMM_ERROR_NULL_POINTER, NULL);
    CHECK(len == 777);
    CHECK_ERR(epcomm_config_check_report(NULL, NULL, 0, NULL), EPCOMM_ERROR_NULL_POINTER, NULL);

    /* NULL message is allowed: a fixed text. */
    CHECK_ERR(epcomm_test_panic(NULL), EPCOMM_ERROR_INTERNAL, NULL);
    CHECK(epcomm_last_error_message() != NULL);

    epcomm_set_log_callback(NULL, NULL);
    epcomm_set_log_callback(NULL, &out);

    CHECK_ERR(epcomm_nccl_version(NULL), EPCOMM_ERROR_NULL_POINTER, NULL);

    CHECK_ERR(epcomm_all2all_backend_resolve(NULL, &out), EPCOMM_ERROR_NULL_POINTER,
              "argument 'name' must not be NULL");
    CHECK(out == -77);
    CHECK_ERR(epcomm_all2all_backend_resolve("deepep_low_latency", NULL),
              EPCOMM_ERROR_NULL_POINTER, "argument 'backend_out' must not be NULL");
    CHECK_ERR(epcomm_all2all_backend_resolve("bogus", NULL), EPCOMM_ERROR_NULL_POINTER, NULL);
    CHECK_ERR(epcomm_all2all_backend_resolve(NULL, NULL), EPCOMM_ERROR_NULL_POINTER, NULL);

    CHECK(!epcomm_all2all_backend_is_known(NULL));

    CHECK_ERR(epcomm_all2all_backend_layout(EPCOMM_ALL2ALL_DEEPEP_V2, NULL),
              EPCOMM_ERROR_NULL_POINTER, "argument 'layout_out' must not be NULL");
    CHECK_ERR(epcomm_all2all_name_info(0, NULL), EPCOMM_ERROR_NULL_POINTER,
              "argument 'info_out' must not be NULL");

    init_request(&req);
    CHECK_ERR(epcomm_eplb_communicator_select(NULL, &out), EPCOMM_ERROR_NULL_POINTER,
              "argument 'request' must not be NULL");
    CHECK(out == -77);
    CHECK_ERR(epcomm_eplb_communicator_select(&req, NULL), EPCOMM_ERROR_NULL_POINTER,
              "argument 'communicator_out' must not be NULL");
    CHECK_ERR(epcomm_eplb_communicator_select(NULL, NULL), EPCOMM_ERROR_NULL_POINTER, NULL);
    /* NULL communicator inside the request = automatic (allowed). */
    req.communicator = NULL;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_OK, NULL);
    CHECK(out == EPCOMM_EPLB_TORCH_GLOO);
}

/* vLLM's passthrough and torch_xccl: passthrough resolves to PassThroughAll2AllManager, which
 * has no exchange (no layout; only a handle request fails, with vLLM's RuntimeError);
 * torch_xccl is selected like vLLM (host-staged in epcomm). */
static void test_v033_names(void) {
    int32_t out = -77;
    int32_t layout = -77;
    select_request_t req;

    CHECK_ERR(epcomm_all2all_backend_resolve("passthrough", &out), EPCOMM_OK, NULL);
    CHECK(out == EPCOMM_ALL2ALL_PASSTHROUGH);
    CHECK(epcomm_all2all_backend_is_known("passthrough"));
    CHECK_STR(epcomm_all2all_backend_name(EPCOMM_ALL2ALL_PASSTHROUGH), "passthrough");
    CHECK_STR(epcomm_all2all_backend_manager_class(EPCOMM_ALL2ALL_PASSTHROUGH),
              "PassThroughAll2AllManager");
    CHECK_ERR(epcomm_all2all_backend_layout(EPCOMM_ALL2ALL_PASSTHROUGH, &layout),
              EPCOMM_ERROR_INVALID_ARGUMENT,
              "all2all backend 'passthrough' (PassThroughAll2AllManager) has no layout: the MoE "
              "backend dispatches and combines itself, with no exchange");
    CHECK(layout == -77);
    CHECK(strcmp(epcomm_status_exception(EPCOMM_ERROR_RUNTIME), "RuntimeError") == 0);
    CHECK_ERR(epcomm_config_check("{\"all2all_backend\":\"passthrough\"}"), EPCOMM_OK, NULL);
    CHECK_ERR(epcomm_config_check("{\"enable_eplb\":true,\"enable_expert_parallel\":true,"
                                  "\"data_parallel_size\":2,\"platform\":\"xpu\"}"),
              EPCOMM_OK, NULL);
    CHECK_ERR(epcomm_config_check("{\"enable_eplb\":true,\"enable_expert_parallel\":true,"
                                  "\"data_parallel_size\":2,\"platform\":\"cpu\"}"),
              EPCOMM_ERROR_INVALID_ARGUMENT,
              "Expert parallelism load balancing is only supported on CUDA devices or ROCm "
              "devices or XPU devices now.");

    init_request(&req);
    req.communicator = "torch_xccl";
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_OK, NULL);
    CHECK(out == EPCOMM_EPLB_TORCH_XCCL);
    /* Automatic on oneAPI (XPU) weights, as vLLM picks it on XPU. */
    init_request(&req);
    req.device_type = EPCOMM_DEVICE_ONEAPI;
    out = -77;
    CHECK_ERR(epcomm_eplb_communicator_select(&req, &out), EPCOMM_OK, NULL);
    CHECK(out == EPCOMM_EPLB_TORCH_XCCL);
}

int main(void) {
    test_resolve_and_logging();
    test_unknown_names();
    test_backend_queries();
    test_config_check();
    test_eplb_select();
    test_status_and_errors();
    test_runtime_probes();
    test_config_logging();
    test_null_arguments();
    test_v033_names();

    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 ? 0 : 1;
}
