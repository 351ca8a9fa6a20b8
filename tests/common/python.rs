//! The Python the tests run: `$PYTHON` (else `python3`) when it has what they need, else a
//! virtual environment the tests make once under `target/` and install the packages into.
//!
//! What the Python tests need beyond the standard library: numpy (tests/py/test_all2all.py,
//! examples/python/moe_two_ranks.py), and pip, setuptools and wheel to build `./python` offline
//! (tests/python_install.rs). When `$PYTHON` lacks one of them, `target/epcomm-test-venv` is
//! made from it and `pip install numpy setuptools wheel` run there (PyPI, about 20 MB, bounded
//! in time); an existing venv that imports them is reused, a broken one rebuilt. When that
//! cannot be done (no venv module, no network) the bare interpreter is used and the tests
//! needing the missing packages print a SKIPPED line saying what is missing and how to get it.
//! A failed attempt is remembered for ten minutes (`target/epcomm-test-venv.failed`) so each
//! test binary does not wait on it again.
//!
//! The pydantic differential test (tests/pydantic_texts.rs) needs pydantic 2.13:
//! [`pydantic_or_skip`] uses the interpreter when it imports pydantic 2.13.x, else installs
//! `pydantic==2.13.5` (the release vLLM v0.33.0 pins in requirements/docs.txt; about 5 MB) into
//! the same venv (bounded in time; a failure is remembered in
//! `target/epcomm-test-venv-pydantic.failed`).
//!
//! The heavy tier (see `skip.rs`): torch and pytest for vLLM's own EPLB tests and the torch
//! integration tests ([`torch_or_skip`]), and vLLM's sdist ([`vllm_sdist`], 153 MB). A plain
//! `cargo test` uses them when they are already here (`$PYTHON` or the test venv imports torch;
//! the sdist is under `target/vllm-src` or named by `EPCOMM_VLLM_SRC`) and otherwise skips,
//! naming `EPCOMM_TEST_FULL=1`. With that switch (or `EPCOMM_REQUIRE_TORCH=1` /
//! `EPCOMM_REQUIRE_VLLM_SRC=1`) they are provisioned: torch's CPU-only build from its CPU index
//! (about 190 MB of wheels, 750 MB installed), else, when that index cannot be reached, torch from
//! PyPI (whose Linux build pulls the CUDA libraries: several GB; the run says so), failures
//! remembered as above in `target/epcomm-test-venv-torch.failed`.
//!
//! Variables: `EPCOMM_TEST_NO_PROVISION=1` never makes the venv (the do-without path);
//! `EPCOMM_REQUIRE_PYTHON=1` turns a missing interpreter (or pydantic) into a failure,
//! `EPCOMM_REQUIRE_NUMPY=1` a missing package (numpy, setuptools, wheel) into one and
//! `EPCOMM_REQUIRE_TORCH=1` a missing torch or pytest into one; `EPCOMM_TEST_FULL=1` implies
//! them all. `EPCOMM_TORCH_INDEX_URL` replaces the CPU index torch is tried from first.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime};

use super::run_with_timeout;
use super::skip::{heavy, required, skipped};

