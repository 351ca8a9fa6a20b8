"""epcomm's configuration check against pydantic itself.

Pydantic dataclasses here mirror the fields epcomm models of vLLM v0.34.0's `ParallelConfig` and
`EPLBConfig` (vllm/config/parallel.py; `@config` in vllm/config/utils.py is a pydantic dataclass
with extra="forbid"), plus epcomm's own keys as `EpcommOptions`. For each bad configuration,
str(ValidationError) must equal the message epcomm_config_check_report gives (through ctypes);
for each configuration pydantic accepts, epcomm's message (if any) must not be a
ValidationError. Validators are left out of the mirror: epcomm gives their errors with vLLM's
raised text.

When EPCOMM_VLLM_SRC names vLLM v0.34.0's source tree, the mirror is compared with `ast` to
vllm/config/parallel.py (field order, types, Literal members, Field bounds), so it cannot drift.

    EPCOMM_LIBRARY=target/debug/libepcomm.so python3 tests/py/test_pydantic_texts.py -v
"""

import ast
import ctypes
import json
import os
import sys
import typing
import unittest
from typing import Literal, Optional

import re

import annotated_types
import pydantic
from pydantic import ConfigDict, Field, ValidationError, field_validator
from pydantic.dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from epcomm_testlib import check, load_library  # noqa: E402

FORBID = ConfigDict(extra="forbid")
_NUMACTL_CPUSET_PATTERN = re.compile(r"^\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*$")

All2AllBackend = Literal[
    "naive",
    "pplx",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "mori_high_throughput",
    "mori_low_latency",
    "moonep",
    "mori",
    "nixl_ep",
    "allgather_reducescatter",
    "flashinfer_all2allv",
    "flashinfer_nvlink_two_sided",
    "flashinfer_nvlink_one_sided",
    "passthrough",
]
EPLBCommunicatorBackend = Literal[
    "torch_nccl", "torch_gloo", "torch_xccl", "nixl", "pynccl", "symm_mem"
]
ExpertPlacementStrategy = Literal["linear", "round_robin"]
EPLBPolicyOption = Literal["default"]


@dataclass(config=FORBID)
class EPLBConfig:
    window_size: int = Field(default=1000, gt=0)
    step_interval: int = Field(default=3000, gt=0)
    num_redundant_experts: int = Field(default=None, ge=0)  # type: ignore[assignment]
    log_balancedness: bool = False
    log_balancedness_interval: int = Field(default=1, gt=0)
    use_async: bool = True
    policy: EPLBPolicyOption = "default"
    communicator: Optional[EPLBCommunicatorBackend] = None
    enable_migration_batching: bool = False


@dataclass(config=FORBID)
class ParallelConfig:
    pipeline_parallel_size: int = Field(default=1, ge=1)
    tensor_parallel_size: int = Field(default=1, ge=1)
    prefill_context_parallel_size: int = Field(default=1, ge=1)
    data_parallel_size: int = Field(default=1, ge=1)
    data_parallel_external_lb: bool = False
    data_parallel_hybrid_lb: bool = False
    enable_expert_parallel: bool = False
    enable_eplb: bool = False
    eplb_config: EPLBConfig = Field(default_factory=EPLBConfig)
    expert_placement_strategy: ExpertPlacementStrategy = "linear"
    all2all_backend: All2AllBackend = "allgather_reducescatter"
    mori_ep_v2: Optional[bool] = None
    enable_elastic_ep: bool = False
    enable_dbo: bool = False
    numa_bind: Optional[bool] = None
    numa_bind_nodes: Optional[list[int]] = None
    numa_bind_cpus: Optional[list[str]] = None
    enable_fault_tolerance: bool = False

    # vLLM v0.34.0's field validators, verbatim (pydantic wraps their ValueError).
    @field_validator("numa_bind_nodes")
    @classmethod
    def _validate_numa_bind_nodes(cls, value):
        if value is None:
            return None
        if not value:
            raise ValueError("numa_bind_nodes must not be empty.")
        if any(node < 0 for node in value):
            raise ValueError("numa_bind_nodes must contain non-negative integers.")
        return value

    @field_validator("numa_bind_cpus")
    @classmethod
    def _validate_numa_bind_cpus(cls, value):
        if value is None:
            return None
        if not value:
            raise ValueError("numa_bind_cpus must not be empty.")

        for cpuset in value:
            if not cpuset:
                raise ValueError("numa_bind_cpus entries must not be empty.")
            if not _NUMACTL_CPUSET_PATTERN.fullmatch(cpuset):
                raise ValueError(
                    "numa_bind_cpus entries must use numactl CPU list syntax, "
                    "for example '0-3' or '0,2,4-7'."
                )
            for part in cpuset.split(","):
                if "-" not in part:
                    continue
                start_str, end_str = part.split("-", 1)
                if int(start_str) > int(end_str):
                    raise ValueError(
                        f"numa_bind_cpus ranges must be ascending, but got '{cpuset}'."
                    )
        return value


