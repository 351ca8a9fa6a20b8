// epcomm.hpp: a header-only C++17 wrapper over epcomm.h.
//
// RAII handles (Group, SharedBuffer, All2All, GpuAll2All, EplbCommunicator, EplbState,
// MigrationSchedule, LayerPlan, DLPackExport, LogSink), exceptions carrying the status, vLLM's
// message, the hint and the Python exception class vLLM raises, builders for the option
// structs (MoeConfig, RearrangeOptions), and tensor helpers that build the DLPack-layout
// epcomm_tensor from pointers, std::vector or (C++20) std::span.
//
// One MoE step on each of two ranks (tests/header_examples.rs extracts this example, compiles
// it and runs it as ranks 0 and 1; every block in this file and docs/api.md that starts with
// the #include line is checked so):
//
// ```cpp
// #include "epcomm.hpp"
//
// // Rank `rank` of 2: dispatch 2 tokens, run toy experts (identity), combine; returns [T, H].
// std::vector<float> moe_step(const std::string &group, int rank) {
//     const int64_t T = 2, H = 4, K = 2;
//     std::vector<float> x(T * H, float(rank + 1)), out(T * H);
//     std::vector<int64_t> ids = {0, 5, 3, 6};           // global expert ids, [T, K]
//     std::vector<float> w = {0.5f, 0.5f, 0.25f, 0.75f}; // routing weights, [T, K]
//     epcomm::Group g = epcomm::Group::shm(group, rank, 2);
//     epcomm::All2All a2a(g, "deepep_high_throughput",
//                         epcomm::MoeConfig().experts(8).top_k(K).hidden_size(H)
//                             .dtypes(epcomm::f32()).max_tokens_per_rank(T));
//     epcomm::Dispatched d = a2a.dispatch(epcomm::Tensor::of(x, {T, H}), epcomm::Tensor::of(ids, {T, K}),
//                                         epcomm::Tensor::of(w, {T, K}));
//     // TOKEN_MAJOR: one row per (source rank, token) routed here, with the ids this rank
//     // does not hold set to -1 and their weights to 0; the holder applies the weights.
//     epcomm::View<float> rows = d.hidden_as<float>();
//     std::vector<float> y(rows.size());
//     for (int64_t r = 0; r < rows.dim(0); ++r) {
//         float weight = 0;
//         for (int64_t k = 0; k < K; ++k) weight += d.topk_weights(r, k);
//         for (int64_t h = 0; h < H; ++h) y[r * H + h] = weight * rows(r, h);
//     }
//     a2a.combine(epcomm::Tensor::of(y, rows.shape()), epcomm::Tensor::of(out, {T, H}));
//     return out;  // == x: each token's weights sum to 1
// }
// ```
//
// Errors throw epcomm::Error; nothing here hides a failure. Every C entry point a C++ program
// calls has a wrapper here except the Python-runtime helpers (epcomm_dlpack_set_python_api,
// epcomm_dlpack_python_release, epcomm_dlpack_capsule_destructor,
// epcomm_last_error_message_torch), which only a Python binding uses: call them from epcomm.h.
#ifndef EPCOMM_HPP
#define EPCOMM_HPP

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
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

/// A failed EplbCommunicator::rearrange_into: as Error, plus how many leading layers of the
/// next weights hold the new placement (the same on every rank; their transfer committed).
class RearrangeError : public Error {
public:
    RearrangeError(const Error &e, int64_t next_valid) : Error(e), next_valid_(next_valid) {}
    int64_t next_valid() const noexcept { return next_valid_; }

private:
    int64_t next_valid_;
};

/// The Error for a non-OK status, from this thread's last error (epcomm_last_error_message:
/// element types in C terms, "float32 (kDLFloat, 32 bits)").
inline Error last_error(int32_t status) {
    const char *message = epcomm_last_error_message();
    const char *hint = epcomm_last_error_hint();
    const char *cls = epcomm_status_exception(status);
    return Error(status, message ? message : epcomm_status_string(status), hint ? hint : "",
                 cls ? cls : "RuntimeError");
}

/// Throws epcomm::Error for a non-OK status (with this thread's last error).
inline void check(int32_t status) {
    if (status != EPCOMM_OK) {
        throw last_error(status);
    }
}

/// Forgets this thread's last error.
inline void clear_last_error() noexcept { epcomm_clear_last_error(); }

/// The library version loaded at run time, "MAJOR.MINOR.PATCH".
inline std::string version() { return epcomm_version(); }
/// The ABI version the loaded library implements (EPCOMM_ABI_VERSION of its header).
inline int32_t abi_version() noexcept { return epcomm_abi_version(); }

namespace detail {
/// A static string the C ABI returns, or nothing for its NULL.
inline std::optional<std::string> text(const char *s) {
    if (s == nullptr) {
        return std::nullopt;
    }
    return std::string(s);
}

/// Throws an invalid-argument Error when a buffer holds fewer than `want` elements (the C call
/// would read past it); negative sizes are left to the library to report.
inline void require_size(const char *what, size_t have, int64_t want, const char *formula) {
    if (want >= 0 && have < static_cast<uint64_t>(want)) {
        throw Error(EPCOMM_ERROR_INVALID_ARGUMENT,
                    std::string(what) + " has " + std::to_string(have) + " entries; expected " +
                        std::to_string(want) + " (" + formula + ")",
                    "", "ValueError");
    }
}
}  // namespace detail

// ---- logging ----------------------------------------------------------------------------------

/// Sets the log level (EPCOMM_LOG_ERROR..EPCOMM_LOG_DEBUG); process-wide.
inline void set_log_level(int32_t level) { check(epcomm_set_log_level(level)); }

/// Routes log messages to a C callback (NULL: back to stderr); process-wide.
inline void set_log_callback(epcomm_log_fn callback, void *user_data) noexcept {
    epcomm_set_log_callback(callback, user_data);
}

/// Routes epcomm's log messages (vLLM's wording, bare) to a function while it lives, then
/// restores the default (stderr). Process-wide: one at a time; the function may be called from
/// any thread that calls into epcomm, and exceptions it throws are dropped (none may cross the
/// C ABI).
class LogSink {
public:
    using Fn = std::function<void(int32_t level, const std::string &message)>;
    explicit LogSink(Fn fn) : fn_(std::move(fn)) { epcomm_set_log_callback(&LogSink::deliver, this); }
    LogSink(const LogSink &) = delete;
    LogSink &operator=(const LogSink &) = delete;
    ~LogSink() { epcomm_set_log_callback(nullptr, nullptr); }

private:
    static void deliver(int32_t level, const char *message, void *self) noexcept {
        try {
            static_cast<LogSink *>(self)->fn_(level, message ? message : "");
        } catch (...) {
        }
    }
    Fn fn_;
};

// ---- runtime probes ---------------------------------------------------------------------------

/// Throws EPCOMM_ERROR_UNAVAILABLE (with the reason) unless this build can use the CUDA driver.
inline void cuda_check() { check(epcomm_cuda_check()); }

/// The runtime NCCL version code (22809 for 2.28.9); throws EPCOMM_ERROR_UNAVAILABLE without it.
inline int32_t nccl_version() {
    int32_t v = 0;
    check(epcomm_nccl_version(&v));
    return v;
}

/// Whether NIXL (libnixl.so) can be loaded in this process.
inline bool nixl_available() noexcept { return epcomm_nixl_available(); }

/// An NCCL unique id (`ncclUniqueId`) for GpuAll2All.
using NcclUniqueId = std::array<uint8_t, EPCOMM_NCCL_UNIQUE_ID_BYTES>;

/// A new NCCL unique id (`ncclGetUniqueId`), made on one rank and shared with the others.
inline NcclUniqueId nccl_unique_id() {
    NcclUniqueId id{};
    check(epcomm_nccl_unique_id(id.data()));
    return id;
}

/// The one owner of a C handle (move-only): released with `Destroy` (NULL-safe) when it goes.
/// A destroy the library refuses (another thread's call on the handle in flight, a forked
/// child) keeps the handle, as a destructor cannot throw; `close` reports it.
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
    /// Releases the handle now with `checked` (its epcomm_*_destroy_checked); throws on a
    /// refusal (EPCOMM_ERROR_INVALID_STATE), keeping the handle. A no-op once released.
    void close(int32_t (*checked)(T *)) {
        if (p_ != nullptr) {
            check(checked(p_));
            p_ = nullptr;
        }
    }
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
/// float8_e4m3fn (DLPack code 10): FP8 dispatch's hidden rows.
inline constexpr epcomm_dtype f8_e4m3fn() { return dtype(10, 8); }

/// Whether two element types are the same (code, bits and lanes).
inline constexpr bool same_dtype(const epcomm_dtype &a, const epcomm_dtype &b) {
    return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr epcomm_dtype value = dtype(2, 32); };
template <> struct dtype_of<double> { static constexpr epcomm_dtype value = dtype(2, 64); };
template <> struct dtype_of<int32_t> { static constexpr epcomm_dtype value = dtype(0, 32); };
template <> struct dtype_of<int64_t> { static constexpr epcomm_dtype value = dtype(0, 64); };
template <> struct dtype_of<uint8_t> { static constexpr epcomm_dtype value = dtype(1, 8); };
template <> struct dtype_of<int8_t> { static constexpr epcomm_dtype value = dtype(0, 8); };

