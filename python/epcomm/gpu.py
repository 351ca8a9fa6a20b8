"""The GPU entry points: dispatch/combine of CUDA tensors over NCCL (epcomm_gpu_all2all_*),
and the probes of what this build and machine offer. In a library built without the ``cuda``
and ``nccl`` features (the default build) every call raises the library's own
EPCOMM_ERROR_UNAVAILABLE error (an epcomm.Error and a RuntimeError) saying so."""

from __future__ import annotations

import ctypes
from typing import Any, Dict, Optional, Sequence

from ._dlpack import Buffer
from ._handle import Handle, in_flight
from ._lib import DispatchOutput, GpuStats, Tensor, i32, load_library, vp
from ._tensor import Arg
from .all2all import OUTPUT_TENSORS, _Config
from .errors import InvalidArgumentError, check
from .layout import layout_name

#: NCCL unique id bytes (EPCOMM_NCCL_UNIQUE_ID_BYTES).
NCCL_UNIQUE_ID_BYTES = 128
#: EPCOMM_GPU_MODE_*: exact sizes with one host sync per dispatch, or fixed capacity
#: (CUDA-graph capturable; EXPERT_MAJOR backends only).
MODES = {"counts": 0, "capacity": 1}


def nccl_version() -> int:
    """The runtime NCCL version code (22809 for 2.28.9); unavailable without NCCL."""
    v = i32()
    check(load_library().epcomm_nccl_version(ctypes.byref(v)))
    return v.value


def cuda_check() -> None:
    """Returns when this build can use the CUDA driver; else the unavailable error and why."""
    check(load_library().epcomm_cuda_check())


def nixl_available() -> bool:
    """Whether NIXL (libnixl.so) can be loaded in this process."""
    return bool(load_library().epcomm_nixl_available())


def nccl_unique_id() -> bytes:
    """A new NCCL unique id (128 bytes) for ``GpuAll2All``: made on one rank, passed to the
    others by the host's means."""
    out = (ctypes.c_uint8 * NCCL_UNIQUE_ID_BYTES)()
    check(load_library().epcomm_nccl_unique_id(out))
    return bytes(out)


def _stream(stream: Any) -> Optional[int]:
    """A cudaStream_t from None (the legacy default stream), an int, or a torch.cuda.Stream."""
    if stream is None or isinstance(stream, int):
        return stream or None
    return int(stream.cuda_stream)


def _mode(mode: str) -> int:
    if mode not in MODES:
        raise InvalidArgumentError(
            f"unknown mode {mode!r}; expected one of {', '.join(MODES)}", 2)
    return MODES[mode]