@dataclass(config=FORBID)
class EpcommOptions:
    """epcomm's own keys (src/select/config.rs EPCOMM_KEYS), validated before ParallelConfig."""

    vllm_version: str = "0.34.0"
    platform: Literal["cuda", "rocm", "cpu", "xpu"] = "cuda"
    num_experts: Optional[int] = Field(default=None, gt=0)
    nixl_available: Optional[bool] = None
    nccl_available: Optional[bool] = None
    enable_lora: bool = False
    draft_model_is_moe: bool = False


EPCOMM_KEYS = [f.name for f in EpcommOptions.__dataclass_fields__.values()]

LONG = "x" * 80

# Each configuration is invalid for pydantic: field types, bounds, lax coercions that fail,
# literals, nested eplb_config, several errors at once, unknown keys, long values.
BAD = [
    {"data_parallel_size": 0},
    {"tensor_parallel_size": -1},
    {"pipeline_parallel_size": 0},
    {"prefill_context_parallel_size": 0},
    {"data_parallel_size": 1.5},
    {"data_parallel_size": "a"},
    {"data_parallel_size": "1e3"},
    {"data_parallel_size": "5."},
    {"data_parallel_size": "1__0"},
    {"data_parallel_size": ""},
    {"data_parallel_size": None},
    {"data_parallel_size": [1, 2]},
    {"data_parallel_size": {"b": 1, "a": 2}},
    {"data_parallel_size": False},
    {"data_parallel_size": "-5"},
    {"data_parallel_size": 1e30},
    {"data_parallel_size": 9.3e18},
    {"data_parallel_size": -0.0},
    {"data_parallel_size": "1" * 4301},
    {"data_parallel_size": 2.5e-7},
    {"enable_eplb": "maybe"},
    {"enable_eplb": 2},
    {"enable_eplb": 1.5},
    {"enable_eplb": 2.0},
    {"enable_eplb": None},
    {"enable_eplb": " true"},
    {"enable_eplb": "00"},
    {"enable_dbo": []},
    {"enable_fault_tolerance": {}},
    {"data_parallel_external_lb": "nope"},
    {"all2all_backend": "deepep"},
    {"all2all_backend": 3},
    {"all2all_backend": None},
    {"all2all_backend": LONG},
    {"all2all_backend": "it's"},
    {"all2all_backend": "it's \"quoted\""},
    {"all2all_backend": "tab\tnew\nline\\ \x00\x7f\xa0\u00e9\u200b\U0001f600"},
    {"all2all_backend": "\u00e9" * 40},
    {"all2all_backend": "a" * 23 + "\u20ac" * 20},
    {"all2all_backend": ["abc"] * 20},
    {"all2all_backend": {"k": "v" * 100}},
    {"all2all_backend": "DeepEP_Low_Latency"},
    {"eplb_config": {"window_size": 0}},
    {"eplb_config": {"step_interval": -3}},
    {"eplb_config": {"num_redundant_experts": -1}},
    {"eplb_config": {"num_redundant_experts": None}},
    {"expert_placement_strategy": "random"},
    {"mori_ep_v2": "sometimes"},
    {"numa_bind": "maybe"},
    {"numa_bind_nodes": []},
    {"numa_bind_nodes": [0, -1]},
    {"numa_bind_nodes": "0"},
    {"numa_bind_nodes": [0, "x", None]},
    {"numa_bind_nodes": {"a": 1}},
    {"numa_bind_cpus": []},
    {"numa_bind_cpus": ["0-3", ""]},
    {"numa_bind_cpus": ["0-3", "3-1"]},
    {"numa_bind_cpus": ["0,2,4-7", "1-"]},
    {"numa_bind_cpus": ["a"]},
    {"numa_bind_cpus": [1]},
    {"numa_bind_cpus": ["10-9"]},
    {"numa_bind_cpus": ["0-3", "010-9"]},
    {"numa_bind_nodes": [], "numa_bind_cpus": ["x"], "numa_bind": 3},
    {"draft_model_is_moe": 2},
    {"eplb_config": {"log_balancedness_interval": 0, "log_balancedness": True}},
    {"eplb_config": {"policy": "custom"}},
    {"eplb_config": {"communicator": "gloo"}},
    {"eplb_config": {"communicator": 5}},
    {"eplb_config": {"use_async": "sometimes"}},
    {"eplb_config": {"enable_migration_batching": 3}},
    {"eplb_config": {"windowsize": 10}},
    {"eplb_config": []},
    {"eplb_config": "x"},
    {"eplb_config": None},
    {"eplb_config": {"window_size": "a" * 100}},
    {"enable_epl": True},
    {"foo": 1, "bar": "x"},
    {"foo": 1, "data_parallel_size": 0},
    {"zzz": 1.0, "eplb_config": {"window_size": 0, "yyy": None}, "tensor_parallel_size": 0},
    {
        "all2all_backend": "x",
        "enable_eplb": "x",
        "data_parallel_size": "x",
        "eplb_config": {"policy": "x", "window_size": "x"},
        "enable_dbo": "x",
    },
    {"platform": "tpu"},
    {"platform": 1},
    {"num_experts": 0},
    {"num_experts": "many"},
    {"nixl_available": "perhaps"},
    {"nccl_available": 7},
    {"enable_lora": "x"},
    {"vllm_version": 33},
    {"platform": "tpu", "num_experts": -1, "data_parallel_size": 0},
]

