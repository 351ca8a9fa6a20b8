// epcomm.hpp: a header-only C++17 wrapper over epcomm.h.
//
// RAII handles (Group, All2All), exceptions carrying the status, vLLM's
// message, the hint and the Python exception class vLLM raises, and tensor helpers that build
// the DLPack-layout epcomm_tensor from pointers, std::vector or (C++20) std::span.
//
//   epcomm::Group g = epcomm::Group::shm("ep0", rank, 2);
//   epcomm::All2All a2a(g, "deepep_high_throughput", cfg);
//   auto out = a2a.dispatch(epcomm::Tensor::of(x.data(), {T, H}), ...);
//
// Errors throw epcomm::Error; nothing here hides a failure.
#ifndef EPCOMM_HPP
#define EPCOMM_HPP

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
#if __cplusplus >= 202002L
#include <span>
#endif

#include "epcomm.h"

namespace epcomm {

/// A failed epcomm call: the status code, the message (vLLM's wording where vLLM has one), the
/// optional hint, and the Python exception class vLLM raises for it.
class Error : public std::runtime_error {
public:
    Error(int32_t status, const std::string &message, std::string hint, std::string exception_class)
        : std::runtime_error(message), status_(status), hint_(std::move(hint)),
          exception_class_(std::move(exception_class)) {}
    int32_t status() const noexcept { return status_; }
    const std::string &hint() const noexcept { return hint_; }
    const std::string &exception_class() const noexcept { return exception_class_; }

private:
    int32_t status_;
    std::string hint_;
    std::string exception_class_;
};

/// Throws epcomm::Error for a non-OK status (with this thread's last error).
inline void check(int32_t status) {
    if (status == EPCOMM_OK) {
        return;
    }
    const char *message = epcomm_last_error_message();
    const char *hint = epcomm_last_error_hint();
    const char *cls = epcomm_status_exception(status);
    throw Error(status, message ? message : epcomm_status_string(status), hint ? hint : "",
                cls ? cls : "RuntimeError");
}

inline std::string version() { return epcomm_version(); }

/// The one owner of a C handle (move-only): released with `Destroy` (NULL-safe) when it goes.
template <class T, void (*Destroy)(T *)> class Owned {
public:
    Owned() noexcept = default;
    explicit Owned(T *p) noexcept : p_(p) {}
    Owned(Owned &&o) noexcept : p_(o.p_) { o.p_ = nullptr; }
    Owned &operator=(Owned &&o) noexcept {
        if (this != &o) {
            Destroy(p_);
            p_ = o.p_;
            o.p_ = nullptr;
        }
        return *this;
    }
    Owned(const Owned &) = delete;
    Owned &operator=(const Owned &) = delete;
    ~Owned() { Destroy(p_); }

    T *get() const noexcept { return p_; }
    /// Where a create call writes the new handle.
    T **out() noexcept { return &p_; }

private:
    T *p_ = nullptr;
};

// ---- element types --------------------------------------------------------------------------

inline constexpr epcomm_dtype dtype(uint8_t code, uint8_t bits) { return epcomm_dtype{code, bits, 1}; }
inline constexpr epcomm_dtype f32() { return dtype(2, 32); }
inline constexpr epcomm_dtype f16() { return dtype(2, 16); }
inline constexpr epcomm_dtype bf16() { return dtype(4, 16); }
inline constexpr epcomm_dtype i32() { return dtype(0, 32); }
inline constexpr epcomm_dtype i64() { return dtype(0, 64); }
inline constexpr epcomm_dtype u8() { return dtype(1, 8); }

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr epcomm_dtype value = dtype(2, 32); };
template <> struct dtype_of<double> { static constexpr epcomm_dtype value = dtype(2, 64); };
template <> struct dtype_of<int32_t> { static constexpr epcomm_dtype value = dtype(0, 32); };
template <> struct dtype_of<int64_t> { static constexpr epcomm_dtype value = dtype(0, 64); };
template <> struct dtype_of<uint8_t> { static constexpr epcomm_dtype value = dtype(1, 8); };
template <> struct dtype_of<int8_t> { static constexpr epcomm_dtype value = dtype(0, 8); };

// ---- tensors --------------------------------------------------------------------------------

