//! Installing epcomm as a system library: `make install` into a temporary prefix, then the C and
//! C++ examples built against it with pkg-config alone (shared and static) and run on two
//! processes; SONAME, symlinks and exported symbols checked with readelf/nm; the Python
//! package installed into a fresh venv and its examples run; `make uninstall` removes it all.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs a command with a deadline; panics with its output when it fails.
fn run(cmd: &mut Command, what: &str, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{what} failed ({:?}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn sh(script: &str, env: &[(&str, &Path)], what: &str) -> String {
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(script).current_dir(root());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run(&mut cmd, what, Duration::from_secs(300));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn install_link_and_use_from_c_cpp_and_python() {
    let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("install");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let prefix = work.join("prefix");
    let pc = prefix.join("lib/pkgconfig");
    let env = [
        ("PREFIX", prefix.as_path()),
        ("PKG_CONFIG_PATH", pc.as_path()),
        ("W", work.as_path()),
    ];

    sh("make -s install PREFIX=\"$PREFIX\"", &env, "make install");
    let lib = prefix.join("lib");
    for f in [
        "libepcomm.so",
        "libepcomm.so.0.1",
        "libepcomm.so.0.1.0",
        "libepcomm.a",
        "pkgconfig/epcomm.pc",
    ] {
        assert!(lib.join(f).exists(), "{f} not installed");
    }
    assert!(prefix.join("include/epcomm.h").exists() && prefix.join("include/epcomm.hpp").exists());
    assert_eq!(
        std::fs::read_link(lib.join("libepcomm.so")).unwrap(),
        PathBuf::from("libepcomm.so.0.1")
    );
    let soname = sh(
        "readelf -d \"$PREFIX/lib/libepcomm.so.0.1.0\" | grep SONAME",
        &env,
        "readelf",
    );
    assert!(soname.contains("[libepcomm.so.0.1]"), "{soname}");
    let symbols = sh(
        "nm -D --defined-only \"$PREFIX/lib/libepcomm.so.0.1.0\" | awk '{print $3}'",
        &env,
        "nm",
    );
    let names: Vec<&str> = symbols.lines().filter(|l| !l.is_empty()).collect();
    assert!(names.len() > 40, "{names:?}");
    assert!(
        names.iter().all(|s| s.starts_with("epcomm_")),
        "non-epcomm exports: {names:?}"
    );

    // C, shared, through pkg-config only.
    sh(
        "cc -std=c11 -Wall -Wextra -Werror examples/c/moe_two_ranks.c $(pkg-config --cflags --libs epcomm) \
         -Wl,-rpath,\"$PREFIX/lib\" -o \"$W/c_shared\"",
        &env,
        "build the C example (shared)",
    );
    for backend in [
        "deepep_high_throughput",
        "deepep_low_latency",
        "deepep_v2",
        "flashinfer_nvlink_one_sided",
        "naive",
    ] {
        let out = sh(
            &format!("\"$W/c_shared\" {backend}"),
            &env,
            "run the C example",
        );
        assert!(
            out.contains("combined 20 13.75 48") && out.contains("combined 70 42"),
            "{backend}: {out}"
        );
    }
    // C, static: the archive plus pkg-config's private libraries.
    sh(
        "cc -std=c11 -Wall -Wextra -Werror examples/c/moe_two_ranks.c $(pkg-config --cflags epcomm) \
         $(pkg-config --libs-only-L epcomm) -Wl,-Bstatic -lepcomm -Wl,-Bdynamic \
         $(pkg-config --static --libs epcomm | sed 's/-lepcomm//') -o \"$W/c_static\"",
        &env,
        "build the C example (static)",
    );
    let deps = sh("ldd \"$W/c_static\" || true", &env, "ldd");
    assert!(
        !deps.contains("libepcomm"),
        "static build still needs libepcomm: {deps}"
    );
    let out = sh(
        "\"$W/c_static\" mori_low_latency",
        &env,
        "run the static C example",
    );
    assert!(out.contains("combined 70 42"), "{out}");
    // C++ with the wrapper header.
    sh(
        "c++ -std=c++17 -Wall -Wextra -Werror examples/cpp/moe_two_ranks.cpp $(pkg-config --cflags --libs epcomm) \
         -Wl,-rpath,\"$PREFIX/lib\" -o \"$W/cpp_shared\"",
        &env,
        "build the C++ example",
    );
    let out = sh("\"$W/cpp_shared\" deepep_v2", &env, "run the C++ example");
    assert!(
        out.contains("rank 0 (deepep_v2): 20 13.75 48")
            && out.contains("rank 1 (deepep_v2): 70 42"),
        "{out}"
    );
    sh(
        "c++ -std=c++17 -Wall -Wextra -Werror examples/cpp/moe_two_ranks.cpp $(pkg-config --cflags epcomm) \
         $(pkg-config --libs-only-L epcomm) -Wl,-Bstatic -lepcomm -Wl,-Bdynamic \
         $(pkg-config --static --libs epcomm | sed 's/-lepcomm//') -o \"$W/cpp_static\"",
        &env,
        "build the C++ example (static)",
    );
    let out = sh(
        "\"$W/cpp_static\" flashinfer_all2allv",
        &env,
        "run the static C++ example",
    );
    assert!(out.contains("rank 1 (flashinfer_all2allv): 70 42"), "{out}");

    // Python: the package in a fresh venv (system site packages only for numpy), the library
    // found on the system path.
    sh(
        "python3 -m venv --system-site-packages \"$W/venv\" && \
         \"$W/venv/bin/python\" -m pip install --quiet --no-deps ./python",
        &env,
        "pip install ./python into a fresh venv",
    );
    let py = "cd examples/python && LD_LIBRARY_PATH=\"$PREFIX/lib\" \"$W/venv/bin/python\"";
    let out = sh(
        &format!("{py} -c 'import epcomm, os; print(epcomm.__file__); print(epcomm.version())'"),
        &env,
        "import epcomm",
    );
    assert!(
        out.contains("venv") && out.trim_end().ends_with("0.1.0"),
        "{out}"
    );
    let out = sh(
        &format!("{py} validate_config.py"),
        &env,
        "validate_config.py",
    );
    assert!(out.contains("allgather_reducescatter -> AgRsAll2AllManager (REPLICATED); EPLB communicator: torch_gloo"), "{out}");
    let out = sh(
        &format!("{py} validate_config.py '{{\"enable_elastic_ep\": true}}' || true"),
        &env,
        "validate_config.py (invalid)",
    );
    assert!(
        out.contains("ValueError: Elastic EP is only supported with enable_eplb=True."),
        "{out}"
    );
    let out = sh(
        &format!("{py} moe_two_ranks.py deepep_low_latency"),
        &env,
        "moe_two_ranks.py",
    );
    assert!(
        out.contains("rank 0 -> [20.0, 13.75, 48.0], rank 1 -> [70.0, 42.0]"),
        "{out}"
    );

    sh(
        "make -s uninstall PREFIX=\"$PREFIX\"",
        &env,
        "make uninstall",
    );
    let left: Vec<_> = walk(&prefix)
        .into_iter()
        .filter(|p| p.is_file() || p.is_symlink())
        .collect();
    assert!(left.is_empty(), "left after uninstall: {left:?}");
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}