/// The bits of one bfloat16 element (C++ has no such type): the element type of a bf16 View.
struct bfloat16 {
    uint16_t bits;
};
/// The bits of one IEEE float16 element: the element type of an f16 View.
struct float16 {
    uint16_t bits;
};
/// The bits of one float8_e4m3fn element: the element type of FP8 dispatch's hidden View.
struct float8_e4m3fn {
    uint8_t bits;
};
template <> struct dtype_of<bfloat16> { static constexpr epcomm_dtype value = dtype(4, 16); };
template <> struct dtype_of<float16> { static constexpr epcomm_dtype value = dtype(2, 16); };
template <> struct dtype_of<float8_e4m3fn> { static constexpr epcomm_dtype value = dtype(10, 8); };

/// The C/C++ name of an element type, for messages ("float", "int64_t", "bfloat16", ...).
inline std::string dtype_name(const epcomm_dtype &t) {
    static const struct {
        epcomm_dtype type;
        const char *name;
    } names[] = {
        {dtype(2, 32), "float"},    {dtype(2, 64), "double"},   {dtype(2, 16), "float16"},
        {dtype(4, 16), "bfloat16"}, {dtype(10, 8), "float8_e4m3fn"}, {dtype(0, 8), "int8_t"},
        {dtype(0, 32), "int32_t"},  {dtype(0, 64), "int64_t"},  {dtype(1, 8), "uint8_t"},
    };
    for (const auto &n : names) {
        if (same_dtype(n.type, t)) return n.name;
    }
    return "epcomm_dtype{code " + std::to_string(t.code) + ", bits " + std::to_string(t.bits) + ", lanes " +
           std::to_string(t.lanes) + "}";
}

// ---- tensors --------------------------------------------------------------------------------

/// A contiguous tensor view (epcomm never owns the memory); keeps its own shape array. Host
/// memory unless moved to a device with `on`.
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
        return Tensor(const_cast<void *>(static_cast<const void *>(data)),
                      dtype_of<typename std::remove_const<T>::type>::value, std::move(shape));
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

    /// The same view on device memory (EPCOMM_DEVICE_CUDA and ordinal for GpuAll2All).
    Tensor &on(int32_t device_type, int32_t device_id) noexcept {
        t_.device.device_type = device_type;
        t_.device.device_id = device_id;
        return *this;
    }

    const epcomm_tensor *get() const noexcept { return &t_; }
    const std::vector<int64_t> &shape() const noexcept { return shape_; }
    epcomm_dtype dtype() const noexcept { return t_.dtype; }
    epcomm_device device() const noexcept { return t_.device; }
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

namespace detail {
/// The C array of a list of views (each still pointing at its Tensor's shape).
inline std::vector<epcomm_tensor> raw(const std::vector<Tensor> &ts) {
    std::vector<epcomm_tensor> out;
    out.reserve(ts.size());
    for (const Tensor &t : ts) out.push_back(*t.get());
    return out;
}
}  // namespace detail

// ---- typed views of dispatch outputs ---------------------------------------------------------

/// A typed view of one dispatch output: element type T (checked against the output's dtype
/// when made), its shape, and row-major indexing. It never owns the memory: like the C views,
/// it is valid until the manager's next call. A view of GpuAll2All's output is of CUDA memory
/// (device()): data(), shape() and tensor() serve on the host, the element access ([], (),
/// begin/end) only in device code.
template <class T> class View {
public:
    /// An empty view (shape [0]).
    View() : shape_{0} {}
    /// A view of `t`, which must hold elements of type T (dtype_of<T>); otherwise throws an
    /// invalid-argument Error naming `what` and both types. An empty tensor is taken whatever
    /// its dtype.
    View(const epcomm_tensor &t, const std::string &what)
        : data_(static_cast<T *>(t.data)), shape_(t.shape, t.shape + (t.ndim > 0 ? t.ndim : 0)),
          device_(t.device) {
        if (size() > 0 && !same_dtype(t.dtype, dtype_of<T>::value)) {
            throw Error(EPCOMM_ERROR_INVALID_ARGUMENT,
                        "dispatch output '" + what + "' holds " + dtype_name(t.dtype) + " elements; View<" +
                            dtype_name(dtype_of<T>::value) + "> cannot view it",
                        "", "ValueError");
        }
        if (size() == 0) data_ = nullptr;
    }

    T *data() const noexcept { return data_; }
    const std::vector<int64_t> &shape() const noexcept { return shape_; }
    /// Where the elements are (EPCOMM_DEVICE_CPU for All2All's, CUDA for GpuAll2All's).
    epcomm_device device() const noexcept { return device_; }
    size_t ndim() const noexcept { return shape_.size(); }
    /// The extent of dimension `i` (0 past the last dimension).
    int64_t dim(size_t i) const noexcept { return i < shape_.size() ? shape_[i] : 0; }
    /// The number of elements.
    int64_t size() const noexcept {
        int64_t n = 1;
        for (int64_t d : shape_) n *= d;
        return n;
    }
    bool empty() const noexcept { return size() == 0; }
    T *begin() const noexcept { return data_; }
    T *end() const noexcept { return data_ + size(); }
    /// The i-th element in row-major order (unchecked, as std::span's).
    T &operator[](int64_t i) const noexcept { return data_[i]; }
    /// The element at (i, j) of a 2-D view, or of the first two dimensions' row-major
    /// flattening into rows of the last dimension (unchecked).
    T &operator()(int64_t i, int64_t j) const noexcept { return data_[i * dim(ndim() - 1) + j]; }
    /// The element at (i, j, k) of a 3-D view (unchecked).
    T &operator()(int64_t i, int64_t j, int64_t k) const noexcept {
        return data_[(i * dim(1) + j) * dim(2) + k];
    }
    /// A Tensor over the same memory, shape and device (e.g. for combine or EplbState::record).
    Tensor tensor() const {
        Tensor t(static_cast<void *>(data_), dtype_of<T>::value, shape_);
        t.on(device_.device_type, device_.device_id);
        return t;
    }

private:
    T *data_ = nullptr;
    std::vector<int64_t> shape_;
    epcomm_device device_{EPCOMM_DEVICE_CPU, 0};
};

/// What All2All::dispatch and GpuAll2All::dispatch return: the C struct's views as typed Views
/// with their shapes (docs/design.md, "The layout contract"). `hidden` is a Tensor of the
/// manager's hidden dtype (hidden_as<T>() views it typed); the others are empty (shape [0])
/// where the layout has none. It converts to the C struct, epcomm_dispatch_output, for code
/// written against it. Like the C views, everything here is valid until the manager's next
/// call; GpuAll2All's are views of CUDA memory (View::device()).
class Dispatched {
public:
    explicit Dispatched(const epcomm_dispatch_output &out)
        : layout(out.layout), received_rows(out.received_rows), hidden(out.hidden),
          topk_ids(out.topk_ids, "topk_ids"), topk_weights(out.topk_weights, "topk_weights"),
          counts(out.counts, "counts"), expert_offsets(offsets_of<int64_t>(out.expert_offsets)),
          expert_offsets_i32(offsets_of<int32_t>(out.expert_offsets)),
          src_rank(out.src_rank, "src_rank"), src_token(out.src_token, "src_token"), raw_(out) {
        for (size_t i = 0; i < out.num_extras; ++i) {
            extras.emplace_back(out.extras[i], "extras[" + std::to_string(i) + "]");
        }
    }

    /// EPCOMM_LAYOUT_* of the backend.
    int32_t layout;
    /// Rows actually received (the fixed-capacity layouts have more rows in `hidden`).
    int64_t received_rows;
    /// The received rows: [rows, hidden] (EXPERT_MAJOR [E_local, M*R, hidden], RANK_MAJOR
    /// [R, M, hidden]); combine's expert output has this shape (or expert_output_buffer()'s).
    Tensor hidden;
    /// [rows, K]: TOKEN_MAJOR's ids owned here (-1 elsewhere), RANK_MAJOR's and REPLICATED's
    /// ids as sent (padding rows all -1); empty for EXPERT_MAJOR and EXPERT_PACKED.
    View<int64_t> topk_ids;
    /// [rows, K] as topk_ids (weight 0 where the id is -1); EXPERT_PACKED [rows], the weight of
    /// each row's (token, expert); empty for EXPERT_MAJOR.
    View<float> topk_weights;
    /// TOKEN_MAJOR tokens_per_local_expert [E_local], EXPERT_MAJOR counts [E_local],
    /// RANK_MAJOR recv_counts [R]; empty otherwise.
    View<int32_t> counts;
    /// EXPERT_PACKED [E_local + 1]: expert j's rows are [expert_offsets[j], expert_offsets[j+1]).
    /// int64 from All2All; GpuAll2All's are int32: expert_offsets_i32 (and this one is empty).
    View<int64_t> expert_offsets;
    /// GpuAll2All's EXPERT_PACKED expert_offsets (int32, [E_local + 1]); empty for All2All's.
    View<int32_t> expert_offsets_i32;
    /// EXPERT_PACKED [rows]: the source rank and source token of each row.
    View<int32_t> src_rank;
    View<int32_t> src_token;
    /// One [rows..., bytes] view per extra payload, laid out like hidden.
    std::vector<View<uint8_t>> extras;

