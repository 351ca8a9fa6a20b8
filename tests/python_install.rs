//! `pip install ./python` gives a package that works on its own, checked the way a user meets it:
//! installed into a fresh venv, imported outside the source tree with `EPCOMM_LIBRARY`,
//! `LD_LIBRARY_PATH` and `PYTHONPATH` unset.
//!
//! - Built next to a library (here `$CARGO_TARGET_DIR/debug/libepcomm.so`, the lookup setup.py
//!   does in the repository), the wheel carries it, is tagged for this platform, and `import
//!   epcomm` loads that copy; examples/python/validate_config.py and (with numpy)
//!   moe_two_ranks.py work; `EPCOMM_LIBRARY` still overrides the carried copy.
//! - Built with `EPCOMM_BUNDLE_LIBRARY=0`, the package carries none, loads the system's by its
//!   SONAME through `LD_LIBRARY_PATH`, and without one `import epcomm` fails naming every path
//!   it tried and how to fix it.
//!
//! The venv is made with `--without-pip` from `common::python::env()`'s interpreter and sees that
//! interpreter's packages (pip, setuptools, wheel, numpy) through a .pth file, so the build needs
//! no network (`--no-build-isolation --no-index`); where they are missing the tests print a
//! SKIPPED line.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use common::python::{
    builder_or_skip, first_paragraph, lock_file, numpy_or_skip, run_code, Python,
};
use common::skip::skipped;
use common::*;

/// How long one `pip install` or venv creation may take (it is offline).
const PIP_TIMEOUT: Duration = Duration::from_secs(180);

/// What validate_config.py prints for its default configuration.
const VALIDATE_DEFAULT: &str = "allgather_reducescatter -> AgRsAll2AllManager (REPLICATED); \
                                EPLB communicator: torch_gloo\n";

/// The last line of the ImportError `import epcomm` raises when no library loads.
const FIX: &str = "Fix: install the library (make install, then ldconfig, or put its directory \
                   on LD_LIBRARY_PATH), set EPCOMM_LIBRARY to the path of libepcomm.so, or \
                   reinstall this package from a repository with a built library (cargo build \
                   --release, then pip install ./python) so that it carries one.\n";

/// Prints the versions, the package file and every libepcomm the process mapped.
const PROBE: &str = "import os, epcomm\n\
print(epcomm.version())\n\
print(epcomm.__version__)\n\
print(os.path.realpath(epcomm.__file__))\n\
maps = {l.split()[-1] for l in open('/proc/self/maps') if 'libepcomm' in l}\n\
print(' '.join(sorted(os.path.realpath(m) for m in maps)))\n";

/// pip builds ./python in place (python/build, python/epcomm.egg-info): one build at a time,
/// in this process and across processes sharing the tree.
fn build_lock() -> (std::sync::MutexGuard<'static, ()>, std::fs::File) {
    static IN_PROCESS: Mutex<()> = Mutex::new(());
    let guard = IN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    let lock = Path::new(env!("CARGO_TARGET_TMPDIR")).join("epcomm-python-build.lock");
    (guard, lock_file(&lock))
}

/// A fresh venv seeing the provisioned interpreter's packages.
struct Venv {
    python: PathBuf,
    /// Its site-packages for pure packages (`purelib`), as its own `sysconfig` names it.
    purelib: PathBuf,
    /// Its site-packages for packages with native code (`platlib`).
    platlib: PathBuf,
}

fn run(cmd: Command, what: &str) -> RunOutput {
    let out = run_with_timeout(cmd, PIP_TIMEOUT);
    assert!(out.success(), "{}", out.describe(what));
    out
}

/// A fresh directory for one test under target/, named with this process's id (concurrent
/// `cargo test` runs share target/); removed when the test passes, kept for a look when not.
struct WorkDir(PathBuf);

impl std::ops::Deref for WorkDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn work_dir(name: &str) -> WorkDir {
    WorkDir(out_dir(&format!("{name}-{}", std::process::id())))
}

