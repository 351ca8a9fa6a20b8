// The C++17 wrapper (include/epcomm.hpp) in one process: exceptions carry vLLM's message and
// class, RAII handles (close(): a group closed before its managers lives on), tensors from
// vectors, a one-rank MoE round trip, names and selection, logging, the config builder and
// buffer sizes, vLLM's EPLB policy steps, the migration scheduler and layer plans, DLPack
// exports, and the GPU entry points where CUDA/NCCL are missing. Built as C++17 under
// ASan+UBSan by tests/cpp_wrapper.rs.
#include "checks.hpp"  // first: it selects POSIX for the system headers

#include <cstring>
#if __cplusplus >= 202002L
#include <span>
#endif
#include <string>
#include <vector>

using I64 = std::vector<int64_t>;

static const char NO_WINDOWS[] =
    "group 'cpphost' has no shared memory to allocate from: only a shared-memory group with "
    "EPCOMM_SHM_DIRECT=1 (the default) maps windows into its peers; use ordinary memory with this group";
static const char NO_BUFFER[] =
    "group 'cpphost' has no shared memory for an expert-output buffer (a shared-memory group with "
    "EPCOMM_SHM_DIRECT=1 has; this transport reads expert outputs from ordinary memory)";

static void test_errors_and_config() {
    CHECK(epcomm::resolve_backend("deepep_low_latency") == EPCOMM_ALL2ALL_DEEPEP_LOW_LATENCY);
    try {
        epcomm::resolve_backend("flashinfer-nvlink-2s");
        CHECK(false);
    } catch (const epcomm::Error &e) {
        CHECK(e.status() == EPCOMM_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(e.what()) == "Unknown all2all backend: flashinfer-nvlink-2s");
        CHECK(e.exception_class() == "ValueError");
        CHECK(e.hint() == "did you mean 'flashinfer_nvlink_two_sided'?");
    }
    CHECK_THROWS(epcomm::check_config("{\"enable_elastic_ep\": true}"), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "Elastic EP is only supported with enable_eplb=True.");
    CHECK(epcomm::config_report("{}").find("\"ok\":true") != std::string::npos);
    const std::string caps = epcomm::cuda_caps();
    CHECK(caps.front() == '{' && caps.back() == '}');
    CHECK(caps.find("\"cuda\"") != std::string::npos && caps.find("\"nccl\"") != std::string::npos);
    CHECK(epcomm::version() == EPCOMM_VERSION_STRING);
    CHECK(epcomm::abi_version() == EPCOMM_ABI_VERSION);
    epcomm::clear_last_error();
    CHECK(epcomm_last_error_message() == nullptr);
}

static void test_groups() {
    const epcomm_unique_id id = epcomm::Group::unique_id();
    epcomm::Group g = epcomm::Group::shm_unique(id, 0, 1);
    CHECK(g.rank() == 0 && g.size() == 1);
    epcomm_unique_id zero{};
    try {
        epcomm::Group::shm_unique(zero, 0, 1);
        CHECK(false);
    } catch (const epcomm::Error &e) {
        CHECK(e.status() == EPCOMM_ERROR_INVALID_ARGUMENT);
        CHECK(std::string(e.what()).rfind("unique group id is not one made by", 0) == 0);
    }
    epcomm_group_options o = epcomm::group_options();
    CHECK(o.struct_size == sizeof o && !o.elastic && !o.disable_direct_reads);
}

// A one-rank group over the host's transport (its all_gather copies): it has no shared-memory
// windows, so shared buffers and the expert-output buffer are refused with the reason.
static int32_t copy_gather(void *, const void *input, size_t bytes, void *output) {
    std::memcpy(output, input, bytes);
    return 0;
}
static int32_t no_send(void *, int32_t, const void *, size_t) { return 1; }
// The host's fault-tolerance callbacks: no rank lost; shrink hands over the same transport.
static int32_t none_lost(void *, uint8_t *, int32_t) { return 0; }
static int32_t count_shrinks(void *user, const int32_t *, size_t num_excluded, void **out_user) {
    int *shrinks = static_cast<int *>(user);
    *shrinks += num_excluded == 0 ? 1 : 100;
    *out_user = user;
    return 0;
}
static int32_t no_recv(void *, int32_t, void *, size_t) { return 1; }

