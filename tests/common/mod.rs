//! Helpers shared by the integration tests that drive the built library from outside Rust
//! (C, C++, Python): locating the cdylib/staticlib cargo built, compiling C programs against
//! them, and running programs with a timeout.
#![allow(dead_code)]

pub mod cuda_emu;
pub mod eplb_fixture;
pub mod ft_fixture;
pub mod moe_fixture;
pub mod python;
pub mod skip;
pub mod vllm_cpu;

use std::ffi::OsStr;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// How long a compiled test program or script may run.
pub const RUN_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one compiler invocation may run.
pub const COMPILE_TIMEOUT: Duration = Duration::from_secs(300);

/// Warnings every C/C++ test program must compile without.
pub const WARNING_FLAGS: &[&str] = &["-Wall", "-Wextra", "-Werror"];

/// What `cargo rustc -- --print native-static-libs` reports for linking libepcomm.a.
pub const NATIVE_STATIC_LIBS: &[&str] = &[
    "-lgcc_s",
    "-lutil",
    "-lrt",
    "-lpthread",
    "-lm",
    "-ldl",
    "-lc",
];

/// The crate root.
pub fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `include/` of the crate (epcomm.h).
pub fn include_dir() -> PathBuf {
    manifest_dir().join("include")
}

/// Where cargo puts the library next to this test binary: `target/<profile>/deps` (the test
/// binary's own directory) and `target/<profile>`.
fn artifact_dirs() -> Vec<PathBuf> {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("test binary has a parent directory");
    let mut dirs = vec![deps.to_path_buf()];
    if let Some(profile) = deps.parent() {
        dirs.push(profile.to_path_buf());
    }
    dirs
}

/// Finds a build artifact of the library (e.g. `libepcomm.so`) in the artifact directories.
pub fn find_artifact(file_name: &str) -> PathBuf {
    let dirs = artifact_dirs();
    for dir in &dirs {
        let p = dir.join(file_name);
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "{file_name} not found in {dirs:?}: cargo builds the library's crate types \
         (cdylib, staticlib) before integration tests; run `cargo build` or `cargo test`"
    );
}

/// The shared library (`libepcomm.so`).
pub fn cdylib() -> PathBuf {
    find_artifact(&format!(
        "{}epcomm{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ))
}

/// The static library (`libepcomm.a`).
pub fn staticlib() -> PathBuf {
    find_artifact("libepcomm.a")
}

/// A fresh directory for one test's outputs, under cargo's temp dir inside `target/`.
pub fn out_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("clean output directory");
    }
    std::fs::create_dir_all(&dir).expect("create output directory");
    dir
}

/// The C compiler (`$CC`, else `cc`).
pub fn c_compiler() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".to_owned())
}

/// The C++ compiler (`$CXX`, else `c++`).
pub fn cxx_compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned())
}

/// The result of running a program to completion (or until its timeout).
pub struct RunOutput {
    /// `None` when the program was killed after its timeout.
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl RunOutput {
    pub fn success(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    /// A printable account of the run, for assertion messages.
    pub fn describe(&self, what: &str) -> String {
        let status = match self.status {
            Some(s) => format!("exited with {s}"),
            None => format!("timed out after {:.1?} and was killed", self.elapsed),
        };
        format!(
            "{what} {status}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.stdout, self.stderr
        )
    }
}

fn drain<R: Read + Send + 'static>(r: Option<R>) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut r) = r {
            let _ = r.read_to_end(&mut buf);
        }
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// Runs `cmd` with stdout/stderr captured; kills it after `timeout`.
pub fn run_with_timeout(mut cmd: Command, timeout: Duration) -> RunOutput {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child: Child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", cmd.get_program()));
    // Read both pipes on their own threads so a chatty child never blocks on a full pipe.
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());
    let status = loop {
        match child.try_wait().expect("wait for child") {
            Some(s) => break Some(s),
            None if start.elapsed() >= timeout => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            None => thread::sleep(Duration::from_millis(20)),
        }
    };
    RunOutput {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
        elapsed: start.elapsed(),
    }
}

