//! Installing epcomm as a system library, as a user or a distribution does: `make` (which runs
//! cargo), then `make install` with no cargo reachable (only the tools install needs are on its
//! PATH, as under `sudo`) into a temporary prefix, and into a DESTDIR staging tree with
//! distribution-style directories. Every installed file is checked (SONAME, symlinks, exported
//! symbols, pkg-config and CMake files, the binary, the man page); the C and C++ examples are
//! built against the installation with pkg-config (shared, static through the archive, fully
//! `-static`) and with CMake (`find_package(epcomm CONFIG REQUIRED)`), and run on two processes;
//! `make uninstall` must leave no file behind.
//!
//! Without make the whole test skips, without pkg-config or cmake those parts skip, each with a
//! SKIPPED line in the normal test output; EPCOMM_REQUIRE_INSTALL_TOOLS=1 turns such a skip
//! into a failure (CI provides the tools).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::skip;

const VERSION: &str = env!("CARGO_PKG_VERSION");
/// How long `make` (a release build into target/make) may take.
const BUILD_LIMIT: Duration = Duration::from_secs(1800);
/// How long any other step (an install, a compile, a program run) may take.
const STEP_LIMIT: Duration = Duration::from_secs(300);
/// The tools `make install` and `make uninstall` may use; nothing else is on their PATH.
const INSTALL_TOOLS: &[&str] = &[
    "make", "sh", "sed", "head", "install", "ln", "rm", "rmdir", "realpath", "getconf",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The SONAME of the installed library: libepcomm.so.0.MINOR while the major version is 0.
fn soname() -> String {
    let major = env!("CARGO_PKG_VERSION_MAJOR");
    let minor = env!("CARGO_PKG_VERSION_MINOR");
    if major == "0" {
        format!("libepcomm.so.0.{minor}")
    } else {
        format!("libepcomm.so.{major}")
    }
}

/// A finished command: its exit code (None when a signal ended it) and its output.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `script` with `sh -c` in the crate root with `env` added, killed after `limit`.
fn sh_ran(script: &str, env: &[(&str, &str)], limit: Duration) -> Ran {
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(script).current_dir(root());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start sh for {script}: {e}"));
    // Read both pipes on threads so a chatty command cannot block on a full pipe.
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out_t = std::thread::spawn(move || {
        let mut s = Vec::new();
        std::io::Read::read_to_end(&mut out, &mut s).ok();
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = Vec::new();
        std::io::Read::read_to_end(&mut err, &mut s).ok();
        s
    });
    let start = Instant::now();
    let mut killed = false;
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().ok();
            killed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = child.wait().unwrap();
    let stdout = String::from_utf8_lossy(&out_t.join().unwrap()).into_owned();
    let stderr = String::from_utf8_lossy(&err_t.join().unwrap()).into_owned();
    assert!(
        !killed,
        "{script}: still running after {limit:?}:\n{stdout}{stderr}"
    );
    Ran {
        code: status.code(),
        stdout,
        stderr,
    }
}

/// Runs `script` and returns its stdout; panics with its output unless it exits 0.
fn sh(script: &str, env: &[(&str, &str)], what: &str) -> String {
    let r = sh_ran(script, env, STEP_LIMIT);
    assert_eq!(
        r.code,
        Some(0),
        "{what} failed:\n$ {script}\n{}{}",
        r.stdout,
        r.stderr
    );
    r.stdout
}

/// Runs a two-rank example program; its stdout with the lines sorted (the ranks print in any
/// order).
fn two_ranks(script: &str, env: &[(&str, &str)], what: &str) -> String {
    let out = sh(script, env, what);
    let mut lines: Vec<&str> = out.lines().collect();
    lines.sort_unstable();
    lines.iter().map(|l| format!("{l}\n")).collect()
}

fn have(tool: &str) -> bool {
    sh_ran(&format!("command -v {tool}"), &[], STEP_LIMIT).code == Some(0)
}

/// Whether `tool` is there; if not, reports `part` as skipped (or fails when CI asks for it).
fn have_or_skip(tool: &str, test: &str, part: &str) -> bool {
    if have(tool) {
        return true;
    }
    assert!(
        !skip::required("EPCOMM_REQUIRE_INSTALL_TOOLS"),
        "{test}: {tool} is missing and EPCOMM_REQUIRE_INSTALL_TOOLS is set"
    );
    skip::skipped(
        test,
        &format!("{tool} is not installed (apt-get install {tool}), so {part} did not run"),
    );
    false
}

/// A directory with links to exactly the tools `make install` needs, and no cargo: the PATH of
/// the install steps, as `sudo make install` sees one without the user's ~/.cargo/bin.
fn install_path(work: &Path) -> String {
    let bin = work.join("install-bin");
    std::fs::create_dir_all(&bin).unwrap();
    for tool in INSTALL_TOOLS {
        let found = sh(&format!("command -v {tool}"), &[], "find an install tool");
        let link = bin.join(tool);
        if !link.exists() {
            std::os::unix::fs::symlink(found.trim(), &link).unwrap();
        }
    }
    let path = bin.display().to_string();
    let cargo = sh_ran("command -v cargo", &[("PATH", &path)], STEP_LIMIT);
    assert_ne!(cargo.code, Some(0), "cargo is reachable: {}", cargo.stdout);
    path
}

/// `make` once for all tests of this file (it runs cargo, with cargo's own PATH).
fn built() {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let r = sh_ran("make -s", &[], BUILD_LIMIT);
        assert_eq!(r.code, Some(0), "make failed:\n{}{}", r.stdout, r.stderr);
    });
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every file and symlink under `dir` (relative paths, sorted).
fn files_under(dir: &Path) -> Vec<String> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                let p = e.path();
                if p.is_dir() && !p.is_symlink() {
                    walk(base, &p, out);
                } else {
                    out.push(p.strip_prefix(base).unwrap().display().to_string());
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// What `make install` puts under a prefix with the default directories.
fn expected_files() -> Vec<String> {
    let mut files = vec![
        "bin/epcomm".to_owned(),
        "include/epcomm.h".to_owned(),
        "include/epcomm.hpp".to_owned(),
        "lib/cmake/epcomm/epcommConfig.cmake".to_owned(),
        "lib/cmake/epcomm/epcommConfigVersion.cmake".to_owned(),
        "lib/libepcomm.a".to_owned(),
        "lib/libepcomm.so".to_owned(),
        format!("lib/{}", soname()),
        format!("lib/libepcomm.so.{VERSION}"),
        "lib/pkgconfig/epcomm.pc".to_owned(),
        "share/man/man1/epcomm.1".to_owned(),
    ];
    files.sort();
    files
}

/// The C example on every kind of link pkg-config offers, each run on two processes.
fn c_example_with_pkg_config(env: &[(&str, &str)]) {
    sh(
        "cc -std=c11 -Wall -Wextra -Werror examples/c/moe_two_ranks.c \
         $(pkg-config --cflags --libs epcomm) -Wl,-rpath,\"$LIBDIR\" -o \"$W/c_shared\"",
        env,
        "build the C example (shared)",
    );
    let needed = sh("readelf -d \"$W/c_shared\"", env, "readelf the C example");
    assert!(
        needed.contains(&format!("Shared library: [{}]", soname())),
        "{needed}"
    );
    for (backend, layout) in [
        ("deepep_high_throughput", "TOKEN_MAJOR"),
        ("deepep_low_latency", "EXPERT_MAJOR"),
        ("deepep_v2", "EXPERT_PACKED"),
        ("flashinfer_nvlink_one_sided", "RANK_MAJOR"),
        ("allgather_reducescatter", "REPLICATED"),
    ] {
        let out = two_ranks(
            &format!("\"$W/c_shared\" {backend}"),
            env,
            "run the C example",
        );
        assert_eq!(
            out,
            format!(
                "rank 0 ({backend}, {layout}): combined 20 13.75 48\n\
                 rank 1 ({backend}, {layout}): combined 70 42\n"
            )
        );
    }
    // The archive, with pkg-config's private libraries, into an otherwise dynamic program.
    sh(
        "cc -std=c11 -Wall -Wextra -Werror examples/c/moe_two_ranks.c $(pkg-config --cflags epcomm) \
         $(pkg-config --libs-only-L epcomm) -Wl,-Bstatic -lepcomm -Wl,-Bdynamic \
         $(pkg-config --static --libs-only-l epcomm | sed 's/-lepcomm//') -o \"$W/c_archive\"",
        env,
        "build the C example (static libepcomm.a)",
    );
    let deps = sh("ldd \"$W/c_archive\"", env, "ldd");
    assert!(!deps.contains("libepcomm"), "still needs libepcomm: {deps}");
    let out = two_ranks(
        "\"$W/c_archive\" mori_low_latency",
        env,
        "run the C example (static libepcomm.a)",
    );
    assert_eq!(
        out,
        "rank 0 (mori_low_latency, TOKEN_MAJOR): combined 20 13.75 48\n\
         rank 1 (mori_low_latency, TOKEN_MAJOR): combined 70 42\n"
    );
    // A fully static program from pkg-config --static alone.
    sh(
        "cc -static -std=c11 -Wall -Wextra -Werror examples/c/moe_two_ranks.c \
         $(pkg-config --static --cflags --libs epcomm) -o \"$W/c_static\"",
        env,
        "build the C example fully static (cc -static, pkg-config --static)",
    );
    let file = sh(
        "readelf -d \"$W/c_static\" || true",
        env,
        "readelf the static program",
    );
    assert!(!file.contains("NEEDED"), "a -static program needs: {file}");
    let out = two_ranks(
        "\"$W/c_static\" deepep_high_throughput",
        env,
        "run the fully static C example",
    );
    assert_eq!(
        out,
        "rank 0 (deepep_high_throughput, TOKEN_MAJOR): combined 20 13.75 48\n\
         rank 1 (deepep_high_throughput, TOKEN_MAJOR): combined 70 42\n"
    );
}

/// The C++ example (wrapper header) through pkg-config, shared and with the archive.
fn cpp_example_with_pkg_config(env: &[(&str, &str)]) {
    sh(
        "c++ -std=c++17 -Wall -Wextra -Werror examples/cpp/moe_two_ranks.cpp \
         $(pkg-config --cflags --libs epcomm) -Wl,-rpath,\"$LIBDIR\" -o \"$W/cpp_shared\"",
        env,
        "build the C++ example (shared)",
    );
    let out = two_ranks("\"$W/cpp_shared\" deepep_v2", env, "run the C++ example");
    assert_eq!(
        out,
        "rank 0 (deepep_v2): 20 13.75 48\nrank 1 (deepep_v2): 70 42\n"
    );
    sh(
        "c++ -std=c++17 -Wall -Wextra -Werror examples/cpp/moe_two_ranks.cpp $(pkg-config --cflags epcomm) \
         $(pkg-config --libs-only-L epcomm) -Wl,-Bstatic -lepcomm -Wl,-Bdynamic \
         $(pkg-config --static --libs-only-l epcomm | sed 's/-lepcomm//') -o \"$W/cpp_archive\"",
        env,
        "build the C++ example (static libepcomm.a)",
    );
    let out = two_ranks(
        "\"$W/cpp_archive\" flashinfer_all2allv",
        env,
        "run the C++ example (static libepcomm.a)",
    );
    assert_eq!(
        out,
        "rank 0 (flashinfer_all2allv): 20 13.75 48\nrank 1 (flashinfer_all2allv): 70 42\n"
    );
}

/// examples/c and examples/cpp configured and built with CMake against the installation found
/// through CMAKE_PREFIX_PATH (in `cmake_dir`), with the shared and the static target, and run;
/// then the version file's answers.
fn examples_with_cmake(env: &[(&str, &str)], tag: &str, cmake_dir: &str) {
    for (lang, kind, flag, backend, layout) in [
        (
            "c",
            "shared",
            "OFF",
            "deepep_v2",
            ", EXPERT_PACKED): combined",
        ),
        (
            "c",
            "static",
            "ON",
            "flashinfer_nvlink_two_sided",
            ", RANK_MAJOR): combined",
        ),
        ("cpp", "shared", "OFF", "deepep_low_latency", "):"),
        ("cpp", "static", "ON", "nixl_ep", "):"),
    ] {
        let what = format!("examples/{lang} with CMake ({kind}, {tag})");
        let build = format!("\"$W/cmake-{tag}-{lang}-{kind}\"");
        sh(
            &format!(
                "cmake -S examples/{lang} -B {build} -DCMAKE_PREFIX_PATH=\"$CMAKE_PREFIX\" \
                 -DEPCOMM_EXAMPLE_STATIC={flag} -DCMAKE_BUILD_TYPE=Release && \
                 cmake --build {build}"
            ),
            env,
            &format!("configure and build {what}"),
        );
        let cache = sh(
            &format!("grep '^epcomm_DIR:' {build}/CMakeCache.txt"),
            env,
            "epcomm_DIR",
        );
        assert_eq!(cache, format!("epcomm_DIR:PATH={cmake_dir}\n"), "{what}");
        let deps = sh(&format!("ldd {build}/moe_two_ranks"), env, "ldd");
        assert_eq!(
            deps.contains("libepcomm"),
            kind == "shared",
            "{what}: {deps}"
        );
        let out = two_ranks(
            &format!("{build}/moe_two_ranks {backend}"),
            env,
            &format!("run {what}"),
        );
        assert_eq!(
            out,
            format!("rank 0 ({backend}{layout} 20 13.75 48\nrank 1 ({backend}{layout} 70 42\n"),
            "{what}"
        );
    }

    // Which requested versions the package accepts: not newer, same major, same minor in 0.x.
    let project = format!(
        // A language enabled, so CMake knows the multiarch library directory it searches.
        "cmake_minimum_required(VERSION 3.19)\nproject(v C)\n\
         foreach(req IN ITEMS {VERSION} 0.1 0.1.1 0.2 1.0 0.1...<0.3 0.2...0.4)\n\
         find_package(epcomm ${{req}} CONFIG QUIET)\n\
         message(STATUS \"epcomm ${{req}}: ${{epcomm_FOUND}}\")\n\
         unset(epcomm_DIR CACHE)\nendforeach()\n"
    );
    let dir = PathBuf::from(env.iter().find(|(k, _)| *k == "W").unwrap().1).join("cmake-versions");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("CMakeLists.txt"), project).unwrap();
    let out = sh(
        &format!(
            "cmake -S \"{0}\" -B \"{0}/build-{tag}\" -DCMAKE_PREFIX_PATH=\"$CMAKE_PREFIX\" | grep '^-- epcomm '",
            dir.display()
        ),
        env,
        "find_package(epcomm VERSION)",
    );
    assert_eq!(VERSION, "0.1.0", "update the expected answers below");
    assert_eq!(
        out,
        "-- epcomm 0.1.0: 1\n-- epcomm 0.1: 1\n-- epcomm 0.1.1: 0\n-- epcomm 0.2: 0\n\
         -- epcomm 1.0: 0\n-- epcomm 0.1...<0.3: 1\n-- epcomm 0.2...0.4: 0\n"
    );
}