/// A fresh venv in `dir`, or `None` after a SKIPPED line for `test` when `venv` fails.
fn fresh_venv(test: &str, py: &Python, dir: &Path) -> Option<Venv> {
    let venv = dir.join("venv");
    let mut cmd = Command::new(&py.exe);
    cmd.args(["-m", "venv", "--without-pip"]).arg(&venv);
    let out = run_with_timeout(cmd, PIP_TIMEOUT);
    if !out.success() {
        skipped(
            test,
            &format!(
                "`{} -m venv --without-pip` failed: {}",
                py.exe.display(),
                first_paragraph(&out.stdout, &out.stderr)
            ),
        );
        return None;
    }
    let python = venv.join("bin/python");
    let paths =
        "import sysconfig; p = sysconfig.get_paths(); print(p['purelib']); print(p['platlib'])";
    let own = run_code(&python, paths).expect("the new venv's sysconfig");
    let mut own = own.lines().map(PathBuf::from);
    let (purelib, platlib) = (own.next().expect("purelib"), own.next().expect("platlib"));
    let provider = run_code(&py.exe, paths).expect("the provisioned python's sysconfig");
    let mut lines: Vec<&str> = provider.lines().collect();
    lines.dedup();
    std::fs::write(
        purelib.join("epcomm-test-provider.pth"),
        lines.join("\n") + "\n",
    )
    .expect("write the .pth file");
    Some(Venv {
        python,
        purelib,
        platlib,
    })
}

/// `pip install ./python` from the crate root into `venv`, with `env` set for the build.
fn pip_install(venv: &Venv, env: &[(&str, &Path)]) {
    let _lock = build_lock();
    let mut cmd = Command::new(&venv.python);
    cmd.current_dir(manifest_dir())
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-build-isolation",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "./python",
        ])
        .env_remove("EPCOMM_LIBRARY")
        .env_remove("EPCOMM_BUNDLE_LIBRARY")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("PYTHONPATH");
    for (k, v) in env {
        cmd.env(k, v);
    }
    run(cmd, "pip install ./python");
}

/// Runs `venv`'s python on `args` in `cwd` (outside the source tree) with no library-finding
/// variables but `env`.
fn python_in(venv: &Venv, cwd: &Path, args: &[&str], env: &[(&str, &Path)]) -> RunOutput {
    let mut cmd = Command::new(&venv.python);
    cmd.current_dir(cwd)
        .args(args)
        .env_remove("EPCOMM_LIBRARY")
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("PYTHONPATH")
        .env_remove("EPCOMM_LOG_LEVEL")
        .env("PYTHONDONTWRITEBYTECODE", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_with_timeout(cmd, RUN_TIMEOUT)
}

fn real(p: &Path) -> String {
    std::fs::canonicalize(p)
        .unwrap_or_else(|e| panic!("canonicalize {}: {e}", p.display()))
        .display()
        .to_string()
}

/// The probe's expected stdout when the package at `site` loaded `lib`.
fn probe_expect(site: &Path, lib: &Path) -> String {
    format!(
        "0.1.0\n0.1.0\n{}\n{}\n",
        real(&site.join("epcomm/__init__.py")),
        real(lib)
    )
}

fn assert_probe(out: &RunOutput, site: &Path, lib: &Path, what: &str) {
    assert!(out.success(), "{}", out.describe(what));
    assert_eq!(
        out.stdout,
        probe_expect(site, lib),
        "{}",
        out.describe(what)
    );
}

/// The platform part of a wheel tag (`linux_x86_64`).
fn platform_tag(venv: &Venv) -> String {
    run_code(
        &venv.python,
        "import sysconfig; print(sysconfig.get_platform().replace('-', '_').replace('.', '_'))",
    )
    .expect("sysconfig.get_platform")
    .trim_end()
    .to_owned()
}

/// The WHEEL metadata of the package installed in `site`: (Root-Is-Purelib, Tag).
fn wheel_tags(site: &Path) -> (String, String) {
    let path = site.join("epcomm-0.1.0.dist-info/WHEEL");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {}:\n{text}", path.display()))
            .to_owned()
    };
    (field("Root-Is-Purelib: "), field("Tag: "))
}