/// A contiguous host tensor view (epcomm never owns the memory); keeps its own shape array.
class Tensor {
public:
    Tensor(void *data, epcomm_dtype type, std::vector<int64_t> shape)
        : shape_(std::move(shape)), t_{} {
        t_.data = data;
        t_.device.device_type = EPCOMM_DEVICE_CPU;
        t_.device.device_id = 0;
        t_.dtype = type;
        repoint();
    }
    /// A view of `data` with the element type of T (bfloat16/float16 data: use the
    /// constructor with epcomm::bf16() / epcomm::f16()).
    template <class T> static Tensor of(T *data, std::vector<int64_t> shape) {
        return Tensor(const_cast<void *>(static_cast<const void *>(data)), dtype_of<typename std::remove_const<T>::type>::value, std::move(shape));
    }
    template <class T> static Tensor of(std::vector<T> &v, std::vector<int64_t> shape) {
        return of(v.data(), std::move(shape));
    }
#if __cplusplus >= 202002L
    template <class T> static Tensor of(std::span<T> s, std::vector<int64_t> shape) {
        return of(s.data(), std::move(shape));
    }
#endif
    /// Adopts a view epcomm returned (e.g. a dispatch output), copying its shape.
    explicit Tensor(const epcomm_tensor &t)
        : shape_(t.shape, t.shape + (t.ndim > 0 ? t.ndim : 0)), t_(t) {
        t_.strides = nullptr;
        repoint();
    }
    Tensor(const Tensor &o) : shape_(o.shape_), t_(o.t_) { repoint(); }
    Tensor &operator=(const Tensor &o) {
        shape_ = o.shape_;
        t_ = o.t_;
        repoint();
        return *this;
    }
    Tensor(Tensor &&o) noexcept : shape_(std::move(o.shape_)), t_(o.t_) { repoint(); }
    Tensor &operator=(Tensor &&o) noexcept {
        shape_ = std::move(o.shape_);
        t_ = o.t_;
        repoint();
        return *this;
    }

    const epcomm_tensor *get() const noexcept { return &t_; }
    const std::vector<int64_t> &shape() const noexcept { return shape_; }
    void *data() const noexcept { return t_.data; }
    int64_t numel() const noexcept {
        int64_t n = 1;
        for (int64_t d : shape_) n *= d;
        return n;
    }
    template <class T> T *as() const noexcept { return static_cast<T *>(t_.data); }

private:
    void repoint() {
        t_.ndim = static_cast<int32_t>(shape_.size());
        t_.shape = shape_.data();
    }
    std::vector<int64_t> shape_;
    epcomm_tensor t_;
};

// ---- selection and configuration --------------------------------------------------------------

/// Resolves an all2all backend name (EPCOMM_ALL2ALL_*), with vLLM's warnings.
inline int32_t resolve_backend(const std::string &name) {
    int32_t b = -1;
    check(epcomm_all2all_backend_resolve(name.c_str(), &b));
    return b;
}

/// Checks a vLLM-style configuration (JSON); throws vLLM's error.
inline void check_config(const std::string &json) { check(epcomm_config_check(json.c_str())); }

/// The JSON report of a configuration check (verdict, resolution, warnings).
inline std::string config_report(const std::string &json) {
    size_t len = 0;
    check(epcomm_config_check_report(json.c_str(), nullptr, 0, &len));
    std::string out(len + 1, '\0');
    check(epcomm_config_check_report(json.c_str(), &out[0], out.size(), &len));
    out.resize(len);
    return out;
}

/// The GPU capability probe as JSON (CUDA driver and devices, NCCL, NVRTC; each part has
/// "available" and, when false, a "reason"). Works on machines without CUDA.
inline std::string cuda_caps() {
    size_t needed = 0;
    check(epcomm_cuda_caps(nullptr, 0, &needed));
    std::string out(needed, '\0');
    check(epcomm_cuda_caps(&out[0], out.size(), &needed));
    out.resize(needed > 0 ? needed - 1 : 0);  // needed counts the NUL
    return out;
}

// ---- groups -----------------------------------------------------------------------------------

