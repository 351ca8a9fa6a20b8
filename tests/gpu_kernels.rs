//! The GPU kernels without a GPU: every variant compiled by NVRTC to CUBIN for sm_70, sm_75,
//! sm_80 and sm_90 (ELF, 0 spill bytes, at most [`MAX_REGISTERS`], register table printed), the
//! C bf16 rounding of sm_7x against the CPU path's, the NVRTC loader's errors, the compile
//! cache (memory, disk, corrupt files), the ptxas log parser and the device error word.
//!
//! NVRTC comes from `EPCOMM_NVRTC_PATH` (CI: `scripts/fetch-nvrtc.sh` prints the directory) or
//! the default names. Without it the NVRTC tests skip with a message, unless
//! `EPCOMM_REQUIRE_NVRTC=1`, which makes a missing NVRTC a failure.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use epcomm::gpu::kernels::{self, Module, ParamType, Variant};
use epcomm::gpu::nvrtc::{self, Compiled, Compiler, Image, Nvrtc};
use epcomm::Status;

mod common;

use common::cuda_emu::{self, temp_dir};

/// Volta and Turing (sm_70, sm_75: no `cvt.rn.bf16.f32`, so bf16 rounds in C), Ampere, Hopper.
const ARCHS: [&str; 4] = ["sm_70", "sm_75", "sm_80", "sm_90"];
/// Registers per thread no kernel may exceed on any arch (NVRTC 12.8, TOPK ≤ 8: 64 in
/// `ep_unpack_rank_major` on sm_75, 56 on sm_70, 48 on sm_80, 40 on sm_90): a regression guard,
/// since 64 keeps 4 blocks of 256 threads resident per SM.
const MAX_REGISTERS: u32 = 64;

/// NVRTC, or `None` (test skipped) when it is absent and not required.
fn nvrtc_or_skip(test: &str) -> Option<Nvrtc> {
    match Nvrtc::global() {
        Ok(n) => Some(*n),
        Err(e) => {
            if common::skip::required("EPCOMM_REQUIRE_NVRTC") {
                panic!(
                    "EPCOMM_REQUIRE_NVRTC=1 (or EPCOMM_TEST_FULL=1) but NVRTC is unavailable: {e}; \
                     export EPCOMM_NVRTC_PATH=\"$(scripts/fetch-nvrtc.sh)\""
                );
            }
            common::skip::skipped(
                test,
                &format!(
                    "{e} (scripts/fetch-nvrtc.sh downloads it and prints its directory, for \
                     EPCOMM_NVRTC_PATH; EPCOMM_TEST_FULL=1 requires it)"
                ),
            );
            None
        }
    }
}

type Outcome = (Variant, &'static str, Result<Arc<Compiled>, epcomm::Error>);

/// The archs of [`ARCHS`] this NVRTC can build CUBIN for (CUDA 13 dropped sm_70; a note names
/// any left out).
fn archs_for(nv: &Nvrtc) -> Vec<&'static str> {
    let Some(known) = nv.supported_archs() else {
        return ARCHS.to_vec();
    };
    let (ok, dropped): (Vec<&str>, Vec<&str>) = ARCHS.iter().partition(|a| {
        a.strip_prefix("sm_")
            .and_then(|n| n.parse::<i32>().ok())
            .is_some_and(|n| known.contains(&n))
    });
    if !dropped.is_empty() {
        println!(
            "NVRTC {}.{} cannot target {} (supports {known:?}): not compiled",
            nv.version.0,
            nv.version.1,
            dropped.join(", ")
        );
    }
    ok
}

/// Compiles every (variant, arch) with `--ptxas-options=-v` on up to 8 threads.
fn compile_all(compiler: &Arc<Compiler>, archs: &[&'static str]) -> Vec<Outcome> {
    let jobs: Vec<(Variant, &'static str)> = kernels::variants()
        .into_iter()
        .flat_map(|v| archs.iter().map(move |a| (v, *a)))
        .collect();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(1, 8);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let jobs = Arc::new(jobs);
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (compiler, next, jobs) = (compiler.clone(), next.clone(), jobs.clone());
            std::thread::spawn(move || {
                let mut out: Vec<Outcome> = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(v, arch)) = jobs.get(i) else { break };
                    let (src, mut opts) = kernels::source(&v);
                    opts.push("--ptxas-options=-v".into());
                    out.push((v, arch, compiler.compile(&src, &opts, arch)));
                }
                out
            })
        })
        .collect();
    let mut results: Vec<Outcome> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("compile thread"))
        .collect();
    results.sort_by_key(|(v, a, _)| (v.name(), *a));
    results
}

/// Prints one compile's register table rows and adds what breaks the limits to `failures`;
/// returns its highest register count.
fn check_compile(v: &Variant, arch: &str, c: &Compiled, failures: &mut Vec<String>) -> u32 {
    match &c.image {
        Image::Cubin(b) if b.starts_with(b"\x7fELF") => {}
        Image::Cubin(_) => failures.push(format!("{} {arch}: CUBIN is not ELF", v.name())),
        Image::Ptx(_) => failures.push(format!("{} {arch}: got PTX, not CUBIN", v.name())),
    }
    let res = c.resources();
    let mut max_regs = 0;
    for k in v.module.kernels() {
        let Some(r) = res.iter().find(|r| r.name == k.name) else {
            failures.push(format!(
                "{} {arch}: no ptxas figures for {} in the log",
                v.name(),
                k.name
            ));
            continue;
        };
        println!(
            "{:<30} {:<24} {:<6} {:>5} {:>6} {:>6} {:>6}",
            r.name,
            v.name(),
            arch,
            r.registers,
            r.stack_bytes,
            r.spill_stores,
            r.spill_loads
        );
        max_regs = max_regs.max(r.registers);
        let what = format!("{} {arch} {}", v.name(), r.name);
        if r.registers > MAX_REGISTERS {
            failures.push(format!(
                "{what}: {} registers, more than {MAX_REGISTERS}",
                r.registers
            ));
        }
        if r.spill_stores != 0 || r.spill_loads != 0 {
            failures.push(format!(
                "{what}: {} bytes spill stores, {} bytes spill loads",
                r.spill_stores, r.spill_loads
            ));
        }
        if r.arch != *arch {
            failures.push(format!("{what}: ptxas compiled for {}", r.arch));
        }
    }
    max_regs
}

