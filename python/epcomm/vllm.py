"""vLLM integration: an all2all manager and an EPLB communicator with the interfaces of vLLM
0.32.0 to 0.34.0 (the plugin that installs them in vLLM: epcomm.vllm_plugin).

``EpcommAll2AllManager`` has the interface of vLLM's ``All2AllManagerBase`` and the semantics
of its ``AgRsAll2AllManager`` (the manager vLLM's CPU backend selects): dispatch all-gathers
``hidden_states``, ``topk_weights``, ``topk_ids`` and the extra tensors along dimension 0 in
rank order, with each rank's own token count; combine sums the ranks' ``[sum(sizes), ...]``
tensors and returns this rank's rows (a reduce-scatter). ``EpcommEplbCommunicator`` has the
interface of vLLM's ``EplbCommunicator`` (add_send/add_recv/execute). Both take torch CPU
tensors and run over epcomm groups made from the torch.distributed CPU (gloo) group vLLM hands
them: ``transport="torch"`` (across hosts) or ``"shm"`` (one host, shared memory). Neither
imports vLLM; ``install()`` puts them in vLLM's place (docs/vllm.md).
"""

from __future__ import annotations

import ctypes
import socket
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._handle import in_flight
from ._lib import load_library
from ._tensor import Arg
from .all2all import All2All
from .eplb import EplbCommunicator
from .errors import InvalidArgumentError, check
from .group import Group

#: sizes(num_local_tokens) -> every rank's token count (vLLM: the DP metadata's chunk sizes).
SizesFn = Callable[[int], List[int]]

TRANSPORTS = ("torch", "shm")


#: The all2all backends vLLM runs fault-tolerant (vllm/v1/worker/sentinel/gpu_worker_sentinel.py,
#: FT_BACKEND_SET).
FT_BACKENDS = frozenset({"deepep_low_latency", "nixl_ep"})


def group_for(process_group: Any, transport: str = "torch", name: str = "vllm",
              timeout_s: Optional[float] = None) -> Group:
    """An epcomm group with the ranks of a torch.distributed CPU ``process_group``: over the
    group itself (``"torch"``: send/recv/all_gather, across hosts) or over shared memory
    (``"shm"``: every rank on this host; the group id travels over ``process_group``)."""
    if transport == "torch":
        return Group.from_torch(process_group, name=name, timeout_s=timeout_s)
    if transport != "shm":
        raise InvalidArgumentError(
            f"unknown transport {transport!r}; expected one of {', '.join(TRANSPORTS)}", 2
        )
    import torch.distributed as dist

    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    uid: List[Any] = [Group.unique_id() if rank == 0 else None]
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast_object_list(uid, src=src, group=process_group)
    return Group.shm_unique(uid[0], rank, world, timeout_s=timeout_s)


def _row_elems(t: Any) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= int(d)
    return n


def _torch() -> Any:
    import torch

    return torch