/// What lets the interpreter build `./python` into a wheel without the network, as (name, code
/// that imports it): bdist_wheel is setuptools' own from 70.1 on, the wheel package's before.
const BUILD_MODULES: &[(&str, &str)] = &[
    ("setuptools", "import setuptools"),
    (
        "wheel",
        "try:\n    import setuptools.command.bdist_wheel\nexcept ImportError:\n    import wheel",
    ),
    ("pip", "import pip"),
];
/// Imports everything the venv provides; setuptools comes before pip, whose distutils would
/// otherwise trip setuptools' import check.
const VENV_CHECK: &str = "import setuptools, wheel, pip, numpy";
/// What the venv gets from PyPI.
const PACKAGES: &[&str] = &["numpy", "setuptools", "wheel"];
/// How long `python -m venv` may take.
const VENV_TIMEOUT: Duration = Duration::from_secs(120);
/// How long `pip install` of the packages may take in all.
const PIP_TIMEOUT: Duration = Duration::from_secs(300);
/// pip's timeout per connection attempt (`--timeout`), so an unreachable index fails fast.
const PIP_SOCKET_TIMEOUT_S: &str = "15";
/// How long a failed provisioning attempt is not retried.
const RETRY_AFTER: Duration = Duration::from_secs(600);
/// Imports what vLLM's EPLB tests need.
const TORCH_CHECK: &str = "import torch, numpy, pytest";
/// Where torch's CPU-only build is tried from first (`EPCOMM_TORCH_INDEX_URL` replaces it).
const TORCH_CPU_INDEX: &str = "https://download.pytorch.org/whl/cpu";
/// How long each `pip install` of torch may take (PyPI's build is several GB with its CUDA
/// libraries).
const TORCH_TIMEOUT: Duration = Duration::from_secs(1200);
/// What provisioning torch downloads, for SKIPPED lines.
const TORCH_DOWNLOAD: &str = "torch's CPU build from its CPU index: about 190 MB to download, \
    750 MB in target/; from PyPI, when that index is unreachable, several GB with CUDA's libraries";

/// The interpreter the Python tests run, and what it lacks.
#[derive(Debug)]
pub struct Python {
    /// The interpreter to run.
    pub exe: PathBuf,
    /// Why numpy cannot be imported, with how to get it; `None` when it can.
    pub numpy_missing: Option<String>,
    /// Why `./python` cannot be built with it offline (pip, setuptools, wheel), with how to get
    /// them; `None` when it can.
    pub build_missing: Option<String>,
}

/// The Python the tests run (found and, when needed, provisioned once per test binary), or why
/// there is none.
pub fn env() -> Result<&'static Python, &'static str> {
    static ENV: OnceLock<Result<Python, String>> = OnceLock::new();
    ENV.get_or_init(find).as_ref().map_err(|why| why.as_str())
}

/// The Python for `test`, or `None` after a SKIPPED line when there is none (a failure when
/// `EPCOMM_REQUIRE_PYTHON=1`).
pub fn python_or_skip(test: &str) -> Option<&'static Python> {
    match env() {
        Ok(p) => Some(p),
        Err(why) => {
            assert!(
                !required("EPCOMM_REQUIRE_PYTHON"),
                "EPCOMM_REQUIRE_PYTHON is set but {why}"
            );
            skipped(test, why);
            None
        }
    }
}

/// The Python for `test` when it imports numpy, or `None` after a SKIPPED line (a failure when
/// `EPCOMM_REQUIRE_NUMPY=1`).
pub fn numpy_or_skip(test: &str) -> Option<&'static Python> {
    let python = python_or_skip(test)?;
    lacking(test, python.numpy_missing.as_deref())?;
    Some(python)
}

/// The Python for `test` when it can build `./python` offline, or `None` after a SKIPPED line
/// (a failure when `EPCOMM_REQUIRE_NUMPY=1`, which asks for everything the venv provides).
pub fn builder_or_skip(test: &str) -> Option<&'static Python> {
    let python = python_or_skip(test)?;
    lacking(test, python.build_missing.as_deref())?;
    Some(python)
}

fn lacking(test: &str, missing: Option<&str>) -> Option<()> {
    let Some(why) = missing else {
        return Some(());
    };
    assert!(
        !required("EPCOMM_REQUIRE_NUMPY"),
        "EPCOMM_REQUIRE_NUMPY is set but {why}"
    );
    skipped(test, why);
    None
}

/// Runs `python -c code`; `Ok(stdout)` when it exits 0, else `Err(last stderr line)`.
pub fn run_code(python: &Path, code: &str) -> Result<String, String> {
    let mut cmd = Command::new(python);
    cmd.args(["-c", code]).env_remove("PYTHONPATH");
    let out = match cmd.output() {
        Ok(out) => out,
        Err(e) => return Err(format!("cannot run {}: {e}", python.display())),
    };
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        let stderr = String::from_utf8_lossy(&out.stderr);
        Err(stderr.trim_end().lines().last().unwrap_or("").to_owned())
    }
}

