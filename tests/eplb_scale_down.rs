//! vLLM v0.34.0's scale-down placement (`vllm/v1/worker/sentinel/eplb_redistribute.py`:
//! `compute_dead_ep_ranks`, `mark_dead_expert_slots_inplace`, `redistribute_expert_placement`)
//! against epcomm's (`eplb::scale_down`, through the C ABI and Python's `epcomm.eplb_algo`) on
//! many random cases: the same new map, the same experts to reload, the same error text when
//! the redundancy is too small. vLLM's three functions are taken unmodified from the 0.34.0
//! sdist (the file's SHA-256 is checked) and run with torch, without importing the rest of
//! vLLM. The sdist: `EPCOMM_VLLM_SRC`, else `scripts/fetch-vllm-sdist.sh 0.34.0 target/vllm-src`
//! (PyPI, once); offline it prints a SKIPPED line (`EPCOMM_REQUIRE_VLLM_SRC=1`: a failure). The
//! interpreter needs torch and numpy (`common::python::torch_or_skip`).

mod common;

use std::process::Command;
use std::time::Duration;

use common::python::torch_or_skip;
use common::skip::{required, skipped};
use common::*;

const VLLM_VERSION: &str = "0.34.0";
const MODULE: &str = "vllm/v1/worker/sentinel/eplb_redistribute.py";
const MODULE_SHA256: &str = "6ec13e8b9e66291b4adc50f4a642e2635f135a6e80aad6cfda1087671e84c4ff";
const CASES: usize = 600;

/// Loads vLLM's three functions from the file by `ast` (the module's other imports need the
/// rest of vLLM), then compares them with epcomm's on random placements and deaths.
const COMPARE: &str = r#"
import ast, hashlib, json, random, sys
from itertools import zip_longest
import torch
import epcomm.eplb_algo as ea

path, want_sha, cases = sys.argv[1], sys.argv[2], int(sys.argv[3])
src = open(path, "rb").read()
assert hashlib.sha256(src).hexdigest() == want_sha, "not vLLM 0.34.0's file"
tree = ast.parse(src)
names = {"compute_dead_ep_ranks", "mark_dead_expert_slots_inplace",
         "redistribute_expert_placement"}
funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
assert {f.name for f in funcs} == names
ns = {"torch": torch, "zip_longest": zip_longest}
# With the file's own `from __future__ import annotations` (its annotations stay strings).
future = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
exec(compile(ast.Module(body=future + funcs, type_ignores=[]), path, "exec"), ns)

rng = random.Random(20261116)
stats = {"cases": 0, "reloads": 0, "errors": 0, "no_change": 0}
for case in range(cases):
    layers = rng.randint(1, 4)
    tp, pcp = rng.choice([1, 1, 2]), rng.choice([1, 1, 2])
    dp = rng.randint(2, 6)
    ranks = dp * tp * pcp
    local = rng.randint(1, 5)
    physical = ranks * local
    num_logical = rng.randint(1, physical)
    rows = []
    for _ in range(layers):
        row = list(range(num_logical)) + [rng.randrange(num_logical)
                                          for _ in range(physical - num_logical)]
        rng.shuffle(row)
        rows.append(row)
    dead_dp = rng.sample(range(dp), rng.randint(0, dp - 1))
    vm = torch.tensor(rows, dtype=torch.int64)
    em = torch.tensor(rows, dtype=torch.int64)
    dead = ns["compute_dead_ep_ranks"](dead_dp, tp, pcp)
    assert ea.compute_dead_ep_ranks(dead_dp, tp, pcp) == dead, (dead_dp, tp, pcp)
    ns["mark_dead_expert_slots_inplace"](vm, dead, local)
    ea.mark_dead_expert_slots_inplace(em, dead, local)
    assert torch.equal(vm, em), (case, vm, em)
    marked = em.clone()
    try:
        want = ns["redistribute_expert_placement"](vm, num_logical, local)
    except RuntimeError as e:
        want = str(e)
    try:
        got = ea.redistribute_expert_placement(em, num_logical, local)
    except RuntimeError as e:
        got = str(e)
        assert torch.equal(em, marked), "a failing call changed the map"
    assert got == want, (case, got, want)
    if isinstance(want, str):
        stats["errors"] += 1
    else:
        assert torch.equal(vm, em), (case, vm.tolist(), em.tolist())
        stats["reloads"] += len(want)
        stats["no_change"] += not want
    stats["cases"] += 1
print(json.dumps(stats))
"#;

#[test]
fn scale_down_placement_is_vllms_on_random_cases() {
    const TEST: &str = "scale_down_placement_is_vllms_on_random_cases";
    let Some(python) = torch_or_skip(TEST) else {
        return;
    };
    let tree = match common::python::vllm_sdist(python, VLLM_VERSION) {
        Ok(t) => t,
        Err(why) => {
            assert!(
                !required("EPCOMM_REQUIRE_VLLM_SRC"),
                "EPCOMM_REQUIRE_VLLM_SRC is set but {why}"
            );
            skipped(TEST, &why);
            return;
        }
    };
    let mut cmd = Command::new(python);
    cmd.arg("-c")
        .arg(COMPARE)
        .arg(tree.join(MODULE))
        .arg(MODULE_SHA256)
        .arg(CASES.to_string())
        .env("PYTHONPATH", manifest_dir().join("python"))
        .env("EPCOMM_LIBRARY", cdylib())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("EPCOMM_LOG_LEVEL");
    let out = run_with_timeout(cmd, Duration::from_secs(300));
    assert!(out.success(), "{}", out.describe("the comparison"));
    let v: serde_json::Value = serde_json::from_str(out.stdout.trim()).expect("one JSON line");
    assert_eq!(v["cases"], CASES);
    // The cases reach every outcome: reloads, too little redundancy, nothing lost.
    for k in ["reloads", "errors", "no_change"] {
        assert!(v[k].as_u64().unwrap() > 0, "no case of {k}: {v}");
    }
    println!("{}", out.stdout.trim());
}