    /// `hidden` as a View<T> (float, bfloat16, float16, float8_e4m3fn, ...); throws an
    /// invalid-argument Error when T is not the hidden rows' element type.
    template <class T> View<T> hidden_as() const { return View<T>(*hidden.get(), "hidden"); }
    /// The C struct this was made from.
    const epcomm_dispatch_output &raw() const noexcept { return raw_; }
    operator const epcomm_dispatch_output &() const noexcept { return raw_; }

private:
    /// The expert offsets as View<T> when they are of type T, else empty.
    template <class T> static View<T> offsets_of(const epcomm_tensor &t) {
        return same_dtype(t.dtype, dtype_of<T>::value) ? View<T>(t, "expert_offsets") : View<T>();
    }

    epcomm_dispatch_output raw_;
};

// ---- selection and configuration --------------------------------------------------------------

/// Resolves an all2all backend name (EPCOMM_ALL2ALL_*), with vLLM's warnings.
inline int32_t resolve_backend(const std::string &name) {
    int32_t b = -1;
    check(epcomm_all2all_backend_resolve(name.c_str(), &b));
    return b;
}

/// Whether `name` resolves to an all2all backend (aliases and removed names too); logs nothing.
inline bool backend_is_known(const std::string &name) {
    return epcomm_all2all_backend_is_known(name.c_str());
}

/// The canonical name of an EPCOMM_ALL2ALL_* backend; nothing for another value.
inline std::optional<std::string> backend_name(int32_t backend) {
    return detail::text(epcomm_all2all_backend_name(backend));
}

/// vLLM's manager class of an EPCOMM_ALL2ALL_* backend; nothing for another value.
inline std::optional<std::string> backend_manager_class(int32_t backend) {
    return detail::text(epcomm_all2all_backend_manager_class(backend));
}

/// The EPCOMM_LAYOUT_* of an EPCOMM_ALL2ALL_* backend.
inline int32_t backend_layout(int32_t backend) {
    int32_t layout = -1;
    check(epcomm_all2all_backend_layout(backend, &layout));
    return layout;
}

/// The name of an EPCOMM_LAYOUT_* value ("REPLICATED", ...); nothing for another value.
inline std::optional<std::string> layout_name(int32_t layout) {
    return detail::text(epcomm_all2all_layout_name(layout));
}

/// Every name accepted as an all2all backend, in vLLM's order (strings are static).
inline std::vector<epcomm_all2all_name_desc> all2all_names() {
    std::vector<epcomm_all2all_name_desc> out(epcomm_all2all_name_count());
    for (size_t i = 0; i < out.size(); ++i) check(epcomm_all2all_name_info(i, &out[i]));
    return out;
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

/// FP8 dispatch (epcomm_moe_config.dispatch_fp8): the EPCOMM_DISPATCH_FP8_* values.
enum class Fp8 : int64_t {
    /// Hidden rows travel as they are.
    Off = EPCOMM_DISPATCH_FP8_OFF,
    /// float8_e4m3fn rows, one float32 scale (amax / 448) per 128 elements.
    E4M3 = EPCOMM_DISPATCH_FP8_E4M3,
    /// As E4M3 with the scales rounded up to powers of two (vLLM's UE8M0 dispatch).
    E4M3_UE8M0 = EPCOMM_DISPATCH_FP8_E4M3_UE8M0,
};

/// A MoE config with defaults (bfloat16), to fill in.
inline epcomm_moe_config moe_config() {
    epcomm_moe_config c;
    check(epcomm_moe_config_init(&c));
    return c;
}

/// A builder of epcomm_moe_config (defaults from epcomm_moe_config_init); it converts to the
/// C struct wherever one is taken, and owns the extra payload sizes that struct points to.
class MoeConfig {
public:
    MoeConfig() : c_(moe_config()) {}
    MoeConfig &experts(int64_t n) { return set(c_.num_experts, n); }
    MoeConfig &redundant_experts(int64_t n) { return set(c_.num_redundant_experts, n); }
    MoeConfig &top_k(int64_t k) { return set(c_.top_k, k); }
    MoeConfig &hidden_size(int64_t h) { return set(c_.hidden_size, h); }
    MoeConfig &hidden_dtype(epcomm_dtype t) { return set(c_.hidden_dtype, t); }
    MoeConfig &expert_dtype(epcomm_dtype t) { return set(c_.expert_dtype, t); }
    MoeConfig &out_dtype(epcomm_dtype t) { return set(c_.out_dtype, t); }
    /// The hidden, expert-output and combine-output element types at once.
    MoeConfig &dtypes(epcomm_dtype t) { return hidden_dtype(t).expert_dtype(t).out_dtype(t); }
    MoeConfig &max_tokens_per_rank(int64_t m) { return set(c_.max_tokens_per_rank, m); }
    MoeConfig &apply_router_weight_on_input(bool on) { return set(c_.apply_router_weight_on_input, on); }
    MoeConfig &dispatch_fp8(Fp8 mode) { return set(c_.dispatch_fp8, static_cast<int64_t>(mode)); }
    /// vLLM's enable_fault_tolerance (deepep_low_latency, nixl_ep): a dead or stalled peer
    /// fails the call in progress, then the survivors continue with that rank masked.
    MoeConfig &fault_tolerance(bool on) { return set(c_.enable_fault_tolerance, on); }
    /// Bytes per token of each extra payload that travels with the rows.
    MoeConfig &extra_row_bytes(std::vector<int64_t> bytes) {
        extras_ = std::move(bytes);
        return *this;
    }

    /// The C struct (its extra_row_bytes points into this builder).
    const epcomm_moe_config &get() const noexcept {
        c_.extra_row_bytes = extras_.empty() ? nullptr : extras_.data();
        c_.num_extras = extras_.size();
        return c_;
    }
    operator const epcomm_moe_config &() const noexcept { return get(); }

private:
    template <class F, class V> MoeConfig &set(F &field, V v) {
        field = v;
        return *this;
    }
    mutable epcomm_moe_config c_;
    std::vector<int64_t> extras_;
};

/// Worst-case bytes of a backend's dispatch buffers and combine accumulator for
/// `tokens_per_rank` tokens on each of `world_size` ranks.
inline uint64_t all2all_buffer_bytes(const std::string &backend, const epcomm_moe_config &config,
                                     int32_t world_size, int64_t tokens_per_rank) {
    uint64_t bytes = 0;
    check(epcomm_all2all_buffer_bytes(backend.c_str(), &config, world_size, tokens_per_rank, &bytes));
    return bytes;
}

// ---- groups -----------------------------------------------------------------------------------

/// Group options with defaults (epcomm_group_options_init), to fill in.
inline epcomm_group_options group_options() {
    epcomm_group_options o;
    check(epcomm_group_options_init(&o));
    return o;
}

/// One send of a send/recv batch: the whole of `t` to rank `peer` (`t` must outlive the call).
inline epcomm_p2p_op p2p_send(int32_t peer, const Tensor &t) noexcept {
    return epcomm_p2p_op{EPCOMM_P2P_SEND, peer, t.get()};
}
/// One receive of a send/recv batch: from rank `peer` into the whole of `t`.
inline epcomm_p2p_op p2p_recv(int32_t peer, const Tensor &t) noexcept {
    return epcomm_p2p_op{EPCOMM_P2P_RECV, peer, t.get()};
}

/// Zeroed shared memory of a group (epcomm_mem_alloc, move-only): a window peers read in
/// place, for tensors passed to any call (e.g. combine's expert outputs). The group must
/// outlive it; it is freed when it goes (or by `free`, which reports errors).
class SharedBuffer {
public:
    SharedBuffer() noexcept = default;
    SharedBuffer(SharedBuffer &&o) noexcept : g_(o.g_), p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
    SharedBuffer &operator=(SharedBuffer &&o) noexcept {
        if (this != &o) {
            drop();
            g_ = o.g_;
            p_ = o.p_;
            bytes_ = o.bytes_;
            o.p_ = nullptr;
        }
        return *this;
    }
    SharedBuffer(const SharedBuffer &) = delete;
    SharedBuffer &operator=(const SharedBuffer &) = delete;
    /// Frees the memory; a failure (another thread's call on the group in flight) leaves it
    /// to epcomm_group_destroy, as a destructor cannot throw.
    ~SharedBuffer() { drop(); }

    /// Frees the memory now (throws EPCOMM_ERROR_INVALID_STATE while another thread's call on
    /// the group is in flight; the buffer is then still allocated). Tensors in it must not be
    /// used afterwards.
    void free() {
        if (p_ != nullptr) {
            check(epcomm_mem_free(g_, p_));
            p_ = nullptr;
        }
    }
    void *data() const noexcept { return p_; }
    size_t size() const noexcept { return p_ ? bytes_ : 0; }
    template <class T> T *as() const noexcept { return static_cast<T *>(p_); }
    /// A view of the buffer's start as `type` with `shape` (which must fit).
    Tensor tensor(epcomm_dtype type, std::vector<int64_t> shape) const {
        Tensor t(p_, type, std::move(shape));
        const uint64_t need = static_cast<uint64_t>(t.numel()) * ((type.bits * type.lanes + 7u) / 8u);
        if (t.numel() < 0 || need > size()) {
            throw Error(EPCOMM_ERROR_INVALID_ARGUMENT,
                        "a view of " + std::to_string(need) + " bytes does not fit a shared buffer of " +
                            std::to_string(size()) + " bytes",
                        "", "ValueError");
        }
        return t;
    }

private:
    friend class Group;
    SharedBuffer(epcomm_group *g, void *p, size_t bytes) noexcept : g_(g), p_(p), bytes_(bytes) {}
    void drop() noexcept {
        if (p_ != nullptr) {
            (void)epcomm_mem_free(g_, p_);
            p_ = nullptr;
        }
    }
    epcomm_group *g_ = nullptr;
    void *p_ = nullptr;
    size_t bytes_ = 0;
};

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
    /// A batch of sends and receives (collective; p2p_send / p2p_recv make the entries).
    void send_recv(const std::vector<epcomm_p2p_op> &ops) {
        check(epcomm_group_send_recv(g_.get(), ops.empty() ? nullptr : ops.data(), ops.size()));
    }
    /// Gathers `bytes` bytes of every rank into `output` (size() * bytes, rank order).
    void all_gather(const void *input, size_t bytes, void *output) {
        check(epcomm_group_all_gather(g_.get(), input, bytes, output));
    }
    /// Gathers one trivially copyable value of every rank, in rank order.
    template <class T> std::vector<T> all_gather(const T &value) {
        static_assert(std::is_trivially_copyable<T>::value, "all_gather moves bytes");
        std::vector<T> out(static_cast<size_t>(size()));
        all_gather(&value, sizeof(T), out.data());
        return out;
    }
    /// Fault tolerance: one entry per rank, 1 where this rank holds the rank as lost (dead,
    /// stalled, failed or gone after an op failed; never this rank), else 0 (vLLM's
    /// active-mask encoding). Works on a group broken by a failure.
    std::vector<int32_t> lost_ranks() const {
        std::vector<int32_t> mask(static_cast<size_t>(size()));
        check(epcomm_group_lost_ranks(g_.get(), mask.data(), mask.size()));
        return mask;
    }
    /// Fault tolerance (as ncclCommShrink): the ranks not in `excluded` (increasing, not this
    /// rank) form a new group, renumbered in the old order, with the same options. Collective
    /// over the survivors, who all pass the same list. This group stays valid (usually broken
    /// by the failure) and is destroyed on its own.
    Group shrink(const std::vector<int32_t> &excluded) {
        epcomm_group *g = nullptr;
        check(epcomm_group_shrink(g_.get(), excluded.empty() ? nullptr : excluded.data(), excluded.size(), &g));
        return Group(g);
    }
    /// `bytes` (> 0) of zeroed shared memory of this rank (not collective); throws
    /// EPCOMM_ERROR_UNAVAILABLE on a group without windows (host callbacks,
    /// EPCOMM_SHM_DIRECT=0): use ordinary memory there.
    SharedBuffer alloc(size_t bytes) {
        void *p = nullptr;
        check(epcomm_mem_alloc(g_.get(), bytes, &p));
        return SharedBuffer(g_.get(), p, bytes);
    }
    /// Leaves the group now (as the destructor does, which cannot report a refusal); throws
    /// EPCOMM_ERROR_INVALID_STATE, keeping the group, while another thread's call using it is
    /// in flight, and in a forked child. Managers made over it keep it alive until they go.
    void close() { g_.close(epcomm_group_destroy_checked); }

private:
    explicit Group(epcomm_group *g) : g_(g) {}
    Owned<epcomm_group, epcomm_group_destroy> g_;
};