static void test_host_group() {
    epcomm_host_callbacks cb{};
    cb.struct_size = sizeof cb;
    cb.send = no_send;
    cb.recv = no_recv;
    cb.all_gather = copy_gather;
    int shrinks = 0;
    cb.user_data = &shrinks;
    cb.lost_ranks = none_lost;
    cb.shrink = count_shrinks;
    epcomm::Group g = epcomm::Group::host(cb, "cpphost", 0, 1);
    CHECK(g.rank() == 0 && g.size() == 1);
    CHECK(g.all_gather(int64_t{42}) == I64{42});
    CHECK(g.lost_ranks() == std::vector<int32_t>{0});
    {
        epcomm::Group s = g.shrink({});
        CHECK(shrinks == 1 && s.size() == 1 && s.all_gather(int64_t{7}) == I64{7});
    }
    CHECK_THROWS(g.alloc(64), EPCOMM_ERROR_UNAVAILABLE, NO_WINDOWS);
    epcomm::MoeConfig c;
    c.experts(2).top_k(1).hidden_size(4).dtypes(epcomm::f32()).max_tokens_per_rank(2);
    epcomm::All2All a(g, "deepep_low_latency", c);
    std::vector<float> x = {1, 2, 3, 4};
    std::vector<int64_t> ids = {1};
    std::vector<float> w = {1.0f};
    a.dispatch(epcomm::Tensor::of(x, {1, 4}), epcomm::Tensor::of(ids, {1, 1}), epcomm::Tensor::of(w, {1, 1}));
    CHECK_THROWS(a.expert_output_buffer(), EPCOMM_ERROR_UNAVAILABLE, NO_BUFFER);
#if __cplusplus >= 202002L
    // C++20: views of std::span.
    std::span<float> s(x);
    CHECK(epcomm::Tensor::of(s, {2, 2}).data() == x.data() && epcomm::Tensor::of(s, {4}).numel() == 4);
#endif
}