/// `make install` into a plain prefix, everything checked and used, then `make uninstall`.
#[test]
fn make_install_into_a_prefix_then_uninstall() {
    const TEST: &str = "make_install_into_a_prefix_then_uninstall";
    if !have_or_skip("make", TEST, "the whole install test") {
        return;
    }
    built();
    let work = fresh_dir("install");
    let prefix = work.join("prefix");
    let path = install_path(&work);
    let (w, p) = (work.display().to_string(), prefix.display().to_string());
    let lib = format!("{p}/lib");
    let pc = format!("{p}/lib/pkgconfig");
    let env = [
        ("W", w.as_str()),
        ("PREFIX", p.as_str()),
        ("LIBDIR", lib.as_str()),
        ("PKG_CONFIG_PATH", pc.as_str()),
        ("CMAKE_PREFIX", p.as_str()),
    ];

    let mut install_env = env.to_vec();
    install_env.push(("PATH", &path));
    let r = sh_ran("make install PREFIX=\"$PREFIX\"", &install_env, STEP_LIMIT);
    assert_eq!(
        r.code,
        Some(0),
        "make install without cargo on PATH:\n{}{}",
        r.stdout,
        r.stderr
    );

    // Exactly the expected files.
    assert_eq!(files_under(&prefix), expected_files());
    let so = prefix.join("lib/libepcomm.so");
    assert_eq!(std::fs::read_link(&so).unwrap(), PathBuf::from(soname()));
    assert_eq!(
        std::fs::read_link(prefix.join("lib").join(soname())).unwrap(),
        PathBuf::from(format!("libepcomm.so.{VERSION}"))
    );
    for h in ["epcomm.h", "epcomm.hpp"] {
        assert_eq!(
            std::fs::read(prefix.join("include").join(h)).unwrap(),
            std::fs::read(root().join("include").join(h)).unwrap(),
            "{h}"
        );
    }
    assert_eq!(
        std::fs::read(prefix.join("share/man/man1/epcomm.1")).unwrap(),
        std::fs::read(root().join("man/epcomm.1")).unwrap()
    );

    // SONAME and exports: only the C API, and no test-only entry point.
    let dynamic = sh("readelf -d \"$LIBDIR\"/libepcomm.so.*.*.*", &env, "readelf");
    assert!(
        dynamic.contains(&format!("Library soname: [{}]", soname())),
        "{dynamic}"
    );
    let symbols = sh(
        "nm -D --defined-only \"$LIBDIR/libepcomm.so\" | awk '{print $3}'",
        &env,
        "nm -D",
    );
    let names: Vec<&str> = symbols.lines().filter(|l| !l.is_empty()).collect();
    assert!(names.len() > 40, "{names:?}");
    let foreign: Vec<&&str> = names.iter().filter(|s| !s.starts_with("epcomm_")).collect();
    assert!(foreign.is_empty(), "non-epcomm exports: {foreign:?}");
    let test_only: Vec<&&str> = names
        .iter()
        .filter(|s| s.starts_with("epcomm_test_"))
        .collect();
    assert!(test_only.is_empty(), "test-only exports: {test_only:?}");
    assert!(names.contains(&"epcomm_version"), "{names:?}");

    // The binary runs from the prefix.
    let out = sh("\"$PREFIX/bin/epcomm\" --version", &env, "epcomm --version");
    assert_eq!(
        out.lines().next(),
        Some(format!("epcomm {VERSION}").as_str())
    );

    // pkg-config: the file, then the examples built from its flags alone.
    if have_or_skip("pkg-config", TEST, "the pkg-config builds") {
        let flags = sh(
            "pkg-config --modversion epcomm; pkg-config --cflags --libs epcomm; \
             pkg-config --static --libs epcomm",
            &env,
            "pkg-config",
        );
        let flags: String = flags
            .lines()
            .map(|l| format!("{}\n", l.trim_end()))
            .collect();
        // The private libraries are rustc's native-static-libs for the archive less -lgcc_s
        // (shared only: it would break `cc -static`) and -lc (every link has it).
        let private: Vec<&str> = common::NATIVE_STATIC_LIBS
            .iter()
            .copied()
            .filter(|l| *l != "-lgcc_s" && *l != "-lc")
            .collect();
        assert_eq!(
            flags,
            format!(
                "{VERSION}\n-I{p}/include -L{p}/lib -lepcomm\n-L{p}/lib -lepcomm {}\n",
                private.join(" ")
            )
        );
        c_example_with_pkg_config(&env);
        cpp_example_with_pkg_config(&env);
    }
    if have_or_skip("cmake", TEST, "the CMake package build") {
        examples_with_cmake(&env, "prefix", &format!("{p}/lib/cmake/epcomm"));
    }

    let r = sh_ran(
        "make uninstall PREFIX=\"$PREFIX\"",
        &install_env,
        STEP_LIMIT,
    );
    assert_eq!(r.code, Some(0), "make uninstall:\n{}{}", r.stdout, r.stderr);
    assert_eq!(files_under(&prefix), Vec::<String>::new());
    assert!(!prefix.join("lib/cmake/epcomm").exists());
}