// ---- all2all ----------------------------------------------------------------------------------

/// An all2all manager for one backend name (move-only); it keeps its group alive.
class All2All {
public:
    All2All(const Group &group, const std::string &backend, const epcomm_moe_config &config)
        : hidden_size_(config.hidden_size), expert_dtype_(config.expert_dtype), world_(group.size()) {
        check(epcomm_all2all_create(group.get(), backend.c_str(), &config, a_.out()));
    }

    epcomm_all2all *get() const noexcept { return a_.get(); }
    /// Releases the manager now; throws EPCOMM_ERROR_INVALID_STATE, keeping it, while another
    /// thread's call on it is in flight, and in a forked child.
    void close() { a_.close(epcomm_all2all_destroy_checked); }
    /// Dispatches (collective): this rank's `hidden` [T, hidden_size], `topk_ids` [T, K]
    /// (int32 or int64) and `topk_weights` [T, K] (float). Returns typed views (Dispatched),
    /// valid until the next call.
    Dispatched dispatch(const Tensor &hidden, const Tensor &topk_ids, const Tensor &topk_weights) {
        return dispatch(hidden, topk_ids, topk_weights, {});
    }
    /// Dispatches with one extra payload per entry of the config's extra_row_bytes
    /// ([T, bytes] each); they arrive as the output's `extras`.
    Dispatched dispatch(const Tensor &hidden, const Tensor &topk_ids, const Tensor &topk_weights,
                        const std::vector<Tensor> &extras) {
        const std::vector<epcomm_tensor> ex = detail::raw(extras);
        epcomm_dispatch_output out{};
        check(epcomm_all2all_dispatch(a_.get(), hidden.get(), topk_ids.get(), topk_weights.get(),
                                      ex.empty() ? nullptr : ex.data(), ex.size(), &out));
        return Dispatched(out);
    }
    /// Combines (collective) this rank's expert outputs into `output` [T, hidden_size] of the
    /// config's out_dtype (T as this rank's last dispatch). `expert_output` is of the config's
    /// expert_dtype, one row per row of the last dispatch's `hidden` (padding rows of the
    /// fixed-capacity layouts included), in either shape:
    ///  - the shape of the last dispatch's `hidden` (EXPERT_MAJOR [E_local, M*R, hidden_size],
    ///    RANK_MAJOR [R, M, hidden_size], the others [rows, hidden_size]), or
    ///  - flat [rows, hidden_size], rows the product of hidden's leading dimensions:
    ///    expert_output_buffer()'s shape (whose rows the peers read in place, no copy).
    /// Any shape whose last dimension is hidden_size and whose rows number the same is taken;
    /// another is an invalid-argument Error on this rank that fails every rank's combine.
    void combine(const Tensor &expert_output, const Tensor &output) {
        check(epcomm_all2all_combine(a_.get(), expert_output.get(), output.get()));
    }
    /// Changes FP8 dispatch for the next dispatches (every rank alike); the last dispatch's
    /// views become invalid.
    void set_dispatch_fp8(Fp8 mode) {
        check(epcomm_all2all_set_dispatch_fp8(a_.get(), static_cast<int64_t>(mode)));
    }
    /// The last dispatch's FP8 scales: float32, the hidden view's shape with hidden_size / 128
    /// in the last dimension; an empty [0] view without FP8 dispatch. Valid until the next call.
    Tensor dispatch_scales() const {
        epcomm_tensor t{};
        check(epcomm_all2all_dispatch_scales(a_.get(), &t));
        return Tensor(t);
    }
    /// The manager's shared expert-output buffer for its last dispatch: a [rows, hidden_size]
    /// view of the config's expert_dtype. Experts that write their outputs there and pass it to
    /// combine are read in place by the peers (no copy). Valid until the next call of this
    /// function or the manager goes; throws EPCOMM_ERROR_INVALID_STATE before a dispatch.
    Tensor expert_output_buffer() {
        void *data = nullptr;
        int64_t rows = 0;
        check(epcomm_all2all_expert_output_buffer(a_.get(), &data, &rows));
        return Tensor(data, expert_dtype_, {rows, hidden_size_});
    }
    /// How many combines read their expert output in place from expert_output_buffer.
    uint64_t zero_copy_combines() const {
        uint64_t n = 0;
        check(epcomm_all2all_zero_copy_combines(a_.get(), &n));
        return n;
    }
    void check_layer(int64_t top_k, int64_t num_experts) const {
        check(epcomm_all2all_check_layer(a_.get(), top_k, num_experts));
    }
    epcomm_all2all_stats stats() const {
        epcomm_all2all_stats s{};
        check(epcomm_all2all_get_stats(a_.get(), &s));
        return s;
    }

    // Fault tolerance (MoeConfig::fault_tolerance), with vLLM's All2AllManagerBase semantics.