static void test_round_trip(const std::string &name) {
    epcomm::Group g = epcomm::Group::shm(name, 0, 1);
    CHECK(g.rank() == 0 && g.size() == 1);
    epcomm_moe_config cfg = epcomm::moe_config();
    cfg.num_experts = 4;
    cfg.top_k = 2;
    cfg.hidden_size = 3;
    cfg.hidden_dtype = epcomm::f32();
    cfg.expert_dtype = epcomm::f32();
    cfg.out_dtype = epcomm::f32();
    cfg.max_tokens_per_rank = 4;
    epcomm::All2All a2a(g, "deepep_high_throughput", cfg);
    std::vector<float> x = {1, 2, 3, 4, 5, 6};
    std::vector<int32_t> ids = {0, 3, 1, -1};
    std::vector<float> w = {0.5f, 0.5f, 1.0f, 0.0f};
    epcomm_dispatch_output out = a2a.dispatch(epcomm::Tensor::of(x, {2, 3}), epcomm::Tensor::of(ids, {2, 2}),
                                              epcomm::Tensor::of(w, {2, 2}));
    epcomm::Tensor hidden(out.hidden);
    CHECK(hidden.shape() == (I64{2, 3}));
    // Expert side: each row weighted and summed over this rank's experts, expert e = (e+1)*x.
    const int64_t *rid = static_cast<const int64_t *>(out.topk_ids.data);
    const float *rw = static_cast<const float *>(out.topk_weights.data);
    std::vector<float> y(6, 0.0f);
    for (int r = 0; r < 2; ++r)
        for (int k = 0; k < 2; ++k)
            if (rid[r * 2 + k] >= 0)
                for (int h = 0; h < 3; ++h)
                    y[r * 3 + h] += rw[r * 2 + k] * float(rid[r * 2 + k] + 1) * hidden.as<float>()[r * 3 + h];
    std::vector<float> combined(6, -1.0f);
    a2a.combine(epcomm::Tensor::of(y, {2, 3}), epcomm::Tensor::of(combined, {2, 3}));
    // Token 0: 0.5*1*x + 0.5*4*x = 2.5x; token 1: 1*2*x = 2x.
    const float want[6] = {2.5f, 5.0f, 7.5f, 8.0f, 10.0f, 12.0f};
    CHECK(std::memcmp(combined.data(), want, sizeof want) == 0);
    CHECK(a2a.stats().world_size == 1);
    // Typed views: no casts; each output's element type and shape.
    const epcomm::Dispatched d = a2a.dispatch(epcomm::Tensor::of(x, {2, 3}), epcomm::Tensor::of(ids, {2, 2}),
                                              epcomm::Tensor::of(w, {2, 2}));
    CHECK(d.layout == EPCOMM_LAYOUT_TOKEN_MAJOR && d.received_rows == 2);
    const epcomm::View<float> rows = d.hidden_as<float>();
    CHECK(rows.shape() == (I64{2, 3}) && rows.size() == 6 && rows(1, 2) == 6.0f && rows[3] == 4.0f);
    CHECK(d.topk_ids.shape() == (I64{2, 2}) && d.topk_ids(0, 1) == 3 && d.topk_ids(1, 1) == -1);
    CHECK(d.topk_weights(0, 0) == 0.5f && d.topk_weights(1, 1) == 0.0f);
    CHECK(d.counts.shape() == (I64{4}) && d.counts[0] == 1 && d.counts[1] == 1 && d.counts[3] == 1);
    CHECK(d.expert_offsets.empty() && d.expert_offsets_i32.empty() && d.src_rank.empty() && d.extras.empty());
    float sum = 0;
    for (float v : rows) sum += v;
    CHECK(sum == 21.0f);
    CHECK(epcomm::same_dtype(d.topk_ids.tensor().dtype(), epcomm::i64()));
    const epcomm_dispatch_output &c_struct = d;  // code written against the C struct still works
    CHECK(c_struct.hidden.data == rows.data());
    CHECK_THROWS(d.hidden_as<epcomm::bfloat16>(), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "dispatch output 'hidden' holds float elements; View<bfloat16> cannot view it");
    // Combine takes the dispatch shape or the flat one; errors name element types in C terms
    // (the Python package shows PyTorch's names: epcomm_last_error_message_torch).
    std::vector<double> wide(6);
    CHECK_THROWS(a2a.combine(epcomm::Tensor::of(wide, {2, 3}), epcomm::Tensor::of(combined, {2, 3})),
                 EPCOMM_ERROR_INVALID_ARGUMENT,
                 "tensor 'expert_output' has dtype float64 (kDLFloat, 64 bits); the manager was created for "
                 "float32 (kDLFloat, 32 bits)");
    std::vector<int16_t> bad_w(4);
    CHECK_THROWS(a2a.dispatch(epcomm::Tensor::of(x, {2, 3}), epcomm::Tensor::of(ids, {2, 2}),
                              epcomm::Tensor(bad_w.data(), epcomm::dtype(0, 16), {2, 2})),
                 EPCOMM_ERROR_INVALID_ARGUMENT,
                 "tensor 'topk_weights' has dtype int16 (kDLInt, 16 bits); expected float32 (kDLFloat, 32 bits)");
    CHECK(std::string(epcomm_last_error_message_torch()) ==
          "tensor 'topk_weights' has dtype torch.int16; expected torch.float32");
    // A device view is refused by the host manager, naming it.
    epcomm::Tensor on_gpu = epcomm::Tensor::of(x, {2, 3});
    on_gpu.on(EPCOMM_DEVICE_CUDA, 1);
    CHECK(on_gpu.device().device_type == EPCOMM_DEVICE_CUDA && on_gpu.device().device_id == 1);
    CHECK_THROWS(a2a.dispatch(on_gpu, epcomm::Tensor::of(ids, {2, 2}), epcomm::Tensor::of(w, {2, 2})),
                 EPCOMM_ERROR_INVALID_ARGUMENT,
                 "tensor 'hidden' is on device type CUDA (2); the host-tensor functions take host memory "
                 "(EPCOMM_DEVICE_CPU = 1): use epcomm_gpu_all2all_dispatch / epcomm_gpu_all2all_combine for "
                 "CUDA tensors");
    // Fault tolerance is for deepep_low_latency and nixl_ep only (vLLM's ValueError in
    // vllm/v1/worker/sentinel/gpu_worker_sentinel.py).
    epcomm::MoeConfig ft;
    ft.experts(4).top_k(2).hidden_size(3).dtypes(epcomm::f32()).max_tokens_per_rank(4).fault_tolerance(true);
    CHECK(ft.get().enable_fault_tolerance);
    CHECK_THROWS(epcomm::All2All(g, "deepep_high_throughput", ft), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "Fault tolerance requires an FT-capable all2all backend (one of ['deepep_low_latency', "
                 "'nixl_ep']), but got 'deepep_high_throughput'.");
    epcomm::All2All tolerant(g, "deepep_low_latency", ft);
    CHECK(tolerant.active_mask() == std::vector<int32_t>{0} && !tolerant.query_fault());
    CHECK_NOTHROW(tolerant.clean_buffers());
    epcomm::All2All moved = std::move(a2a);
    try {
        moved.check_layer(3, 4);
        CHECK(false);
    } catch (const epcomm::Error &e) {
        CHECK(e.status() == EPCOMM_ERROR_INVALID_ARGUMENT);
    }
    // close(): the group first (its managers keep it alive: they still dispatch), then a
    // manager; a second close is a no-op; a closed handle's calls name the NULL argument.
    CHECK_NOTHROW(g.close());
    CHECK_NOTHROW(g.close());
    CHECK_THROWS(g.barrier(), EPCOMM_ERROR_NULL_POINTER, "argument 'group' must not be NULL");
    CHECK_NOTHROW(moved.dispatch(epcomm::Tensor::of(x, {2, 3}), epcomm::Tensor::of(ids, {2, 2}),
                                 epcomm::Tensor::of(w, {2, 2})));
    CHECK_NOTHROW(moved.close());
    CHECK_NOTHROW(moved.close());
    CHECK_THROWS(moved.check_layer(2, 4), EPCOMM_ERROR_NULL_POINTER, "argument 'a2a' must not be NULL");
}

