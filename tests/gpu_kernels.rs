//! The GPU kernels without a GPU: every variant compiled by NVRTC to CUBIN for sm_80 and
//! sm_90 (ELF, 0 spill bytes, register table printed), the NVRTC loader's errors, the compile
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

const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

/// NVRTC, or `None` (test skipped) when it is absent and not required.
fn nvrtc_or_skip(test: &str) -> Option<Nvrtc> {
    match Nvrtc::global() {
        Ok(n) => Some(*n),
        Err(e) => {
            if std::env::var("EPCOMM_REQUIRE_NVRTC").as_deref() == Ok("1") {
                panic!("EPCOMM_REQUIRE_NVRTC=1 but NVRTC is unavailable: {e}");
            }
            eprintln!(
                "SKIP {test}: {e} (run scripts/fetch-nvrtc.sh and set EPCOMM_NVRTC_PATH to the directory it prints)"
            );
            None
        }
    }
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let d = std::env::temp_dir().join(format!("epcomm-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&d).expect("create temp dir");
    d
}

#[test]
fn every_variant_compiles_to_cubin_without_spills() {
    let Some(nv) = nvrtc_or_skip("every_variant_compiles_to_cubin_without_spills") else {
        return;
    };
    let compiler = Arc::new(Compiler::new(nv, None));
    let jobs: Vec<(Variant, &str)> = kernels::variants()
        .into_iter()
        .flat_map(|v| ARCHS.map(|a| (v, a)))
        .collect();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(1, 8);
    let started = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let jobs = Arc::new(jobs);
    type Outcome = (Variant, &'static str, Result<Arc<Compiled>, epcomm::Error>);
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
    let elapsed = started.elapsed();
    results.sort_by_key(|(v, a, _)| (v.name(), *a));

    println!(
        "NVRTC {}.{} ({}); {} variants x {} archs = {} compiles in {:.1} s on {threads} threads",
        nv.version.0,
        nv.version.1,
        nv.path,
        kernels::variants().len(),
        ARCHS.len(),
        results.len(),
        elapsed.as_secs_f64()
    );
    println!(
        "{:<30} {:<24} {:<6} {:>5} {:>6} {:>6} {:>6}",
        "kernel", "variant", "arch", "regs", "stack", "spillS", "spillL"
    );
    let mut failures = Vec::new();
    let mut max_regs = 0;
    for (v, arch, r) in &results {
        let c = match r {
            Ok(c) => c,
            Err(e) => {
                failures.push(format!("{} {arch}: {e}", v.name()));
                continue;
            }
        };
        match &c.image {
            Image::Cubin(b) if b.starts_with(b"\x7fELF") => {}
            Image::Cubin(_) => failures.push(format!("{} {arch}: CUBIN is not ELF", v.name())),
            Image::Ptx(_) => failures.push(format!("{} {arch}: got PTX, not CUBIN", v.name())),
        }
        let res = c.resources();
        for k in v.module.kernels() {
            match res.iter().find(|r| r.name == k.name) {
                None => failures.push(format!(
                    "{} {arch}: no ptxas figures for {} in the log",
                    v.name(),
                    k.name
                )),
                Some(r) => {
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
                    if r.spill_stores != 0 || r.spill_loads != 0 {
                        failures.push(format!(
                            "{} {arch} {}: {} bytes spill stores, {} bytes spill loads",
                            v.name(),
                            r.name,
                            r.spill_stores,
                            r.spill_loads
                        ));
                    }
                    if r.arch != *arch {
                        failures.push(format!("{} {arch}: ptxas compiled for {}", r.name, r.arch));
                    }
                }
            }
        }
    }
    println!("max registers per thread: {max_regs}");
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
        eprintln!("SKIP unknown_arch_falls_back_to_ptx: NVRTC has no nvrtcGetSupportedArchs");
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
