"""MoE dispatch/combine managers for vLLM's all2all backend names."""

from __future__ import annotations

import ctypes
from typing import Any, Dict

from ._handle import Handle
from ._lib import DispatchOutput, MoeConfig, Tensor, load_library, vp
from ._dlpack import Buffer
from ._tensor import Arg, dtype_struct, to_numpy
from .errors import check
from .group import Group

# The dispatch outputs every layout returns (empty where its contract has none), as the C
# struct lists them.
OUTPUT_TENSORS = tuple(name for name, kind in DispatchOutput._fields_ if kind is Tensor)


class All2All(Handle):
    """A MoE dispatch/combine manager for a vLLM all2all backend name over ``group``. Dtypes
    are names ("float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16", ...), torch dtypes or
    numpy dtypes. A context manager; ``close()`` may be called any number of times."""

    _DESTROY = "epcomm_all2all_destroy"

    def __init__(
        self,
        group: Group,
        backend: str,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        dtype: Any = "float32",
        expert_dtype: Any = None,
        out_dtype: Any = None,
        max_tokens_per_rank: int = 0,
        num_redundant_experts: int = 0,
        apply_router_weight_on_input: bool = False,
    ):
        lib = load_library()
        self._h = vp()
        cfg = MoeConfig()
        check(lib.epcomm_moe_config_init(ctypes.byref(cfg)))
        cfg.num_experts, cfg.top_k, cfg.hidden_size = num_experts, top_k, hidden_size
        cfg.num_redundant_experts = num_redundant_experts
        cfg.hidden_dtype = dtype_struct(dtype)
        cfg.expert_dtype = dtype_struct(expert_dtype or dtype)
        cfg.out_dtype = dtype_struct(out_dtype or expert_dtype or dtype)
        cfg.max_tokens_per_rank = max_tokens_per_rank
        cfg.apply_router_weight_on_input = apply_router_weight_on_input
        h = vp()
        group.check(
            lib.epcomm_all2all_create(
                group.handle, backend.encode(), ctypes.byref(cfg), ctypes.byref(h)
            )
        )
        self._h = h
        self._group = group  # the group must outlive the manager

    def dispatch(
        self, hidden: Any, topk_ids: Any, topk_weights: Any, views: bool = True
    ) -> Dict[str, Any]:
        """Dispatches this rank's tokens (collective); returns a dict of the layout's outputs,
        with "layout" and "received_rows": ``Buffer``s over the manager's memory, valid until
        the next dispatch or close (``torch.from_dlpack``, ``numpy.from_dlpack`` and
        ``numpy.asarray`` view them without a copy), or with ``views=False`` numpy copies."""
        lib = load_library()
        out = DispatchOutput()
        try:
            args = [
                Arg(hidden, "hidden"),
                Arg(topk_ids, "topk_ids"),
                Arg(topk_weights, "topk_weights"),
            ]
        except (TypeError, ValueError):
            # The peers are already in this dispatch: a call the library rejects (no tensors)
            # tells them at once instead of leaving them to time out.
            lib.epcomm_all2all_dispatch(self._h, None, None, None, None, 0, ctypes.byref(out))
            raise
        self._group.check(
            lib.epcomm_all2all_dispatch(
                self._h, args[0].ptr, args[1].ptr, args[2].ptr, None, 0, ctypes.byref(out)
            )
        )
        wrap = (lambda t: Buffer(t, self)) if views else to_numpy
        result: Dict[str, Any] = {name: wrap(getattr(out, name)) for name in OUTPUT_TENSORS}
        result["layout"] = out.layout
        result["received_rows"] = out.received_rows
        return result

    def combine(self, expert_output: Any, out: Any) -> Any:
        """Combines expert outputs (the dispatch output's shape) into `out` ([T, hidden]), in
        place: any writable numpy array (C- or Fortran-order, strided, either byte order) or a
        writable, contiguous __dlpack__ tensor. A read-only `out` is a ValueError on this rank
        and the peers' combine fails at once ("rank R rejected its input")."""
        lib = load_library()
        try:
            a, o = Arg(expert_output, "expert_output"), Arg(out, "out", output=True)
        except (TypeError, ValueError):
            # As in dispatch: let the library reject the call so the peers learn of it at once.
            lib.epcomm_all2all_combine(self._h, None, None)
            raise
        self._group.check(lib.epcomm_all2all_combine(self._h, a.ptr, o.ptr))
        o.finish()
        return out