static void test_names() {
    const std::vector<epcomm_all2all_name_desc> names = epcomm::all2all_names();
    CHECK(names.size() == 14 && names.size() == epcomm_all2all_name_count());
    if (names.size() == 14) {
        CHECK(std::string(names[0].name) == "naive" && names[0].kind == EPCOMM_NAME_REMOVED);
        CHECK(names[0].backend == EPCOMM_ALL2ALL_ALLGATHER_REDUCESCATTER);
        CHECK(std::string(names[0].manager_class) == "AgRsAll2AllManager");
        CHECK(std::string(names[8].name) == "mori" && names[8].backend == EPCOMM_ALL2ALL_MORI);
        CHECK(std::string(names[11].name) == "flashinfer_all2allv" && names[11].kind == EPCOMM_NAME_ALIAS);
        CHECK(names[11].layout == EPCOMM_LAYOUT_RANK_MAJOR);
        CHECK(std::string(names[13].name) == "flashinfer_nvlink_one_sided");
    }
    CHECK(epcomm::backend_is_known("naive") && !epcomm::backend_is_known("flashinfer-nvlink-2s"));
    CHECK(epcomm::backend_is_known("passthrough"));
    CHECK(epcomm::backend_name(EPCOMM_ALL2ALL_PASSTHROUGH) == std::string("passthrough"));
    CHECK(epcomm::backend_name(EPCOMM_ALL2ALL_DEEPEP_LOW_LATENCY) == std::string("deepep_low_latency"));
    CHECK(!epcomm::backend_name(12).has_value() && !epcomm::backend_name(-1).has_value());
    CHECK(epcomm::backend_manager_class(EPCOMM_ALL2ALL_DEEPEP_LOW_LATENCY) == std::string("DeepEPLLAll2AllManager"));
    CHECK(!epcomm::backend_manager_class(12).has_value());
    CHECK(epcomm::backend_layout(EPCOMM_ALL2ALL_DEEPEP_V2) == EPCOMM_LAYOUT_EXPERT_PACKED);
    CHECK(epcomm::backend_layout(EPCOMM_ALL2ALL_MOONEP) == EPCOMM_LAYOUT_MOONEP_SLOTS);
    CHECK_THROWS(epcomm::backend_layout(12), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "all2all backend 12 is not valid: expected an EPCOMM_ALL2ALL_* value in 0..10");
    CHECK(epcomm::layout_name(EPCOMM_LAYOUT_EXPERT_MAJOR) == std::string("EXPERT_MAJOR"));
    CHECK(epcomm::layout_name(EPCOMM_LAYOUT_REPLICATED) == std::string("REPLICATED"));
    CHECK(!epcomm::layout_name(6).has_value());
}

