"""EPLB: vLLM's default rebalancing policy and moving expert weights between ranks."""

from __future__ import annotations

import ctypes
import json
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._dlpack import Buffer
from ._handle import Handle, in_flight
from ._lib import (
    DEVICE_CPU,
    DType,
    EplbSelectRequest,
    EplbSummary,
    PlanView,
    RearrangeOptions,
    Tensor,
    i32,
    i64p,
    load_library,
    vp,
)
from ._tensor import Arg, dtype_struct
from .errors import InvalidArgumentError, check
from .group import Group

#: EPCOMM_PROBE: let the library probe this process for NCCL/NIXL.
PROBE = -1
_DEVICES = {"cpu": 1, "cuda": 2, "rocm": 10, "xpu": 14}


def eplb_rebalance(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old_phy2log: Any = None,
) -> Buffer:
    """vLLM's default EPLB policy: weight [layers, logical] (lists, numpy, torch or a Buffer)
    → phy2log, an int64 Buffer [layers, num_replicas] (``.tolist()`` for lists)."""
    rows = [list(map(float, r)) for r in _rows(weight)]
    layers, logical = len(rows), len(rows[0])
    w = (ctypes.c_float * (layers * logical))(*[x for r in rows for x in r])
    out = (ctypes.c_int64 * (layers * num_replicas))()
    old = None
    if old_phy2log is not None:
        flat = [int(x) for r in _rows(old_phy2log) for x in r]
        old = (ctypes.c_int64 * (layers * num_replicas))(*flat)
    check(
        load_library().epcomm_eplb_rebalance(
            w, layers, logical, num_replicas, num_groups, num_nodes, num_ranks, old, out
        )
    )
    return Buffer.owning(out, (layers, num_replicas), "int64")


def _rows(x: Any) -> Any:
    """Nested lists from lists, numpy arrays, torch tensors or Buffers."""
    return x.tolist() if hasattr(x, "tolist") else x


def logical_maps(phy2log: Any, num_logical: int, max_replicas: int) -> Tuple[Buffer, Buffer]:
    """From physical → logical maps [layers, num_physical] (-1 = unused slot): the replica
    count per logical expert (logcnt [layers, num_logical]) and the logical → physical map
    (log2phy [layers, num_logical, max_replicas], ascending slots, -1 padded), as int64
    Buffers. An expert with more than ``max_replicas`` replicas is a ValueError naming it."""
    maps, layers, physical = _maps(phy2log, "phy2log")
    logcnt = (ctypes.c_int64 * max(layers * num_logical, 1))()
    log2phy = (ctypes.c_int64 * max(layers * num_logical * max_replicas, 1))()
    check(load_library().epcomm_eplb_logical_maps(
        maps, layers, physical, num_logical, max_replicas, logcnt, log2phy))
    return (Buffer.owning(logcnt, (layers, num_logical), "int64"),
            Buffer.owning(log2phy, (layers, num_logical, max_replicas), "int64"))


def min_redundant_experts(num_logical: int, ep_size: int) -> int:
    """The smallest num_redundant_experts that makes num_logical + redundant divisible by
    ep_size."""
    n = ctypes.c_int64()
    check(load_library().epcomm_eplb_min_redundant_experts(num_logical, ep_size,
                                                           ctypes.byref(n)))
    return n.value


def _address(p: Any) -> Optional[int]:
    return ctypes.cast(p, vp).value


