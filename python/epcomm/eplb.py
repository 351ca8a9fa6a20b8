"""EPLB: vLLM's default rebalancing policy and moving expert weights between ranks."""

from __future__ import annotations

import ctypes
import json
from typing import Any, Dict, List, Optional, Sequence

from ._handle import Handle
from ._lib import DEVICE_CPU, EplbSelectRequest, EplbSummary, Tensor, load_library, vp
from ._tensor import Arg
from .errors import InvalidArgumentError, check
from .group import Group


def eplb_rebalance(
    weight: Sequence[Sequence[float]],
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old_phy2log: Optional[Sequence[Sequence[int]]] = None,
) -> List[List[int]]:
    """vLLM's default EPLB policy: weight [layers, logical] → phy2log [layers, num_replicas]."""
    rows = [list(map(float, r)) for r in weight]
    layers, logical = len(rows), len(rows[0])
    w = (ctypes.c_float * (layers * logical))(*[x for r in rows for x in r])
    out = (ctypes.c_int64 * (layers * num_replicas))()
    old = None
    if old_phy2log is not None:
        flat = [int(x) for r in old_phy2log for x in r]
        old = (ctypes.c_int64 * (layers * num_replicas))(*flat)
    check(
        load_library().epcomm_eplb_rebalance(
            w, layers, logical, num_replicas, num_groups, num_nodes, num_ranks, old, out
        )
    )
    return [list(out[i * num_replicas : (i + 1) * num_replicas]) for i in range(layers)]


def _maps(maps: Sequence[Sequence[int]], what: str) -> "tuple[Any, int, int]":
    """A [layers, slots] map as a C int64 array, with its layers and slots."""
    rows = [[int(x) for x in r] for r in maps]
    slots = len(rows[0]) if rows else 0
    if any(len(r) != slots for r in rows):
        raise InvalidArgumentError(f"{what}: every layer must have {slots} slots", 2)
    flat = [x for r in rows for x in r]
    return (ctypes.c_int64 * max(len(flat), 1))(*flat), len(rows), slots


class EplbCommunicator(Handle):
    """vLLM's EPLB communicator over ``group``, chosen by vLLM's rules (``communicator``: a
    name such as "torch_gloo", or None for automatic selection) for CPU weights. A context
    manager; ``close()`` may be called any number of times."""

    _DESTROY = "epcomm_eplb_communicator_destroy"

    def __init__(self, group: Group, communicator: Optional[str] = None, elastic: bool = False):
        self._h = vp()
        req = EplbSelectRequest()
        req.struct_size = ctypes.sizeof(EplbSelectRequest)
        req.communicator = communicator.encode() if communicator else None
        req.elastic = elastic
        req.device_type = DEVICE_CPU
        h = vp()
        group.check(
            load_library().epcomm_eplb_communicator_create(
                group.handle, ctypes.byref(req), ctypes.byref(h)
            )
        )
        self._h, self._group = h, group
        self._pending: List[Any] = []  # queued tensors, kept alive until execute()

    def _queue(self, fn_name: str, tensors: Sequence[Any], peer: int, expert: int,
               output: bool) -> None:
        args = [Arg(t, f"tensors[{i}]", output=output) for i, t in enumerate(tensors)]
        if any(a.copy_into is not None for a in args):
            raise InvalidArgumentError("tensors must be C-contiguous in native byte order", 2)
        c = (Tensor * max(len(args), 1))(*[a.ptr.contents for a in args])
        check(getattr(load_library(), fn_name)(self._h, c, len(args), peer, expert))
        # The library reads and writes these tensors' memory at execute().
        self._pending.append((args, c))

    def add_send(self, tensors: Sequence[Any], dst_rank: int, expert_id: int) -> None:
        """Queues sending one expert's rows (one tensor per weight tensor; numpy arrays or
        contiguous CPU torch tensors) to group rank ``dst_rank``; they must stay unchanged until
        ``execute()``. Sends and receives pair by order per pair of ranks."""
        self._queue("epcomm_eplb_communicator_add_send", tensors, dst_rank, expert_id, False)

    def add_recv(self, tensors: Sequence[Any], src_rank: int, expert_id: int) -> None:
        """Queues receiving one expert's rows from group rank ``src_rank`` into ``tensors``
        (writable, contiguous), filled in place by ``execute()``."""
        self._queue("epcomm_eplb_communicator_add_recv", tensors, src_rank, expert_id, True)

    def execute(self) -> None:
        """Runs every queued send and receive (collective: every rank of the group calls it)
        and clears the queue, also on failure."""
        try:
            self._group.check(load_library().epcomm_eplb_communicator_execute(self._h))
        finally:
            self._pending.clear()

    def rearrange(
        self,
        old_phy2log: Sequence[Sequence[int]],
        new_phy2log: Sequence[Sequence[int]],
        weights: Sequence[Sequence[Any]],
        rank_mapping: Optional[Sequence[int]] = None,
    ) -> Dict[str, int]:
        """Moves every layer's expert weights from the old to the new placement (collective).
        ``weights[layer]`` lists that layer's writable weight tensors (numpy arrays or
        contiguous CPU torch tensors), this rank's local experts along dimension 0; they are
        updated in place. Returns the summary (layers_changed, rows_sent, rows_received,
        rows_copied_locally)."""
        old, layers, old_slots = _maps(old_phy2log, "old_phy2log")
        new, new_layers, new_slots = _maps(new_phy2log, "new_phy2log")
        if new_layers != layers or len(weights) != layers:
            raise InvalidArgumentError(
                f"old_phy2log has {layers} layers, new_phy2log {new_layers}, weights "
                f"{len(weights)}; expected the same number",
                2,
            )
        per_layer = len(weights[0]) if layers else 0
        args = [Arg(t, f"weights[{l}][{i}]", output=True) for l, ws in enumerate(weights)
                for i, t in enumerate(ws)]
        if any(a.copy_into is not None for a in args):
            raise InvalidArgumentError("weights must be C-contiguous in native byte order", 2)
        tensors = (Tensor * max(len(args), 1))(*[a.ptr.contents for a in args])
        mapping = None
        if rank_mapping is not None:
            mapping = (ctypes.c_int64 * len(rank_mapping))(*[int(r) for r in rank_mapping])
        summary = EplbSummary()
        self._group.check(
            load_library().epcomm_eplb_rearrange(
                self._h, old, new, layers, old_slots, new_slots, tensors, per_layer,
                mapping, len(rank_mapping or ()), ctypes.byref(summary),
            )
        )
        return {name: getattr(summary, name) for name, _ in EplbSummary._fields_}