#[test]
fn every_variant_compiles_to_cubin_without_spills() {
    let Some(nv) = nvrtc_or_skip("every_variant_compiles_to_cubin_without_spills") else {
        return;
    };
    let compiler = Arc::new(Compiler::new(nv, None));
    let archs = archs_for(&nv);
    let started = Instant::now();
    let results = compile_all(&compiler, &archs);
    println!(
        "NVRTC {}.{} ({}); {} variants x {} archs ({}) = {} compiles in {:.1} s",
        nv.version.0,
        nv.version.1,
        nv.path,
        kernels::variants().len(),
        archs.len(),
        archs.join(", "),
        results.len(),
        started.elapsed().as_secs_f64()
    );
    println!(
        "{:<30} {:<24} {:<6} {:>5} {:>6} {:>6} {:>6}",
        "kernel", "variant", "arch", "regs", "stack", "spillS", "spillL"
    );
    let mut failures = Vec::new();
    let mut max_regs = 0;
    for (v, arch, r) in &results {
        match r {
            Ok(c) => max_regs = max_regs.max(check_compile(v, arch, c, &mut failures)),
            Err(e) => failures.push(format!("{} {arch}: {e}", v.name())),
        }
    }
    println!("max registers per thread: {max_regs} (limit {MAX_REGISTERS})");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn kernel_tables_match_the_cuda_sources() {
    for m in Module::ALL {
        let parsed = kernels::parse_entry_points(m.body());
        let table = m.kernels();
        let names: Vec<&str> = parsed.iter().map(|(n, _)| n.as_str()).collect();
        let expected: Vec<&str> = table.iter().map(|k| k.name).collect();
        let (mut a, mut b) = (names.clone(), expected.clone());
        a.sort();
        b.sort();
        assert_eq!(a, b, "entry points of {}.cu", m.name());
        for (name, params) in &parsed {
            let sig = table.iter().find(|k| k.name == name).expect("listed");
            let got: Vec<&str> = params.iter().map(|(_, n)| n.as_str()).collect();
            let want: Vec<&str> = sig.params.iter().map(|p| p.name).collect();
            assert_eq!(got, want, "parameters of {name}");
            for ((ty, pname), p) in params.iter().zip(sig.params) {
                let is_ptr = ty.contains('*');
                assert_eq!(
                    is_ptr,
                    matches!(p.ty, ParamType::Ptr { .. }),
                    "{name}.{pname}: C type '{ty}' vs {:?}",
                    p.ty
                );
                match p.ty {
                    ParamType::I32 => assert_eq!(ty, "int", "{name}.{pname}"),
                    ParamType::U64 => assert_eq!(ty, "u64", "{name}.{pname}"),
                    ParamType::Ptr { written, .. } => {
                        assert_eq!(!ty.starts_with("const"), written, "{name}.{pname}: '{ty}'")
                    }
                }
            }
        }
    }
    let mut all: Vec<&str> = kernels::ALL_KERNELS.iter().map(|k| k.name).collect();
    all.sort();
    all.dedup();
    assert_eq!(
        all.len(),
        kernels::ALL_KERNELS.len(),
        "duplicate kernel names"
    );
    // Every module appears among the variants.
    let v = kernels::variants();
    for m in Module::ALL {
        assert!(
            v.iter().any(|x| x.module == m),
            "{} has no variant",
            m.name()
        );
    }
}

#[test]
fn sources_are_header_free() {
    for v in kernels::variants() {
        let (src, opts) = kernels::source(&v);
        assert!(!src.contains("#include"), "{}", v.name());
        assert!(opts.iter().all(|o| o.starts_with('-')));
    }
    let (_, opts) = kernels::source(&Variant::combine(
        kernels::FloatDtype::Bf16,
        kernels::FloatDtype::F32,
        8,
    ));
    assert_eq!(
        opts,
        ["-std=c++17", "-DTOPK=8", "-DIN_DTYPE=1", "-DOUT_DTYPE=0"]
    );
    assert!(Variant::layout(kernels::IdDtype::I32, 33)
        .validate()
        .is_err());
}

#[test]
fn error_word_decodes_to_messages_naming_token_and_peer() {
    use kernels::*;
    assert_eq!(decode_error_word(0), None);
    assert_eq!(describe_error_word(0), "no device error");
    let w = encode_error_word(ERR_ID_OUT_OF_RANGE, 17, 3);
    assert_eq!(w, (1u64 << 56) | (17u64 << 24) | 3);
    assert_eq!(
        describe_error_word(w),
        "topk_ids[17][3] is out of range: expected -1 (masked) or an expert id in [0, num_experts)"
    );
    let e = decode_error_word(encode_error_word(ERR_DUPLICATE_ID, 5, 1)).expect("error");
    assert_eq!(e, DeviceError::DuplicateId { token: 5, k: 1 });
    assert!(e.to_string().contains("routes token 5 to one expert twice"));
    assert_eq!(e.to_error().status(), Status::InvalidArgument);
    let e = decode_error_word(encode_error_word(ERR_WAIT_TIMEOUT, 6, 0)).expect("error");
    assert_eq!(
        e.to_string(),
        "timed out waiting for rank 6 to signal (peer dead, stuck or not participating)"
    );
    assert_eq!(e.to_error().status(), Status::Timeout);
    assert_eq!(
        decode_error_word(encode_error_word(ERR_CAPACITY, 9, 2)),
        Some(DeviceError::Capacity {
            row: 9,
            local_expert: 2
        })
    );
    assert_eq!(
        decode_error_word(encode_error_word(ERR_RANK_CAPACITY, 1, 300)),
        Some(DeviceError::RankCapacity {
            source: 1,
            rows: 300
        })
    );
    // Full-width token index and 24-bit b survive.
    assert_eq!(
        decode_error_word(encode_error_word(ERR_DUPLICATE_ID, u32::MAX, 0xff_ffff)),
        Some(DeviceError::DuplicateId {
            token: u32::MAX,
            k: 0xff_ffff
        })
    );
    let unknown = decode_error_word(encode_error_word(200, 1, 2)).expect("error");
    assert_eq!(unknown.to_error().status(), Status::Internal);
    // The kernels keep the smallest word: lower codes, then lower tokens win.
    assert!(
        encode_error_word(ERR_ID_OUT_OF_RANGE, 9, 0) < encode_error_word(ERR_DUPLICATE_ID, 0, 0)
    );
    assert!(encode_error_word(ERR_DUPLICATE_ID, 3, 5) < encode_error_word(ERR_DUPLICATE_ID, 4, 0));
}

#[test]
fn missing_nvrtc_path_is_a_clear_unavailable_error() {
    let path = "/nonexistent/epcomm-test/libnvrtc.so.12";
    let e = Nvrtc::open(Some(path)).expect_err("must fail");
    assert_eq!(e.status(), Status::Unavailable);
    assert_eq!(
        e.to_string(),
        "NVRTC not found: EPCOMM_NVRTC_PATH=/nonexistent/epcomm-test/libnvrtc.so.12 does not exist"
    );
    let dir = temp_dir("nvrtc-empty");
    let e = Nvrtc::open(dir.to_str()).expect_err("must fail");
    assert_eq!(
        e.to_string(),
        format!(
            "NVRTC not found: EPCOMM_NVRTC_PATH={} is a directory without libnvrtc.so*",
            dir.display()
        )
    );
    // A file that is not a shared library: dlopen's reason is passed on.
    let bogus = dir.join("libnvrtc.so.12");
    std::fs::write(&bogus, b"not an ELF").expect("write");
    let e = Nvrtc::open(dir.to_str()).expect_err("must fail");
    assert_eq!(e.status(), Status::Unavailable);
    assert!(
        e.to_string().starts_with(&format!(
            "NVRTC could not be loaded from {}: ",
            bogus.display()
        )),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ptxas_log_parser() {
    let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'ep_scan_block' for 'sm_90'\n\
ptxas info    : Function properties for ep_scan_block\n\
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 32 registers, used 1 barriers, 32 bytes smem, 400 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'ep_wait' for 'sm_90'\n\
ptxas info    : Function properties for ep_wait\n\
ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 14 registers, used 0 barriers, 392 bytes cmem[0]\n";
    let r = nvrtc::parse_ptxas_log(log);
    assert_eq!(r.len(), 2);
    assert_eq!(
        (
            r[0].name.as_str(),
            r[0].arch.as_str(),
            r[0].registers,
            r[0].shared_bytes
        ),
        ("ep_scan_block", "sm_90", 32, 32)
    );
    assert_eq!(
        (
            r[1].stack_bytes,
            r[1].spill_stores,
            r[1].spill_loads,
            r[1].registers
        ),
        (24, 8, 12, 14)
    );
    assert!(nvrtc::parse_ptxas_log("").is_empty());
}

#[test]
fn cache_entry_encoding_rejects_corruption() {
    let c = Compiled {
        image: Image::Cubin(b"\x7fELF-fake-cubin".to_vec()),
        log: "ptxas info: ok".into(),
        target: "sm_90".into(),
    };
    let bytes = nvrtc::encode_entry(42, &c);
    assert_eq!(nvrtc::decode_entry(42, &bytes), Some(c.clone()));
    assert_eq!(nvrtc::decode_entry(43, &bytes), None, "other key");
    assert_eq!(
        nvrtc::decode_entry(42, &bytes[..bytes.len() - 1]),
        None,
        "truncated"
    );
    let mut flipped = bytes.clone();
    let last = flipped.len() - 3;
    flipped[last] ^= 0x40;
    assert_eq!(nvrtc::decode_entry(42, &flipped), None, "bit flip");
    assert_eq!(nvrtc::decode_entry(42, b"garbage"), None);
    let ptx = Compiled {
        image: Image::Ptx(".version 8.7".into()),
        log: String::new(),
        target: "compute_90".into(),
    };
    assert_eq!(
        nvrtc::decode_entry(7, &nvrtc::encode_entry(7, &ptx)),
        Some(ptx.clone())
    );
    assert_eq!(ptx.image.module_bytes().last(), Some(&0));
}

#[test]
fn cache_hits_memory_then_disk_and_rewrites_corrupt_files() {
    let Some(nv) = nvrtc_or_skip("cache_hits_memory_then_disk_and_rewrites_corrupt_files") else {
        return;
    };
    let dir = temp_dir("nvrtc-cache");
    let (src, opts) = kernels::source(&Variant::signal());
    let a = Compiler::new(nv, Some(dir.clone()));
    let first = a.compile(&src, &opts, "sm_90").expect("compile");
    let again = a.compile(&src, &opts, "sm_90").expect("compile");
    assert!(Arc::ptr_eq(&first, &again));
    assert_eq!(a.stats.compiles.load(Ordering::Relaxed), 1);
    assert_eq!(a.stats.memory_hits.load(Ordering::Relaxed), 1);
    assert_eq!(a.stats.disk_writes.load(Ordering::Relaxed), 1);
    let path = a
        .disk_path(&a.key(&src, &opts, "sm_90"))
        .expect("disk path");
    assert!(path.exists());

    // A fresh compiler (a new process, in effect) reads the disk entry.
    let b = Compiler::new(nv, Some(dir.clone()));
    let from_disk = b.compile(&src, &opts, "sm_90").expect("disk hit");
    assert_eq!(*from_disk, *first);
    assert_eq!(b.stats.disk_hits.load(Ordering::Relaxed), 1);
    assert_eq!(b.stats.compiles.load(Ordering::Relaxed), 0);

    // Another key (options differ) is another entry.
    let mut opts2 = opts.clone();
    opts2.push("-lineinfo".into());
    b.compile(&src, &opts2, "sm_90").expect("compile");
    assert_eq!(b.stats.compiles.load(Ordering::Relaxed), 1);

    // A corrupt file is ignored, recompiled and rewritten.
    let mut bytes = std::fs::read(&path).expect("read");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&path, &bytes).expect("corrupt");
    let c = Compiler::new(nv, Some(dir.clone()));
    let fresh = c.compile(&src, &opts, "sm_90").expect("recompile");
    assert_eq!(c.stats.disk_rejected.load(Ordering::Relaxed), 1);
    assert_eq!(c.stats.compiles.load(Ordering::Relaxed), 1);
    assert_eq!(c.stats.disk_writes.load(Ordering::Relaxed), 1);
    let key_hash = c.key(&src, &opts, "sm_90").hash64();
    let rewritten = std::fs::read(&path).expect("read");
    assert_eq!(
        nvrtc::decode_entry(key_hash, &rewritten).as_ref(),
        Some(&*fresh)
    );
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .expect("list")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn compile_error_carries_the_nvrtc_log() {
    let Some(nv) = nvrtc_or_skip("compile_error_carries_the_nvrtc_log") else {
        return;
    };
    let compiler = Compiler::new(nv, None);
    let src = "extern \"C\" __global__ void broken(int* p) { p[0] = undefined_thing; }\n";
    let e = compiler
        .compile(src, &[], "sm_90")
        .expect_err("must not compile");
    assert_eq!(e.status(), Status::Runtime);
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!(
            "NVRTC {}.{} failed to compile epcomm_kernels.cu for sm_90: NVRTC_ERROR_COMPILATION\n",
            nv.version.0, nv.version.1
        )),
        "{msg}"
    );
    assert!(
        msg.contains("identifier \"undefined_thing\" is undefined"),
        "{msg}"
    );
    // A bad option names the options.
    let e = compiler
        .compile("", &["--no-such-option".into()], "sm_90")
        .expect_err("bad option");
    assert!(e.to_string().contains("--no-such-option"), "{e}");
    // Not an arch at all.
    let e = compiler.compile("", &[], "gfx90a").expect_err("bad arch");
    assert_eq!(e.status(), Status::InvalidArgument);
}

#[test]
fn unknown_arch_falls_back_to_ptx() {
    let Some(nv) = nvrtc_or_skip("unknown_arch_falls_back_to_ptx") else {
        return;
    };
    let Some(archs) = nv.supported_archs() else {
        common::skip::skipped(
            "unknown_arch_falls_back_to_ptx",
            "this NVRTC has no nvrtcGetSupportedArchs",
        );
        return;
    };
    let newest = *archs.iter().max().expect("archs");
    let compiler = Compiler::new(nv, None);
    let (src, opts) = kernels::source(&Variant::scan());
    let c = compiler
        .compile(&src, &opts, "sm_999")
        .expect("ptx fallback");
    assert_eq!(c.target, format!("compute_{newest}"));
    match &c.image {
        Image::Ptx(p) => assert!(p.contains(".entry ep_scan_block"), "{p}"),
        Image::Cubin(_) => panic!("expected PTX"),
    }
    println!("NVRTC {:?} supports {archs:?}", nv.version);
}

/// The two-rank worked example (R = 2, E = 4, K = 2, expert e computing (e+1)*x; combine gives
/// [20, 13.75, 48] on rank 0 and [70, 42] on rank 1) through layout → pack → transport → unpack
/// (every layout) → combine_return → weighted_combine / sum_ranks, id validation, and the scan
/// (one tile, many tiles with the block sums scanned by the kernel itself, in place) against a
/// plain loop.
const EMU_MAIN: &str = r##"#include "emu_prelude.h"
#include "prelude_tail.h"
#include "layout.cu"
#include "pack.cu"
#include "unpack.cu"
#include "combine.cu"
#include "scan.cu"
#include <functional>
using namespace std;
static void launch(unsigned grid, unsigned block, const function<void()>& f) { emu_seq(grid, block, f); }
// One OS thread per CUDA thread, blocks in order (block must be a multiple of 32, <= 1024).
static void launch_threads(unsigned grid, unsigned block, const function<void()>& f) { emu_threads(grid, block, f); }
static vector<int> scan(const vector<int>& v) { vector<int> o(v.size() + 1); int s = 0; for (size_t i = 0; i < v.size(); ++i) { o[i] = s; s += v[i]; } o[v.size()] = s; return o; }
static int fails = 0;
#define CHECK(c) do { if (!(c)) { printf("FAIL line %d: %s\n", __LINE__, #c); ++fails; } } while (0)
template <class T> static bool eq(const vector<T>& a, vector<T> b) { return a == b; }
static void pr(const char* n, const vector<float>& v) { printf("%s:", n); for (float x : v) printf(" %g", x); printf("\n"); }

const int R = 2, E = 4, EL = 2, K = TOPK, M = 3;
struct Rank {
    vector<float> x; vector<id_t_> ids; vector<float> w; int T;
    vector<int> rank_flag, pair_flag, rank_counts, expert_counts, send_pos, pair_pos;
    vector<float> send_rows; vector<int> send_ids, send_src; vector<float> send_w;
    // receive side
    vector<float> recv_rows; vector<int> recv_ids, recv_src, recv_offsets; vector<float> recv_w; int N;
    vector<int> expert_flag, rpair_flag, local_counts, expert_pos, rpair_pos;
};
int main() {
    Rank rk[R];
    rk[0].x = {10, 11, 12}; rk[0].ids = {0, 2, 1, 0, 3, -1}; rk[0].w = {.5, .5, .25, .75, 1, 0};
    rk[1].x = {20, 21}; rk[1].ids = {2, 3, 1, -1}; rk[1].w = {.5, .5, 1, 0};
    u64 err = 0;
    for (auto& r : rk) {
        r.T = (int)r.x.size();
        r.rank_flag.assign(R * r.T, 7); r.pair_flag.assign(R * r.T * K, 7); r.rank_counts.assign(R, 0); r.expert_counts.assign(E, 0);
        launch(2, 64, [&] { ep_layout(r.ids.data(), r.T, E, EL, R, r.rank_flag.data(), r.pair_flag.data(), r.rank_counts.data(), r.expert_counts.data(), &err); });
        r.send_pos = scan(r.rank_flag); r.pair_pos = scan(r.pair_flag);
        int ns = r.send_pos.back();
        r.send_rows.assign(ns, -1); r.send_ids.assign(ns * K, 99); r.send_w.assign(ns * K, -1); r.send_src.assign(ns, -1);
        launch(2, 64, [&] { ep_pack((const u8*)r.x.data(), 4, r.ids.data(), r.w.data(), r.T, R, r.rank_flag.data(), r.send_pos.data(), (u8*)r.send_rows.data(), r.send_ids.data(), r.send_w.data(), r.send_src.data()); });
    }
    CHECK(err == 0);
    CHECK(eq(rk[0].rank_counts, {2, 2})); CHECK(eq(rk[1].rank_counts, {1, 1}));
    CHECK(eq(rk[0].expert_counts, {2, 1, 1, 1}));
    // transport: receiver d gets, for s in order, s's block for d
    for (int d = 0; d < R; ++d) {
        Rank& q = rk[d]; q.recv_offsets = {0};
        for (int s = 0; s < R; ++s) {
            Rank& p = rk[s];
            int a = p.send_pos[d * p.T], b = p.send_pos[(d + 1) * p.T];
            for (int i = a; i < b; ++i) {
                q.recv_rows.push_back(p.send_rows[i]); q.recv_src.push_back(p.send_src[i]);
                for (int k = 0; k < K; ++k) { q.recv_ids.push_back(p.send_ids[i * K + k]); q.recv_w.push_back(p.send_w[i * K + k]); }
            }
            q.recv_offsets.push_back((int)q.recv_rows.size());
        }
        q.N = (int)q.recv_rows.size();
        q.expert_flag.assign(EL * q.N, 7); q.rpair_flag.assign(q.N * K, 7); q.local_counts.assign(EL, 0);
        launch(1, 32, [&] { ep_recv_flags(q.recv_ids.data(), q.N, EL, d, q.expert_flag.data(), q.rpair_flag.data(), q.local_counts.data()); });
        q.expert_pos = scan(q.expert_flag); q.rpair_pos = scan(q.rpair_flag);
    }
    CHECK(eq(rk[0].recv_rows, {10, 11, 21})); CHECK(eq(rk[1].recv_rows, {10, 12, 20}));
    CHECK(eq(rk[0].local_counts, {2, 2})); CHECK(eq(rk[1].local_counts, {2, 2}));
    // ---- TOKEN_MAJOR
    vector<float> want_out[R] = {{20, 13.75f, 48}, {70, 42}};
    {
        vector<float> ret_rows[R];
        for (int d = 0; d < R; ++d) {
            Rank& q = rk[d];
            vector<float> rows(q.N); vector<id_t_> ids(q.N * K); vector<float> w(q.N * K);
            launch(1, 64, [&] { ep_unpack_token_major((const u8*)q.recv_rows.data(), q.recv_ids.data(), q.recv_w.data(), q.N, 4, EL, d, (u8*)rows.data(), ids.data(), w.data()); });
            if (d == 0) { CHECK(eq(rows, {10, 11, 21})); CHECK(eq(ids, {0, -1, 1, 0, 1, -1})); CHECK(eq(w, {.5, 0, .25, .75, 1, 0})); }
            else { CHECK(eq(rows, {10, 12, 20})); CHECK(eq(ids, {-1, 2, 3, -1, 2, 3})); CHECK(eq(w, {0, .5, 1, 0, .5, .5})); }
            // expert rank: weighted sum over its experts, y = (e+1) x
            vector<float> y(q.N);
            for (int n = 0; n < q.N; ++n) { float acc = 0; for (int k = 0; k < K; ++k) if (ids[n * K + k] >= 0) acc += w[n * K + k] * ((float)ids[n * K + k] + 1) * rows[n]; y[n] = acc; }
            ret_rows[d] = y;
        }
        for (int s = 0; s < R; ++s) {
            Rank& p = rk[s]; vector<float> back;
            for (int d = 0; d < R; ++d) for (int i = rk[d].recv_offsets[s]; i < rk[d].recv_offsets[s + 1]; ++i) back.push_back(ret_rows[d][i]);
            vector<float> out(p.T, -1);
            launch(2, 32, [&] { ep_sum_ranks(back.data(), p.rank_flag.data(), p.send_pos.data(), p.T, R, 1, out.data()); });
            pr("token_major out", out); CHECK(out == want_out[s]);
        }
    }
    // ---- EXPERT_MAJOR and EXPERT_PACKED
    for (int packed = 0; packed < 2; ++packed) {
        vector<float> ret[R]; vector<int> ret_off[R];
        for (int d = 0; d < R; ++d) {
            Rank& q = rk[d]; int cap = M * R;
            int nrows = packed ? q.expert_pos.back() : EL * cap;
            vector<float> rows(nrows, -1), ow(nrows, -1); vector<int> counts(EL, -1), offs(EL + 1, -1), srk(nrows, -1), stok(nrows, -1);
            if (packed) launch(1, 64, [&] { ep_unpack_expert_packed((const u8*)q.recv_rows.data(), q.recv_ids.data(), q.recv_w.data(), q.recv_src.data(), q.recv_offsets.data(), q.N, R, 4, EL, d, q.expert_flag.data(), q.expert_pos.data(), (u8*)rows.data(), offs.data(), ow.data(), srk.data(), stok.data()); });
            else launch(1, 64, [&] { ep_unpack_expert_major((const u8*)q.recv_rows.data(), q.recv_ids.data(), q.recv_w.data(), q.recv_src.data(), q.recv_offsets.data(), q.N, R, 4, EL, d, q.expert_flag.data(), q.expert_pos.data(), cap, (u8*)rows.data(), counts.data(), ow.data(), srk.data(), stok.data(), &err); });
            if (packed) {
                if (d == 0) { CHECK(eq(rows, {10, 11, 11, 21})); CHECK(eq(offs, {0, 2, 4})); CHECK(eq(ow, {.5, .75, .25, 1})); CHECK(eq(srk, {0, 0, 0, 1})); CHECK(eq(stok, {0, 1, 1, 1})); }
                else { CHECK(eq(rows, {10, 20, 12, 20})); CHECK(eq(offs, {0, 2, 4})); CHECK(eq(ow, {.5, .5, 1, .5})); CHECK(eq(srk, {0, 1, 0, 1})); CHECK(eq(stok, {0, 0, 2, 0})); }
            } else {
                CHECK(eq(counts, {2, 2}));
                if (d == 0) { CHECK(rows[0] == 10 && rows[1] == 11 && rows[cap] == 11 && rows[cap + 1] == 21); }
                else { CHECK(rows[0] == 10 && rows[1] == 20 && rows[cap] == 12 && rows[cap + 1] == 20); }
            }
            // experts: y = (e+1) x, raw (weights applied on the source)
            vector<float> y(rows.size());
            for (int j = 0; j < EL; ++j) {
                int a = packed ? offs[j] : j * cap, b = packed ? offs[j + 1] : j * cap + counts[j];
                for (int i = a; i < b; ++i) y[i] = (float)(d * EL + j + 1) * rows[i];
            }
            vector<float> send(q.rpair_pos.back(), -1);
            launch(1, 64, [&] { ep_combine_return_expert((const u8*)y.data(), 4, q.recv_ids.data(), q.N, EL, d, q.expert_pos.data(), packed ? 0 : cap, q.rpair_pos.data(), (u8*)send.data()); });
            ret[d] = send;
        }
        for (int s = 0; s < R; ++s) {
            Rank& p = rk[s]; vector<float> back;
            for (int d = 0; d < R; ++d) {
                Rank& q = rk[d];
                int a = q.rpair_pos[q.recv_offsets[s] * K], b = q.rpair_pos[q.recv_offsets[s + 1] * K];
                for (int i = a; i < b; ++i) back.push_back(ret[d][i]);
            }
            CHECK((int)back.size() == p.pair_pos.back());
            vector<int> rows(p.T * K, 7); vector<float> out(p.T, -1);
            launch(1, 32, [&] { ep_pair_rows(p.ids.data(), p.T, E, EL, p.pair_pos.data(), rows.data()); });
            launch(2, 32, [&] { ep_weighted_combine(back.data(), rows.data(), p.w.data(), p.T, 1, out.data()); });
            pr(packed ? "expert_packed out" : "expert_major out", out); CHECK(out == want_out[s]);
        }
    }
    // ---- RANK_MAJOR
    {
        vector<float> ret[R];
        for (int d = 0; d < R; ++d) {
            Rank& q = rk[d];
            vector<float> rows(R * M, -1), w(R * M * K, -1); vector<id_t_> ids(R * M * K, 99); vector<int> cnt(R, -1);
            launch(1, 64, [&] { ep_unpack_rank_major((const u8*)q.recv_rows.data(), q.recv_ids.data(), q.recv_w.data(), q.recv_offsets.data(), R, M, 4, (u8*)rows.data(), ids.data(), w.data(), cnt.data(), &err); });
            CHECK(eq(cnt, {2, 1}));
            if (d == 0) { CHECK(rows[0] == 10 && rows[1] == 11 && rows[M] == 21); CHECK(ids[0] == 0 && ids[1] == 2 && ids[2] == 1 && ids[3] == 0 && ids[4] == -1 && ids[5] == -1); }
            else { CHECK(rows[0] == 10 && rows[1] == 12 && rows[M] == 20); }
            CHECK(ids[(M + 1) * K] == -1 && w[(M + 1) * K] == 0);
            vector<float> y(R * M, 0);
            for (int s = 0; s < R; ++s) for (int m = 0; m < cnt[s]; ++m) { int i = s * M + m; float acc = 0; for (int k = 0; k < K; ++k) { int e = (int)ids[i * K + k]; if (e >= d * EL && e < (d + 1) * EL) acc += w[i * K + k] * (float)(e + 1) * rows[i]; } y[i] = acc; }
            vector<float> send(q.N, -1);
            launch(1, 64, [&] { ep_combine_return_rank_major((const u8*)y.data(), 4, q.recv_offsets.data(), R, M, (u8*)send.data()); });
            ret[d] = send;
        }
        for (int s = 0; s < R; ++s) {
            Rank& p = rk[s]; vector<float> back;
            for (int d = 0; d < R; ++d) for (int i = rk[d].recv_offsets[s]; i < rk[d].recv_offsets[s + 1]; ++i) back.push_back(ret[d][i]);
            vector<float> out(p.T, -1);
            launch(2, 32, [&] { ep_sum_ranks(back.data(), p.rank_flag.data(), p.send_pos.data(), p.T, R, 1, out.data()); });
            pr("rank_major out", out); CHECK(out == want_out[s]);
        }
    }
    CHECK(err == 0);
    // ---- validation: out of range and duplicate ids report the first bad (token, k), as the
    // CPU path's in-order validation does (token 1's duplicate before token 2's bad id)
    {
        vector<id_t_> bad = {0, 1, 2, 2, 7, 0}; vector<int> rf(R * 3), pf(R * 3 * K); u64 e2 = 0;
        launch(1, 32, [&] { ep_layout(bad.data(), 3, E, EL, R, rf.data(), pf.data(), nullptr, nullptr, &e2); });
        CHECK(e2 == ep_err_make(EP_ERR_DUPLICATE_ID, 1, 1));
        vector<id_t_> bad2 = {0, 1, 2, 9, 7, 0}; u64 e4 = 0;
        launch(1, 32, [&] { ep_layout(bad2.data(), 3, E, EL, R, rf.data(), pf.data(), nullptr, nullptr, &e4); });
        CHECK(e4 == ep_err_make(EP_ERR_ID_OUT_OF_RANGE, 1, 1));
        vector<id_t_> dup = {0, 1, 3, 3}; u64 e3 = 0;
        launch(1, 32, [&] { ep_layout(dup.data(), 2, E, EL, R, rf.data(), pf.data(), nullptr, nullptr, &e3); });
        CHECK(e3 == ep_err_make(EP_ERR_DUPLICATE_ID, 1, 1));
        CHECK(rf[1] == 0 && rf[2 + 1] == 0); // the bad token goes nowhere
    }
    // ---- scan: one tile, several tiles (block sums scanned by the kernel itself), in place
    for (u64 n : {0ull, 1ull, 5ull, 1024ull, 1025ull, 3000ull, 4096ull}) {
        for (int in_place = 0; in_place < 2; ++in_place) {
            vector<int> in(n), out(n + 1, -7);
            for (u64 i = 0; i < n; ++i) in[i] = (int)((i * 7919u) % 5u);
            vector<int> want = scan(in);
            int* dst = in_place ? (in.resize(n + 1), in.data()) : out.data();
            unsigned tiles = (unsigned)((n + 1023) / 1024); if (tiles == 0) tiles = 1;
            vector<int> sums(tiles, -7), offs(tiles + 1, -7);
            launch_threads(tiles, 256, [&] { ep_scan_block(in.data(), dst, n, tiles > 1 ? sums.data() : nullptr); });
            if (tiles > 1) {
                launch_threads(1, 256, [&] { ep_scan_block(sums.data(), offs.data(), tiles, nullptr); });
                launch(2, 64, [&] { ep_scan_add(dst, n, offs.data()); });
            }
            vector<int> got(dst, dst + n + 1);
            if (got != want) printf("scan n=%llu in_place=%d wrong\n", n, in_place);
            CHECK(got == want);
        }
    }
    printf("%s (%d failures)\n", fails ? "FAILED" : "OK", fails);
    return fails != 0;
}
"##;

#[test]
fn kernels_reproduce_the_spec_worked_example_on_the_host() {
    let Some(cxx) = cuda_emu::cxx_or_skip("kernels_reproduce_the_spec_worked_example_on_the_host")
    else {
        return;
    };
    let dir = temp_dir("kernel-emu");
    cuda_emu::write_sources(
        &dir,
        &[
            ("layout.cu", kernels::LAYOUT_CU),
            ("pack.cu", kernels::PACK_CU),
            ("unpack.cu", kernels::UNPACK_CU),
            ("combine.cu", kernels::COMBINE_CU),
            ("scan.cu", kernels::SCAN_CU),
            ("main.cpp", EMU_MAIN),
        ],
    );
    for id in [0, 1] {
        let (ok, stdout) = cuda_emu::build_and_run(
            &cxx,
            &dir,
            &[format!("-DID_DTYPE={id}")],
            &format!("emu{id}"),
        );
        println!("ID_DTYPE={id}:\n{stdout}");
        assert!(ok && stdout.contains("OK (0 failures)"), "{stdout}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The f32 bit patterns the bf16 rounding is checked on: every upper half (each sign, exponent
/// and top 7 mantissa bits: zeros, subnormals, infinities, quiet and signalling NaNs) with the
/// low halves around the rounding point (ties to even and odd, just below and above), then
/// 2^20 pseudo-random patterns (splitmix64).
fn bf16_rounding_inputs() -> Vec<u32> {
    const LOW: [u32; 8] = [0, 1, 0x7fff, 0x8000, 0x8001, 0xfffe, 0xffff, 0x4000];
    let mut v: Vec<u32> = (0..=0xffffu32)
        .flat_map(|hi| LOW.iter().map(move |lo| (hi << 16) | lo))
        .collect();
    let mut s: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..1 << 20 {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        v.push((z ^ (z >> 31)) as u32);
    }
    v
}

/// The C rounding sm_70/sm_75 use for bf16 outputs (`ep_bf16_from_bits` in prelude.cu, cut
/// out of the real prelude) run on the host over [`bf16_rounding_inputs`]: bit-identical to
/// the CPU path's `num::f32_to_bf16` on every pattern, NaNs included (quiet, sign and upper
/// payload kept). On sm_80+ the prelude uses `cvt.rn.bf16.f32`, IEEE round-to-nearest-even,
/// which gives the same bits for every non-NaN input.
#[test]
fn bf16_c_rounding_of_sm7x_matches_the_cpu_path() {
    let Some(cxx) = cuda_emu::cxx_or_skip("bf16_c_rounding_of_sm7x_matches_the_cpu_path") else {
        return;
    };
    let (begin, end) = (
        "// ---- bf16 rounding in C (begin)",
        "// ---- bf16 rounding in C (end)",
    );
    let c_fn = kernels::PRELUDE_CU
        .split_once(begin)
        .and_then(|(_, rest)| rest.split_once(end))
        .map(|(body, _)| body)
        .expect("prelude.cu marks its C bf16 rounding");
    assert!(c_fn.contains("u16 ep_bf16_from_bits(u32 b)"), "{c_fn}");
    let dir = temp_dir("bf16-round");
    let inputs = bf16_rounding_inputs();
    let bytes: Vec<u8> = inputs.iter().flat_map(|b| b.to_le_bytes()).collect();
    std::fs::write(dir.join("in.bin"), bytes).expect("write inputs");
    let main = format!(
        r#"#include "emu_prelude.h"
{c_fn}
int main() {{
    FILE* in = fopen("{dir}/in.bin", "rb"); FILE* out = fopen("{dir}/out.bin", "wb");
    if (!in || !out) return 2;
    u32 b; unsigned long n = 0;
    while (fread(&b, 4, 1, in) == 1) {{ u16 r = ep_bf16_from_bits(b); fwrite(&r, 2, 1, out); ++n; }}
    fclose(in); fclose(out);
    printf("rounded %lu patterns\n", n);
    return 0;
}}
"#,
        dir = dir.display()
    );
    cuda_emu::write_sources(&dir, &[("main.cpp", &main)]);
    let (ok, stdout) = cuda_emu::build_and_run(&cxx, &dir, &[], "bf16round");
    assert!(ok, "{stdout}");
    assert_eq!(stdout, format!("rounded {} patterns\n", inputs.len()));
    let out = std::fs::read(dir.join("out.bin")).expect("read outputs");
    assert_eq!(out.len(), 2 * inputs.len());
    let mut mismatches = Vec::new();
    for (b, r) in inputs.iter().zip(out.chunks_exact(2)) {
        let got = u16::from_le_bytes([r[0], r[1]]);
        let want = epcomm::num::f32_to_bf16(f32::from_bits(*b));
        if got != want {
            mismatches.push(format!("{b:#010x}: C {got:#06x}, num.rs {want:#06x}"));
        }
    }
    println!(
        "{} f32 patterns, {} mismatches",
        inputs.len(),
        mismatches.len()
    );
    assert!(
        mismatches.is_empty(),
        "{}",
        mismatches[..mismatches.len().min(20)].join("\n")
    );
    // Spot checks of the rule itself: ties to even, carry into the exponent, overflow to
    // infinity, NaN made quiet.
    let c = |b: u32| epcomm::num::f32_to_bf16(f32::from_bits(b));
    assert_eq!(c(0x3f80_8000), 0x3f80, "tie, even stays");
    assert_eq!(c(0x3f81_8000), 0x3f82, "tie, odd rounds up");
    assert_eq!(c(0x3fff_8000), 0x4000, "carry into the exponent");
    assert_eq!(c(0x7f7f_ffff), 0x7f80, "max finite rounds to infinity");
    assert_eq!(c(0xff80_0001), 0xffc0, "signalling NaN made quiet");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every `#define EP_ERR_<NAME> <value>` of a CUDA source: (name, value).
fn error_defines(src: &str) -> Vec<(String, u64)> {
    src.lines()
        .filter_map(|l| l.trim().strip_prefix("#define EP_ERR_"))
        .map(|rest| {
            let (name, value) = rest.split_once(' ').expect("#define NAME VALUE");
            let v = value.trim().trim_end_matches('u');
            let v = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => v.parse(),
            }
            .unwrap_or_else(|e| panic!("EP_ERR_{name} = {value}: {e}"));
            (format!("EP_ERR_{name}"), v)
        })
        .collect()
}

/// The error word has one definition: prelude.cu's `EP_ERR_*` defines are exactly
/// `kernels::ERROR_WORD_DEFINES`, no other kernel source defines any, and the real
/// `ep_err_make` (host emulation) builds `encode_error_word`'s word for every code and for
/// extreme `a`/`b`, which `decode_error_word` reads back.
#[test]
fn error_word_layout_is_declared_once() {
    let parsed = error_defines(kernels::PRELUDE_CU);
    let want: Vec<(String, u64)> = kernels::ERROR_WORD_DEFINES
        .iter()
        .map(|(n, v)| (n.to_string(), *v))
        .collect();
    assert_eq!(parsed, want);
    for m in Module::ALL {
        assert_eq!(error_defines(m.body()), [], "{}.cu", m.name());
    }
    let Some(cxx) = cuda_emu::cxx_or_skip("error_word_layout_is_declared_once") else {
        return;
    };
    let dir = temp_dir("err-word");
    let main = r#"#include "emu_prelude.h"
#include "prelude_tail.h"
int main() {
    const u32 as[] = {0u, 1u, 4095u, 0xffffffffu}, bs[] = {0u, 7u, 0xffffffu, 0xffffffffu};
    for (u32 code = 0; code < 256; code += 1)
        for (u32 a : as) for (u32 b : bs)
            printf("%u %u %u %llu\n", code, a, b, (unsigned long long)ep_err_make(code, a, b));
    return 0;
}
"#;
    cuda_emu::write_sources(&dir, &[("main.cpp", main)]);
    let (ok, stdout) = cuda_emu::build_and_run(&cxx, &dir, &[], "errword");
    assert!(ok, "{stdout}");
    let mut n = 0;
    for line in stdout.lines() {
        let f: Vec<u64> = line
            .split(' ')
            .map(|x| x.parse().expect("number"))
            .collect();
        let (code, a, b) = (f[0] as u8, f[1] as u32, f[2] as u32);
        assert_eq!(f[3], kernels::encode_error_word(code, a, b), "{line}");
        if code != 0 {
            let d = kernels::decode_error_word(f[3]).expect("non-zero word");
            let (da, db) = match d {
                kernels::DeviceError::IdOutOfRange { token, k }
                | kernels::DeviceError::DuplicateId { token, k } => (token, k),
                kernels::DeviceError::Capacity { row, local_expert } => (row, local_expert),
                kernels::DeviceError::WaitTimeout { peer } => (peer, b & kernels::ERR_B_MASK),
                kernels::DeviceError::RankCapacity { source, rows } => (source, rows),
                kernels::DeviceError::HostRejected => (a, b & kernels::ERR_B_MASK),
                kernels::DeviceError::Unknown { code: c, a, b } => {
                    assert_eq!(c, code);
                    (a, b)
                }
            };
            assert_eq!((da, db), (a, b & kernels::ERR_B_MASK), "{line}");
        }
        n += 1;
    }
    assert_eq!(n, 256 * 16);
    let _ = std::fs::remove_dir_all(&dir);
}

fn cand(name: &str, major: i32, loaded: bool) -> nvrtc::Candidate {
    nvrtc::Candidate {
        name: name.into(),
        major,
        loaded,
    }
}

/// `nvrtc::choose` as a pure function of (driver version, libraries found): the newest NVRTC
/// whose major the driver runs (an already-loaded one first, then search order), the newest
/// of all when the driver is unknown, and an error naming both versions when every NVRTC is
/// newer than the driver.
#[test]
fn nvrtc_choice_follows_the_driver_version() {
    let both = [
        cand("libnvrtc.so.13", 13, false),
        cand("libnvrtc.so.12", 12, false),
    ];
    let pick = |driver, found: &[nvrtc::Candidate]| {
        nvrtc::choose(driver, found).map(|c| (found[c.index].name.clone(), c.reason))
    };
    assert_eq!(
        pick(Some(12080), &both).unwrap(),
        (
            "libnvrtc.so.12".into(),
            "the CUDA 12.8 driver (cuDriverGetVersion 12080) runs code from NVRTC 12 or older: libnvrtc.so.12 (NVRTC 12), the newest such found; not libnvrtc.so.13 (NVRTC 13) (newer than the driver)".into()
        )
    );
    assert_eq!(
        pick(Some(13000), &both).unwrap(),
        (
            "libnvrtc.so.13".into(),
            "the CUDA 13.0 driver (cuDriverGetVersion 13000) runs code from NVRTC 13 or older: libnvrtc.so.13 (NVRTC 13), the newest such found".into()
        )
    );
    // The host's copy (already loaded) is reused when the driver runs it ...
    let host12 = [
        cand("libnvrtc.so.13", 13, false),
        cand("libnvrtc.so.12", 12, true),
    ];
    assert_eq!(
        pick(Some(13020), &host12).unwrap(),
        (
            "libnvrtc.so.12".into(),
            "the CUDA 13.2 driver (cuDriverGetVersion 13020) runs code from NVRTC 13 or older: libnvrtc.so.12 (NVRTC 12), already loaded in this process".into()
        )
    );
    // ... and not when it does not.
    let host13 = [
        cand("libnvrtc.so.13", 13, true),
        cand("libnvrtc.so.12", 12, false),
    ];
    assert_eq!(pick(Some(12090), &host13).unwrap().0, "libnvrtc.so.12");
    // An older NVRTC on a newer driver; the first of one major in search order.
    assert_eq!(pick(Some(13010), &both[1..]).unwrap().0, "libnvrtc.so.12");
    let same = [
        cand("libnvrtc.so.12", 12, false),
        cand("libnvrtc.so", 12, false),
    ];
    assert_eq!(pick(Some(12080), &same).unwrap().0, "libnvrtc.so.12");
    // Unknown driver (CPU-only compile checks): the newest.
    assert_eq!(
        pick(None, &both).unwrap(),
        (
            "libnvrtc.so.13".into(),
            "the CUDA driver version is unknown: libnvrtc.so.13 (NVRTC 13), the newest such found"
                .into()
        )
    );
    // Only newer majors than the driver: an error naming both versions.
    let e = nvrtc::choose(Some(12040), &both[..1]).unwrap_err();
    assert_eq!(e.status(), Status::Unavailable);
    assert_eq!(
        e.to_string(),
        "NVRTC does not match the CUDA driver: found libnvrtc.so.13 (NVRTC 13); the CUDA 12.4 driver (cuDriverGetVersion 12040) runs code from NVRTC 12 or older. Install NVRTC 12 (pip: nvidia-cuda-nvrtc-cu12) and set EPCOMM_NVRTC_PATH to it, or update the driver"
    );
    let e = nvrtc::choose(Some(11080), &both).unwrap_err();
    assert!(
        e.to_string().starts_with("NVRTC does not match the CUDA driver: found libnvrtc.so.13 (NVRTC 13), libnvrtc.so.12 (NVRTC 12); the CUDA 11.8 driver (cuDriverGetVersion 11080) runs code from NVRTC 11 or older."),
        "{e}"
    );
    let e = nvrtc::choose(Some(13000), &[cand("libnvrtc.so.14", 14, true)]).unwrap_err();
    assert!(
        e.to_string()
            .ends_with("Install NVRTC 13 (pip: nvidia-cuda-nvrtc==13.*) and set EPCOMM_NVRTC_PATH to it, or update the driver"),
        "{e}"
    );
    assert_eq!(
        nvrtc::choose(None, &[]).unwrap_err().status(),
        Status::Unavailable
    );
    assert_eq!(
        nvrtc::choose(Some(12080), &[]).unwrap_err().status(),
        Status::Unavailable
    );
}

/// `Nvrtc::select` over a directory: every `libnvrtc.so.N` is a candidate (read by
/// `nvrtcVersion`), and the driver decides; a driver older than every NVRTC there is the
/// mismatch error.
#[test]
fn nvrtc_selection_in_a_directory_follows_the_driver() {
    let Some(nv) = nvrtc_or_skip("nvrtc_selection_in_a_directory_follows_the_driver") else {
        return;
    };
    let Some(dir) = std::path::Path::new(nv.path)
        .parent()
        .filter(|d| d.is_dir())
    else {
        common::skip::skipped(
            "nvrtc_selection_in_a_directory_follows_the_driver",
            &format!(
                "NVRTC was loaded by name ({}), not from a directory",
                nv.path
            ),
        );
        return;
    };
    let dir = dir.to_str().expect("UTF-8 path");
    let major = nv.version.0;
    let sel = Nvrtc::select(Some(dir), Ok(major * 1000 + 20)).expect("same-major driver");
    assert_eq!(sel.nvrtc.version, nv.version);
    assert!(sel.candidates.iter().any(|c| c.major == major));
    assert!(
        sel.choice
            .reason
            .starts_with(&format!("the CUDA {major}.2 driver")),
        "{}",
        sel.choice.reason
    );
    let e = Nvrtc::select(Some(dir), Ok((major - 1) * 1000)).expect_err("older driver");
    assert_eq!(e.status(), Status::Unavailable);
    assert!(
        e.to_string()
            .starts_with("NVRTC does not match the CUDA driver: found "),
        "{e}"
    );
    assert!(e.to_string().contains(&format!("(NVRTC {major})")), "{e}");
    let unknown = Nvrtc::select(Some(dir), Err("no driver".into())).expect("unknown driver");
    assert!(unknown
        .choice
        .reason
        .starts_with("the CUDA driver version is unknown: "));
}