    /// vLLM's query_active_mask: one entry per rank, 0 = live, 1 = masked (all 0 without a
    /// failure).
    std::vector<int32_t> active_mask() const {
        std::vector<int32_t> mask(static_cast<size_t>(world_));
        check(epcomm_all2all_query_active_mask(a_.get(), mask.data(), mask.size()));
        return mask;
    }
    /// vLLM's query_fault: whether the mask changed since the last clean_buffers.
    bool query_fault() const {
        bool fault = false;
        check(epcomm_all2all_query_fault(a_.get(), &fault));
        return fault;
    }
    /// vLLM's clean_buffers, the recovery point (rank-local): zeroes the receive buffers,
    /// forgets the last dispatch and makes the current mask query_fault's baseline.
    void clean_buffers() { check(epcomm_all2all_clean_buffers(a_.get())); }
    /// vLLM 0.34.0's update_mask (rank-local): replays a scale-down's dead rank after
    /// clean_buffers (a no-op for a masked rank: epcomm keeps the mask); masking a live rank or
    /// unmasking a masked one throws (EPCOMM_ERROR_INVALID_STATE).
    void update_mask(int32_t rank, bool masked = true) {
        check(epcomm_all2all_update_mask(a_.get(), rank, masked));
    }
    /// This rank's (token, expert) pairs dropped for masked ranks' experts.
    struct DroppedPairs {
        /// By the last dispatch.
        uint64_t last;
        /// Since the manager was created.
        uint64_t total;
    };
    DroppedPairs dropped_pairs() const {
        DroppedPairs d{0, 0};
        check(epcomm_all2all_dropped_pairs(a_.get(), &d.last, &d.total));
        return d;
    }

private:
    Owned<epcomm_all2all, epcomm_all2all_destroy> a_;
    int64_t hidden_size_;
    epcomm_dtype expert_dtype_;
    int32_t world_;
};

/// GPU dispatch modes (EPCOMM_GPU_MODE_*).
enum class GpuMode : int32_t {
    /// Exact sizes, one host sync per dispatch; not capturable.
    Counts = EPCOMM_GPU_MODE_COUNTS,
    /// Fixed max_tokens_per_rank slabs, no host sync, CUDA-graph capturable.
    Capacity = EPCOMM_GPU_MODE_CAPACITY,
};

/// A GPU all2all manager over NCCL (move-only): tensors are CUDA views (Tensor::on), calls are
/// enqueued on the host's stream (a cudaStream_t; nullptr = the legacy default stream).
class GpuAll2All {
public:
    /// Creates the manager and its own NCCL communicator (collective over `world_size` ranks)
    /// from an id made by nccl_unique_id on one rank, on CUDA device `device`.
    GpuAll2All(const std::string &backend, const epcomm_moe_config &config, const NcclUniqueId &id,
               int32_t rank, int32_t world_size, int32_t device, GpuMode mode) {
        check(epcomm_gpu_all2all_create(backend.c_str(), &config, id.data(), rank, world_size, device,
                                        static_cast<int32_t>(mode), a_.out()));
    }
    /// A manager on the host's NCCL communicator (an ncclComm_t, borrowed: it must outlive the
    /// manager and come from the libnccl epcomm loads).
    static GpuAll2All from_comm(const std::string &backend, const epcomm_moe_config &config,
                                void *nccl_comm, int32_t device, GpuMode mode) {
        GpuAll2All a;
        check(epcomm_gpu_all2all_create_from_comm(backend.c_str(), &config, nccl_comm, device,
                                                  static_cast<int32_t>(mode), a.a_.out()));
        return a;
    }

    epcomm_gpu_all2all *get() const noexcept { return a_.get(); }
    /// Dispatches on `stream` (collective): CUDA `hidden` [T, hidden_size], `topk_ids` [T, K]
    /// (int32 or int64), `topk_weights` [T, K] (float) and one [T, bytes] view per extra payload.
    /// Returns typed views (Dispatched, as All2All::dispatch) of CUDA memory, valid until the
    /// next dispatch.
    Dispatched dispatch(void *stream, const Tensor &hidden, const Tensor &topk_ids, const Tensor &topk_weights,
                        const std::vector<Tensor> &extras = {}) {
        const std::vector<epcomm_tensor> ex = detail::raw(extras);
        epcomm_dispatch_output out{};
        check(epcomm_gpu_all2all_dispatch(a_.get(), stream, hidden.get(), topk_ids.get(), topk_weights.get(),
                                          ex.empty() ? nullptr : ex.data(), ex.size(), &out));
        return Dispatched(out);
    }
    /// Combines on `stream` (collective).
    void combine(void *stream, const Tensor &expert_output, const Tensor &output) {
        check(epcomm_gpu_all2all_combine(a_.get(), stream, expert_output.get(), output.get()));
    }
    /// Synchronises `stream` and throws the device's error of the last dispatch/combine (bad
    /// ids, a full bucket): capacity mode's way to learn of bad input.
    void check_error(void *stream) { check(epcomm_gpu_all2all_check_error(a_.get(), stream)); }
    /// The device pool: buffers and bytes held, reserved at creation, reallocations since.
    epcomm_gpu_all2all_stats stats() const {
        epcomm_gpu_all2all_stats st{};
        st.struct_size = sizeof st;
        check(epcomm_gpu_all2all_get_stats(a_.get(), &st));
        return st;
    }

private:
    GpuAll2All() = default;
    Owned<epcomm_gpu_all2all, epcomm_gpu_all2all_destroy> a_;
};

// ---- DLPack -----------------------------------------------------------------------------------

/// A DLPack export of a view (epcomm_dlpack_export, move-only): a DLManagedTensorVersioned
/// (DLPack 1.x) or a DLManagedTensor with its own copy of the shape; the data is not copied and
/// must outlive the export. Deleted when it goes, unless `release` handed it to a consumer,
/// who then calls its deleter once. `on_release` runs exactly once when the deleter runs (on
/// the consumer's thread; exceptions it throws are dropped).
class DLPackExport {
public:
    DLPackExport(const Tensor &t, bool versioned, std::function<void()> on_release = {})
        : DLPackExport(*t.get(), versioned, std::move(on_release)) {}
    DLPackExport(const epcomm_tensor &t, bool versioned, std::function<void()> on_release = {})
        : versioned_(versioned) {
        std::function<void()> *ctx = on_release ? new std::function<void()>(std::move(on_release)) : nullptr;
        const int32_t st =
            epcomm_dlpack_export(&t, versioned, ctx ? &DLPackExport::released : nullptr, ctx, &m_);
        if (st != EPCOMM_OK) {
            delete ctx;  // a failed export never calls its release function
            throw last_error(st);
        }
    }
    DLPackExport(DLPackExport &&o) noexcept : m_(o.m_), versioned_(o.versioned_) { o.m_ = nullptr; }
    DLPackExport &operator=(DLPackExport &&o) noexcept {
        if (this != &o) {
            reset();
            m_ = o.m_;
            versioned_ = o.versioned_;
            o.m_ = nullptr;
        }
        return *this;
    }
    DLPackExport(const DLPackExport &) = delete;
    DLPackExport &operator=(const DLPackExport &) = delete;
    ~DLPackExport() { reset(); }

    bool is_versioned() const noexcept { return versioned_; }
    /// The DLManagedTensor (nullptr when versioned or released).
    epcomm_dlpack_managed *managed() const noexcept {
        return versioned_ ? nullptr : static_cast<epcomm_dlpack_managed *>(m_);
    }
    /// The DLManagedTensorVersioned (nullptr when not versioned or released).
    epcomm_dlpack_managed_versioned *managed_versioned() const noexcept {
        return versioned_ ? static_cast<epcomm_dlpack_managed_versioned *>(m_) : nullptr;
    }
    /// The exported DLTensor (the export must not have been released).
    const epcomm_tensor &tensor() const noexcept {
        return versioned_ ? managed_versioned()->dl_tensor : managed()->dl_tensor;
    }
    /// Hands the managed tensor to a consumer (who calls its deleter); this no longer owns it.
    void *release() noexcept {
        void *m = m_;
        m_ = nullptr;
        return m;
    }

private:
    static void released(void *ctx) noexcept {
        std::function<void()> *f = static_cast<std::function<void()> *>(ctx);
        try {
            (*f)();
        } catch (...) {
        }
        delete f;
    }
    void reset() noexcept {
        if (m_ == nullptr) {
            return;
        }
        if (versioned_) {
            epcomm_dlpack_delete_versioned(static_cast<epcomm_dlpack_managed_versioned *>(m_));
        } else {
            epcomm_dlpack_delete(static_cast<epcomm_dlpack_managed *>(m_));
        }
        m_ = nullptr;
    }
    void *m_ = nullptr;
    bool versioned_ = false;
};

/// How many DLPack exports of this process have not been deleted yet.
inline size_t dlpack_live() noexcept { return epcomm_dlpack_live(); }

// ---- EPLB policy ------------------------------------------------------------------------------

/// vLLM's default EPLB policy as vLLM's eplb_state runs it: `weight` is [layers, logical] loads;
/// returns [layers, replicas].
inline std::vector<int64_t> eplb_rebalance(const std::vector<float> &weight, int64_t layers, int64_t logical,
                                           int64_t replicas, int64_t groups, int64_t nodes, int64_t ranks,
                                           const std::vector<int64_t> *old_phy2log = nullptr) {
    detail::require_size("weight", weight.size(), layers * logical, "num_layers * num_logical_experts");
    if (old_phy2log) {
        detail::require_size("old_phy2log", old_phy2log->size(), layers * replicas, "num_layers * num_replicas");
    }
    std::vector<int64_t> out(static_cast<size_t>(layers * replicas));
    check(epcomm_eplb_rebalance(weight.data(), layers, logical, replicas, groups, nodes, ranks,
                                old_phy2log ? old_phy2log->data() : nullptr, out.data()));
    return out;
}

