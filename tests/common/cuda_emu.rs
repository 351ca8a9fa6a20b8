//! The CPU emulation of the CUDA kernels shared by tests/gpu_kernels.rs,
//! tests/gpu_pipeline_emu.rs and tests/gpu_pipeline_counts_emu.rs: the real .cu sources
//! compiled by the host C++ compiler (`$CXX`, default `c++`) against a stand-in for the CUDA
//! built-ins (`EMU_PRELUDE`, written as `emu_prelude.h`) and the device-side tail of
//! `kernels::PRELUDE_CU` (`prelude_tail.h`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use epcomm::gpu::kernels;

/// Host emulation of the CUDA built-ins the kernels use, plus the two grid runners
/// `emu_seq(grid, block, f)` (thread by thread: every kernel that never synchronises) and
/// `emu_threads(grid, block, f)` (one OS thread per CUDA thread, blocks in order; block a
/// multiple of 32, <= 1024: the scan).
pub const EMU_PRELUDE: &str = r##"// Host emulation of the CUDA built-ins: row kernels run thread by thread (emu_seq),
// block-synchronous kernels (scan) with one OS thread per CUDA thread (emu_threads):
// __syncthreads is a block barrier, a shuffle a per-warp exchange between two warp barriers,
// __shared__ a static. Signal/wait (inline PTX) is not emulated.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#include <functional>
#include <thread>
#include <type_traits>
#include <utility>
#include <pthread.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(x)
struct dim3_ { unsigned x, y, z; };
static thread_local dim3_ threadIdx;
static dim3_ blockIdx, blockDim, gridDim;
#define __shared__ static
struct EmuBlock { pthread_barrier_t block; pthread_barrier_t warp[32]; int xchg[1024]; };
static thread_local EmuBlock* emu_block;
static inline void __syncthreads() { pthread_barrier_wait(&emu_block->block); }
static inline int __shfl_up_sync(unsigned, int v, int o) {
    unsigned t = threadIdx.x, lane = t & 31u, w = t >> 5;
    emu_block->xchg[t] = v;
    pthread_barrier_wait(&emu_block->warp[w]);
    int r = lane >= (unsigned)o ? emu_block->xchg[t - o] : v;
    pthread_barrier_wait(&emu_block->warp[w]);
    return r;
}
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
struct uint4 { unsigned x, y, z, w; };
#ifndef TOPK
#define TOPK 1
#endif
#if ID_DTYPE == 0
typedef int id_t_;
#else
typedef long long id_t_;
#endif
static inline int atomicAdd(int* p, int v) { int o = *p; *p += v; return o; }
static inline u64 atomicCAS(u64* p, u64 c, u64 v) { u64 o = *p; if (o == c) *p = v; return o; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float bf16_to_f32(u16 v) { u32 b = ((u32)v) << 16; float f; memcpy(&f, &b, 4); return f; }
static inline u16 f32_to_bf16(float f) {
    u32 b; memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b >> 16) | 0x40u);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (u16)(b >> 16);
}
static void emu_seq(unsigned grid, unsigned block, const std::function<void()>& f) {
    gridDim = {grid, 1, 1}; blockDim = {block, 1, 1};
    for (unsigned b = 0; b < grid; ++b) for (unsigned t = 0; t < block; ++t) { blockIdx = {b, 0, 0}; threadIdx = {t, 0, 0}; f(); }
}
static void emu_threads(unsigned grid, unsigned block, const std::function<void()>& f) {
    gridDim = {grid, 1, 1}; blockDim = {block, 1, 1};
    EmuBlock ctx;
    pthread_barrier_init(&ctx.block, nullptr, block);
    for (unsigned w = 0; w < block / 32; ++w) pthread_barrier_init(&ctx.warp[w], nullptr, 32);
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx = {b, 0, 0};
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < block; ++t) ts.emplace_back([&, t] { threadIdx = {t, 0, 0}; emu_block = &ctx; f(); });
        for (auto& t : ts) t.join();
    }
    pthread_barrier_destroy(&ctx.block);
    for (unsigned w = 0; w < block / 32; ++w) pthread_barrier_destroy(&ctx.warp[w]);
}
"##;

/// The host C++ compiler: `$CXX`, or `c++`.
pub fn cxx() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

/// The host C++ compiler, when it runs.
pub fn cxx_available() -> Option<String> {
    let cxx = cxx();
    Command::new(&cxx)
        .arg("--version")
        .output()
        .is_ok()
        .then_some(cxx)
}

/// The host C++ compiler, or `None` after a SKIPPED line naming `test` when it does not run.
pub fn cxx_or_skip(test: &str) -> Option<String> {
    let found = cxx_available();
    if found.is_none() {
        super::skip::skipped(
            test,
            &format!(
                "no C++ compiler ({}; install g++ or set $CXX) for the CUDA host emulation",
                cxx()
            ),
        );
    }
    found
}

/// A fresh directory `epcomm-{tag}-{pid}-{nanos}` under the system temp dir.
pub fn temp_dir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let d = std::env::temp_dir().join(format!("epcomm-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&d).expect("create temp dir");
    d
}

/// Writes `emu_prelude.h` (`EMU_PRELUDE`), `prelude_tail.h` (the part of `PRELUDE_CU` from the
/// device error word on) and each `(name, text)` of `files` into `dir`.
pub fn write_sources(dir: &Path, files: &[(&str, &str)]) {
    let tail = kernels::PRELUDE_CU
        .split_once("// ---- device error word")
        .map(|(_, t)| format!("// ---- device error word{t}"))
        .expect("prelude marker");
    std::fs::write(dir.join("emu_prelude.h"), EMU_PRELUDE).expect("write");
    std::fs::write(dir.join("prelude_tail.h"), tail).expect("write");
    for (name, text) in files {
        std::fs::write(dir.join(name), text).expect("write");
    }
}

/// The host compiler, run in `dir` with the flags every emulation build uses (K = 2, no FMA
/// contraction, so float results match the device's `__fadd_rn`/`__fmul_rn`).
pub fn cxx_command(cxx: &str, dir: &Path) -> Command {
    let mut c = Command::new(cxx);
    c.current_dir(dir).args([
        "-std=c++17",
        "-O1",
        "-ffp-contract=off",
        "-DTOPK=2",
        "-w",
        "-pthread",
    ]);
    c
}

/// Compiles `main.cpp` in `dir` with `defines` into the program `exe` (asserting the compiler
/// succeeds) and runs it: whether it exited 0, and its stdout.
pub fn build_and_run(cxx: &str, dir: &Path, defines: &[String], exe: &str) -> (bool, String) {
    let exe = dir.join(exe);
    let out = cxx_command(cxx, dir)
        .args(defines)
        .arg("-o")
        .arg(&exe)
        .arg("main.cpp")
        .output()
        .expect("run the C++ compiler");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().expect("run");
    (
        run.status.success(),
        String::from_utf8_lossy(&run.stdout).into_owned(),
    )
}