# Each configuration is valid for pydantic (lax mode coerces it).
GOOD = [
    {"data_parallel_size": True},
    {"data_parallel_size": "5"},
    {"data_parallel_size": " 5 "},
    {"data_parallel_size": "+5"},
    {"data_parallel_size": "5.000"},
    {"data_parallel_size": "1_000"},
    {"data_parallel_size": 2.0},
    {"data_parallel_size": "00012"},
    {"enable_expert_parallel": "yes"},
    {"enable_expert_parallel": "On"},
    {"enable_expert_parallel": "F"},
    {"enable_expert_parallel": 1},
    {"enable_expert_parallel": 0.0},
    {"enable_dbo": "0"},
    {"eplb_config": {"enable_migration_batching": 1}},
    {"mori_ep_v2": None, "expert_placement_strategy": "round_robin"},
    {"numa_bind": None, "numa_bind_nodes": [0, "1", 2.0], "numa_bind_cpus": ["0-3", "0,2,4-7"]},
    {"numa_bind_nodes": None, "numa_bind_cpus": None},
    {"numa_bind_cpus": ["007-10", "2-00010"]},
    {"eplb_config": {"communicator": "symm_mem"}},
    {"eplb_config": {"communicator": None, "use_async": "false"}},
    {"num_experts": "8", "nccl_available": "true", "nixl_available": None},
    {"all2all_backend": "passthrough"},
]


def epcomm_message(config):
    """epcomm's message for `config` (None when the check passes)."""
    text = json.dumps(config).encode()
    size = ctypes.c_size_t(0)
    check(LIB.epcomm_config_check_report(text, None, 0, ctypes.byref(size)))
    buf = ctypes.create_string_buffer(size.value + 1)
    check(LIB.epcomm_config_check_report(text, buf, len(buf), ctypes.byref(size)))
    report = json.loads(buf.value.decode("utf-8"))
    return None if report["ok"] else report["message"]


def pydantic_message(config):
    """str(ValidationError) for `config` as epcomm reads it, or None when pydantic accepts it."""
    options = {k: v for k, v in config.items() if k in EPCOMM_KEYS}
    rest = {k: v for k, v in config.items() if k not in EPCOMM_KEYS}
    try:
        EpcommOptions(**options)
        ParallelConfig(**rest)
    except ValidationError as e:
        return str(e)
    return None