static void test_eplb_select() {
    epcomm_eplb_select_request req = epcomm::eplb_select_request();
    CHECK(req.struct_size == sizeof req && req.communicator == nullptr);
    CHECK(req.device_type == EPCOMM_DEVICE_CPU && req.nccl_available == EPCOMM_PROBE);
    req.nccl_available = 0;
    req.nixl_available = 0;
    CHECK(epcomm::eplb_communicator_select(req) == EPCOMM_EPLB_TORCH_GLOO);
    req.communicator = "bogus";
    CHECK_THROWS(epcomm::eplb_communicator_select(req), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "Unknown EPLB communicator backend: bogus");
    req = epcomm::eplb_select_request("pynccl");
    CHECK_THROWS(epcomm::eplb_communicator_select(req), EPCOMM_ERROR_RUNTIME,
                 "EPLB communicator 'pynccl' supports only cuda-like devices (got cpu).");
    CHECK(epcomm::eplb_communicator_name(EPCOMM_EPLB_TORCH_XCCL) == std::string("torch_xccl"));
    CHECK(epcomm::eplb_communicator_class(EPCOMM_EPLB_PYNCCL) == std::string("PyNcclEplbCommunicator"));
    CHECK(epcomm::eplb_communicator_name(EPCOMM_EPLB_SYMM_MEM) == std::string("symm_mem"));
    CHECK(!epcomm::eplb_communicator_name(6).has_value() && !epcomm::eplb_communicator_class(-1).has_value());
}

// A log sink sees vLLM's warnings, bare; it is gone with its scope (the default returns).
static void test_logging() {
    std::vector<std::pair<int32_t, std::string>> seen;
    {
        epcomm::LogSink sink([&](int32_t level, const std::string &m) { seen.emplace_back(level, m); });
        CHECK(epcomm::resolve_backend("naive") == EPCOMM_ALL2ALL_ALLGATHER_REDUCESCATTER);
    }
    CHECK(seen.size() == 1);
    if (!seen.empty()) {
        CHECK(seen[0].first == EPCOMM_LOG_WARN);
        CHECK(seen[0].second ==
              "The 'naive' all2all backend has been removed. Falling back to 'allgather_reducescatter'.");
    }
    epcomm::set_log_level(EPCOMM_LOG_ERROR);
    CHECK(epcomm::resolve_backend("pplx") == EPCOMM_ALL2ALL_ALLGATHER_REDUCESCATTER);  // stderr: nothing
    epcomm::set_log_level(EPCOMM_LOG_WARN);
    CHECK_THROWS(epcomm::set_log_level(0), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "log level 0 is not valid: expected EPCOMM_LOG_ERROR (1), EPCOMM_LOG_WARN (2), "
                 "EPCOMM_LOG_INFO (3) or EPCOMM_LOG_DEBUG (4)");
    epcomm::set_log_callback(nullptr, nullptr);
}