/// The base interpreter named by `$PYTHON` (else `python3`), as its description
/// (`sys.executable` and version) when it is a Python 3.
fn base() -> Result<(PathBuf, String), String> {
    let name = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let exe = PathBuf::from(&name);
    match run_code(
        &exe,
        "import sys; assert sys.version_info[0] == 3; print(sys.executable); print(sys.version)",
    ) {
        Ok(about) => Ok((exe, about)),
        Err(e) if e.starts_with("cannot run") => Err(format!(
            "no Python 3 interpreter: {e}; install python3 or set $PYTHON to one"
        )),
        Err(e) => Err(format!(
            "no Python 3 interpreter: {name} is not a working Python 3 ({e}); install python3 \
             or set $PYTHON to one"
        )),
    }
}

fn find() -> Result<Python, String> {
    let (exe, about) = base()?;
    let missing = |modules: &[(&str, &str)]| -> Vec<String> {
        modules
            .iter()
            .filter(|(_, code)| run_code(&exe, code).is_err())
            .map(|(name, _)| name.to_string())
            .collect()
    };
    let numpy = missing(&[("numpy", "import numpy")]);
    let build = missing(BUILD_MODULES);
    if numpy.is_empty() && build.is_empty() {
        return Ok(Python {
            exe,
            numpy_missing: None,
            build_missing: None,
        });
    }
    let lacks = [numpy.clone(), build.clone()].concat().join(", ");
    let bare = |why: String| Python {
        exe: exe.clone(),
        numpy_missing: (!numpy.is_empty())
            .then(|| format!("{} cannot import numpy; {why}", exe.display())),
        build_missing: (!build.is_empty()).then(|| {
            format!(
                "{} cannot build ./python offline: it lacks {}; {why}",
                exe.display(),
                build.join(", ")
            )
        }),
    };
    if required("EPCOMM_TEST_NO_PROVISION") {
        return Ok(bare(format!(
            "EPCOMM_TEST_NO_PROVISION is set, so no venv is made (install {lacks} into {}, or \
             unset it to let the tests make one under target/)",
            exe.display()
        )));
    }
    match provision(&exe, &about) {
        Ok(venv_python) => Ok(Python {
            exe: venv_python,
            numpy_missing: None,
            build_missing: None,
        }),
        Err(why) => Ok(bare(format!(
            "making a venv with them failed: {why} (install {lacks} into {}, or fix that and \
             rerun)",
            exe.display()
        ))),
    }
}

/// `target/` of this build (the parent of cargo's temp dir for tests).
fn target_dir() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).to_path_buf()
}

/// The venv the tests provision: `target/epcomm-test-venv`.
pub fn venv_dir() -> PathBuf {
    target_dir().join("epcomm-test-venv")
}

/// An exclusive lock on `path` (made if absent), held until the file is dropped: concurrent
/// `cargo test` runs on one target/ (and the threads of one test binary) may race.
pub fn lock_file(path: &Path) -> File {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    // SAFETY: the descriptor is open for the call; flock only takes an advisory lock on it,
    // released when `file` is closed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(
        rc,
        0,
        "flock {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    file
}

/// Makes (or reuses) the venv and returns its interpreter, or says why it cannot be had.
fn provision(base: &Path, about: &str) -> Result<PathBuf, String> {
    let venv = venv_dir();
    let python = venv.join("bin/python");
    let stamp = venv.join("epcomm-base.txt");
    let failed = target_dir().join("epcomm-test-venv.failed");
    let _lock = lock_file(&target_dir().join("epcomm-test-venv.lock"));

    let check = VENV_CHECK;
    let same_base = std::fs::read_to_string(&stamp).is_ok_and(|s| s == about);
    if same_base && run_code(&python, check).is_ok() {
        return Ok(python);
    }
    recent_failure(&failed, "EPCOMM_REQUIRE_NUMPY")?;
    let result = make_venv(base, &venv, &python, check);
    match &result {
        Ok(_) => {
            std::fs::write(&stamp, about).map_err(|e| format!("write {}: {e}", stamp.display()))?;
            let _ = std::fs::remove_file(&failed);
        }
        Err(why) => {
            let _ = std::fs::remove_dir_all(&venv);
            let _ = std::fs::write(&failed, why);
        }
    }
    result.map(|()| python)
}