class GpuAll2All(Handle):
    """A GPU all2all manager for a vLLM backend name on CUDA device ``device`` with its own
    NCCL communicator, made from ``unique_id`` (``nccl_unique_id()`` on one rank; collective:
    returns once all ``world_size`` ranks joined), or with ``GpuAll2All.from_comm`` on the
    host's ``ncclComm_t``. Tensors are CUDA tensors (torch); outputs are CUDA ``Buffer``s
    (``torch.from_dlpack``), valid until the next dispatch. A context manager."""

    _DESTROY = "epcomm_gpu_all2all_destroy"
    _WHAT = "GPU all2all manager"

    def __init__(self, backend: str, num_experts: int, top_k: int, hidden_size: int, *,
                 unique_id: bytes, rank: int, world_size: int, device: int = 0,
                 mode: str = "counts", dtype: Any = "bfloat16", expert_dtype: Any = None,
                 out_dtype: Any = None, max_tokens_per_rank: int = 0,
                 num_redundant_experts: int = 0, extra_row_bytes: Sequence[int] = ()):
        self._h = vp()
        raw = bytes(unique_id)
        if len(raw) != NCCL_UNIQUE_ID_BYTES:
            raise InvalidArgumentError(
                f"unique_id has {len(raw)} bytes; expected {NCCL_UNIQUE_ID_BYTES}", 2)
        cfg = _Config(num_experts, top_k, hidden_size, dtype, expert_dtype, out_dtype,
                      max_tokens_per_rank, num_redundant_experts, False, extra_row_bytes)
        uid = (ctypes.c_uint8 * NCCL_UNIQUE_ID_BYTES)(*raw)
        h = vp()
        check(load_library().epcomm_gpu_all2all_create(
            backend.encode(), ctypes.byref(cfg.struct), uid, rank, world_size, device,
            _mode(mode), ctypes.byref(h)))
        self._h = h

    @classmethod
    def from_comm(cls, backend: str, num_experts: int, top_k: int, hidden_size: int, *,
                  nccl_comm: int, device: int = 0, mode: str = "counts",
                  dtype: Any = "bfloat16", expert_dtype: Any = None, out_dtype: Any = None,
                  max_tokens_per_rank: int = 0, num_redundant_experts: int = 0,
                  extra_row_bytes: Sequence[int] = ()) -> "GpuAll2All":
        """A manager on the host's NCCL communicator (an ``ncclComm_t`` address, borrowed:
        it must outlive the manager and come from the libnccl epcomm loads)."""
        a = cls.__new__(cls)
        a._h = vp()
        cfg = _Config(num_experts, top_k, hidden_size, dtype, expert_dtype, out_dtype,
                      max_tokens_per_rank, num_redundant_experts, False, extra_row_bytes)
        h = vp()
        check(load_library().epcomm_gpu_all2all_create_from_comm(
            backend.encode(), ctypes.byref(cfg.struct), nccl_comm, device, _mode(mode),
            ctypes.byref(h)))
        a._h = h
        return a

    def dispatch(self, hidden: Any, topk_ids: Any, topk_weights: Any,
                 extras: Optional[Sequence[Any]] = None, stream: Any = None) -> Dict[str, Any]:
        """Dispatches this rank's tokens on ``stream`` (collective); the outputs as
        ``All2All.dispatch``'s, CUDA Buffers ("received_rows" is -1 in capacity mode). Any
        exception while the arguments are prepared is raised after the library is told (no
        tensors), so the peers' dispatch fails at once."""
        lib = load_library()
        out = DispatchOutput()
        with in_flight(self) as h:
            try:
                s = _stream(stream)
                args = [Arg(hidden, "hidden"), Arg(topk_ids, "topk_ids"),
                        Arg(topk_weights, "topk_weights")]
                ex = [Arg(e, f"extras[{i}]") for i, e in enumerate(extras or ())]
                c_ex = (Tensor * max(len(ex), 1))(*[a.ptr.contents for a in ex])
            except BaseException:
                lib.epcomm_gpu_all2all_dispatch(h, None, None, None, None, None, 0,
                                                ctypes.byref(out))
                raise
            check(lib.epcomm_gpu_all2all_dispatch(
                h, s, args[0].ptr, args[1].ptr, args[2].ptr, c_ex if ex else None, len(ex),
                ctypes.byref(out)))
        result: Dict[str, Any] = {n: Buffer(getattr(out, n), self) for n in OUTPUT_TENSORS}
        result["layout"], result["received_rows"] = layout_name(out.layout), out.received_rows
        views = ctypes.cast(out.extras, ctypes.POINTER(Tensor))
        result["extras"] = [Buffer(views[i], self) for i in range(out.num_extras)]
        return result

    def combine(self, expert_output: Any, out: Any, stream: Any = None) -> Any:
        """Combines expert outputs into ``out`` (CUDA, [T, hidden], contiguous) on ``stream``
        (collective); returns ``out``."""
        a, o = Arg(expert_output, "expert_output"), Arg(out, "out", output=True)
        with in_flight(self) as h:
            check(load_library().epcomm_gpu_all2all_combine(h, _stream(stream), a.ptr, o.ptr))
        return out

    def pool_stats(self) -> Dict[str, int]:
        """The handle's device pool (epcomm_gpu_all2all_get_stats): "pool_buffers",
        "pool_bytes", "pool_reserved_bytes" (allocated at creation) and "pool_reallocations"
        (allocations by calls after creation; 0 while every call stays within
        max_tokens_per_rank)."""
        st = GpuStats()
        st.struct_size = ctypes.sizeof(GpuStats)
        with in_flight(self) as h:
            check(load_library().epcomm_gpu_all2all_get_stats(h, ctypes.byref(st)))
        return {name: getattr(st, name) for name, _ in GpuStats._fields_[1:]}

    def check_error(self, stream: Any = None) -> None:
        """Synchronises ``stream`` and raises the device error of the last dispatch/combine
        (bad topk_ids, a full bucket), if any: capacity mode's way to learn of bad input."""
        with in_flight(self) as h:
            check(load_library().epcomm_gpu_all2all_check_error(h, _stream(stream)))
