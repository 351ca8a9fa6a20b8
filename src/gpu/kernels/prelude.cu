// epcomm kernel prelude: prepended to every module. Header-free on purpose (NVRTC has no
// cuda_bf16.h / cuda_fp16.h built in), so 16-bit floats are raw `unsigned short` bits.
// Specialisation macros (set by kernels.rs with -D): TOPK, ID_DTYPE (0 = int32, 1 = int64),
// IN_DTYPE / OUT_DTYPE (0 = f32, 1 = bf16, 2 = f16). Unused ones get harmless defaults here.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#ifndef TOPK
#define TOPK 1
#endif
#ifndef ID_DTYPE
#define ID_DTYPE 0
#endif
#if ID_DTYPE == 0
typedef int id_t_;
#else
typedef long long id_t_;
#endif

// ---- 16-bit float helpers (round-to-nearest-even, as torch does) -------------------------
__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float(((u32)v) << 16); }
// ---- bf16 rounding in C (begin)
// f32 bits -> bf16 bits, round to nearest even on the bits (carry into the exponent gives the
// right result for every finite input, overflow included: max finite rounds to infinity); a NaN
// keeps its sign and upper payload and is made quiet (bit 6). Equal to `cvt.rn.bf16.f32` for
// every non-NaN input and to src/num.rs's `f32_to_bf16` for every input (tests/gpu_kernels.rs).
__device__ __forceinline__ u16 ep_bf16_from_bits(u32 b) {
    if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b >> 16) | 0x40u);
    return (u16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
// ---- bf16 rounding in C (end)
// `cvt.rn.bf16.f32` needs sm_80; older GPUs (sm_70, sm_75) round in C.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
#if __CUDA_ARCH__ >= 800
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
#else
    return ep_bf16_from_bits(__float_as_uint(f));
#endif
}
__device__ __forceinline__ float f16_to_f32(u16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// ---- device error word -----------------------------------------------------------------
// 64 bits: code (63..56) | a (55..24, u32: token or peer) | b (23..0: k, expert, ...).
// 0 = no error. Declared once in Rust (kernels.rs: ERROR_WORD_DEFINES, decode_error_word; the
// one-sided workspace holds the same word): tests/gpu_kernels.rs checks every EP_ERR_ define
// here against that table and runs ep_err_make against encode_error_word.
#define EP_ERR_CODE_SHIFT 56
#define EP_ERR_A_SHIFT 24
#define EP_ERR_B_MASK 0xffffffu
#define EP_ERR_ID_OUT_OF_RANGE 1u
#define EP_ERR_DUPLICATE_ID 2u
#define EP_ERR_CAPACITY 3u
#define EP_ERR_WAIT_TIMEOUT 4u
#define EP_ERR_RANK_CAPACITY 5u

__device__ __forceinline__ u64 ep_err_make(u32 code, u32 a, u32 b) {
    return ((u64)(code & 0xffu) << EP_ERR_CODE_SHIFT) | ((u64)a << EP_ERR_A_SHIFT) |
           (u64)(b & EP_ERR_B_MASK);
}

// Ordering key of a word: a (token/peer), then b (k, ...), then the code. The lowest token,
// then the lowest k, is the entry the CPU path's in-order validation reports first (at one
// (t, k) only one check can fail: an out-of-range id counts as -1 for the duplicate check).
__device__ __forceinline__ u64 ep_err_key(u64 w) {
    return (((w >> EP_ERR_A_SHIFT) & 0xffffffffull) << 32) | ((w & EP_ERR_B_MASK) << 8) |
           (w >> EP_ERR_CODE_SHIFT);
}

// Keeps the non-zero word of the smallest key: when several threads fail, the report is
// deterministic (and the CPU path's) instead of whoever came first.
__device__ __forceinline__ void ep_err_report(u64* err, u64 word) {
    if (err == 0) return;
    u64 old = *((volatile u64*)err);
    while (old == 0ull || ep_err_key(word) < ep_err_key(old)) {
        u64 prev = atomicCAS(err, old, word);
        if (prev == old) break;
        old = prev;
    }
}

// ---- row copies --------------------------------------------------------------------------
// Copies `bytes` with `n` cooperating threads (`lane` in [0, n)): 16-byte vectors when both
// pointers and the size are 16-aligned, 4-byte words when 4-aligned, bytes otherwise.
__device__ __forceinline__ void ep_copy_bytes(u8* dst, const u8* src, u64 bytes, u32 lane, u32 n) {
    u64 align = ((u64)dst) | ((u64)src) | bytes;
    if ((align & 15ull) == 0) {
        uint4* d = (uint4*)dst;
        const uint4* s = (const uint4*)src;
        for (u64 i = lane; i < (bytes >> 4); i += n) d[i] = s[i];
    } else if ((align & 3ull) == 0) {
        u32* d = (u32*)dst;
        const u32* s = (const u32*)src;
        for (u64 i = lane; i < (bytes >> 2); i += n) d[i] = s[i];
    } else {
        for (u64 i = lane; i < bytes; i += n) dst[i] = src[i];
    }
}

__device__ __forceinline__ u32 ep_lane() { return threadIdx.x & 31u; }
__device__ __forceinline__ u64 ep_global_warp() {
    return ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
}
__device__ __forceinline__ u64 ep_num_warps() { return ((u64)gridDim.x * blockDim.x) >> 5; }
__device__ __forceinline__ u64 ep_global_thread() {
    return (u64)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ u64 ep_num_threads() { return (u64)gridDim.x * blockDim.x; }
