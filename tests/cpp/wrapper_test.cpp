// The C++17 wrapper (include/epcomm.hpp): exceptions carry vLLM's message and class, RAII
// handles, tensors from vectors, a one-rank MoE round trip and the EPLB policy.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "epcomm.hpp"

static int passed = 0, failed = 0;
#define CHECK(cond)                                                            \
    do {                                                                       \
        if (cond) {                                                            \
            ++passed;                                                          \
        } else {                                                               \
            ++failed;                                                          \
            std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                      \
    } while (0)

int main(int argc, char **argv) {
    std::string name = argc > 1 ? argv[1] : "cppwrap";
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
    try {
        epcomm::check_config("{\"enable_elastic_ep\": true}");
        CHECK(false);
    } catch (const epcomm::Error &e) {
        CHECK(std::string(e.what()) == "Elastic EP is only supported with enable_eplb=True.");
    }
    CHECK(epcomm::config_report("{}").find("\"ok\":true") != std::string::npos);
    {
        const std::string caps = epcomm::cuda_caps();
        CHECK(caps.front() == '{' && caps.back() == '}');
        CHECK(caps.find("\"cuda\"") != std::string::npos && caps.find("\"nccl\"") != std::string::npos);
    }

    {
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
    }

    {
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
        CHECK(hidden.shape() == (std::vector<int64_t>{2, 3}));
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
        epcomm::All2All moved = std::move(a2a);
        try {
            moved.check_layer(3, 4);
            CHECK(false);
        } catch (const epcomm::Error &e) {
            CHECK(e.status() == EPCOMM_ERROR_INVALID_ARGUMENT);
        }
    }

    std::vector<float> load = {90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86};
    std::vector<int64_t> p2l = epcomm::eplb_rebalance(load, 1, 12, 16, 4, 2, 8);
    const int64_t want_p2l[16] = {5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1};
    CHECK(std::memcmp(p2l.data(), want_p2l, sizeof want_p2l) == 0);
    try {
        epcomm::eplb_rebalance({10, 20, 30, 40}, 1, 4, 7, 2, 2, 4);
        CHECK(false);
    } catch (const epcomm::Error &e) {
        CHECK(e.exception_class() == "AssertionError");
    }
    std::printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