/// A process group (move-only). Collectives must be called by every rank in the same order.
class Group {
public:
    /// Creates (rank 0) or joins the shared-memory group `name` of `world_size` ranks.
    static Group shm(const std::string &name, int32_t rank, int32_t world_size,
                     const epcomm_group_options *options = nullptr) {
        epcomm_group *g = nullptr;
        check(epcomm_group_create_shm(name.c_str(), rank, world_size, options, &g));
        return Group(g);
    }
    /// A fresh group id (as ncclGetUniqueId): made on one rank, passed to the others by the
    /// host's own means, then given to `shm_unique` on every rank.
    static epcomm_unique_id unique_id() {
        epcomm_unique_id id;
        check(epcomm_group_unique_id(&id));
        return id;
    }
    /// Creates or joins the shared-memory group of the id `id` (no name needed).
    static Group shm_unique(const epcomm_unique_id &id, int32_t rank, int32_t world_size,
                            const epcomm_group_options *options = nullptr) {
        epcomm_group *g = nullptr;
        check(epcomm_group_create_shm_unique(&id, rank, world_size, options, &g));
        return Group(g);
    }
    /// A group over the host's transport callbacks.
    static Group host(const epcomm_host_callbacks &callbacks, const std::string &name, int32_t rank,
                      int32_t world_size, const epcomm_group_options *options = nullptr) {
        epcomm_group *g = nullptr;
        check(epcomm_group_create_host(&callbacks, name.c_str(), rank, world_size, options, &g));
        return Group(g);
    }
    epcomm_group *get() const noexcept { return g_.get(); }
    int32_t rank() const {
        int32_t r = -1;
        check(epcomm_group_rank(g_.get(), &r));
        return r;
    }
    int32_t size() const {
        int32_t s = -1;
        check(epcomm_group_size(g_.get(), &s));
        return s;
    }
    void barrier() { check(epcomm_group_barrier(g_.get())); }
    void all_gatherv(const Tensor &input, const std::vector<int64_t> &sizes, const Tensor &output) {
        check(epcomm_group_all_gatherv(g_.get(), input.get(), sizes.data(), output.get()));
    }
    void reduce_scatterv(const Tensor &input, const std::vector<int64_t> &sizes, const Tensor &output) {
        check(epcomm_group_reduce_scatterv(g_.get(), input.get(), sizes.data(), output.get()));
    }
    void all_to_allv(const Tensor &input, const std::vector<int64_t> &send_counts, const Tensor &output,
                     const std::vector<int64_t> &recv_counts) {
        check(epcomm_group_all_to_allv(g_.get(), input.get(), send_counts.data(), output.get(),
                                       recv_counts.data()));
    }
    void broadcast(const Tensor &t, int32_t root) { check(epcomm_group_broadcast(g_.get(), t.get(), root)); }

private:
    explicit Group(epcomm_group *g) : g_(g) {}
    Owned<epcomm_group, epcomm_group_destroy> g_;
};

// ---- all2all ----------------------------------------------------------------------------------

/// A MoE config with defaults (bfloat16), to fill in.
inline epcomm_moe_config moe_config() {
    epcomm_moe_config c;
    check(epcomm_moe_config_init(&c));
    return c;
}

/// An all2all manager for one backend name (move-only); the group must outlive it.
class All2All {
public:
    All2All(const Group &group, const std::string &backend, const epcomm_moe_config &config) {
        check(epcomm_all2all_create(group.get(), backend.c_str(), &config, a_.out()));
    }

    epcomm_all2all *get() const noexcept { return a_.get(); }
    /// Dispatches (collective); the returned views stay valid until the next call.
    epcomm_dispatch_output dispatch(const Tensor &hidden, const Tensor &topk_ids, const Tensor &topk_weights) {
        epcomm_dispatch_output out{};
        check(epcomm_all2all_dispatch(a_.get(), hidden.get(), topk_ids.get(), topk_weights.get(), nullptr, 0, &out));
        return out;
    }
    /// Combines (collective): expert outputs in the dispatch output's shape → [T, hidden].
    void combine(const Tensor &expert_output, const Tensor &output) {
        check(epcomm_all2all_combine(a_.get(), expert_output.get(), output.get()));
    }
    void check_layer(int64_t top_k, int64_t num_experts) const {
        check(epcomm_all2all_check_layer(a_.get(), top_k, num_experts));
    }
    epcomm_all2all_stats stats() const {
        epcomm_all2all_stats s{};
        check(epcomm_all2all_get_stats(a_.get(), &s));
        return s;
    }

private:
    Owned<epcomm_all2all, epcomm_all2all_destroy> a_;
};

// ---- EPLB -------------------------------------------------------------------------------------

/// vLLM's default EPLB policy: `weight` is [layers, logical] loads; returns [layers, replicas].
inline std::vector<int64_t> eplb_rebalance(const std::vector<float> &weight, int64_t layers, int64_t logical,
                                           int64_t replicas, int64_t groups, int64_t nodes, int64_t ranks,
                                           const std::vector<int64_t> *old_phy2log = nullptr) {
    std::vector<int64_t> out(static_cast<size_t>(layers * replicas));
    check(epcomm_eplb_rebalance(weight.data(), layers, logical, replicas, groups, nodes, ranks,
                                old_phy2log ? old_phy2log->data() : nullptr, out.data()));
    return out;
}

}  // namespace epcomm

#endif  // EPCOMM_HPP