/// vLLM's DefaultEplbPolicy.rebalance_experts: [layers, logical] loads → [layers, replicas];
/// `flags` 0 or EPCOMM_EPLB_ONE_NODE_FALLBACK; `old_phy2log` keeps experts in their slots.
inline std::vector<int64_t> eplb_rebalance_experts(const std::vector<float> &weight, int64_t layers, int64_t logical,
                                                   int64_t replicas, int64_t groups, int64_t nodes, int64_t ranks,
                                                   const std::vector<int64_t> *old_phy2log = nullptr,
                                                   uint32_t flags = 0) {
    detail::require_size("weight", weight.size(), layers * logical, "num_layers * num_logical_experts");
    if (old_phy2log) {
        detail::require_size("old_phy2log", old_phy2log->size(), layers * replicas, "num_layers * num_replicas");
    }
    std::vector<int64_t> out(static_cast<size_t>(layers * replicas));
    check(epcomm_eplb_rebalance_experts(weight.data(), layers, logical, replicas, groups, nodes, ranks,
                                        old_phy2log ? old_phy2log->data() : nullptr, flags, out.data()));
    return out;
}

/// vLLM's rebalance_experts_hierarchical: [layers, logical] loads → [layers, physical].
inline std::vector<int64_t> eplb_rebalance_experts_hierarchical(const std::vector<float> &weight, int64_t layers,
                                                                int64_t logical, int64_t physical, int64_t groups,
                                                                int64_t nodes, int64_t gpus) {
    detail::require_size("weight", weight.size(), layers * logical, "num_layers * num_logical_experts");
    std::vector<int64_t> out(static_cast<size_t>(layers * physical));
    check(epcomm_eplb_rebalance_experts_hierarchical(weight.data(), layers, logical, physical, groups, nodes,
                                                     gpus, out.data()));
    return out;
}

/// What eplb_balanced_packing returns: [rows, items] each.
struct Packing {
    std::vector<int64_t> pack_index;
    std::vector<int64_t> rank_in_pack;
};

/// vLLM's balanced_packing of `weight` [rows, items] into `packs` packs per row.
inline Packing eplb_balanced_packing(const std::vector<double> &weight, int64_t rows, int64_t items, int64_t packs) {
    detail::require_size("weight", weight.size(), rows * items, "num_rows * num_items");
    const size_t n = static_cast<size_t>(rows * items);
    Packing p{std::vector<int64_t>(n), std::vector<int64_t>(n)};
    check(epcomm_eplb_balanced_packing(weight.data(), rows, items, packs, p.pack_index.data(),
                                       p.rank_in_pack.data()));
    return p;
}

/// What eplb_replicate_experts returns: phy2log [rows, physical], logcnt [rows, logical].
struct Replication {
    std::vector<int64_t> phy2log;
    std::vector<int64_t> logcnt;
};

/// vLLM's replicate_experts of `weight` [rows, logical] into `physical` slots per row.
inline Replication eplb_replicate_experts(const std::vector<double> &weight, int64_t rows, int64_t logical,
                                          int64_t physical) {
    detail::require_size("weight", weight.size(), rows * logical, "num_rows * num_logical");
    Replication r{std::vector<int64_t>(static_cast<size_t>(rows * physical)),
                  std::vector<int64_t>(static_cast<size_t>(rows * logical))};
    check(epcomm_eplb_replicate_experts(weight.data(), rows, logical, physical, r.phy2log.data(),
                                        r.logcnt.data()));
    return r;
}

/// vLLM's preserve_intragpu_slots: `phy2log` [layers, physical] reordered per rank so experts
/// that stay on a rank keep their `old_phy2log` slots.
inline std::vector<int64_t> eplb_preserve_intragpu_slots(const std::vector<int64_t> &phy2log, int64_t layers,
                                                         int64_t ranks, const std::vector<int64_t> &old_phy2log) {
    const int64_t physical = layers > 0 ? static_cast<int64_t>(phy2log.size()) / layers : 0;
    detail::require_size("old_phy2log", old_phy2log.size(), static_cast<int64_t>(phy2log.size()), "phy2log's size");
    std::vector<int64_t> out(phy2log.size());
    check(epcomm_eplb_preserve_intragpu_slots(phy2log.data(), layers, physical, ranks, old_phy2log.data(),
                                              out.data()));
    return out;
}

/// vLLM 0.34.0's compute_dead_ep_ranks: the EP ranks (ascending) of the dead DP ranks, each
/// owning tp_size * pcp_size consecutive EP ranks.
inline std::vector<int64_t> eplb_dead_ep_ranks(const std::vector<int64_t> &dead_dp_ranks, int64_t tp_size,
                                               int64_t pcp_size = 1) {
    const int64_t block = tp_size > 0 && pcp_size > 0 ? tp_size * pcp_size : 0;
    std::vector<int64_t> out(dead_dp_ranks.size() * static_cast<size_t>(block > 0 ? block : 0) + 1);
    size_t n = 0;
    check(epcomm_eplb_dead_ep_ranks(dead_dp_ranks.data(), dead_dp_ranks.size(), tp_size, pcp_size, out.data(), &n));
    out.resize(n);
    return out;
}

/// vLLM 0.34.0's mark_dead_expert_slots_inplace: the dead EP ranks' slots of `phy2log`
/// [layers, physical] become -1, in place.
inline void eplb_mark_dead_expert_slots(std::vector<int64_t> &phy2log, int64_t layers,
                                        const std::vector<int64_t> &dead_ep_ranks, int64_t num_local_experts) {
    const int64_t physical = layers > 0 ? static_cast<int64_t>(phy2log.size()) / layers : 0;
    check(epcomm_eplb_mark_dead_expert_slots(phy2log.data(), layers, physical, dead_ep_ranks.data(),
                                             dead_ep_ranks.size(), num_local_experts));
}

/// vLLM 0.34.0's redistribute_expert_placement: each lost logical expert takes a spare slot of
/// an over-replicated one (the same on every survivor), `phy2log` rewritten in place; returns
/// the reload flags [layers, logical] (1 = reload that expert's weights). Too little
/// redundancy throws vLLM's RuntimeError text, `phy2log` unchanged.
inline std::vector<uint8_t> eplb_redistribute_expert_placement(std::vector<int64_t> &phy2log, int64_t layers,
                                                               int64_t logical, int64_t num_local_experts) {
    const int64_t physical = layers > 0 ? static_cast<int64_t>(phy2log.size()) / layers : 0;
    std::vector<uint8_t> reload(static_cast<size_t>(layers > 0 && logical > 0 ? layers * logical : 0) + 1);
    check(epcomm_eplb_redistribute_expert_placement(phy2log.data(), layers, physical, logical, num_local_experts,
                                                    reload.data()));
    reload.pop_back();
    return reload;
}

/// Logical maps of a placement: replica counts [layers, logical] and the logical → physical map
/// [layers, logical, max_replicas] (ascending slots, padded with -1).
struct LogicalMaps {
    std::vector<int64_t> logcnt;
    std::vector<int64_t> log2phy;
    int64_t max_replicas = 0;
};

/// vLLM's compute_logical_maps of `phy2log` [layers, physical] (-1 = unused slot); the width
/// is vLLM's max(logcnt).
inline LogicalMaps eplb_compute_logical_maps(const std::vector<int64_t> &phy2log, int64_t layers, int64_t logical) {
    const int64_t physical = layers > 0 ? static_cast<int64_t>(phy2log.size()) / layers : 0;
    LogicalMaps m;
    m.logcnt.resize(static_cast<size_t>(layers > 0 && logical > 0 ? layers * logical : 0));
    check(epcomm_eplb_compute_logical_maps(phy2log.data(), layers, physical, logical, m.logcnt.data(), nullptr, 0,
                                           &m.max_replicas));
    m.log2phy.resize(static_cast<size_t>(layers * logical * m.max_replicas));
    check(epcomm_eplb_compute_logical_maps(phy2log.data(), layers, physical, logical, m.logcnt.data(),
                                           m.log2phy.data(), static_cast<int64_t>(m.log2phy.size()),
                                           &m.max_replicas));
    return m;
}

/// The logical maps of `phy2log` [layers, physical] with a fixed width `max_replicas` (an
/// expert with more replicas is an error naming it).
inline LogicalMaps eplb_logical_maps(const std::vector<int64_t> &phy2log, int64_t layers, int64_t logical,
                                     int64_t max_replicas) {
    const int64_t physical = layers > 0 ? static_cast<int64_t>(phy2log.size()) / layers : 0;
    LogicalMaps m;
    m.max_replicas = max_replicas;
    m.logcnt.resize(static_cast<size_t>(layers > 0 && logical > 0 ? layers * logical : 0));
    const bool sized = layers > 0 && logical > 0 && max_replicas > 0;
    m.log2phy.resize(static_cast<size_t>(sized ? layers * logical * max_replicas : 0));
    check(epcomm_eplb_logical_maps(phy2log.data(), layers, physical, logical, max_replicas, m.logcnt.data(),
                                   m.log2phy.data()));
    return m;
}