class LayerPlan(Handle):
    """One rank's transfer plan for one layer (vLLM's sender/receiver pairing), from the old
    and new physical → logical maps of that layer (the same number of slots each). Its views
    are ``Buffer``s of the plan's memory, valid until ``close()``: ``unchanged`` (uint8
    [local slots], 1 = the slot keeps its expert) and int64 ``local_copies`` [n, 2]
    (destination slot, source slot), ``sends`` [n, 3] (expert, source slot, destination rank),
    ``recvs`` [n, 3] (expert, primary slot, source rank), ``duplicates`` [n, 2] (destination
    slot, primary slot). A context manager."""

    _DESTROY = "epcomm_eplb_layer_plan_destroy"
    _WHAT = "layer plan"

    def __init__(self, old_phy2log: Sequence[int], new_phy2log: Sequence[int],
                 slots_per_rank: int, rank: int):
        self._h = vp()
        old, _, n = _maps([_rows(old_phy2log)], "old_phy2log")
        new, _, m = _maps([_rows(new_phy2log)], "new_phy2log")
        if n != m:
            raise InvalidArgumentError(
                f"old_phy2log has {n} slots, new_phy2log {m}; expected the same number", 2)
        lib = load_library()
        h = vp()
        check(lib.epcomm_eplb_plan_layer(old, new, n, slots_per_rank, rank, ctypes.byref(h)))
        self._h = h
        v = PlanView()
        check(lib.epcomm_eplb_layer_plan_view(h, ctypes.byref(v)))
        self.num_slots: int = v.num_slots
        self.unchanged = Buffer.view(_address(v.unchanged), (v.num_slots,), "uint8", self)
        self.local_copies = self._view(v.local_copies, v.num_local_copies, 2)
        self.sends = self._view(v.sends, v.num_sends, 3)
        self.recvs = self._view(v.recvs, v.num_recvs, 3)
        self.duplicates = self._view(v.duplicates, v.num_duplicates, 2)

    def _view(self, p: Any, rows: int, cols: int) -> Buffer:
        return Buffer.view(_address(p), (rows, cols), "int64", self)


def select_eplb_communicator(communicator: Optional[str] = None, device: str = "cpu",
                             weight_dtypes: Sequence[Any] = (), elastic: bool = False,
                             nccl_available: int = PROBE, nixl_available: int = PROBE) -> str:
    """The EPLB communicator vLLM's ``create_eplb_communicator`` chooses (its rules and
    messages): ``communicator`` is the configured name or None (automatic), ``device`` where
    the weights live ("cpu", "cuda", "rocm", "xpu"), ``weight_dtypes`` the first layer's
    weight dtypes; availability 1/0 or ``PROBE``. Returns the name ("torch_gloo", ...)."""
    if device not in _DEVICES:
        raise InvalidArgumentError(
            f"unknown device {device!r}; expected one of {', '.join(_DEVICES)}", 2)
    dts = (DType * max(len(weight_dtypes), 1))(*[dtype_struct(d) for d in weight_dtypes])
    req = EplbSelectRequest(
        ctypes.sizeof(EplbSelectRequest), communicator.encode() if communicator else None,
        elastic, _DEVICES[device], dts, len(weight_dtypes), nccl_available, nixl_available,
    )
    out = i32()
    lib = load_library()
    check(lib.epcomm_eplb_communicator_select(ctypes.byref(req), ctypes.byref(out)))
    return lib.epcomm_eplb_communicator_name(out.value).decode()


def eplb_communicator_class(name: str) -> str:
    """vLLM's class for an EPLB communicator name (e.g. "pynccl" → "PyNcclEplbCommunicator")."""
    lib = load_library()
    for value in range(16):
        n = lib.epcomm_eplb_communicator_name(value)
        if n is not None and n.decode() == name:
            return lib.epcomm_eplb_communicator_class(value).decode()
    raise InvalidArgumentError(f"unknown EPLB communicator {name!r}", 2)