class _Collectives:
    """all_gatherv / reduce_scatterv of torch CPU tensors over one epcomm group."""

    def __init__(self, group: Group):
        self.group = group
        self.rank, self.world_size = group.rank, group.size

    def _call(self, fn_name: str, x: Any, sizes: Sequence[int], out: Any) -> Any:
        fn = getattr(load_library(), fn_name)
        with in_flight(self.group) as h:
            try:
                s = (ctypes.c_int64 * len(sizes))(*[int(n) for n in sizes])
                a, o = Arg(x, "input"), Arg(out, "output", output=True)
            except BaseException:
                # The peers are in this collective already: a call the library rejects (no
                # tensors) fails theirs at once instead of pairing it with this rank's next
                # one or leaving them to time out.
                self.group._tell_peers(fn, h, None, None, None)
                raise
            self.group.check(fn(h, a.ptr, s, o.ptr))
        return out

    def token_counts(self, n: int) -> List[int]:
        """Every rank's ``n``, in rank order (collective)."""
        torch = _torch()
        mine = torch.tensor([n], dtype=torch.int64)
        out = torch.empty(self.world_size, dtype=torch.int64)
        return self._call("epcomm_group_all_gatherv", mine, [1] * self.world_size, out).tolist()

    def all_gatherv(self, t: Any, sizes: Sequence[int]) -> Any:
        """Every rank's rows of ``t`` (any dtype) concatenated in rank order; rows move as
        bytes, so the dtype and row shape come back as they went."""
        torch = _torch()
        row_bytes = _row_elems(t) * t.element_size()
        mine = t.contiguous().view(torch.uint8).reshape(t.shape[0], row_bytes)
        out = torch.empty((sum(sizes), row_bytes), dtype=torch.uint8)
        self._call("epcomm_group_all_gatherv", mine, sizes, out)
        return out.view(t.dtype).reshape((sum(sizes),) + tuple(t.shape[1:]))

    def reduce_scatterv(self, t: Any, sizes: Sequence[int], out: Any = None) -> Any:
        """The sum over ranks of ``t`` (``sum(sizes)`` rows; float32/bfloat16/float16,
        accumulated in float32 in rank order), this rank's ``sizes[rank]`` rows of it, written
        into ``out`` when given (contiguous, ``t``'s dtype and row shape)."""
        torch = _torch()
        if out is None:
            out = torch.empty((sizes[self.rank],) + tuple(t.shape[1:]), dtype=t.dtype)
        return self._call("epcomm_group_reduce_scatterv", t.contiguous(), sizes, out)