/// `Err(why)` when the attempt that `failed` records is less than [`RETRY_AFTER`] old (each test
/// binary would wait on it again), unless the REQUIRE variable `require` asks for the real
/// outcome.
fn recent_failure(failed: &Path, require: &str) -> Result<(), String> {
    if required(require) {
        return Ok(());
    }
    let recent = std::fs::metadata(failed)
        .ok()
        .and_then(|meta| meta.modified().ok())
        .and_then(|m| SystemTime::now().duration_since(m).ok())
        .is_some_and(|age| age < RETRY_AFTER);
    if !recent {
        return Ok(());
    }
    let why = std::fs::read_to_string(failed).unwrap_or_default();
    Err(format!(
        "{} (from an attempt less than {} minutes ago; delete {} to retry now)",
        why.trim_end(),
        RETRY_AFTER.as_secs() / 60,
        failed.display()
    ))
}

/// The pydantic release vLLM v0.33.0 pins (requirements/docs.txt).
const PYDANTIC_PIN: &str = "pydantic==2.13.5";
/// Imports pydantic 2.13.x (whose texts the configuration check reproduces).
const PYDANTIC_CHECK: &str = "import pydantic, annotated_types; \
    assert pydantic.VERSION.startswith('2.13.'), pydantic.VERSION";

/// The interpreter for the pydantic differential test, found or provisioned once per test
/// binary, or why there is none.
pub fn pydantic_env() -> Result<&'static Path, &'static str> {
    static ENV: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    ENV.get_or_init(find_pydantic)
        .as_ref()
        .map(PathBuf::as_path)
        .map_err(|why| why.as_str())
}

/// The interpreter for `test` when it imports pydantic 2.13, or `None` after a SKIPPED line (a
/// failure when `EPCOMM_REQUIRE_PYTHON=1`).
pub fn pydantic_or_skip(test: &str) -> Option<&'static Path> {
    or_skip(pydantic_env(), "EPCOMM_REQUIRE_PYTHON", test)
}

/// `env`'s interpreter, or `None` after a SKIPPED line for `test` (a failure when `flag` is 1).
fn or_skip(
    env: Result<&'static Path, &'static str>,
    flag: &str,
    test: &str,
) -> Option<&'static Path> {
    match env {
        Ok(p) => Some(p),
        Err(why) => {
            assert!(!required(flag), "{flag} is set but {why}");
            skipped(test, why);
            None
        }
    }
}

fn find_pydantic() -> Result<PathBuf, String> {
    let (exe, about) = base()?;
    if run_code(&exe, PYDANTIC_CHECK).is_ok() {
        return Ok(exe);
    }
    if required("EPCOMM_TEST_NO_PROVISION") {
        return Err(format!(
            "{} cannot import pydantic 2.13 and EPCOMM_TEST_NO_PROVISION is set (pip install \
             {PYDANTIC_PIN})",
            exe.display()
        ));
    }
    let python = provision(&exe, &about)?;
    let failed = target_dir().join("epcomm-test-venv-pydantic.failed");
    let _lock = lock_file(&target_dir().join("epcomm-test-venv.lock"));
    if run_code(&python, PYDANTIC_CHECK).is_ok() {
        return Ok(python);
    }
    recent_failure(&failed, "EPCOMM_REQUIRE_PYTHON")?;
    let installed = pip_install(&python, &[PYDANTIC_PIN], PIP_TIMEOUT)
        .map_err(|e| format!("`pip install {PYDANTIC_PIN}` into the test venv failed: {e}"))
        .and_then(|()| {
            run_code(&python, PYDANTIC_CHECK)
                .map_err(|e| format!("the test venv cannot import pydantic 2.13: {e}"))
        });
    match installed {
        Ok(_) => {
            let _ = std::fs::remove_file(&failed);
            let note = format!("installed {PYDANTIC_PIN} into {}\n", python.display());
            // Shown in normal output: a test run that downloads packages should say so.
            std::io::Write::write_all(&mut std::io::stderr(), note.as_bytes()).ok();
            Ok(python)
        }
        Err(why) => {
            let _ = std::fs::write(&failed, &why);
            Err(why)
        }
    }
}