// The builder fills the C struct; buffer sizes follow from it (worst-case rows x row bytes,
// plus combine's float32 accumulator of T x H).
static void test_moe_config() {
    epcomm::MoeConfig c;
    c.experts(4).top_k(2).hidden_size(8).dtypes(epcomm::f32()).max_tokens_per_rank(4);
    const epcomm_moe_config &raw = c;
    CHECK(raw.struct_size == sizeof(epcomm_moe_config));
    CHECK(raw.num_experts == 4 && raw.top_k == 2 && raw.hidden_size == 8 && raw.max_tokens_per_rank == 4);
    CHECK(epcomm::same_dtype(raw.expert_dtype, epcomm::f32()) && epcomm::same_dtype(raw.out_dtype, epcomm::f32()));
    CHECK(raw.dispatch_fp8 == EPCOMM_DISPATCH_FP8_OFF && raw.extra_row_bytes == nullptr && raw.num_extras == 0);
    // deepep_low_latency: E/R * M * R rows of 32 bytes + 4 * 8 * 4 = 640.
    CHECK(epcomm::all2all_buffer_bytes("deepep_low_latency", c, 2, 4) == 640);
    // deepep_high_throughput: R * T rows of 32 + 12 K metadata bytes: 8 * 56 + 128 = 576.
    CHECK(epcomm::all2all_buffer_bytes("deepep_high_throughput", c, 2, 4) == 576);
    epcomm::MoeConfig copy = c;
    copy.extra_row_bytes({16}).dispatch_fp8(epcomm::Fp8::E4M3_UE8M0).redundant_experts(0);
    CHECK(copy.get().num_extras == 1 && copy.get().extra_row_bytes[0] == 16);
    CHECK(copy.get().dispatch_fp8 == EPCOMM_DISPATCH_FP8_E4M3_UE8M0);
    CHECK(c.get().num_extras == 0);
    // 16 rows of 48 bytes + 128.
    CHECK(epcomm::all2all_buffer_bytes("deepep_low_latency", copy, 2, 4) == 896);
    CHECK_THROWS(epcomm::all2all_buffer_bytes("bogus", c, 2, 4), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "Unknown all2all backend: bogus");
}

// Exports own their shape; each deleter runs the release function once; a failure allocates
// nothing and never runs it (LeakSanitizer sees the wrapper's state freed either way).
static void test_dlpack() {
    std::vector<float> data = {0, 1, 2, 3, 4, 5};
    int released = 0;
    const size_t before = epcomm::dlpack_live();
    {
        epcomm::Tensor t = epcomm::Tensor::of(data, {2, 3});
        epcomm::DLPackExport plain(t, false, [&] { ++released; });
        epcomm::DLPackExport versioned(t, true, [&] { ++released; });
        epcomm::DLPackExport quiet(t, false);
        CHECK(epcomm::dlpack_live() == before + 3);
        CHECK(plain.managed() != nullptr && plain.managed_versioned() == nullptr && !plain.is_versioned());
        CHECK(versioned.managed_versioned() != nullptr && versioned.managed() == nullptr);
        const epcomm_dlpack_managed_versioned *v = versioned.managed_versioned();
        CHECK(v->version.major == 1 && v->version.minor == 0 && v->flags == 0);
        CHECK(plain.tensor().data == data.data() && plain.tensor().shape != t.get()->shape);
        CHECK(plain.tensor().ndim == 2 && plain.tensor().shape[0] == 2 && plain.tensor().shape[1] == 3);
        CHECK(versioned.tensor().strides == nullptr && epcomm::same_dtype(versioned.tensor().dtype, epcomm::f32()));
        // Handed to a consumer, which calls the deleter itself.
        epcomm_dlpack_managed *consumer = static_cast<epcomm_dlpack_managed *>(plain.release());
        CHECK(plain.managed() == nullptr && released == 0);
        consumer->deleter(consumer);
        CHECK(released == 1 && epcomm::dlpack_live() == before + 2);
        epcomm::DLPackExport moved = std::move(versioned);
        CHECK(moved.managed_versioned() == v && released == 1);
    }
    CHECK(released == 2 && epcomm::dlpack_live() == before);
    epcomm_tensor bad = *epcomm::Tensor::of(data, {6}).get();
    bad.ndim = -1;
    CHECK_THROWS(epcomm::DLPackExport(bad, true, [&] { ++released; }), EPCOMM_ERROR_INVALID_ARGUMENT,
                 "tensor->ndim is -1; expected 0 or more dimensions");
    CHECK(released == 2 && epcomm::dlpack_live() == before);
}