/// The smallest num_redundant_experts making num_logical + redundant divisible by ep_size.
inline int64_t eplb_min_redundant_experts(int64_t num_logical, int64_t ep_size) {
    int64_t n = 0;
    check(epcomm_eplb_min_redundant_experts(num_logical, ep_size, &n));
    return n;
}

// ---- EPLB at run time -------------------------------------------------------------------------

/// A communicator request: `communicator` a name ("torch_gloo", ...) or nullptr for vLLM's
/// automatic choice, weights on `device_type`, NCCL and NIXL availability probed in this
/// process (set nccl_available / nixl_available to 0 or 1 to decide instead).
inline epcomm_eplb_select_request eplb_select_request(const char *communicator = nullptr,
                                                      int32_t device_type = EPCOMM_DEVICE_CPU) {
    epcomm_eplb_select_request r{};
    r.struct_size = sizeof r;
    r.communicator = communicator;
    r.device_type = device_type;
    r.nccl_available = EPCOMM_PROBE;
    r.nixl_available = EPCOMM_PROBE;
    return r;
}

/// The EPCOMM_EPLB_* communicator vLLM's factory chooses for `request`, with its messages.
inline int32_t eplb_communicator_select(const epcomm_eplb_select_request &request) {
    int32_t c = -1;
    check(epcomm_eplb_communicator_select(&request, &c));
    return c;
}

/// The name of an EPCOMM_EPLB_* communicator; nothing for another value.
inline std::optional<std::string> eplb_communicator_name(int32_t communicator) {
    return detail::text(epcomm_eplb_communicator_name(communicator));
}

/// vLLM's class of an EPCOMM_EPLB_* communicator; nothing for another value.
inline std::optional<std::string> eplb_communicator_class(int32_t communicator) {
    return detail::text(epcomm_eplb_communicator_class(communicator));
}

/// Options of a rearrangement (epcomm_eplb_rearrange_options_init defaults: no rank mapping,
/// no migration batching); every rank must pass the same.
class RearrangeOptions {
public:
    RearrangeOptions() { check(epcomm_eplb_rearrange_options_init(&o_)); }
    /// Old rank → new rank or -1: a change of EP size.
    RearrangeOptions &rank_mapping(std::vector<int64_t> mapping) {
        mapping_ = std::move(mapping);
        return *this;
    }
    /// vLLM's migration batching: each rank talks to at most one peer at a time.
    RearrangeOptions &migration_batching(bool on) {
        o_.migration_batching = on;
        return *this;
    }
    /// After a failure: rearrange even when the new placement needs experts no member rank
    /// holds; their slots keep their bytes and are reported (Rearranged::lost_experts). Off
    /// (the default): such a rearrangement fails on every rank before any data moves.
    RearrangeOptions &allow_lost_experts(bool on) {
        allow_lost_ = on;
        return *this;
    }
    bool lost_experts_allowed() const noexcept { return allow_lost_; }
    /// The C struct (its rank_mapping points into this object).
    const epcomm_eplb_rearrange_options *get() const noexcept {
        o_.rank_mapping = mapping_.empty() ? nullptr : mapping_.data();
        o_.rank_mapping_len = mapping_.size();
        return &o_;
    }

private:
    mutable epcomm_eplb_rearrange_options o_{};
    std::vector<int64_t> mapping_;
    bool allow_lost_ = false;
};

/// A logical expert of a layer the new placement needs but no member rank holds.
struct LostExpert {
    int64_t layer;
    int64_t expert;
};

/// What a rearrangement did (the C summary) and, with allow_lost_experts, the experts it left
/// unwritten (layers ascending, experts ascending within a layer).
struct Rearranged : epcomm_eplb_summary {
    std::vector<LostExpert> lost_experts;
};

/// The logical experts of one layer's old placement (`slots_per_rank` slots per old rank, -1 =
/// empty) with no replica on a surviving rank (`rank_mapping[r] >= 0`, one entry per old
/// rank), ascending: after a failure their weights are gone.
inline std::vector<int64_t> eplb_lost_experts(const std::vector<int64_t> &old_phy2log, int64_t slots_per_rank,
                                              const std::vector<int64_t> &rank_mapping) {
    const int64_t slots = static_cast<int64_t>(old_phy2log.size());
    int64_t n = 0;
    check(epcomm_eplb_lost_experts(old_phy2log.data(), slots, slots_per_rank, rank_mapping.data(),
                                   rank_mapping.size(), nullptr, 0, &n));
    std::vector<int64_t> lost(static_cast<size_t>(n));
    check(epcomm_eplb_lost_experts(old_phy2log.data(), slots, slots_per_rank, rank_mapping.data(),
                                   rank_mapping.size(), lost.data(), lost.size(), &n));
    return lost;
}

/// An EPLB communicator over a group (move-only), as vLLM's factory builds it for a request;
/// it keeps its group alive.
class EplbCommunicator {
public:
    EplbCommunicator(const Group &group, const epcomm_eplb_select_request &request) {
        check(epcomm_eplb_communicator_create(group.get(), &request, c_.out()));
    }
    epcomm_eplb_communicator *get() const noexcept { return c_.get(); }

    /// Queues sending one expert's rows (one view per weight tensor) to rank `dst`; the memory
    /// must stay unchanged until execute returns.
    void add_send(const std::vector<Tensor> &tensors, int32_t dst, int64_t expert) {
        const std::vector<epcomm_tensor> t = detail::raw(tensors);
        check(epcomm_eplb_communicator_add_send(c_.get(), t.empty() ? nullptr : t.data(), t.size(), dst,
                                                expert));
    }
    /// Queues receiving one expert's rows from rank `src` into `tensors`.
    void add_recv(const std::vector<Tensor> &tensors, int32_t src, int64_t expert) {
        const std::vector<epcomm_tensor> t = detail::raw(tensors);
        check(epcomm_eplb_communicator_add_recv(c_.get(), t.empty() ? nullptr : t.data(), t.size(), src,
                                                expert));
    }
    /// Runs every queued transfer (collective) and clears the queue, also on failure.
    void execute() { check(epcomm_eplb_communicator_execute(c_.get())); }

    /// Moves every layer's expert weights (collective) from `old_phy2log` to `new_phy2log`
    /// ([num_layers, slots] each); `weights` holds num_layers * tensors-per-layer views,
    /// layer-major. A failure leaves the failed layer and later ones unchanged. A rank mapping
    /// with more entries than the group has ranks is a scale-down after a failure (the group
    /// is the survivors, e.g. from Group::shrink); see RearrangeOptions::allow_lost_experts.
    Rearranged rearrange(const std::vector<int64_t> &old_phy2log, const std::vector<int64_t> &new_phy2log,
                         int64_t num_layers, const std::vector<Tensor> &weights,
                         const RearrangeOptions &options = RearrangeOptions()) {
        const Shape s = shape(old_phy2log, new_phy2log, num_layers, weights);
        const std::vector<epcomm_tensor> w = detail::raw(weights);
        Lost lost(options, s);
        Rearranged r{};
        check(options.lost_experts_allowed()
                  ? epcomm_eplb_rearrange_with_lost(c_.get(), old_phy2log.data(), new_phy2log.data(), num_layers,
                                                    s.old_slots, s.new_slots, w.data(), s.tensors, options.get(),
                                                    &lost.options, &r)
                  : epcomm_eplb_rearrange_with(c_.get(), old_phy2log.data(), new_phy2log.data(), num_layers,
                                               s.old_slots, s.new_slots, w.data(), s.tensors, options.get(), &r));
        lost.report(r);
        return r;
    }
    /// As rearrange with a rank mapping (epcomm_eplb_rearrange: old rank → new rank or -1).
    Rearranged rearrange(const std::vector<int64_t> &old_phy2log, const std::vector<int64_t> &new_phy2log,
                         int64_t num_layers, const std::vector<Tensor> &weights,
                         const std::vector<int64_t> &rank_mapping) {
        const Shape s = shape(old_phy2log, new_phy2log, num_layers, weights);
        const std::vector<epcomm_tensor> w = detail::raw(weights);
        Rearranged r{};
        check(epcomm_eplb_rearrange(c_.get(), old_phy2log.data(), new_phy2log.data(), num_layers, s.old_slots,
                                    s.new_slots, w.data(), s.tensors,
                                    rank_mapping.empty() ? nullptr : rank_mapping.data(), rank_mapping.size(), &r));
        return r;
    }
    /// Double-buffered rearrange: `weights` are only read and the new placement is written
    /// into `next_weights` (same layout, buffers of their own; a lost expert's next rows are
    /// its slot's live rows). Throws RearrangeError, whose next_valid() says how many leading
    /// layers of the next weights are complete.
    Rearranged rearrange_into(const std::vector<int64_t> &old_phy2log, const std::vector<int64_t> &new_phy2log,
                              int64_t num_layers, const std::vector<Tensor> &weights,
                              const std::vector<Tensor> &next_weights,
                              const RearrangeOptions &options = RearrangeOptions()) {
        const Shape s = shape(old_phy2log, new_phy2log, num_layers, weights);
        detail::require_size("next_weights", next_weights.size(), static_cast<int64_t>(weights.size()),
                             "weights' size");
        const std::vector<epcomm_tensor> w = detail::raw(weights), n = detail::raw(next_weights);
        Lost lost(options, s);
        Rearranged r{};
        int64_t valid = 0;
        const int32_t st =
            options.lost_experts_allowed()
                ? epcomm_eplb_rearrange_into_with_lost(c_.get(), old_phy2log.data(), new_phy2log.data(), num_layers,
                                                       s.old_slots, s.new_slots, w.data(), n.data(), s.tensors,
                                                       options.get(), &lost.options, &r, &valid)
                : epcomm_eplb_rearrange_into(c_.get(), old_phy2log.data(), new_phy2log.data(), num_layers,
                                             s.old_slots, s.new_slots, w.data(), n.data(), s.tensors, options.get(),
                                             &r, &valid);
        if (st != EPCOMM_OK) {
            throw RearrangeError(last_error(st), valid);
        }
        lost.report(r);
        return r;
    }

private:
    struct Shape {
        int64_t layers, old_slots, new_slots;
        size_t tensors;
    };
    /// Lost-expert options allowing them, reporting into room for every (layer, new slot),
    /// which always suffices.
    struct Lost {
        Lost(const RearrangeOptions &o, const Shape &s) : pairs(2 * static_cast<size_t>(s.layers * s.new_slots)) {
            check(epcomm_eplb_lost_experts_options_init(&options));
            options.allow_lost_experts = o.lost_experts_allowed();
            options.lost_experts_out = pairs.empty() ? nullptr : pairs.data();
            options.lost_experts_capacity = pairs.size() / 2;
            options.num_lost_experts_out = &count;
        }
        void report(Rearranged &r) const {
            for (int64_t i = 0; i < count; ++i) {
                r.lost_experts.push_back(LostExpert{pairs[static_cast<size_t>(2 * i)], pairs[static_cast<size_t>(2 * i + 1)]});
            }
        }
        epcomm_eplb_lost_experts_options options{};
        std::vector<int64_t> pairs;
        int64_t count = 0;
    };
    /// Slots per layer and tensors per layer from the sizes (which must divide by num_layers).
    static Shape shape(const std::vector<int64_t> &old_map, const std::vector<int64_t> &new_map, int64_t layers,
                       const std::vector<Tensor> &weights) {
        const size_t l = layers > 0 ? static_cast<size_t>(layers) : 1;
        if (old_map.size() % l != 0 || new_map.size() % l != 0 || weights.size() % l != 0) {
            throw Error(EPCOMM_ERROR_INVALID_ARGUMENT,
                        "rearrange: maps of " + std::to_string(old_map.size()) + " and " +
                            std::to_string(new_map.size()) + " slots and " + std::to_string(weights.size()) +
                            " weight tensors do not divide into " + std::to_string(layers) + " layers",
                        "", "ValueError");
        }
        return Shape{layers, static_cast<int64_t>(old_map.size() / l), static_cast<int64_t>(new_map.size() / l),
                     weights.size() / l};
    }
    Owned<epcomm_eplb_communicator, epcomm_eplb_communicator_destroy> c_;
};