/// The interpreter for vLLM's EPLB tests (torch, numpy, pytest), found or provisioned once per
/// test binary, or why there is none.
pub fn torch_env() -> Result<&'static Path, &'static str> {
    static ENV: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    ENV.get_or_init(find_torch)
        .as_ref()
        .map(PathBuf::as_path)
        .map_err(|why| why.as_str())
}

/// The interpreter for `test` when it imports torch, numpy and pytest, or `None` after a SKIPPED
/// line (a failure when `EPCOMM_REQUIRE_TORCH=1`).
pub fn torch_or_skip(test: &str) -> Option<&'static Path> {
    or_skip(torch_env(), "EPCOMM_REQUIRE_TORCH", test)
}

fn find_torch() -> Result<PathBuf, String> {
    let (exe, about) = base()?;
    if run_code(&exe, TORCH_CHECK).is_ok() {
        return Ok(exe);
    }
    if required("EPCOMM_TEST_NO_PROVISION") {
        return Err(format!(
            "{} cannot `{TORCH_CHECK}` and EPCOMM_TEST_NO_PROVISION is set (pip install torch \
             --index-url {TORCH_CPU_INDEX}; pip install numpy pytest)",
            exe.display()
        ));
    }
    let python = provision(&exe, &about)?;
    if run_code(&python, TORCH_CHECK).is_ok() {
        return Ok(python);
    }
    if !required("EPCOMM_REQUIRE_TORCH") {
        return Err(heavy(
            &format!(
                "torch (with numpy and pytest) for {} or the test venv {}",
                exe.display(),
                venv_dir().display()
            ),
            TORCH_DOWNLOAD,
        ));
    }
    let failed = target_dir().join("epcomm-test-venv-torch.failed");
    let _lock = lock_file(&target_dir().join("epcomm-test-venv.lock"));
    if run_code(&python, TORCH_CHECK).is_ok() {
        return Ok(python);
    }
    recent_failure(&failed, "EPCOMM_REQUIRE_TORCH")?;
    match install_torch(&python) {
        Ok(()) => {
            let _ = std::fs::remove_file(&failed);
            Ok(python)
        }
        Err(why) => {
            let _ = std::fs::write(&failed, &why);
            Err(why)
        }
    }
}

/// `python -m pip install ARGS` (bounded by `timeout`); `Err` with pip's last line.
fn pip_install(python: &Path, args: &[&str], timeout: Duration) -> Result<(), String> {
    let mut cmd = Command::new(python);
    cmd.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
    ])
    .args([
        "--no-input",
        "--timeout",
        PIP_SOCKET_TIMEOUT_S,
        "--retries",
        "1",
    ])
    .args(args)
    .env_remove("PYTHONPATH");
    let out = run_with_timeout(cmd, timeout);
    match out.status {
        _ if out.success() => Ok(()),
        Some(_) => Err(last_line(&out.stdout, &out.stderr)),
        None => Err(format!("did not finish in {} s", timeout.as_secs())),
    }
}

/// Installs pytest and torch (the CPU build from its index, else PyPI's) into the venv.
fn install_torch(python: &Path) -> Result<(), String> {
    let started = Instant::now();
    pip_install(python, &["pytest"], PIP_TIMEOUT)
        .map_err(|e| format!("`pip install pytest` into the test venv failed: {e}"))?;
    let index = std::env::var("EPCOMM_TORCH_INDEX_URL").unwrap_or_else(|_| TORCH_CPU_INDEX.into());
    let from = match pip_install(python, &["torch", "--index-url", &index], TORCH_TIMEOUT) {
        Ok(()) => format!("torch (CPU build) from {index}"),
        Err(cpu) => {
            pip_install(python, &["torch"], TORCH_TIMEOUT).map_err(|pypi| {
                format!(
                    "installing torch into the test venv failed: from {index}: {cpu}; from \
                     PyPI: {pypi}"
                )
            })?;
            format!("torch from PyPI ({index} failed: {cpu})")
        }
    };
    run_code(python, TORCH_CHECK)
        .map_err(|e| format!("the test venv cannot `{TORCH_CHECK}` after installing: {e}"))?;
    let note = format!(
        "installed pytest and {from} into {} in {:.0} s\n",
        python.display(),
        started.elapsed().as_secs_f64()
    );
    // Shown in normal output: a test run that downloads packages should say so.
    std::io::Write::write_all(&mut std::io::stderr(), note.as_bytes()).ok();
    Ok(())
}