// GpuAll2All::dispatch returns the typed views All2All::dispatch does (epcomm::Dispatched), of
// CUDA memory, and combine takes them. Compiled everywhere; run where a manager can be made,
// with host tensors, which it refuses naming the device it is for.
static epcomm::Dispatched gpu_step(epcomm::GpuAll2All &a, void *stream, const epcomm::Tensor &x,
                                   const epcomm::Tensor &ids, const epcomm::Tensor &w, const epcomm::Tensor &out) {
    epcomm::Dispatched d = a.dispatch(stream, x, ids, w);
    const epcomm::View<float> rows = d.hidden_as<float>();
    CHECK(rows.device().device_type == EPCOMM_DEVICE_CUDA && rows.tensor().device().device_type == EPCOMM_DEVICE_CUDA);
    CHECK(d.topk_weights.device().device_type == EPCOMM_DEVICE_CUDA || d.topk_weights.empty());
    CHECK(d.expert_offsets.empty());  // a GPU manager's are int32: expert_offsets_i32
    a.combine(stream, rows.tensor(), out);
    return d;
}

// A one-rank GPU manager: its device pool, and gpu_step with host tensors.
static void gpu_one_rank(const epcomm::MoeConfig &c) {
    epcomm::NcclUniqueId id = epcomm::nccl_unique_id();
    epcomm::GpuAll2All a("deepep_low_latency", c, id, 0, 1, 0, epcomm::GpuMode::Capacity);
    const epcomm_gpu_all2all_stats st = a.stats();
    CHECK(st.pool_reserved_bytes > 0 && st.pool_reallocations == 0);
    std::vector<float> x(2 * 16), w(4, 0.5f), out(2 * 16);
    std::vector<int64_t> ids = {0, 1, 2, 3};
    CHECK_THROWS(gpu_step(a, nullptr, epcomm::Tensor::of(x, {2, 16}), epcomm::Tensor::of(ids, {2, 2}),
                          epcomm::Tensor::of(w, {2, 2}), epcomm::Tensor::of(out, {2, 16})),
                 EPCOMM_ERROR_INVALID_ARGUMENT,
                 "tensor 'hidden' is on device type CPU (1) id 0; expected CUDA device memory "
                 "(EPCOMM_DEVICE_CUDA = 2) on device 0, the device the GPU all2all handle was created for");
}

// Without CUDA/NCCL (or this build's nccl feature) the GPU manager reports why, after checking
// its arguments; with both, a one-rank manager is created.
static void test_gpu() {
    const std::string nccl = error_of([] { epcomm::nccl_version(); });
    const std::string cuda = error_of([] { epcomm::cuda_check(); });
    const bool no_feature = nccl == "NCCL is unavailable: epcomm was built without the 'nccl' feature";
    epcomm::MoeConfig c;
    c.experts(8).top_k(2).hidden_size(16).max_tokens_per_rank(4);
    const epcomm::NcclUniqueId zero{};
    CHECK_THROWS(epcomm::GpuAll2All("deepep_low_latency", c, zero, 2, 2, 0, epcomm::GpuMode::Counts),
                 EPCOMM_ERROR_INVALID_ARGUMENT, "rank 2 is not in a group of 2 ranks");
    CHECK_THROWS(epcomm::GpuAll2All::from_comm("deepep_low_latency", c, nullptr, 0, epcomm::GpuMode::Capacity),
                 EPCOMM_ERROR_NULL_POINTER, "argument 'nccl_comm' must not be NULL");
    if (nccl.empty() && cuda.empty()) {
        CHECK_NOTHROW(gpu_one_rank(c));
        return;
    }
    const std::string why = no_feature || cuda.empty() ? nccl : cuda;
    CHECK(no_feature || cuda.rfind("CUDA is unavailable: ", 0) == 0 || nccl.rfind("NCCL is unavailable: ", 0) == 0);
    CHECK_THROWS(epcomm::GpuAll2All("deepep_low_latency", c, zero, 0, 1, 0, epcomm::GpuMode::Counts),
                 EPCOMM_ERROR_UNAVAILABLE, why);
    if (!nccl.empty()) {
        CHECK_THROWS(epcomm::nccl_unique_id(), EPCOMM_ERROR_UNAVAILABLE, nccl);
    }
    CHECK(epcomm::nixl_available() == epcomm_nixl_available());
}

int main(int argc, char **argv) {
    const std::string name = argc > 1 ? argv[1] : "cppwrap";
    test_errors_and_config();
    test_groups();
    test_round_trip(name);
    test_host_group();
    test_names();
    test_eplb_select();
    test_logging();
    test_moe_config();
    test_dlpack();
    test_gpu();
    return test_report();
}