/// Runs a compiler with `args`; panics with its output unless it succeeds.
pub fn compile<S: AsRef<OsStr>>(compiler: &str, args: &[S]) {
    let mut cmd = Command::new(compiler);
    cmd.args(args).current_dir(manifest_dir());
    let shown = format!(
        "{compiler} {}",
        args.iter()
            .map(|a| a.as_ref().to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let out = run_with_timeout(cmd, COMPILE_TIMEOUT);
    assert!(out.success(), "{}", out.describe(&format!("`{shown}`")));
}

/// Linker arguments for the shared library: `-L<dir> -lepcomm` and an RPATH to `<dir>`.
/// `--disable-new-dtags` makes it DT_RPATH, which wins over LD_LIBRARY_PATH: cargo puts
/// target/debug on that path, where a stale libepcomm.so from an earlier `cargo build` may be.
pub fn link_cdylib_args() -> Vec<String> {
    let lib = cdylib();
    let dir = lib
        .parent()
        .expect("library directory")
        .display()
        .to_string();
    vec![
        format!("-L{dir}"),
        "-lepcomm".to_owned(),
        format!("-Wl,--disable-new-dtags,-rpath,{dir}"),
    ]
}

/// A command for a test program with a predictable environment: default log level, short panic
/// output, and UBSan findings fatal.
fn test_command(program: &Path, asan_options: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.current_dir(manifest_dir())
        .env_remove("EPCOMM_LOG_LEVEL")
        .env("RUST_BACKTRACE", "0")
        .env("ASAN_OPTIONS", asan_options)
        .env("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1");
    cmd
}

/// A command for a program that forms a shared-memory group (tests/c/test_ranks.h): its
/// group-name argument, and `test_command`'s environment without `EPCOMM_TIMEOUT_S`, so the
/// program's own group timeouts apply.
pub fn group_program_command(program: &Path, group: &str, asan_options: &str) -> Command {
    let mut cmd = test_command(program, asan_options);
    cmd.arg(group).env_remove("EPCOMM_TIMEOUT_S");
    cmd
}

/// Whether a run's stderr says that LeakSanitizer could not run at all.
fn lsan_unusable(out: &RunOutput) -> bool {
    out.stderr
        .contains("LeakSanitizer has encountered a fatal error")
        || out
            .stderr
            .contains("LeakSanitizer does not work under ptrace")
}

/// Runs `command(asan_options, rerun)` with leak detection; when LeakSanitizer is unusable, runs
/// `command` again (`rerun` true) with `detect_leaks=0` so the rest of ASan still applies.
fn run_with_lsan_fallback(
    program: &Path,
    timeout: Duration,
    command: impl Fn(&str, bool) -> Command,
) -> RunOutput {
    let out = run_with_timeout(command("detect_leaks=1:abort_on_error=0", false), timeout);
    if lsan_unusable(&out) {
        eprintln!(
            "note: LeakSanitizer is unusable here (ptrace restrictions); rerunning {} with detect_leaks=0",
            program.display()
        );
        return run_with_timeout(command("detect_leaks=0:abort_on_error=0", true), timeout);
    }
    out
}

/// Runs a program built with `-fsanitize=address` (and maybe `undefined`), with leak detection.
///
/// LeakSanitizer cannot run under ptrace (some CI sandboxes and debuggers); when it reports
/// that, the program is run again with `detect_leaks=0` so the rest of ASan still applies.
pub fn run_sanitized(program: &Path) -> RunOutput {
    run_with_lsan_fallback(program, RUN_TIMEOUT, |asan_options, _| {
        test_command(program, asan_options)
    })
}

/// Like `run_sanitized`, for a program that forms a shared-memory group named by its argument
/// (tests/c/test_ranks.h), bounded by `timeout`. A rerun without leak detection uses the group
/// name with an `r` appended, so it cannot meet anything the first run left behind.
pub fn run_group_program(program: &Path, group: &str, timeout: Duration) -> RunOutput {
    run_with_lsan_fallback(program, timeout, |asan_options, rerun| {
        let group = if rerun {
            format!("{group}r")
        } else {
            group.to_owned()
        };
        group_program_command(program, &group, asan_options)
    })
}

/// A group name unique to this test process: `{prefix}{pid}{suffix}`. Give each program its own
/// prefix and each variant its own suffix, none a prefix of another, so each run's /dev/shm
/// check sees only its own group.
pub fn group_name(prefix: &str, suffix: &str) -> String {
    format!("{prefix}{}{suffix}", std::process::id())
}

/// Runs a program built without sanitizers.
pub fn run_plain(program: &Path) -> RunOutput {
    run_with_timeout(test_command(program, ""), RUN_TIMEOUT)
}

/// Asserts that a C test program succeeded and that its last line is `N passed, 0 failed`.
pub fn assert_c_test_passed(what: &str, out: &RunOutput) {
    assert!(out.success(), "{}", out.describe(what));
    let last = out.stdout.lines().last().unwrap_or("");
    let counts: Vec<&str> = last.split(' ').collect();
    let ok = counts.len() == 4
        && counts[0].parse::<u32>().is_ok_and(|n| n > 0)
        && counts[1] == "passed,"
        && counts[2] == "0"
        && counts[3] == "failed";
    assert!(
        ok,
        "{}",
        out.describe(&format!(
            "{what}: last line is {last:?}, expected \"N passed, 0 failed\";"
        ))
    );
    println!("{what}: {last}");
}

/// AddressSanitizer and UBSan, as every C test builds.
pub const SANITIZERS: &str = "-fsanitize=address,undefined";

/// Compiles `source` with `compiler` and `lang_flags` (e.g. `-std=c11`) plus warnings as
/// errors and the sanitizers, linked against the shared library, into `out`.
pub fn build_sanitized(compiler: &str, lang_flags: &[&str], source: &Path, out: &Path) {
    let mut args: Vec<String> = lang_flags.iter().map(|s| s.to_string()).collect();
    args.extend(WARNING_FLAGS.iter().map(|s| s.to_string()));
    args.push(SANITIZERS.to_owned());
    args.push(format!("-I{}", include_dir().display()));
    args.push(source.display().to_string());
    args.push("-o".to_owned());
    args.push(out.display().to_string());
    // `-x none` ends `-x c++` so the libraries are not taken for C++ sources.
    args.push("-x".to_owned());
    args.push("none".to_owned());
    args.extend(link_cdylib_args());
    compile(compiler, &args);
}

/// The two languages every C test program is built as.
#[derive(Clone, Copy, Debug)]
pub enum Lang {
    /// `$CC -std=c11`.
    C11,
    /// `$CXX -x c++ -std=c++17`.
    Cxx17,
}

impl Lang {
    pub fn compiler(self) -> String {
        match self {
            Lang::C11 => c_compiler(),
            Lang::Cxx17 => cxx_compiler(),
        }
    }

    pub fn flags(self) -> &'static [&'static str] {
        match self {
            Lang::C11 => &["-std=c11"],
            Lang::Cxx17 => &["-x", "c++", "-std=c++17"],
        }
    }

    /// Short names for output directories and group names.
    fn tag(self) -> &'static str {
        match self {
            Lang::C11 => "c11",
            Lang::Cxx17 => "cpp17",
        }
    }

    fn group_suffix(self) -> &'static str {
        match self {
            Lang::C11 => "c",
            Lang::Cxx17 => "x",
        }
    }
}

/// Builds the group program `source` (relative to the crate root; tests/c/test_ranks.h) as
/// `lang` under ASan+UBSan against the shared library, runs it on a group unique to this
/// process and language (`group_name(group_prefix, ..)`) bounded by `timeout`, and asserts that
/// it passed (`assert_c_test_passed`, naming it `what`).
pub fn check_group_program(
    source: &str,
    lang: Lang,
    group_prefix: &str,
    timeout: Duration,
    what: &str,
) {
    let source = manifest_dir().join(source);
    let stem = source
        .file_stem()
        .expect("a source file name")
        .to_string_lossy()
        .into_owned();
    let exe = out_dir(&format!("{stem}-{}", lang.tag())).join(&stem);
    build_sanitized(&lang.compiler(), lang.flags(), &source, &exe);
    let out = run_group_program(
        &exe,
        &group_name(group_prefix, lang.group_suffix()),
        timeout,
    );
    assert_c_test_passed(what, &out);
}
