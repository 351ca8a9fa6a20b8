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
use common::skip::{required, skipped};
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
    let out = run_with_timeout(cmd, SCRIPT_TIMEOUT);
    if out.status.and_then(|s| s.code()) == Some(OFFLINE) {
        let why = format!("PyPI is unreachable: {}", out.stderr.trim());
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
fn literal_error(names: &str, input: &str) -> String {
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
    let o = epcomm(&["check", "--vllm-version", "0.31.2"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o),
        "ValueError: unknown vLLM version '0.31.2': the nearest known releases are 0.31.0 and \
         0.32.0\n"
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
         release is 0.34.0 (scripts/gen-vllm-versions.py adds newer ones)\n"
    );
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
