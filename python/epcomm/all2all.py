"""MoE dispatch/combine managers for vLLM's all2all backend names."""

from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Optional, Sequence

from ._dlpack import _DTYPE_NAMES, Buffer
from ._handle import Handle, in_flight
from ._lib import All2AllStats, DispatchOutput, MoeConfig, Tensor, load_library, vp
from ._tensor import Arg, dtype_struct
from .errors import check
from .group import Group
from .layout import layout_name

# The dispatch outputs every layout returns (empty where its contract has none), as the C
# struct lists them.
OUTPUT_TENSORS = tuple(f[0] for f in DispatchOutput._fields_ if f[1] is Tensor)
_STATS_ARRAYS = tuple(f[0] for f in All2AllStats._fields_ if f[0] not in (
    "world_size", "dispatch_seconds", "combine_seconds"))


class _Config:
    """An epcomm_moe_config and the extra-row array it points into."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, dtype: Any,
                 expert_dtype: Any, out_dtype: Any, max_tokens_per_rank: int,
                 num_redundant_experts: int, apply_router_weight_on_input: bool,
                 extra_row_bytes: Sequence[int]):
        cfg = MoeConfig()
        check(load_library().epcomm_moe_config_init(ctypes.byref(cfg)))
        cfg.num_experts, cfg.top_k, cfg.hidden_size = num_experts, top_k, hidden_size
        cfg.num_redundant_experts = num_redundant_experts
        cfg.hidden_dtype = dtype_struct(dtype)
        cfg.expert_dtype = dtype_struct(expert_dtype or dtype)
        cfg.out_dtype = dtype_struct(out_dtype or expert_dtype or dtype)
        cfg.max_tokens_per_rank = max_tokens_per_rank
        cfg.apply_router_weight_on_input = apply_router_weight_on_input
        self.extras = (ctypes.c_int64 * max(len(extra_row_bytes), 1))(*extra_row_bytes)
        cfg.num_extras = len(extra_row_bytes)
        if extra_row_bytes:
            cfg.extra_row_bytes = ctypes.cast(self.extras, ctypes.POINTER(ctypes.c_int64))
        self.struct = cfg


def buffer_bytes(backend: str, num_experts: int, top_k: int, hidden_size: int,
                 world_size: int, tokens_per_rank: int, dtype: Any = "float32",
                 expert_dtype: Any = None, out_dtype: Any = None, max_tokens_per_rank: int = 0,
                 num_redundant_experts: int = 0, extra_row_bytes: Sequence[int] = ()) -> int:
    """Bytes ``backend``'s dispatch buffers and combine accumulator need for
    ``tokens_per_rank`` tokens on each of ``world_size`` ranks, in the worst case, before
    anything is allocated (epcomm_all2all_buffer_bytes)."""
    cfg = _Config(num_experts, top_k, hidden_size, dtype, expert_dtype, out_dtype,
                  max_tokens_per_rank, num_redundant_experts, False, extra_row_bytes)
    n = ctypes.c_uint64()
    check(load_library().epcomm_all2all_buffer_bytes(
        backend.encode(), ctypes.byref(cfg.struct), world_size, tokens_per_rank,
        ctypes.byref(n)))
    return n.value


# epcomm_moe_config.dispatch_fp8 values (EPCOMM_DISPATCH_FP8_*) by the names dispatch_fp8=
# and dispatch(..., fp8=) accept.
_FP8_MODES = {False: 0, "off": 0, True: 1, "e4m3": 1, "ue8m0": 2, "e4m3_ue8m0": 2}


def _fp8_mode(v: Any) -> int:
    try:
        return _FP8_MODES[v]
    except (KeyError, TypeError):
        raise ValueError(
            f"fp8 must be False/'off', True/'e4m3' or 'ue8m0'/'e4m3_ue8m0', not {v!r}") from None


class All2All(Handle):
    """A MoE dispatch/combine manager for a vLLM all2all backend name over ``group``. Dtypes
    are names ("float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16", ...), torch dtypes or
    numpy dtypes. A context manager; ``close()`` may be called any number of times (refused
    while a call on the manager is in flight on another thread); arrays and tensors made from
    its Buffers keep its memory alive after it (the group's ``close()`` closes it too)."""

    _DESTROY = "epcomm_all2all_destroy"
    _WHAT = "All2All manager"

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
        extra_row_bytes: Sequence[int] = (),
        dispatch_fp8: Any = False,
        enable_fault_tolerance: bool = False,
    ):
        lib = load_library()
        self._h = vp()
        cfg = _Config(num_experts, top_k, hidden_size, dtype, expert_dtype, out_dtype,
                      max_tokens_per_rank, num_redundant_experts,
                      apply_router_weight_on_input, extra_row_bytes)
        # FP8 dispatch: float8_e4m3fn rows, one float32 scale per 128 elements (DeepEP
        # low-latency's use_fp8 format; "ue8m0": power-of-two scales).
        self._fp8 = cfg.struct.dispatch_fp8 = _fp8_mode(dispatch_fp8)
        # vLLM's enable_fault_tolerance (deepep_low_latency, nixl_ep): a failed peer is masked
        # and the survivors go on (query_active_mask, query_fault, clean_buffers).
        cfg.struct.enable_fault_tolerance = bool(enable_fault_tolerance)
        self.world_size = group.size
        h = vp()
        with in_flight(group) as gh:
            group.check(
                lib.epcomm_all2all_create(
                    gh, backend.encode(), ctypes.byref(cfg.struct), ctypes.byref(h)
                )
            )
            self._h = h
            self._group = group  # the group must outlive the manager: its close() closes this
            self._depend_on(group)
        # Dispatches and expert_output_buffer() calls so far: a Buffer of an earlier one views
        # memory the manager may have reused or freed (a grown receive buffer is reallocated).
        self._dispatches = 0
        self._expert_buffers = 0
        self.num_extras = len(extra_row_bytes)
        self._expert = (hidden_size, cfg.struct.expert_dtype)  # expert_output_buffer's rows

    def dispatch(
        self, hidden: Any, topk_ids: Any, topk_weights: Any,
        extras: Optional[Sequence[Any]] = None, views: bool = True, fp8: Any = None,
    ) -> Dict[str, Any]:
        """Dispatches this rank's tokens (collective); returns a dict of the layout's outputs,
        with "layout" (the layout's name, one of ``epcomm.layout.LAYOUTS``, e.g.
        ``epcomm.layout.TOKEN_MAJOR == "TOKEN_MAJOR"``, as ``backend_layout`` returns it),
        "received_rows" and "extras" (one per extra payload, uint8 rows laid out like "hidden"): ``Buffer``s over the manager's memory, valid until the next dispatch or
        close (``torch.from_dlpack``, ``numpy.from_dlpack`` and ``numpy.asarray`` view them
        without a copy), or with ``views=False`` numpy copies. ``extras`` are this rank's
        [T, extra_row_bytes[i]] payloads (any dtype of that many bytes per row).

        With FP8 dispatch (``fp8=True``/"e4m3" or "ue8m0" here, from this call on, or
        ``dispatch_fp8=`` at creation; every rank alike) the rows travel quantised on the
        sending side: "hidden" holds float8_e4m3fn bits as uint8 (``.view(torch.float8_e4m3fn)``)
        and "scales" float32 [rows..., hidden_size/128], value = element x scale.

        Any exception while the arguments are prepared here (a TypeError, torch's BufferError
        for a tensor it cannot export, a KeyboardInterrupt) is raised after the library is told,
        so the peers' dispatch fails at once ("rank R rejected its input") and every rank's next
        dispatch pairs with the others' next one."""
        lib = load_library()
        out = DispatchOutput()
        with in_flight(self, self._group) as h:
            # Whatever is returned from here on views memory this call may replace.
            self._dispatches += 1
            try:
                args = [
                    Arg(hidden, "hidden"),
                    Arg(topk_ids, "topk_ids"),
                    Arg(topk_weights, "topk_weights"),
                ]
                ex = [Arg(e, f"extras[{i}]") for i, e in enumerate(extras or ())]
                c_ex = (Tensor * max(len(ex), 1))(*[a.ptr.contents for a in ex])
                mode = self._fp8 if fp8 is None else _fp8_mode(fp8)
                if mode != self._fp8:
                    check(lib.epcomm_all2all_set_dispatch_fp8(h, mode))
                    self._fp8 = mode
            except BaseException:
                # The peers are already in this dispatch: a call the library rejects (no
                # tensors) fails theirs at once, instead of pairing it with this rank's next
                # dispatch or leaving them to time out.
                self._group._tell_peers(lib.epcomm_all2all_dispatch, h, None, None, None, None, 0,
                                       ctypes.byref(out))
                raise
            self._group.check(
                lib.epcomm_all2all_dispatch(
                    h, args[0].ptr, args[1].ptr, args[2].ptr, c_ex if ex else None, len(ex),
                    ctypes.byref(out),
                )
            )
            return self._outputs(h, out, views)

    def _stale_after(self, counter: str, what: str) -> Any:
        """A Buffer's ``stale`` check: the message once ``counter`` moved on from now."""
        n = getattr(self, counter)

        def stale() -> Any:
            if getattr(self, counter) == n:
                return None
            return (f"this Buffer is {what}; the {self._WHAT} has replaced it since (its memory "
                    "may be reused or freed): copy what you keep before the next call")
        return stale

    def _outputs(self, h: vp, out: DispatchOutput, views: bool) -> Dict[str, Any]:
        stale = self._stale_after("_dispatches", "an output of an earlier dispatch")

        def wrap(t: Tensor) -> Any:
            b = Buffer(t, self, stale)
            return b if views else b.numpy()
        result: Dict[str, Any] = {
            name: wrap(getattr(out, name)) for name in OUTPUT_TENSORS
            if not (self._fp8 and name == "hidden")
        }
        if self._fp8:
            hid = out.hidden
            shape = [hid.shape[i] for i in range(hid.ndim)]
            q = Buffer.view(hid.data, shape, "uint8", self, stale)  # float8_e4m3fn bits
            result["hidden"] = q if views else q.numpy()
            sc = Tensor()
            check(load_library().epcomm_all2all_dispatch_scales(h, ctypes.byref(sc)))
            result["scales"] = wrap(sc)
        result["layout"] = layout_name(out.layout)
        result["received_rows"] = out.received_rows
        extras = ctypes.cast(out.extras, ctypes.POINTER(Tensor))
        result["extras"] = [wrap(extras[i]) for i in range(out.num_extras)]
        return result

    def stats(self) -> Dict[str, Any]:
        """Statistics of the last dispatch and combine: "world_size", per-peer "tokens_sent",
        "tokens_received", "bytes_sent", "bytes_received", "combine_bytes_received" (uint64
        ``Buffer``s, valid until the next call), "dispatch_seconds", "combine_seconds", and
        with fault tolerance "dropped_pairs" / "dropped_pairs_total": this rank's (token,
        expert) pairs routed to masked ranks' experts (sent nowhere), last dispatch / all."""
        st = All2AllStats()
        last, total = ctypes.c_uint64(), ctypes.c_uint64()
        with in_flight(self) as h:
            check(load_library().epcomm_all2all_get_stats(h, ctypes.byref(st)))
            check(load_library().epcomm_all2all_dropped_pairs(
                h, ctypes.byref(last), ctypes.byref(total)))
        n = st.world_size
        result: Dict[str, Any] = {
            name: Buffer.view(ctypes.cast(getattr(st, name), vp).value, (n,), "uint64", self)
            for name in _STATS_ARRAYS
        }
        result.update(world_size=n, dispatch_seconds=st.dispatch_seconds,
                      combine_seconds=st.combine_seconds, dropped_pairs=last.value,
                      dropped_pairs_total=total.value)
        return result

    def query_active_mask(self) -> List[int]:
        """vLLM's ``query_active_mask``: one entry per rank, 0 = live, 1 = masked (a rank that
        died or stalled and that every survivor left out); all 0 without fault tolerance."""
        mask = (ctypes.c_int32 * self.world_size)()
        with in_flight(self, self._group) as h:
            check(load_library().epcomm_all2all_query_active_mask(h, mask, self.world_size))
        return list(mask)

    def query_fault(self) -> bool:
        """vLLM's ``query_fault``: whether the mask changed since the last ``clean_buffers``."""
        fault = ctypes.c_bool()
        with in_flight(self, self._group) as h:
            check(load_library().epcomm_all2all_query_fault(h, ctypes.byref(fault)))
        return fault.value

    def update_mask(self, rank: int, masked: bool = True) -> None:
        """vLLM v0.34.0's ``update_mask`` (this rank only), which vLLM's sentinel calls after
        ``clean_buffers`` to replay a scale-down's dead ranks: sets ``rank``'s entry of the mask
        and of ``query_fault``'s baseline. Replaying a masked rank changes nothing; masking a
        live rank or unmasking a masked one raises (epcomm masks the ranks the group loses;
        rejoining means a new group)."""
        with in_flight(self, self._group) as h:
            check(load_library().epcomm_all2all_update_mask(h, int(rank), bool(masked)))

    def clean_buffers(self) -> None:
        """vLLM's ``clean_buffers``, the recovery point (this rank only): the receive buffers
        are zeroed, the last dispatch is forgotten (views of it are invalid; combine needs a
        new dispatch), and the current mask becomes ``query_fault``'s baseline. Masked ranks
        stay masked."""
        with in_flight(self, self._group) as h:
            self._dispatches += 1  # the dispatch outputs are forgotten
            check(load_library().epcomm_all2all_clean_buffers(h))

    def check_layer(self, top_k: int, num_experts: int) -> None:
        """Declares a MoE layer's top_k and (physical) num_experts: vLLM's AssertionError for
        flashinfer_nvlink_one_sided when they differ from the manager's, else a ValueError."""
        with in_flight(self) as h:
            check(load_library().epcomm_all2all_check_layer(h, top_k, num_experts))

    def expert_output_buffer(self) -> Buffer:
        """The manager's expert-output buffer for the last dispatch ([rows, hidden_size] of
        expert_dtype, in shared memory the manager owns; contents unspecified): write the
        experts' outputs into it (``torch.from_dlpack`` views it) and pass it, or that tensor,
        to ``combine``, whose peers then read it in place (no copy; ``zero_copy_combines``
        counts them). Valid until the next call of this method (which may reallocate it; the
        Buffer then raises) or close. Before a dispatch, or on a group without shared memory,
        an epcomm.Error (a RuntimeError) saying so."""

        data, rows = vp(), ctypes.c_int64()
        with in_flight(self, self._group) as h:
            self._expert_buffers += 1
            check(load_library().epcomm_all2all_expert_output_buffer(
                h, ctypes.byref(data), ctypes.byref(rows)))
        hidden, dt = self._expert
        name = _DTYPE_NAMES[(dt.code, dt.bits)]
        stale = self._stale_after(
            "_expert_buffers", "an expert-output buffer of an earlier expert_output_buffer()")
        return Buffer.view(data.value, (rows.value, hidden), name, self, stale)

    def zero_copy_combines(self) -> int:
        """How many combines read their expert output in place from ``expert_output_buffer``."""

        n = ctypes.c_uint64()
        with in_flight(self) as h:
            check(load_library().epcomm_all2all_zero_copy_combines(h, ctypes.byref(n)))
        return n.value

    def combine(self, expert_output: Any, out: Any) -> Any:
        """Combines expert outputs (the dispatch output's shape) into `out` ([T, hidden] of
        out_dtype) and returns `out`: a writable, contiguous __dlpack__ tensor (a torch tensor)
        is written in place, a writable numpy array of any order or byte order receives the
        result. A read-only, non-contiguous or copied-on-export `out` is a ValueError on this
        rank, a wrong dtype or shape the library's ValueError, and the peers' combine fails at
        once ("rank R rejected its input"); so is any other exception raised while the
        arguments are prepared (torch's BufferError, a KeyboardInterrupt), after the peers are
        told."""
        lib = load_library()
        with in_flight(self, self._group) as h:
            try:
                a, o = Arg(expert_output, "expert_output"), Arg(out, "out", output=True)
            except BaseException:
                # As in dispatch: let the library reject the call so the peers learn of it at
                # once.
                self._group._tell_peers(lib.epcomm_all2all_combine, h, None, None)
                raise
            self._group.check(lib.epcomm_all2all_combine(h, a.ptr, o.ptr))
        o.finish()
        return out