/// One flow of a migration batch: `src` sends `experts` (ascending) to `dst`.
struct MigrationFlow {
    int64_t src;
    int64_t dst;
    std::vector<int64_t> experts;
};

/// vLLM's migration schedule of one layer (epcomm_eplb_schedule_migration_batches; immutable,
/// move-only): batches of flows in which each rank is in at most one flow.
class MigrationSchedule {
public:
    /// The schedule from the old to the new map (`slots_per_rank` slots per rank; -1 = empty).
    MigrationSchedule(const std::vector<int64_t> &old_phy2log, const std::vector<int64_t> &new_phy2log,
                      int64_t slots_per_rank) {
        detail::require_size("new_phy2log", new_phy2log.size(), static_cast<int64_t>(old_phy2log.size()),
                             "old_phy2log's size");
        check(epcomm_eplb_schedule_migration_batches(old_phy2log.data(), new_phy2log.data(),
                                                     static_cast<int64_t>(old_phy2log.size()), slots_per_rank,
                                                     s_.out()));
    }
    /// The C views (valid while this schedule lives).
    epcomm_eplb_schedule_view view() const {
        epcomm_eplb_schedule_view v{};
        check(epcomm_eplb_migration_schedule_view(s_.get(), &v));
        return v;
    }
    /// The batches, each a list of flows, in vLLM's order.
    std::vector<std::vector<MigrationFlow>> batches() const {
        const epcomm_eplb_schedule_view v = view();
        std::vector<std::vector<MigrationFlow>> out(static_cast<size_t>(v.num_batches));
        for (int64_t b = 0; b < v.num_batches; ++b) {
            for (int64_t f = v.batch_starts[b]; f < v.batch_starts[b + 1]; ++f) {
                out[static_cast<size_t>(b)].push_back(
                    MigrationFlow{v.flows[2 * f], v.flows[2 * f + 1],
                                  std::vector<int64_t>(v.expert_ids + v.expert_starts[f],
                                                       v.expert_ids + v.expert_starts[f + 1])});
            }
        }
        return out;
    }

private:
    Owned<epcomm_eplb_migration_schedule, epcomm_eplb_migration_schedule_destroy> s_;
};

/// One rank's transfer plan for one layer (epcomm_eplb_plan_layer, move-only), with vLLM's
/// sender/receiver pairing.
class LayerPlan {
public:
    LayerPlan(const std::vector<int64_t> &old_phy2log, const std::vector<int64_t> &new_phy2log,
              int64_t slots_per_rank, int32_t rank) {
        detail::require_size("new_phy2log", new_phy2log.size(), static_cast<int64_t>(old_phy2log.size()),
                             "old_phy2log's size");
        check(epcomm_eplb_plan_layer(old_phy2log.data(), new_phy2log.data(),
                                     static_cast<int64_t>(old_phy2log.size()), slots_per_rank, rank, p_.out()));
    }
    /// The C views (valid while this plan lives).
    epcomm_eplb_plan_view view() const {
        epcomm_eplb_plan_view v{};
        check(epcomm_eplb_layer_plan_view(p_.get(), &v));
        return v;
    }

private:
    Owned<epcomm_eplb_layer_plan, epcomm_eplb_layer_plan_destroy> p_;
};

/// Expert-load statistics of one model on one rank (move-only): window, schedule and vLLM's
/// balancedness log line.
class EplbState {
public:
    /// Load statistics for `num_layers` MoE layers of `num_physical` experts, in the order C's
    /// epcomm_eplb_state_new and Python's epcomm.EplbState take: `model_name` names the model in
    /// the balancedness line; `config_json` is vLLM's EPLBConfig as JSON (empty: vLLM's
    /// defaults).
    EplbState(int64_t num_layers, int64_t num_physical, const std::string &model_name,
              const std::string &config_json = "") {
        check(epcomm_eplb_state_new(num_layers, num_physical, model_name.c_str(),
                                    config_json.empty() ? nullptr : config_json.c_str(), s_.out()));
    }
    /// The same, with the arguments in an older order (model_name first), kept for existing
    /// callers; new code uses the constructor above.
    EplbState(const std::string &model_name, int64_t num_layers, int64_t num_physical,
              const std::string &config_json = "")
        : EplbState(num_layers, num_physical, model_name, config_json) {}
    epcomm_eplb_state *get() const noexcept { return s_.get(); }
    /// vLLM's EPLBConfig.migration_batching_enabled (use_async and enable_migration_batching).
    bool migration_batching() const {
        bool on = false;
        check(epcomm_eplb_state_migration_batching(s_.get(), &on));
        return on;
    }
    /// Adds the load of the manager's last dispatch to layer `layer` of this step.
    void record_dispatch(int64_t layer, const All2All &a2a) {
        check(epcomm_eplb_state_record_dispatch(s_.get(), layer, a2a.get()));
    }
    /// Adds one token per valid id of `topk_ids` (int32/int64, -1 ignored) to layer `layer`.
    void record(int64_t layer, const Tensor &topk_ids) {
        check(epcomm_eplb_state_record(s_.get(), layer, topk_ids.get()));
    }
    /// Ends a forward step (collective when logging balancedness); true when a rearrangement
    /// is due.
    bool step(Group &group, bool is_dummy, bool log_stats) {
        bool due = false;
        check(epcomm_eplb_state_step(s_.get(), group.get(), is_dummy, log_stats, &due));
        return due;
    }
    /// The window's load per logical expert over all ranks (collective): `phy2log` is the
    /// current placement [num_layers, physical]; returns [num_layers, num_logical].
    std::vector<float> logical_load(Group &group, const std::vector<int64_t> &phy2log, int64_t num_layers,
                                    int64_t num_logical) const {
        const int64_t physical = num_layers > 0 ? static_cast<int64_t>(phy2log.size()) / num_layers : 0;
        const bool sized = num_layers > 0 && num_logical > 0;
        std::vector<float> load(static_cast<size_t>(sized ? num_layers * num_logical : 0));
        check(epcomm_eplb_state_logical_load(s_.get(), group.get(), phy2log.data(), num_layers, physical, num_logical,
                                             load.data()));
        return load;
    }

private:
    Owned<epcomm_eplb_state, epcomm_eplb_state_destroy> s_;
};

}  // namespace epcomm

#endif  // EPCOMM_HPP