class DifferentialTexts(unittest.TestCase):
    def test_pydantic_version(self):
        self.assertTrue(pydantic.VERSION.startswith("2.13."), pydantic.VERSION)

    def test_bad_configs_give_pydantics_text(self):
        self.assertGreaterEqual(len(BAD), 40)
        for config in BAD:
            with self.subTest(config=config):
                expected = pydantic_message(config)
                self.assertIsNotNone(expected, "the mirror accepts a BAD case")
                self.assertEqual(epcomm_message(config), expected)
        print("%d bad configurations: epcomm's text == pydantic's" % len(BAD), file=sys.stderr)

    def test_lax_coercions_pass(self):
        for config in GOOD:
            with self.subTest(config=config):
                self.assertIsNone(pydantic_message(config))
                message = epcomm_message(config)
                if message is not None:
                    self.assertNotIn("validation error", message)


def _literal_members(node, aliases):
    """The members of a Literal annotation (through module-level aliases), else None."""
    if isinstance(node, ast.Name) and node.id in aliases:
        return _literal_members(aliases[node.id], aliases)
    if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "Literal":
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return tuple(e.value for e in elts)
    return None


def _vllm_fields(tree, cls_name, aliases):
    """{field: (type, literal members, optional, bounds)} of a vLLM class, in order."""
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    out = {}
    for stmt in cls.body:
        if not isinstance(stmt, ast.AnnAssign):
            continue
        ann, optional = stmt.annotation, False
        if isinstance(ann, ast.BinOp) and getattr(ann.right, "value", 0) is None:
            ann, optional = ann.left, True
        members = _literal_members(ann, aliases)
        kind = "literal" if members else ast.unparse(ann)
        bounds = {}
        if isinstance(stmt.value, ast.Call) and getattr(stmt.value.func, "id", "") == "Field":
            bounds = {
                k.arg: ast.literal_eval(k.value)
                for k in stmt.value.keywords
                if k.arg in ("gt", "ge", "lt", "le")
            }
        out[stmt.target.id] = (kind, members, optional, bounds)
    return out


def _mirror_fields(cls):
    out = {}
    for name, info in cls.__pydantic_fields__.items():
        ann, optional = info.annotation, False
        args = typing.get_args(ann)
        if type(None) in args:
            ann, optional = next(a for a in args if a is not type(None)), True
        if typing.get_origin(ann) is Literal:
            kind, members = "literal", typing.get_args(ann)
        elif typing.get_origin(ann) is list:
            kind, members = "list[%s]" % typing.get_args(ann)[0].__name__, None
        else:
            kind, members = ann.__name__, None
        bounds = {}
        for m in info.metadata:
            for attr, typ in (("gt", annotated_types.Gt), ("ge", annotated_types.Ge)):
                if isinstance(m, typ):
                    bounds[attr] = getattr(m, attr)
        out[name] = (kind, members, optional, bounds)
    return out


class MirrorMatchesVllm(unittest.TestCase):
    def test_declarations_equal_vllms(self):
        src = os.environ.get("EPCOMM_VLLM_SRC")
        if not src:
            self.skipTest("EPCOMM_VLLM_SRC is not set")
        path = os.path.join(src, "vllm", "config", "parallel.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        aliases = {
            n.targets[0].id: n.value
            for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
        }
        for mirror in (EPLBConfig, ParallelConfig):
            vllm = _vllm_fields(tree, mirror.__name__, aliases)
            mine = _mirror_fields(mirror)
            ordered = [name for name in vllm if name in mine]
            with self.subTest(cls=mirror.__name__):
                self.assertEqual(ordered, list(mine), "declaration order")
                for name, decl in mine.items():
                    self.assertEqual(decl, vllm[name], name)
        print("mirror == %s (ParallelConfig, EPLBConfig)" % path, file=sys.stderr)


def _signatures():
    sz = ctypes.c_size_t
    return {
        "epcomm_config_check_report": (
            ctypes.c_int32,
            [ctypes.c_char_p, ctypes.c_char_p, sz, ctypes.POINTER(sz)],
        ),
    }


LIB = load_library(_signatures())

if __name__ == "__main__":
    unittest.main()