/// Copies examples/python into `dir`, so the scripts run away from the source tree.
fn copy_examples(dir: &Path) -> PathBuf {
    let to = dir.join("examples");
    std::fs::create_dir_all(&to).unwrap();
    for name in ["validate_config.py", "moe_two_ranks.py"] {
        std::fs::copy(
            manifest_dir().join("examples/python").join(name),
            to.join(name),
        )
        .unwrap_or_else(|e| panic!("copy {name}: {e}"));
    }
    to
}

#[test]
fn pip_installed_package_carries_its_library() {
    const TEST: &str = "pip_installed_package_carries_its_library";
    let Some(py) = builder_or_skip(TEST) else {
        return;
    };
    let work = work_dir("python-install-carried");
    // A target directory holding a debug build: what setup.py looks for next to the package.
    let target = work.join("target");
    std::fs::create_dir_all(target.join("debug")).unwrap();
    let built = target.join("debug/libepcomm.so");
    std::fs::copy(cdylib(), &built).unwrap();

    let Some(venv) = fresh_venv(TEST, py, &work) else {
        return;
    };
    pip_install(&venv, &[("CARGO_TARGET_DIR", &target)]);
    // Native code goes to platlib (the same directory as purelib on Debian).
    let carried = venv.platlib.join("epcomm/libepcomm.so");
    assert!(carried.is_file(), "{} was not installed", carried.display());
    assert_eq!(
        wheel_tags(&venv.platlib),
        (
            "false".to_owned(),
            format!("py3-none-{}", platform_tag(&venv))
        )
    );

    // The licence reaches the metadata whichever field this setuptools writes.
    let metadata = std::fs::read_to_string(venv.platlib.join("epcomm-0.1.0.dist-info/METADATA"))
        .expect("read METADATA");
    assert!(
        metadata
            .lines()
            .any(|l| l == "License: MIT OR Apache-2.0"
                || l == "License-Expression: MIT OR Apache-2.0"),
        "no licence in METADATA:\n{metadata}"
    );

    let out = python_in(&venv, &work, &["-c", PROBE], &[]);
    assert_probe(
        &out,
        &venv.platlib,
        &carried,
        "import epcomm (carried library)",
    );

    // EPCOMM_LIBRARY comes before the carried copy.
    let other = work.join("other/libepcomm.so");
    std::fs::create_dir_all(other.parent().unwrap()).unwrap();
    std::fs::copy(cdylib(), &other).unwrap();
    let out = python_in(&venv, &work, &["-c", PROBE], &[("EPCOMM_LIBRARY", &other)]);
    assert_probe(
        &out,
        &venv.platlib,
        &other,
        "import epcomm (EPCOMM_LIBRARY)",
    );

    let examples = copy_examples(&work);
    let out = python_in(&venv, &examples, &["validate_config.py"], &[]);
    assert!(out.success(), "{}", out.describe("validate_config.py"));
    assert_eq!(
        out.stdout,
        VALIDATE_DEFAULT,
        "{}",
        out.describe("validate_config.py")
    );
    let out = python_in(
        &venv,
        &examples,
        &["validate_config.py", r#"{"enable_elastic_ep": true}"#],
        &[],
    );
    assert_eq!(
        out.status.and_then(|s| s.code()),
        Some(1),
        "{}",
        out.describe("validate_config.py (elastic EP without EPLB)")
    );
    assert_eq!(
        out.stdout,
        "ValueError: Elastic EP is only supported with enable_eplb=True.\n\
         hint: set enable_eplb=true\n",
        "{}",
        out.describe("validate_config.py (elastic EP without EPLB)")
    );

    if numpy_or_skip(&format!("{TEST} (moe_two_ranks.py)")).is_some() {
        let out = python_in(
            &venv,
            &examples,
            &["moe_two_ranks.py", "deepep_low_latency"],
            &[],
        );
        assert!(out.success(), "{}", out.describe("moe_two_ranks.py"));
        assert_eq!(
            out.stdout,
            "deepep_low_latency: rank 0 -> [20.0, 13.75, 48.0], rank 1 -> [70.0, 42.0]\n",
            "{}",
            out.describe("moe_two_ranks.py")
        );
    }
}

#[test]
fn package_without_a_library_finds_the_system_one_or_says_how() {
    const TEST: &str = "package_without_a_library_finds_the_system_one_or_says_how";
    let Some(py) = builder_or_skip(TEST) else {
        return;
    };
    let work = work_dir("python-install-system");
    let Some(venv) = fresh_venv(TEST, py, &work) else {
        return;
    };
    pip_install(&venv, &[("EPCOMM_BUNDLE_LIBRARY", Path::new("0"))]);
    let carried = venv.purelib.join("epcomm/libepcomm.so");
    assert!(!carried.exists(), "{} was installed", carried.display());
    assert_eq!(
        wheel_tags(&venv.purelib),
        ("true".to_owned(), "py3-none-any".to_owned())
    );

    // A runtime package's directory: the library under its SONAME only.
    let lib_dir = work.join("lib");
    std::fs::create_dir_all(&lib_dir).unwrap();
    let soname = lib_dir.join("libepcomm.so.0.1");
    std::fs::copy(cdylib(), &soname).unwrap();
    let out = python_in(
        &venv,
        &work,
        &["-c", PROBE],
        &[("LD_LIBRARY_PATH", &lib_dir)],
    );
    assert_probe(
        &out,
        &venv.purelib,
        &soname,
        "import epcomm (LD_LIBRARY_PATH)",
    );

    // EPCOMM_LIBRARY, when set, is the only candidate: no fallback to the system's.
    let named = work.join("nowhere/libepcomm.so");
    let out = python_in(
        &venv,
        &work,
        &["-c", "import epcomm"],
        &[("EPCOMM_LIBRARY", &named), ("LD_LIBRARY_PATH", &lib_dir)],
    );
    assert_eq!(
        out.status.and_then(|s| s.code()),
        Some(1),
        "{}",
        out.describe("import epcomm (EPCOMM_LIBRARY names no file)")
    );
    let expected = format!(
        "ImportError: epcomm cannot load libepcomm. Tried:\n  \
         {} (EPCOMM_LIBRARY): no such file\n{FIX}",
        named.display()
    );
    assert!(
        out.stderr.ends_with(&expected),
        "stderr does not end with\n{expected}\n{}",
        out.describe("import epcomm (EPCOMM_LIBRARY names no file)")
    );

    // A libepcomm installed on this machine (ldconfig's cache, /usr/lib) would be found.
    let out = python_in(
        &venv,
        &work,
        &[
            "-c",
            "import ctypes\nfor n in ('libepcomm.so.0.1', 'libepcomm.so'):\n    try:\n        \
             ctypes.CDLL(n); print(n)\n    except OSError:\n        pass",
        ],
        &[],
    );
    assert!(
        out.success(),
        "{}",
        out.describe("probe the system library path")
    );
    let system = out.stdout;
    if !system.is_empty() {
        skipped(
            &format!("{TEST} (no library at all)"),
            &format!(
                "this machine has a system libepcomm ({}), so the error cannot be provoked",
                system.trim_end().replace('\n', ", ")
            ),
        );
        return;
    }
    let out = python_in(&venv, &work, &["-c", "import epcomm"], &[]);
    assert_eq!(
        out.status.and_then(|s| s.code()),
        Some(1),
        "{}",
        out.describe("import epcomm (no library)")
    );
    let missing =
        |name: &str| format!("{name}: cannot open shared object file: No such file or directory");
    let expected = format!(
        "ImportError: epcomm cannot load libepcomm. Tried:\n  \
         {} (the copy carried by the package): no such file\n  \
         libepcomm.so.0.1 (the system library path): {}\n  \
         libepcomm.so (the system library path): {}\n{FIX}",
        carried.display(),
        missing("libepcomm.so.0.1"),
        missing("libepcomm.so"),
    );
    assert!(
        out.stderr.ends_with(&expected),
        "stderr does not end with\n{expected}\n{}",
        out.describe("import epcomm (no library)")
    );
}