fn make_venv(base: &Path, venv: &Path, python: &Path, check: &str) -> Result<(), String> {
    if venv.exists() {
        std::fs::remove_dir_all(venv).map_err(|e| format!("remove {}: {e}", venv.display()))?;
    }
    let started = Instant::now();
    let mut cmd = Command::new(base);
    cmd.args(["-m", "venv"]).arg(venv);
    let out = run_with_timeout(cmd, VENV_TIMEOUT);
    if !out.success() {
        return Err(format!(
            "`{} -m venv {}` failed: {} (on Debian the venv module is the python3-venv package)",
            base.display(),
            venv.display(),
            first_paragraph(&out.stdout, &out.stderr)
        ));
    }
    pip_install(python, PACKAGES, PIP_TIMEOUT).map_err(|how| {
        format!(
            "`pip install {}` into {} failed (PyPI unreachable?): {how}",
            PACKAGES.join(" "),
            venv.display()
        )
    })?;
    run_code(python, check).map_err(|e| format!("the new venv cannot `{check}`: {e}"))?;
    let note = format!(
        "made {} with {} in {:.0} s\n",
        venv.display(),
        PACKAGES.join(", "),
        started.elapsed().as_secs_f64()
    );
    // Shown in normal output: a test run that downloads packages should say so.
    std::io::Write::write_all(&mut std::io::stderr(), note.as_bytes()).ok();
    Ok(())
}

/// The first paragraph of the output, on one line (where `venv` states its error).
pub fn first_paragraph(stdout: &str, stderr: &str) -> String {
    let text = format!("{stderr}\n{stdout}");
    text.lines()
        .map(str::trim)
        .skip_while(|l| l.is_empty())
        .take_while(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The last non-empty line of stderr, else of stdout (where pip states its error).
fn last_line(stdout: &str, stderr: &str) -> String {
    let text = if stderr.trim().is_empty() {
        stdout
    } else {
        stderr
    };
    text.trim_end().lines().last().unwrap_or("").to_owned()
}

/// vLLM `version`'s source tree: `EPCOMM_VLLM_SRC`, else its sdist fetched once under target/
/// (`scripts/fetch-vllm-sdist.sh`, from PyPI); `Err(why)` when it cannot be had.
pub fn vllm_sdist(python: &Path, version: &str) -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("EPCOMM_VLLM_SRC") {
        return Ok(PathBuf::from(dir));
    }
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .map_or_else(|| PathBuf::from("target"), Path::to_path_buf);
    let cached = target.join("vllm-src").join(format!("vllm-{version}"));
    if !cached.join("vllm").is_dir() && !required("EPCOMM_REQUIRE_VLLM_SRC") {
        return Err(heavy(
            &format!(
                "vLLM {version}'s source tree ({} or EPCOMM_VLLM_SRC)",
                cached.display()
            ),
            "its sdist from PyPI: 153 MB to download, 320 MB in target/",
        ));
    }
    let _lock = lock_file(&target.join("vllm-src.lock"));
    let mut cmd = Command::new("bash");
    cmd.arg(super::manifest_dir().join("scripts/fetch-vllm-sdist.sh"))
        .arg(version)
        .arg(target.join("vllm-src"))
        .env("PYTHON", python);
    let out = run_with_timeout(cmd, Duration::from_secs(600));
    if !out.success() {
        let last = out.stderr.trim_end().lines().last().unwrap_or("");
        return Err(format!(
            "vLLM {version}'s sdist could not be fetched (offline?): {last}; set \
             EPCOMM_VLLM_SRC to an unpacked vllm-{version} tree, or run \
             scripts/fetch-vllm-sdist.sh {version} DIR where PyPI is reachable"
        ));
    }
    Ok(PathBuf::from(out.stdout.trim_end()))
}