def host_id() -> str:
    """This host's identity: the host name and the kernel's boot id (two containers with the
    same name on different machines differ by boot id; ranks that share both share the host's
    memory, which the "shm" transport needs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def same_host(process_group: Any) -> bool:
    """Whether every rank of the torch.distributed CPU ``process_group`` runs on this host
    (collective: every rank's ``host_id()`` over the group)."""
    import torch.distributed as dist

    names: List[Optional[str]] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(names, host_id(), group=process_group)
    return len(set(names)) == 1


_same_host = same_host

#: Live managers by key, for the custom ops that stand for their collectives in a graph
#: torch.compile captures (an op takes numbers and tensors, not Python objects).
_MANAGERS: Dict[int, "EpcommAll2AllManager"] = {}
_OPS_READY = False


def _register_ops() -> bool:
    """Registers ``epcomm::vllm_gather`` and ``epcomm::vllm_combine_into`` (once per process):
    the manager's collectives as custom ops, so that torch.compile (vLLM's default mode, which
    traces the MoE layer with fullgraph=True) records one opaque call instead of tracing into
    ctypes. False where this torch has no ``torch.library.custom_op`` (before 2.4): the
    manager then works in eager mode only."""
    global _OPS_READY
    if _OPS_READY:
        return True
    torch = _torch()
    lib = getattr(torch, "library", None)
    if lib is None or not hasattr(lib, "custom_op"):
        return False

    @lib.custom_op("epcomm::vllm_gather", mutates_args=(), schema=(
        "(Tensor[] tensors, int manager, bool is_sequence_parallel) -> Tensor[]"))
    def _gather_op(tensors, manager, is_sequence_parallel):  # type: ignore[no-untyped-def]
        return _MANAGERS[manager]._gather(list(tensors), is_sequence_parallel)

    @_gather_op.register_fake
    def _(tensors, manager, is_sequence_parallel):  # type: ignore[no-untyped-def]
        rows = lib.get_ctx().new_dynamic_size()  # the sum of every rank's token count
        return [t.new_empty((rows,) + tuple(t.shape[1:])) for t in tensors]

    @lib.custom_op("epcomm::vllm_combine_into", mutates_args=("output",), schema=(
        "(Tensor hidden_states, Tensor(a!) output, int manager, bool is_sequence_parallel)"
        " -> ()"))
    def _combine_into_op(hidden_states, output, manager,  # type: ignore[no-untyped-def]
                         is_sequence_parallel):
        _MANAGERS[manager]._combine(hidden_states, is_sequence_parallel, output)

    @_combine_into_op.register_fake
    def _(hidden_states, output, manager, is_sequence_parallel):  # type: ignore[no-untyped-def]
        return None

    @lib.custom_op("epcomm::vllm_combine", mutates_args=(), schema=(
        "(Tensor hidden_states, int manager, bool is_sequence_parallel) -> Tensor"))
    def _combine_op(hidden_states, manager, is_sequence_parallel):  # type: ignore[no-untyped-def]
        return _MANAGERS[manager]._combine(hidden_states, is_sequence_parallel, None)

    @_combine_op.register_fake
    def _(hidden_states, manager, is_sequence_parallel):  # type: ignore[no-untyped-def]
        rows = lib.get_ctx().new_dynamic_size()  # this rank's token count
        return hidden_states.new_empty((rows,) + tuple(hidden_states.shape[1:]))

    _OPS_READY = True
    return True


def _compiling() -> bool:
    """Whether torch.compile is tracing this call (dynamo folds it to True there)."""
    import torch

    return bool(torch.compiler.is_compiling())


_warned_once: set = set()


def _warn_once(message: str, *args: Any) -> None:
    import logging

    if message not in _warned_once:
        _warned_once.add(message)
        logging.getLogger("epcomm.vllm").warning(message, *args)


class EpcommAll2AllManager:
    """vLLM's ``AgRsAll2AllManager`` over epcomm, with ``All2AllManagerBase``'s interface.

    ``cpu_group`` is the EP group's torch.distributed CPU group (the one vLLM passes its
    managers); ``dp_group``, when given, is the DP group's, which vLLM's manager gathers over
    when the input is not sequence parallel (without it, ``cpu_group`` is used: the same ranks
    when tensor parallelism is 1). ``sizes`` gives every rank's token count (vLLM: the DP
    metadata's chunk sizes); without it dispatch all-gathers the counts itself.
    ``transport``: "torch" (over the groups themselves, across hosts) or "shm" (one host)."""

    def __init__(
        self,
        cpu_group: Any,
        tcp_store_group: Any = None,
        *,
        dp_group: Any = None,
        sizes: Optional[SizesFn] = None,
        transport: str = "torch",
        timeout_s: Optional[float] = None,
        enable_fault_tolerance: bool = False,
    ):
        self.cpu_group, self.tcp_store_group = cpu_group, tcp_store_group
        self._sizes_fn = sizes
        self._ep = _Collectives(group_for(cpu_group, transport, "vllm-ep", timeout_s))
        self._dp = (
            _Collectives(group_for(dp_group, transport, "vllm-dp", timeout_s))
            if dp_group is not None
            else self._ep
        )
        self.rank, self.world_size = self._ep.rank, self._ep.world_size
        self.dp_rank, self.dp_world_size = self._dp.rank, self._dp.world_size
        self.internode = not _same_host(cpu_group)
        # vLLM's parallel_config.enable_fault_tolerance, as DeepEPLLAll2AllManager and
        # NixlEPAll2AllManager read it: handles of those backends then mask failed ranks.
        self.support_fault_tolerance = bool(enable_fault_tolerance)
        self._handles: Dict[Tuple[Any, ...], All2All] = {}
        # The sizes of the last dispatch per group, which its combine splits by.
        self._last_sizes: Dict[int, List[int]] = {}
        self.transport = transport
        #: What this manager moved: gathers (dispatch, dispatch_router_logits), combines, the
        #: rows gathered and the rows this rank received back from combines.
        self.stats = {"dispatches": 0, "combines": 0, "rows_gathered": 0, "rows_combined": 0}
        # The key the custom ops find this manager by under torch.compile.
        self._key = id(self)
        _MANAGERS[self._key] = self
        _register_ops()

    def _comm(self, is_sequence_parallel: bool) -> _Collectives:
        return self._ep if is_sequence_parallel else self._dp

    def _sizes(self, n: int, comm: _Collectives) -> List[int]:
        sizes = self._sizes_fn(n) if self._sizes_fn is not None else comm.token_counts(n)
        sizes = [int(s) for s in sizes]
        assert len(sizes) == comm.world_size
        assert sizes[comm.rank] == n
        self._last_sizes[id(comm)] = sizes
        return sizes

    def _gather(self, tensors: List[Any], is_sequence_parallel: bool) -> List[Any]:
        comm = self._comm(is_sequence_parallel)
        sizes = self._sizes(tensors[0].shape[0], comm)
        self.stats["dispatches"] += 1
        self.stats["rows_gathered"] += sum(sizes)
        return [comm.all_gatherv(t, sizes) for t in tensors]

    def _gather_any(self, tensors: List[Any], is_sequence_parallel: bool) -> List[Any]:
        # Under torch.compile the gather is one opaque custom op (dynamo cannot trace ctypes).
        if _compiling() and _OPS_READY:
            return list(_torch().ops.epcomm.vllm_gather(tensors, self._key,
                                                        is_sequence_parallel))
        return self._gather(tensors, is_sequence_parallel)

    def _combine(self, hidden_states: Any, is_sequence_parallel: bool, output: Any) -> Any:
        comm = self._comm(is_sequence_parallel)
        sizes = self._combine_sizes(comm, hidden_states)
        self.stats["combines"] += 1
        self.stats["rows_combined"] += sizes[comm.rank]
        if output is not None and not (
            output.is_contiguous() and output.dtype == hidden_states.dtype
            and tuple(output.shape) == (sizes[comm.rank],) + tuple(hidden_states.shape[1:])
        ):
            # vLLM's base class: the combined rows copied into whatever ``output`` is.
            output.copy_(comm.reduce_scatterv(hidden_states, sizes))
            return output
        return comm.reduce_scatterv(hidden_states, sizes, out=output)

    def get_handle(self, kwargs: Dict[str, Any]) -> All2All:
        """An ``epcomm.All2All`` over the EP group for ``kwargs`` (its constructor's keyword
        arguments; ``backend`` defaults to "allgather_reducescatter"), cached per kwargs as
        vLLM's managers cache theirs."""
        key = tuple(sorted((k, str(v)) for k, v in kwargs.items()))
        if key not in self._handles:
            args = dict(kwargs)
            backend = args.pop("backend", "allgather_reducescatter")
            if self.support_fault_tolerance and backend in FT_BACKENDS:
                args.setdefault("enable_fault_tolerance", True)
            self._handles[key] = All2All(self._ep.group, backend, **args)
        return self._handles[key]

    def dispatch_router_logits(
        self,
        hidden_states: Any,
        router_logits: Any,
        is_sequence_parallel: bool = False,
        extra_tensors: Optional[List[Any]] = None,
    ) -> Any:
        """Gathers hidden_states, router_logits and the extra tensors from every rank."""
        g = self._gather_any([hidden_states, router_logits] + list(extra_tensors or []),
                             is_sequence_parallel)
        if extra_tensors is not None:
            return g[0], g[1], g[2:]
        return g[0], g[1]

    def dispatch(
        self,
        hidden_states: Any,
        topk_weights: Any,
        topk_ids: Any,
        is_sequence_parallel: bool = False,
        extra_tensors: Optional[List[Any]] = None,
    ) -> Any:
        """Gathers hidden_states, topk_weights, topk_ids and the extra tensors from every rank
        (in rank order, dtypes kept); returns them in that order."""
        g = self._gather_any([hidden_states, topk_weights, topk_ids]
                             + list(extra_tensors or []), is_sequence_parallel)
        if extra_tensors is None:
            return g[0], g[1], g[2]
        return g[0], g[1], g[2], g[3:]

    def combine(self, hidden_states: Any, is_sequence_parallel: bool = False) -> Any:
        """Sums every rank's ``hidden_states`` ([sum of the ranks' tokens, ...]) and returns this
        rank's rows: the token counts of the last dispatch, or an equal split as vLLM's
        manager uses without data parallelism."""
        if _compiling() and _OPS_READY:
            return _torch().ops.epcomm.vllm_combine(hidden_states, self._key,
                                                    is_sequence_parallel)
        return self._combine(hidden_states, is_sequence_parallel, None)

    def _combine_sizes(self, comm: _Collectives, hidden_states: Any) -> List[int]:
        rows = int(hidden_states.shape[0])
        sizes = self._last_sizes.get(id(comm))
        if sizes is None or sum(sizes) != rows:
            if rows % comm.world_size:
                raise InvalidArgumentError(
                    f"combine: {rows} rows do not split evenly over {comm.world_size} ranks "
                    "and no dispatch gave the ranks' token counts", 2
                )
            sizes = [rows // comm.world_size] * comm.world_size
        return sizes

    def allocate_combine_input(self, shape: Any, dtype: Any, device: Any,
                               is_sequence_parallel: bool = False) -> Any:
        """None: combine takes any tensor (no symmetric buffer to hand out)."""
        return None

    def combine_into_output(self, hidden_states: Any, output: Any,
                            is_sequence_parallel: bool = False) -> Any:
        """``combine`` written into ``output`` in place (no temporary: vLLM's base class copies
        ``combine``'s result; here the reduction lands in ``output`` itself). ``output`` must
        be contiguous with ``hidden_states``' dtype and this rank's row count, else an
        epcomm.Error (ValueError)."""
        if _compiling() and _OPS_READY:
            _torch().ops.epcomm.vllm_combine_into(hidden_states, output, self._key,
                                                  is_sequence_parallel)
            return output
        comm = self._comm(is_sequence_parallel)
        return comm.reduce_scatterv(
            hidden_states, self._combine_sizes(comm, hidden_states), out=output
        )

    def combine_into_output_any(self, hidden_states: Any, output: Any,
                                is_sequence_parallel: bool = False) -> Any:
        """``combine_into_output`` for any ``output`` (vLLM's communicators' contract): in
        place when ``output`` is contiguous with ``hidden_states``' dtype and this rank's rows,
        else the combined rows copied into it. What the vLLM plugin routes vLLM's CPU
        communicator's ``combine_into_output`` to."""
        if _compiling() and _OPS_READY:
            _torch().ops.epcomm.vllm_combine_into(hidden_states, output, self._key,
                                                  is_sequence_parallel)
            return output
        return self._combine(hidden_states, is_sequence_parallel, output)

    def _ft_handles(self) -> List[All2All]:
        if not self.support_fault_tolerance:
            # All2AllManagerBase's: the manager has no fault tolerance.
            raise NotImplementedError
        return list(self._handles.values())

    def query_active_mask(self) -> Any:
        """vLLM's ``query_active_mask``: an int32 tensor, one entry per EP rank, 0 = live,
        1 = masked (a rank that died or stalled; every survivor masks the same). Over every
        handle of this manager (they share the EP group and its survivors). Without fault
        tolerance, NotImplementedError as vLLM's base class."""
        torch = _torch()
        mask = [0] * self.world_size
        for h in self._ft_handles():
            mask = [max(a, b) for a, b in zip(mask, h.query_active_mask())]
        return torch.tensor(mask, dtype=torch.int32)

    def query_fault(self) -> Any:
        """vLLM's ``query_fault``: a scalar bool tensor, True if the mask changed since the
        last ``clean_buffers`` (the recovery point)."""
        torch = _torch()
        return torch.tensor(any(h.query_fault() for h in self._ft_handles()))

    def clean_buffers(self) -> None:
        """vLLM's ``clean_buffers`` (rank-local): every handle's receive buffers are zeroed and
        its mask becomes the baseline of ``query_fault``. Masked ranks stay masked (vLLM's
        DeepEP buffer resets its mask here; epcomm's survivors' group has no place for them)."""
        for h in self._ft_handles():
            h.clean_buffers()

    def update_mask(self, rank: int, masked: bool = True) -> None:
        """vLLM v0.34.0's ``update_mask`` (rank-local), which vLLM's sentinel calls after
        ``clean_buffers`` to replay a scale-down's dead ranks: sets the rank's entry of the
        mask and of ``query_fault``'s baseline, on every handle. epcomm keeps the mask across
        ``clean_buffers``, so replaying a masked rank changes nothing; masking a live rank or
        unmasking a masked one raises (epcomm masks the ranks the group loses; rejoining means
        a new group). Without fault tolerance, NotImplementedError as vLLM's base class."""
        for h in self._ft_handles():
            h.update_mask(rank, masked)

    def set_num_sms(self, num_sms: int) -> None:
        """No-op (no GPU)."""

    def checkpoint_prepare(self) -> None:
        """vLLM's base class (0.32.0 to 0.34.0): warns once that it is not implemented and
        skips (the manager holds no state a checkpoint needs)."""
        _warn_once("%s.checkpoint_prepare is not implemented; skipping.", type(self).__name__)

    def checkpoint_restore(self) -> None:
        """vLLM's base class: warns once that it is not implemented and skips."""
        _warn_once("%s.checkpoint_restore is not implemented; skipping.", type(self).__name__)

    def stage_ep_size(self) -> None:
        """No-op, as vLLM's base class (elastic EP resizes no buffer of this manager)."""

    def commit_ep_size(self) -> None:
        """No-op, as vLLM's base class."""

    def mask_remote_ranks(self) -> Any:
        """A context manager that does nothing, as vLLM's base class's."""
        import contextlib

        return contextlib.nullcontext()

    def max_sms_used(self) -> Optional[int]:
        """None, as vLLM's base class."""
        return None

    def destroy(self) -> None:
        """Releases the cached handles and the groups (idempotent)."""
        for h in self._handles.values():
            h.close()
        self._handles.clear()
        _MANAGERS.pop(self._key, None)
        self._dp.group.close()
        self._ep.group.close()


class EpcommEplbCommunicator:
    """vLLM's ``EplbCommunicator`` interface (add_send/add_recv/execute) over epcomm's EPLB
    communicator. ``group`` is an ``epcomm.Group`` or a torch.distributed CPU group (the EP
    group's; made into an epcomm group with ``transport``); ranks are that group's ranks.
    ``execute()`` is collective: every rank calls it, as vLLM's weight rearrangement does once
    per layer. Tensors are CPU tensors (or numpy arrays), contiguous."""

    def __init__(self, group: Any, stream: Any = None, *, communicator: Optional[str] = None,
                 transport: str = "torch", timeout_s: Optional[float] = None):
        self._own = not isinstance(group, Group)
        self._group = group_for(group, transport, "vllm-eplb", timeout_s) if self._own else group
        self._comm = EplbCommunicator(self._group, communicator)
        self._stream = stream

    def add_send(self, tensors: List[Any], dst_rank: int, expert_id: int) -> None:
        """Queues sending one expert's tensors to ``dst_rank``."""
        self._comm.add_send(tensors, dst_rank, expert_id)

    def add_recv(self, tensors: List[Any], src_rank: int, expert_id: int) -> None:
        """Queues receiving one expert's tensors from ``src_rank`` (filled in place)."""
        self._comm.add_recv(tensors, src_rank, expert_id)

    def execute(self) -> None:
        """Completes every queued transfer; on return the received tensors hold the data."""
        self._comm.execute()

    def set_transfer_context(self, old_indices: Any, layer_idx: int,
                             recv_rows: Any = None) -> None:
        """No-op, as in vLLM's base class (v0.34.0 adds ``recv_rows``, which only push
        backends use)."""

    @property
    def needs_recv_rows(self) -> bool:
        """False, as in vLLM v0.34.0's base class: senders and receivers pair up, nothing is
        pushed into a receiver's buffer."""
        return False

    @property
    def owned_expert_buffer(self) -> Optional[List[Any]]:
        """None, as in vLLM v0.34.0's base class: the caller's expert buffer is used."""
        return None

    @property
    def needs_profile_buffer_reservation(self) -> bool:
        """True, as in vLLM's base class."""
        return True

    def set_stream(self, stream: Any) -> None:
        """Kept for vLLM's interface; host transfers use no stream."""
        self._stream = stream

    def destroy(self) -> None:
        """Releases the communicator (and the group made for it)."""
        self._comm.close()
        if self._own:
            self._group.close()


def install(eplb: bool = True, transport: str = "torch") -> None:
    """Makes vLLM, in this process, use epcomm where its CPU backend would use its own: the
    all2all manager vLLM's communicators build for "allgather_reducescatter" (and "naive", and
    every name on CPU) becomes ``EpcommAll2AllManager`` over ``transport`` ("torch" or "shm"),
    and, with ``eplb``, the EPLB communicator for CPU expert weights becomes
    ``EpcommEplbCommunicator`` (vLLM's own factory still serves device weights). Call it before
    vLLM creates its process groups, in every process. vLLM's CPU workers are spawned, so only a
    ``vllm.general_plugins`` entry point reaches them: epcomm's own plugin
    (``epcomm.vllm_plugin``, docs/vllm.md) does this and more (the transport chosen by host,
    the CPU MoE fix, compiled mode)."""
    import functools
    import importlib

    if transport not in TRANSPORTS:
        raise InvalidArgumentError(
            f"unknown transport {transport!r}; expected one of {', '.join(TRANSPORTS)}", 2
        )
    cls: Any = EpcommAll2AllManager
    if transport != "torch":
        cls = type("EpcommAll2AllManager", (EpcommAll2AllManager,), {
            "__init__": functools.partialmethod(EpcommAll2AllManager.__init__,
                                                transport=transport)})
    all2all = importlib.import_module("vllm.distributed.device_communicators.all2all")
    setattr(all2all, "AgRsAll2AllManager", cls)
    if eplb:
        install_eplb_factory()


def install_eplb_factory() -> None:
    """Replaces ``create_eplb_communicator`` in ``vllm.distributed.eplb.eplb_state`` with one
    that returns ``EpcommEplbCommunicator(group_coordinator.cpu_group)`` for CPU expert weights
    and calls vLLM's own for device weights (idempotent)."""
    import importlib

    state = importlib.import_module("vllm.distributed.eplb.eplb_state")
    original = getattr(state, "create_eplb_communicator")
    if getattr(original, "_epcomm", False):
        return  # installed already (plugins may load more than once)

    def create_eplb_communicator(group_coordinator: Any, backend: str, expert_weights: Any,
                                 expert_buffer: Any) -> Any:
        first = expert_weights[0] if expert_weights else []
        # Device weights, and vLLM 0.34.0's push backend `symm_mem` (its own buffer, its own
        # checks: "symm_mem EPLB requires CUDA"), stay vLLM's.
        if (first and first[0].device.type != "cpu") or backend == "symm_mem":
            return original(group_coordinator, backend, expert_weights, expert_buffer)
        return EpcommEplbCommunicator(group_coordinator.cpu_group)

    create_eplb_communicator._epcomm = True  # type: ignore[attr-defined]
    setattr(state, "create_eplb_communicator", create_eplb_communicator)


__all__ = [
    "EpcommAll2AllManager",
    "EpcommEplbCommunicator",
    "group_for",
    "host_id",
    "install",
    "install_eplb_factory",
    "same_host",
    "TRANSPORTS",
]