class _LostExpertsOptions(ctypes.Structure):
    """epcomm_eplb_lost_experts_options: what a rearrangement does with lost experts."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("allow_lost_experts", ctypes.c_bool),
        ("lost_experts_out", i64p),
        ("lost_experts_capacity", ctypes.c_size_t),
        ("num_lost_experts_out", i64p),
    ]


def _declared(name: str, args: List[Any]) -> Any:
    """A library function of this module, declared (restype int32)."""
    f = getattr(load_library(), name)
    f.restype = i32
    f.argtypes = args
    return f


def _rearrange_fns() -> Tuple[Any, Any]:
    """epcomm_eplb_rearrange_with_lost and epcomm_eplb_rearrange_into_with_lost, declared."""
    T, O = ctypes.POINTER(Tensor), ctypes.POINTER(RearrangeOptions)
    L, S = ctypes.POINTER(_LostExpertsOptions), ctypes.POINTER(EplbSummary)
    i64, sz = ctypes.c_int64, ctypes.c_size_t
    maps = [vp, i64p, i64p, i64, i64, i64]
    with_lost = _declared("epcomm_eplb_rearrange_with_lost", maps + [T, sz, O, L, S])
    into = _declared("epcomm_eplb_rearrange_into_with_lost", maps + [T, T, sz, O, L, S, i64p])
    return with_lost, into


def _lost_experts_fn() -> Any:
    """epcomm_eplb_lost_experts, declared."""
    i64, sz = ctypes.c_int64, ctypes.c_size_t
    return _declared("epcomm_eplb_lost_experts", [i64p, i64, i64, i64p, sz, i64p, sz, i64p])


def lost_experts(old_phy2log: Sequence[int], num_local: int,
                 rank_mapping: Sequence[int]) -> List[int]:
    """The logical experts of one layer's old placement (``old_phy2log``: one entry per slot,
    ``num_local`` slots per old rank, -1 = empty) with no replica on a surviving rank
    (``rank_mapping[old_rank]`` >= 0; -1 = removed): after a failure their weights are gone.
    Sorted; ValueError (InvalidArgumentError) for a bad mapping or map size."""
    old = [int(x) for x in old_phy2log]
    src = (ctypes.c_int64 * max(len(old), 1))(*old)
    mapping = (ctypes.c_int64 * max(len(rank_mapping), 1))(*[int(r) for r in rank_mapping])
    out = (ctypes.c_int64 * max(len(old), 1))()
    n = ctypes.c_int64(0)
    check(_lost_experts_fn()(src, len(old), num_local, mapping, len(rank_mapping), out,
                             len(old), ctypes.byref(n)))
    return list(out[: n.value])


def _maps(maps: Any, what: str) -> "tuple[Any, int, int]":
    """A [layers, slots] map (lists, numpy, torch or a Buffer) as a C int64 array, with its
    layers and slots."""
    rows = [[int(x) for x in r] for r in _rows(maps)]
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
    _WHAT = "EPLB communicator"

    def __init__(self, group: Group, communicator: Optional[str] = None, elastic: bool = False):
        self._h = vp()
        req = EplbSelectRequest()
        req.struct_size = ctypes.sizeof(EplbSelectRequest)
        req.communicator = communicator.encode() if communicator else None
        req.elastic = elastic
        req.device_type = DEVICE_CPU
        h = vp()
        with in_flight(group) as gh:
            group.check(
                load_library().epcomm_eplb_communicator_create(
                    gh, ctypes.byref(req), ctypes.byref(h)
                )
            )
            self._h, self._group = h, group
            self._depend_on(group)  # the group's close() closes this first
        self._pending: List[Any] = []  # queued tensors, kept alive until execute()

    def _queue(self, fn_name: str, tensors: Sequence[Any], peer: int, expert: int,
               output: bool) -> None:
        args = [Arg(t, f"tensors[{i}]", output=output) for i, t in enumerate(tensors)]
        if any(a.copy_into is not None for a in args):
            raise InvalidArgumentError("tensors must be C-contiguous in native byte order", 2)
        c = (Tensor * max(len(args), 1))(*[a.ptr.contents for a in args])
        with in_flight(self) as h:
            check(getattr(load_library(), fn_name)(h, c, len(args), peer, expert))
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
            with in_flight(self, self._group) as h:
                self._group.check(load_library().epcomm_eplb_communicator_execute(h))
        finally:
            self._pending.clear()

    def rearrange(
        self,
        old_phy2log: Sequence[Sequence[int]],
        new_phy2log: Sequence[Sequence[int]],
        weights: Sequence[Sequence[Any]],
        rank_mapping: Optional[Sequence[int]] = None,
        migration_batching: bool = False,
        next_weights: Optional[Sequence[Sequence[Any]]] = None,
        allow_lost_experts: bool = False,
    ) -> Dict[str, Any]:
        """Moves every layer's expert weights from the old to the new placement (collective).
        ``weights[layer]`` lists that layer's writable weight tensors (numpy arrays or
        contiguous CPU torch tensors), this rank's local experts along dimension 0; they are
        updated in place. ``migration_batching`` (vLLM v0.33.0's
        ``EPLBConfig.migration_batching_enabled``, e.g. ``EplbState.migration_batching``) runs
        each layer's transfers in the batches of vLLM's migration scheduler, one execute per
        batch; the result is the same. Every rank passes the same. Returns the summary
        (layers_changed, rows_sent, rows_received, rows_copied_locally).

        Double-buffered with ``next_weights`` (the same layout as ``weights``: per layer, one
        writable contiguous tensor of each live tensor's size, separate from them; need not be
        initialised): ``weights`` are only read and the new placement is written into
        ``next_weights``, each byte once; swap them in (the commit) for the layers reported
        valid. The summary then has ``next_valid`` (every layer). On an error the exception's
        ``next_valid`` attribute is the number of leading layers whose next tensors are valid
        (the same on every rank); the next tensors of the layer after them are garbage, later
        ones untouched, and ``weights`` unchanged. Every rank passes next_weights or none.
        Next tensors in this rank's shared memory from ``Group.alloc`` (e.g. the live and the
        next weights as the two halves of one Buffer, swapped by turns) have their received
        rows stored there by the senders (plain stores, one copy per byte, no system call);
        next tensors elsewhere have them read from the senders through the kernel.

        ``rank_mapping`` (old rank -> new rank or -1) changes the EP size: as many entries as
        the group has ranks is a scale-down on the old group (leaving ranks send their
        experts), fewer a scale-up on the grown group (new ranks start empty), more a
        scale-down after a failure on the group of survivors (the removed ranks are not
        members; experts come from surviving replicas only). A logical expert the new placement
        needs that no member holds is lost: the call fails on every rank before any data moves
        (ValueError naming the layer and the experts), unless ``allow_lost_experts``, which
        leaves the slots of lost experts with the bytes they held before (never zeros) and
        reports them. The summary's ``lost_experts`` lists, per layer, the lost experts left
        unwritten (empty lists otherwise)."""
        with in_flight(self, self._group) as h:
            try:
                run = self._prepare_rearrange(
                    h, old_phy2log, new_phy2log, weights, rank_mapping, migration_batching,
                    next_weights, allow_lost_experts)
            except BaseException:
                # The peers are already in this rearrangement: a call the library rejects (no
                # maps) fails theirs at once instead of pairing it with this rank's next one.
                with_lost, _ = _rearrange_fns()
                self._group._tell_peers(with_lost, h, None, None, 1, 1, 1, None, 1, None, None,
                                        None)
                raise
            return run()

    def _prepare_rearrange(
        self, h: vp, old_phy2log: Any, new_phy2log: Any, weights: Sequence[Sequence[Any]],
        rank_mapping: Optional[Sequence[int]], migration_batching: bool,
        next_weights: Optional[Sequence[Sequence[Any]]], allow_lost_experts: bool,
    ) -> Callable[[], Dict[str, Any]]:
        """``rearrange``'s arguments as C data, and the call that runs it (any exception here
        is raised before the library is called)."""
        old, layers, old_slots = _maps(old_phy2log, "old_phy2log")
        new, new_layers, new_slots = _maps(new_phy2log, "new_phy2log")
        if new_layers != layers or len(weights) != layers:
            raise InvalidArgumentError(
                f"old_phy2log has {layers} layers, new_phy2log {new_layers}, weights "
                f"{len(weights)}; expected the same number",
                2,
            )
        per_layer = len(weights[0]) if layers else 0
        args, tensors = _tensors(weights, "weights", next_weights is None)
        mapping = None
        if rank_mapping is not None:
            mapping = (ctypes.c_int64 * len(rank_mapping))(*[int(r) for r in rank_mapping])
        options = RearrangeOptions()
        lib = load_library()
        check(lib.epcomm_eplb_rearrange_options_init(ctypes.byref(options)))
        options.rank_mapping = ctypes.cast(mapping, i64p) if mapping is not None else None
        options.rank_mapping_len = len(rank_mapping or ())
        options.migration_batching = bool(migration_batching)
        # A lost expert takes at least one slot of the new placement: layers * new_slots pairs.
        pairs = (ctypes.c_int64 * max(2 * layers * new_slots, 1))()
        num_lost = ctypes.c_int64(0)
        lost_options = _LostExpertsOptions()
        init = _declared("epcomm_eplb_lost_experts_options_init",
                         [ctypes.POINTER(_LostExpertsOptions)])
        check(init(ctypes.byref(lost_options)))
        lost_options.lost_experts_out = ctypes.cast(pairs, i64p)
        lost_options.lost_experts_capacity = layers * new_slots
        lost_options.num_lost_experts_out = ctypes.pointer(num_lost)
        lost_options.allow_lost_experts = bool(allow_lost_experts)
        rearrange_with_lost, rearrange_into_with_lost = _rearrange_fns()

        def lost() -> List[List[int]]:
            per_layer: List[List[int]] = [[] for _ in range(layers)]
            if allow_lost_experts:
                for i in range(num_lost.value):
                    per_layer[pairs[2 * i]].append(pairs[2 * i + 1])
            return per_layer

        summary = EplbSummary()
        keep = (args, mapping, pairs)  # what the C data points into, alive until the call
        if next_weights is None:
            def run(_keep: Any = keep) -> Dict[str, Any]:
                self._group.check(
                    rearrange_with_lost(
                        h, old, new, layers, old_slots, new_slots, tensors, per_layer,
                        ctypes.byref(options), ctypes.byref(lost_options),
                        ctypes.byref(summary),
                    )
                )
                done: Dict[str, Any] = {
                    f[0]: getattr(summary, f[0]) for f in EplbSummary._fields_}
                done["lost_experts"] = lost()
                return done
            return run
        if len(next_weights) != layers or any(len(n) != per_layer for n in next_weights):
            raise InvalidArgumentError(
                f"next_weights must have the layout of weights: {layers} layers of "
                f"{per_layer} tensors",
                2,
            )
        next_args, next_tensors = _tensors(next_weights, "next_weights", True)
        valid = ctypes.c_int64(0)

        def run_into(_keep: Any = (keep, next_args)) -> Dict[str, Any]:
            try:
                self._group.check(
                    rearrange_into_with_lost(
                        h, old, new, layers, old_slots, new_slots, tensors, next_tensors,
                        per_layer, ctypes.byref(options), ctypes.byref(lost_options),
                        ctypes.byref(summary), ctypes.byref(valid),
                    )
                )
            except Exception as e:
                e.next_valid = valid.value  # type: ignore[attr-defined]
                raise
            out: Dict[str, Any] = {f[0]: getattr(summary, f[0]) for f in EplbSummary._fields_}
            out["next_valid"] = valid.value
            out["lost_experts"] = lost()
            return out
        return run_into


def _tensors(weights: Sequence[Sequence[Any]], what: str, output: bool) -> Tuple[List[Any], Any]:
    """``weights[layer][i]`` as C tensor descriptors (and the Args that keep them alive)."""
    args = [Arg(t, f"{what}[{l}][{i}]", output=output) for l, ws in enumerate(weights)
            for i, t in enumerate(ws)]
    if any(a.copy_into is not None for a in args):
        raise InvalidArgumentError(f"{what} must be C-contiguous in native byte order", 2)
    return args, (Tensor * max(len(args), 1))(*[a.ptr.contents for a in args])


class EplbState(Handle):
    """vLLM's EPLB load statistics for ``num_layers`` MoE layers of ``num_physical`` experts:
    record each step's load, end the step, and read the window's load per logical expert (for
    ``eplb_rebalance``). ``model_name`` labels vLLM's log lines; ``eplb_config`` is vLLM's
    EPLBConfig (a dict or JSON; None: vLLM's defaults). The arguments come in the order C's
    ``epcomm_eplb_state_new`` and C++'s ``epcomm::EplbState`` take them; the last two are
    keyword-only. A context manager; ``close()`` may be called any number of times."""

    _DESTROY = "epcomm_eplb_state_destroy"
    _WHAT = "EPLB state"

    def __init__(self, num_layers: int, num_physical: int, *, model_name: str = "",
                 eplb_config: Any = None):
        self._h = vp()
        text = None
        if eplb_config is not None:
            text = (eplb_config if isinstance(eplb_config, str) else json.dumps(eplb_config))
        h = vp()
        check(load_library().epcomm_eplb_state_new(
            num_layers, num_physical, model_name.encode(),
            text.encode() if text is not None else None, ctypes.byref(h),
        ))
        self._h = h
        self.num_layers, self.num_physical = num_layers, num_physical

    @property
    def migration_batching(self) -> bool:
        """vLLM's ``EPLBConfig.migration_batching_enabled`` for this state's config
        (``use_async and enable_migration_batching``): what to pass as
        ``EplbCommunicator.rearrange(..., migration_batching=)``."""
        on = ctypes.c_bool()
        with in_flight(self) as h:
            check(load_library().epcomm_eplb_state_migration_batching(h, ctypes.byref(on)))
        return on.value

    def record(self, layer: int, topk_ids: Any) -> None:
        """Adds one token per valid id of ``topk_ids`` (int32/int64, -1 ignored) to ``layer``."""
        ids = Arg(topk_ids, "topk_ids")
        with in_flight(self) as h:
            check(load_library().epcomm_eplb_state_record(h, layer, ids.ptr))

    def record_dispatch(self, layer: int, a2a: Any) -> None:
        """Adds the load of ``a2a``'s last dispatch to ``layer`` (no second pass over the ids)."""
        with in_flight(self, a2a) as h:
            check(load_library().epcomm_eplb_state_record_dispatch(h, layer, a2a._h))

    def step(self, group: Group, is_dummy: bool = False, log_stats: bool = False) -> bool:
        """Ends a forward step (collective when logging balancedness); True when a
        rearrangement is due."""
        due = ctypes.c_bool()
        with in_flight(self, group) as h:
            group.check(load_library().epcomm_eplb_state_step(
                h, group._h, is_dummy, log_stats, ctypes.byref(due)))
        return due.value

    def logical_load(self, group: Group, phy2log: Sequence[Sequence[int]],
                     num_logical: int) -> Buffer:
        """The window's load per logical expert, summed over the window and every rank
        (collective): a float32 Buffer [num_layers, num_logical] (``.tolist()`` for lists),
        ready for ``eplb_rebalance``."""
        maps, layers, slots = _maps(phy2log, "phy2log")
        load = (ctypes.c_float * max(layers * num_logical, 1))()
        with in_flight(self, group) as h:
            group.check(load_library().epcomm_eplb_state_logical_load(
                h, group._h, maps, layers, slots, num_logical, load))
        return Buffer.owning(load, (layers, num_logical), "float32")