/// A distribution's install: DESTDIR staging with PREFIX=/usr and a multiarch LIBDIR. Nothing
/// lands outside the staging tree, the files carry the final paths, and the staged tree is
/// usable as it is (the CMake package locates itself; pkg-config through its sysroot).
#[test]
fn make_install_with_destdir_and_distribution_dirs() {
    const TEST: &str = "make_install_with_destdir_and_distribution_dirs";
    if !have_or_skip("make", TEST, "the whole install test") {
        return;
    }
    built();
    let work = fresh_dir("install-destdir");
    let stage = work.join("stage");
    let path = install_path(&work);
    let (w, s) = (work.display().to_string(), stage.display().to_string());
    // The multiarch directory CMake searches on this machine (Debian's layout), else lib64.
    let arch = sh("cc -print-multiarch", &[], "cc -print-multiarch");
    let libdir = match arch.trim() {
        "" => "/usr/lib64".to_owned(),
        arch => format!("/usr/lib/{arch}"),
    };
    let lib_rel = libdir.strip_prefix("/usr/").unwrap().to_owned();
    let staged_lib = format!("{s}{libdir}");
    let pc = format!("{staged_lib}/pkgconfig");
    let usr = format!("{s}/usr");
    let dirs = format!(
        "PREFIX=/usr LIBDIR={libdir} MANDIR=/usr/share/man \
         CMAKEDIR={libdir}/cmake/epcomm DESTDIR=\"$STAGE\""
    );
    let env = [
        ("W", w.as_str()),
        ("STAGE", s.as_str()),
        ("LIBDIR", staged_lib.as_str()),
        ("PKG_CONFIG_LIBDIR", pc.as_str()),
        ("PKG_CONFIG_SYSROOT_DIR", s.as_str()),
        ("CMAKE_PREFIX", usr.as_str()),
        ("PATH", &path),
    ];
    sh(
        &format!("make install {dirs}"),
        &env,
        "make install DESTDIR",
    );

    let mut want: Vec<String> = expected_files()
        .into_iter()
        .map(|f| match f.strip_prefix("lib/") {
            Some(rest) => format!("usr/{lib_rel}/{rest}"),
            None => format!("usr/{f}"),
        })
        .collect();
    want.sort();
    assert_eq!(files_under(&stage), want);
    let pc_text = std::fs::read_to_string(format!("{pc}/epcomm.pc")).unwrap();
    assert!(
        pc_text.starts_with(&format!(
            "prefix=/usr\nlibdir=${{prefix}}/{lib_rel}\nincludedir=${{prefix}}/include\n"
        )),
        "{pc_text}"
    );
    assert!(
        !pc_text.contains(&s),
        "staging path in epcomm.pc: {pc_text}"
    );
    let config =
        std::fs::read_to_string(format!("{staged_lib}/cmake/epcomm/epcommConfig.cmake")).unwrap();
    assert!(!config.contains(&s), "staging path in epcommConfig.cmake");
    // From LIBDIR/cmake/epcomm: two levels up is LIBDIR, one more per level of LIBDIR below /usr
    // is /usr.
    let up = "/..".repeat(lib_rel.split('/').count());
    assert!(
        config.contains("\"${CMAKE_CURRENT_LIST_DIR}/../..\"")
            && config.contains(&format!(
                "\"${{CMAKE_CURRENT_LIST_DIR}}/../..{up}/include\""
            )),
        "{config}"
    );

    let mut build_env = env.to_vec();
    build_env.retain(|(k, _)| *k != "PATH");
    if have_or_skip(
        "pkg-config",
        TEST,
        "the pkg-config build from the staging tree",
    ) {
        sh(
            "cc -std=c11 -Wall -Wextra -Werror examples/c/moe_two_ranks.c \
             $(pkg-config --cflags --libs epcomm) -Wl,-rpath,\"$LIBDIR\" -o \"$W/c_staged\"",
            &build_env,
            "build the C example against the staging tree",
        );
        let out = two_ranks(
            "\"$W/c_staged\" deepep_v2",
            &build_env,
            "run the C example built against the staging tree",
        );
        assert_eq!(
            out,
            "rank 0 (deepep_v2, EXPERT_PACKED): combined 20 13.75 48\n\
             rank 1 (deepep_v2, EXPERT_PACKED): combined 70 42\n"
        );
    }
    if have_or_skip("cmake", TEST, "the CMake build from the staging tree") {
        examples_with_cmake(&build_env, "destdir", &format!("{staged_lib}/cmake/epcomm"));
    }

    sh(
        &format!("make uninstall {dirs}"),
        &env,
        "make uninstall DESTDIR",
    );
    assert_eq!(files_under(&stage), Vec::<String>::new());
}

