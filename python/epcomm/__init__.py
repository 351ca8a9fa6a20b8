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
from typing import Any, Dict, Union

from ._dlpack import Buffer
from ._lib import load_library, logger
from ._tensor import dtype_name
from .all2all import All2All
from .eplb import EplbCommunicator, EplbState, eplb_rebalance
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

__all__ = [
    "Error",
    "InvalidArgumentError",
    "EpcommAssertionError",
    "EpcommNotImplementedError",
    "EpcommRuntimeError",
    "EpcommTimeoutError",
    "version",
    "resolve_backend",
    "backends",
    "check_config",
    "config_report",
    "cuda_caps",
    "dtype_name",
    "Group",
    "All2All",
    "Buffer",
    "EplbCommunicator",
    "EplbState",
    "eplb_rebalance",
    "load_library",
    "logger",
]

Config = Union[str, Dict[str, Any]]


def version() -> str:
    """The loaded library's version (epcomm_version)."""
    return load_library().epcomm_version().decode()


# ---- selection and configuration ------------------------------------------------------------


def resolve_backend(name: str) -> str:
    """The canonical all2all backend a vLLM name resolves to (logs vLLM's warnings)."""
    lib = load_library()
    b = ctypes.c_int32()
    _check(lib.epcomm_all2all_backend_resolve(name.encode(), ctypes.byref(b)))
    return lib.epcomm_all2all_backend_name(b.value).decode()


def _json_text(config: Config) -> bytes:
    return (config if isinstance(config, str) else json.dumps(config)).encode()


def config_report(config: Config) -> Dict[str, Any]:
    """Checks a vLLM-style configuration (dict or JSON) and returns epcomm's report (a dict with
    "ok", the resolution or the error, "warnings" and "infos"); never raises for an invalid one."""
    lib = load_library()
    text = _json_text(config)
    n = ctypes.c_size_t()
    _check(lib.epcomm_config_check_report(text, None, 0, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value + 1)
    _check(lib.epcomm_config_check_report(text, buf, n.value + 1, ctypes.byref(n)))
    return json.loads(buf.value.decode())


def check_config(config: Config) -> Dict[str, Any]:
    """Raises vLLM's exception for the first error of a configuration; returns the report."""
    _check(load_library().epcomm_config_check(_json_text(config)))
    return config_report(config)


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
    """The resolution of every all2all name vLLM accepts."""
    names = [
        "naive", "pplx", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
        "mori_high_throughput", "mori_low_latency", "moonep", "nixl_ep",
        "allgather_reducescatter", "flashinfer_all2allv", "flashinfer_nvlink_two_sided",
        "flashinfer_nvlink_one_sided",
    ]  # fmt: skip
    return {n: config_report({"all2all_backend": n}) for n in names}


from . import eplb_algo  # noqa: E402,F401  (vLLM's EPLB policy steps)

# Loaded at import, so a missing library is reported by `import epcomm` itself.
load_library()

#: The loaded library's version (epcomm_version()); ``_lib.PACKAGE_VERSION`` is the package's.
__version__: str = version()
