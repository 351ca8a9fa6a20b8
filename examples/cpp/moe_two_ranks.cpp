// One MoE dispatch/combine step through the C++ wrapper on two forked ranks, over shared memory
// (the worked example of docs/design.md, section 3): every backend gives rank 0 "20 13.75 48"
// and rank 1 "70 42".
//
//   c++ -std=c++17 moe_two_ranks.cpp $(pkg-config --cflags --libs epcomm) -o moe_two_ranks
//   or with CMake: see CMakeLists.txt next to this file.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include <epcomm.hpp>

static int run_rank(int rank, const std::string &backend, const std::string &name) {
    try {
        epcomm::Group g = epcomm::Group::shm(name, rank, 2);
        epcomm_moe_config cfg = epcomm::moe_config();
        cfg.num_experts = 4;
        cfg.top_k = 2;
        cfg.hidden_size = 1;
        cfg.max_tokens_per_rank = 3;
        cfg.hidden_dtype = cfg.expert_dtype = cfg.out_dtype = epcomm::f32();
        epcomm::All2All a2a(g, backend, cfg);
        std::vector<float> x = rank == 0 ? std::vector<float>{10, 11, 12} : std::vector<float>{20, 21};
        std::vector<int32_t> ids = rank == 0 ? std::vector<int32_t>{0, 2, 1, 0, 3, -1} : std::vector<int32_t>{2, 3, 1, -1};
        std::vector<float> w = rank == 0 ? std::vector<float>{0.5f, 0.5f, 0.25f, 0.75f, 1, 0}
                                         : std::vector<float>{0.5f, 0.5f, 1, 0};
        int64_t t = static_cast<int64_t>(x.size());
        epcomm_dispatch_output d = a2a.dispatch(epcomm::Tensor::of(x, {t, 1}), epcomm::Tensor::of(ids, {t, 2}),
                                                epcomm::Tensor::of(w, {t, 2}));
        epcomm::Tensor hidden(d.hidden);
        std::vector<float> y(static_cast<size_t>(hidden.numel()), 0.0f);
        for (int64_t r = 0; r < hidden.numel(); ++r) {
            float xr = hidden.as<float>()[r];
            if (d.layout == EPCOMM_LAYOUT_EXPERT_MAJOR || d.layout == EPCOMM_LAYOUT_EXPERT_PACKED) {
                int64_t j = d.layout == EPCOMM_LAYOUT_EXPERT_MAJOR
                                ? r / hidden.shape()[1]
                                : (r < static_cast<const int64_t *>(d.expert_offsets.data)[1] ? 0 : 1);
                y[r] = float(rank * 2 + j + 1) * xr;
            } else {
                auto ri = static_cast<const int64_t *>(d.topk_ids.data);
                auto rw = static_cast<const float *>(d.topk_weights.data);
                for (int k = 0; k < 2; ++k)
                    if (ri[r * 2 + k] >= 0 && ri[r * 2 + k] / 2 == rank)
                        y[r] += rw[r * 2 + k] * float(ri[r * 2 + k] + 1) * xr;
            }
        }
        std::vector<float> out(static_cast<size_t>(t), 0.0f);
        a2a.combine(epcomm::Tensor(y.data(), epcomm::f32(), hidden.shape()), epcomm::Tensor::of(out, {t, 1}));
        std::printf("rank %d (%s):", rank, backend.c_str());
        for (float v : out) std::printf(" %g", v);
        std::printf("\n");
        return 0;
    } catch (const epcomm::Error &e) {
        std::fprintf(stderr, "%s: %s\n", e.exception_class().c_str(), e.what());
        return 1;
    }
}

int main(int argc, char **argv) {
    std::string backend = argc > 1 ? argv[1] : "deepep_low_latency";
    std::string name = "example-cpp-" + std::to_string(getpid());
    pid_t kids[2];
    for (int r = 0; r < 2; ++r) {
        kids[r] = fork();
        if (kids[r] == 0) {
            int rc = run_rank(r, backend, name);
            fflush(stdout);
            _exit(rc);
        }
    }
    bool ok = true;
    for (pid_t k : kids) {
        int status = 0;
        waitpid(k, &status, 0);
        ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    }
    return ok ? 0 : 1;
}