/// Without the build outputs, `make install` stops at once with one line saying to run `make`,
/// and copies nothing.
#[test]
fn make_install_without_a_build_says_to_run_make() {
    const TEST: &str = "make_install_without_a_build_says_to_run_make";
    if !have_or_skip("make", TEST, "the whole install test") {
        return;
    }
    let work = fresh_dir("install-unbuilt");
    let path = install_path(&work);
    let (w, p) = (
        work.display().to_string(),
        work.join("prefix").display().to_string(),
    );
    let r = sh_ran(
        "make -s install PREFIX=\"$PREFIX\" BUILDDIR=\"$W/never-built\"",
        &[("W", &w), ("PREFIX", &p), ("PATH", &path)],
        STEP_LIMIT,
    );
    assert_eq!(r.code, Some(2), "{}{}", r.stdout, r.stderr);
    assert_eq!(r.stdout, "");
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{}", r.stderr);
    assert_eq!(
        lines[0],
        format!(
            "make install: {w}/never-built/release/libepcomm.so is missing; \
             run 'make' first (install only copies)"
        )
    );
    // make's own closing line names the failed target.
    assert!(lines[1].starts_with("make: *** [Makefile:"), "{}", lines[1]);
    assert!(!work.join("prefix").exists());
}

/// The version Cargo.toml gives is the one the packaging files name (Debian's as the upstream
/// part of `VERSION-REVISION`: the package is `3.0 (quilt)`).
#[test]
fn packaging_files_name_the_crate_version() {
    let changelog = std::fs::read_to_string(root().join("CHANGELOG.md")).unwrap();
    assert!(
        changelog.contains(&format!("\n## [{VERSION}] - ")),
        "CHANGELOG.md has no section for {VERSION}"
    );
    assert!(changelog.contains("\n## [Unreleased]\n"), "CHANGELOG.md");
    let debian = std::fs::read_to_string(root().join("debian/changelog")).unwrap();
    assert!(
        debian.starts_with(&format!("epcomm ({VERSION}-")),
        "debian/changelog's first entry is not {VERSION}: {}",
        debian.lines().next().unwrap_or("")
    );
    for f in ["LICENSE-MIT", "LICENSE-APACHE", "debian/copyright"] {
        assert!(root().join(f).exists(), "{f} is missing");
    }
}