class EplbState(Handle):
    """vLLM's EPLB load statistics for ``num_layers`` MoE layers of ``num_physical`` experts:
    record each step's load, end the step, and read the window's load per logical expert (for
    ``eplb_rebalance``). ``eplb_config`` is vLLM's EPLBConfig (a dict or JSON; None: vLLM's
    defaults); ``model_name`` labels vLLM's log lines. A context manager; ``close()`` may be called any number of times."""

    _DESTROY = "epcomm_eplb_state_destroy"

    def __init__(self, num_layers: int, num_physical: int, eplb_config: Any = None,
                 model_name: str = ""):
        self._h = vp()
        text = None
        if eplb_config is not None:
            text = (eplb_config if isinstance(eplb_config, str) else json.dumps(eplb_config))
        h = vp()
        check(load_library().epcomm_eplb_state_create(
            text.encode() if text is not None else None,
            model_name.encode(),
            num_layers, num_physical, ctypes.byref(h),
        ))
        self._h = h
        self.num_layers, self.num_physical = num_layers, num_physical

    def record(self, layer: int, topk_ids: Any) -> None:
        """Adds one token per valid id of ``topk_ids`` (int32/int64, -1 ignored) to ``layer``."""
        check(load_library().epcomm_eplb_state_record(self._h, layer, Arg(topk_ids, "topk_ids").ptr))

    def record_dispatch(self, layer: int, a2a: Any) -> None:
        """Adds the load of ``a2a``'s last dispatch to ``layer`` (no second pass over the ids)."""
        check(load_library().epcomm_eplb_state_record_dispatch(self._h, layer, a2a._h))

    def step(self, group: Group, is_dummy: bool = False, log_stats: bool = False) -> bool:
        """Ends a forward step (collective when logging balancedness); True when a
        rearrangement is due."""
        due = ctypes.c_bool()
        group.check(load_library().epcomm_eplb_state_step(
            self._h, group.handle, is_dummy, log_stats, ctypes.byref(due)))
        return due.value

    def logical_load(self, group: Group, phy2log: Sequence[Sequence[int]],
                     num_logical: int) -> List[List[float]]:
        """The window's load per logical expert, summed over the window and every rank
        (collective): [num_layers, num_logical], ready for ``eplb_rebalance``."""
        maps, layers, slots = _maps(phy2log, "phy2log")
        load = (ctypes.c_float * max(layers * num_logical, 1))()
        group.check(load_library().epcomm_eplb_state_logical_load(
            self._h, group.handle, maps, layers, slots, num_logical, load))
        return [list(load[l * num_logical:(l + 1) * num_logical]) for l in range(layers)]
