"""Process groups: shared memory on one host (by name or by a unique id), or the host's own
transport (Python callables, or a torch.distributed process group) across hosts."""

from __future__ import annotations

import ctypes
import operator
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ._handle import Handle, in_flight
from ._lib import (
    ALL_GATHER_FN,
    ALL_TO_ALLV_FN,
    BARRIER_FN,
    LOST_RANKS_FN,
    RECV_FN,
    SEND_FN,
    SHRINK_FN,
    UNIQUE_ID_BYTES,
    GroupOptions,
    HostCallbacks,
    P2POp,
    UniqueId,
    i32,
    load_library,
    vp,
)
from ._dlpack import Buffer
from ._tensor import Arg, dtype_name, dtype_struct
from .errors import InvalidArgumentError, check, make_error

#: send(peer, data): deliver the bytes of ``data`` (a memoryview) to group rank ``peer``.
SendFn = Callable[[int, memoryview], None]
#: recv(peer, out): fill ``out`` (a writable memoryview) with bytes from group rank ``peer``.
RecvFn = Callable[[int, memoryview], None]
#: all_gather(data, out): every rank's ``data`` into ``out`` (world_size * len(data), rank order).
AllGatherFn = Callable[[memoryview, memoryview], None]
#: all_to_allv(data, data_sizes, out, out_sizes): ``data_sizes[p]`` bytes of ``data``
#: (consecutive chunks, rank order) to each rank p, and ``out_sizes[p]`` bytes from each rank p
#: into consecutive chunks of ``out`` (memoryviews of bytes; lists of ints).
AllToAllvFn = Callable[[memoryview, List[int], memoryview, List[int]], None]


def _options(timeout_s: Optional[float]) -> GroupOptions:
    opts = GroupOptions()
    check(load_library().epcomm_group_options_init(ctypes.byref(opts)))
    if timeout_s is not None:
        opts.timeout_s = float(timeout_s)
    return opts


def _view(address: Optional[int], nbytes: int) -> memoryview:
    """The ``nbytes`` bytes at ``address`` as a writable memoryview, without a copy."""
    if nbytes == 0 or not address:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _ft_library() -> ctypes.CDLL:
    """The library with the signatures of the fault-tolerance calls of groups."""
    lib = load_library()
    if not getattr(lib, "_epcomm_group_ft_declared", False):
        lib.epcomm_group_lost_ranks.restype = i32
        lib.epcomm_group_lost_ranks.argtypes = [vp, ctypes.POINTER(i32), ctypes.c_size_t]
        lib.epcomm_group_shrink.restype = i32
        lib.epcomm_group_shrink.argtypes = [
            vp, ctypes.POINTER(i32), ctypes.c_size_t, ctypes.POINTER(vp)
        ]
        lib._epcomm_group_ft_declared = True
    return lib


class _SharedMemory:
    """One epcomm_mem_alloc allocation: freed when the last Buffer or tensor over it dies
    (each holds this object), so memory in use is never freed; it holds the group open."""

    def __init__(self, group: "Group", nbytes: int):
        p = vp()
        with in_flight(group) as h:
            group.check(load_library().epcomm_mem_alloc(h, nbytes, ctypes.byref(p)))
        self.group, self.address = group, p.value
        group._allocations += 1

    def __del__(self) -> None:
        g = getattr(self, "group", None)
        if g is None:
            return
        g._allocations -= 1
        try:
            if g._h:
                load_library().epcomm_mem_free(g._h, self.address)
        except Exception:  # noqa: BLE001 -- at interpreter exit the library may be gone
            pass


class _HostTransport:
    """The C callbacks over Python callables. An exception in a callable is kept (the first
    one) and turned into a non-zero return, which fails the epcomm call on this rank; the
    group then raises an epcomm.Error naming it."""

    def __init__(
        self,
        send: SendFn,
        recv: RecvFn,
        all_gather: Optional[AllGatherFn],
        world_size: int,
        all_to_allv: Optional[AllToAllvFn] = None,
    ):
        self.world_size = world_size
        self.error: Optional[BaseException] = None
        self._send, self._recv, self._all_gather = send, recv, all_gather
        self._all_to_allv = all_to_allv
        # The ctypes function objects must live as long as the group.
        self._fns = (
            SEND_FN(self._on_send),
            RECV_FN(self._on_recv),
            ALL_GATHER_FN(self._on_all_gather) if all_gather else ALL_GATHER_FN(),
            BARRIER_FN(),
            LOST_RANKS_FN(),
            SHRINK_FN(),
            ALL_TO_ALLV_FN(self._on_all_to_allv) if all_to_allv else ALL_TO_ALLV_FN(),
        )
        self.callbacks = HostCallbacks(ctypes.sizeof(HostCallbacks), None, *self._fns)

    def _guard(self, fn: Callable[..., Any], *args: Any) -> int:
        try:
            fn(*args)
            return 0
        except BaseException as e:  # noqa: BLE001 -- an exception must not cross the C frames
            if self.error is None:
                self.error = e
            return 1

    def _on_send(self, _user: Any, peer: int, data: Optional[int], nbytes: int) -> int:
        return self._guard(self._send, peer, _view(data, nbytes))

    def _on_recv(self, _user: Any, peer: int, data: Optional[int], nbytes: int) -> int:
        return self._guard(self._recv, peer, _view(data, nbytes))

    def _on_all_gather(
        self, _user: Any, data: Optional[int], nbytes: int, out: Optional[int]
    ) -> int:
        whole = _view(out, nbytes * self.world_size)
        assert self._all_gather is not None  # the callback exists only with one
        return self._guard(self._all_gather, _view(data, nbytes), whole)

    def _on_all_to_allv(self, _user: Any, data: Optional[int], data_sizes: Any,
                        out: Optional[int], out_sizes: Any) -> int:
        n = self.world_size
        sizes, got = data_sizes[:n], out_sizes[:n]
        assert self._all_to_allv is not None  # the callback exists only with one
        return self._guard(
            self._all_to_allv, _view(data, sum(sizes)), sizes, _view(out, sum(got)), got
        )

    def raise_for(self, status: int) -> None:
        """Raises the epcomm error for ``status``; a callable's exception is its cause and is
        named in the message."""
        if status == 0:
            return
        err, cause = make_error(status), self.error
        self.error = None
        if cause is not None:
            err = type(err)(
                f"{err.message}; the Python callback raised {type(cause).__name__}: {cause}",
                err.status,
                err.hint,
            )
            raise err from cause
        raise err


class Group(Handle):
    """A process group. ``Group(name, rank, world_size)`` (or ``Group.shm``) is a shared-memory
    group of processes or threads on one host; ``Group.shm_unique`` one found by an id instead
    of a name; ``Group.host`` and ``Group.from_torch`` run over the host's own transport, across
    machines. A context manager; ``close()`` may be called any number of times: it closes the
    managers made on the group too (see ``close``)."""

    _DESTROY = "epcomm_group_destroy"
    _WHAT = "group"
    _allocations = 0  # live Group.alloc buffers (close refuses to free them under a tensor)

    def __init__(
        self, name: str, rank: int, world_size: int, timeout_s: Optional[float] = None
    ):
        h = vp()
        opts = _options(timeout_s)
        self._transport: Optional[_HostTransport] = None
        self._h = vp()
        check(
            load_library().epcomm_group_create_shm(
                name.encode(), rank, world_size, ctypes.byref(opts), ctypes.byref(h)
            )
        )
        self._h = h

    @classmethod
    def _adopt(cls, h: vp, transport: Optional[_HostTransport]) -> "Group":
        g = cls.__new__(cls)
        g._h, g._transport = h, transport
        return g

    @classmethod
    def shm(
        cls, name: str, rank: int, world_size: int, timeout_s: Optional[float] = None
    ) -> "Group":
        """Creates (rank 0) or joins the shared-memory group ``name`` on this host."""
        return cls(name, rank, world_size, timeout_s)

    @staticmethod
    def unique_id() -> bytes:
        """A fresh group id (bytes) for ``shm_unique``: made on one rank, passed to the others
        by the host's means (a TCP store, torch.distributed, a pipe)."""
        uid = UniqueId()
        check(load_library().epcomm_group_unique_id(ctypes.byref(uid)))
        return bytes(uid.internal)

    @classmethod
    def shm_unique(
        cls, unique_id: bytes, rank: int, world_size: int, timeout_s: Optional[float] = None
    ) -> "Group":
        """As ``shm``, for the group of ``unique_id`` (from ``Group.unique_id()``)."""
        raw = bytes(unique_id)
        if len(raw) != UNIQUE_ID_BYTES:
            raise InvalidArgumentError(
                f"unique_id has {len(raw)} bytes; expected {UNIQUE_ID_BYTES} "
                "(the bytes Group.unique_id() returned)",
                2,
            )
        uid = UniqueId.from_buffer_copy(raw)
        opts, h = _options(timeout_s), vp()
        check(
            load_library().epcomm_group_create_shm_unique(
                ctypes.byref(uid), rank, world_size, ctypes.byref(opts), ctypes.byref(h)
            )
        )
        return cls._adopt(h, None)

    @classmethod
    def host(
        cls,
        send: SendFn,
        recv: RecvFn,
        all_gather: Optional[AllGatherFn] = None,
        *,
        rank: int,
        world_size: int,
        name: str = "host",
        timeout_s: Optional[float] = None,
        all_to_allv: Optional[AllToAllvFn] = None,
    ) -> "Group":
        """A group over the host's transport: blocking ``send(peer, data)`` and
        ``recv(peer, out)`` (memoryviews of bytes; peers are ranks of this group) and, when
        given, ``all_gather(data, out)`` and ``all_to_allv(data, data_sizes, out, out_sizes)``
        (else built from send/recv; with all_to_allv, dispatch, combine and the collectives
        move their data in one host call each). An exception in one of them fails the call
        with an epcomm.Error (RuntimeError) naming it, never a crash."""
        transport = _HostTransport(send, recv, all_gather, world_size, all_to_allv)
        opts, h = _options(timeout_s), vp()
        check(
            load_library().epcomm_group_create_host(
                ctypes.byref(transport.callbacks),
                name.encode(),
                rank,
                world_size,
                ctypes.byref(opts),
                ctypes.byref(h),
            )
        )
        return cls._adopt(h, transport)

    @classmethod
    def from_torch(
        cls, process_group: Any = None, *, name: str = "torch", timeout_s: Optional[float] = None
    ) -> "Group":
        """A host-transport group over a torch.distributed process group (default: the world):
        send/recv/all_gather/all_to_all_single of CPU uint8 tensors (gloo). The ranks are the process group's;
        a peer's failure surfaces as an epcomm.Error when torch.distributed reports it (within
        the process group's own timeout)."""
        from ._torch import TorchTransport

        t = TorchTransport(process_group)
        return cls.host(
            t.send,
            t.recv,
            t.all_gather,
            rank=t.rank,
            world_size=t.world_size,
            name=name,
            timeout_s=timeout_s,
            all_to_allv=t.all_to_allv,
        )

    def check(self, status: int) -> None:
        """Raises the epcomm error for a call's ``status`` (naming a failed callback's
        exception, for a host-transport group)."""
        if self._transport is not None:
            self._transport.raise_for(status)
        else:
            check(status)

    def _tell_peers(self, fn: Callable[..., int], *args: Any) -> None:
        """After this rank failed to prepare a collective's arguments (any exception): calls
        the collective ``fn(*args)`` with no tensors, which the library refuses and reports to
        the peers, so their call fails at once ("rank R rejected its input") instead of pairing
        with this rank's next one or timing out. Its own error is dropped (the caller raises the
        original exception), including a host callback's."""
        fn(*args)
        if self._transport is not None:
            self._transport.error = None

    @property
    def handle(self) -> vp:
        """The C handle (epcomm_group *)."""
        if not self._h or self._closed:
            raise InvalidArgumentError("the group is closed", 2)
        return self._h

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        r = i32()
        with in_flight(self) as h:
            check(load_library().epcomm_group_rank(h, ctypes.byref(r)))
        return r.value

    @property
    def size(self) -> int:
        """The number of ranks."""
        s = i32()
        with in_flight(self) as h:
            check(load_library().epcomm_group_size(h, ctypes.byref(s)))
        return s.value

    def alloc(self, nbytes_or_shape: Any, dtype: Any = "uint8") -> Buffer:
        """Shared memory every peer of this group maps (epcomm_mem_alloc): a zeroed Buffer of
        ``nbytes_or_shape`` bytes (an int; ``dtype`` elements filling them) or of that shape
        (a sequence) of ``dtype``. ``torch.from_dlpack`` / ``numpy.asarray`` view it without a
        copy; dispatch and combine given it (or such a tensor) move its rows with plain
        stores and loads. Not collective. Freed when the Buffer and every tensor made from it
        are gone; ``close()`` refuses while any is alive. A group without shared memory
        (host transport, EPCOMM_SHM_DIRECT=0): an epcomm.Error (a RuntimeError)."""
        name = dtype_name(dtype)
        size = dtype_struct(dtype).bits // 8
        if isinstance(nbytes_or_shape, int):
            if nbytes_or_shape % size:
                raise InvalidArgumentError(
                    f"{nbytes_or_shape} bytes is not a whole number of {name} elements", 2)
            shape: Tuple[int, ...] = (nbytes_or_shape // size,)
        else:
            shape = tuple(int(d) for d in nbytes_or_shape)
        nbytes = size
        for d in shape:
            if d < 0:
                raise InvalidArgumentError(f"shape {shape} has a negative extent", 2)
            nbytes *= d
        mem = _SharedMemory(self, nbytes)
        return Buffer.view(mem.address, shape, name, mem)

    def close(self) -> None:
        """Ends the group (idempotent) after closing the managers made on it (All2All,
        EplbCommunicator); the C group is destroyed once theirs are (after the last array or
        tensor viewing their memory). Refused, everything left open: while buffers from
        ``alloc`` are alive (InvalidArgumentError), since destroying the group frees their
        memory; while a call on the group or on one of those managers is in flight on another
        thread (an epcomm.Error that is a RuntimeError, status EPCOMM_ERROR_INVALID_STATE)."""
        if self._h and not self._closed and self._allocations:
            raise InvalidArgumentError(
                f"the group has {self._allocations} live buffers from Group.alloc; drop them "
                "(and the tensors made from them) before close()", 2)
        super().close()

    def barrier(self) -> None:
        """Waits for every rank (collective)."""
        with in_flight(self) as h:
            self.check(load_library().epcomm_group_barrier(h))

    def _gather_like(self, fn_name: str, x: Any, sizes: Sequence[int],
                     out_rows: Callable[[], int]) -> Any:
        import numpy as np

        fn = getattr(load_library(), fn_name)
        with in_flight(self) as h:
            try:
                arr = np.asarray(x)
                if arr.dtype.hasobject:  # np.asarray wraps what it cannot read as numbers
                    raise TypeError(
                        f"x: expected numeric rows (a numpy array, a CPU tensor or a buffer), "
                        f"got {type(x).__name__}")
                a = Arg(arr, "x")  # compact, native byte order
                s = (ctypes.c_int64 * len(sizes))(*sizes)
                out = np.empty((int(out_rows()),) + a.array.shape[1:], a.array.dtype)
                o = Arg(out, "out", output=True)
            except BaseException:
                self._tell_peers(fn, h, None, None, None)
                raise
            self.check(fn(h, a.ptr, s, o.ptr))
        return out

    def all_gatherv(self, x: Any, sizes: Sequence[int]) -> Any:
        """Concatenates every rank's rows (numpy) in rank order."""
        return self._gather_like("epcomm_group_all_gatherv", x, sizes, lambda: sum(sizes))

    def reduce_scatterv(self, x: Any, sizes: Sequence[int]) -> Any:
        """Sums every rank's rows and returns this rank's slice (float32/float16)."""
        return self._gather_like("epcomm_group_reduce_scatterv", x, sizes,
                                 lambda: sizes[self.rank])

    def all_to_allv(self, x: Any, send_counts: Sequence[int], out: Any,
                    recv_counts: Sequence[int]) -> Any:
        """Sends ``send_counts[p]`` consecutive rows of ``x`` to each rank p and receives
        ``recv_counts[p]`` rows from each into consecutive rows of ``out`` (same row shape and
        dtype, written in place; contiguous); returns ``out`` (collective)."""
        fn = load_library().epcomm_group_all_to_allv
        with in_flight(self) as h:
            try:
                sc = (ctypes.c_int64 * len(send_counts))(*send_counts)
                rc = (ctypes.c_int64 * len(recv_counts))(*recv_counts)
                a, o = Arg(x, "x"), Arg(out, "out", output=True)
            except BaseException:
                self._tell_peers(fn, h, None, None, None, None)
                raise
            self.check(fn(h, a.ptr, sc, o.ptr, rc))
        o.finish()
        return out

    def send_recv(self, ops: Sequence[Tuple[str, int, Any]]) -> None:
        """A batch of ("send" | "recv", peer, tensor) operations, like torch.distributed's
        batch_isend_irecv: the j-th send from a to b fills the j-th receive on b from a (equal
        byte sizes; received tensors are written in place). Collective: every rank calls it,
        possibly with no operations."""
        fn = load_library().epcomm_group_send_recv
        kinds = {"send": 0, "recv": 1}
        with in_flight(self) as h:
            try:
                for kind, _, _ in ops:
                    if kind not in kinds:
                        raise InvalidArgumentError(
                            f"unknown operation {kind!r}; expected 'send' or 'recv'", 2)
                args = [Arg(t, f"ops[{i}]", output=k == "recv")
                        for i, (k, _, t) in enumerate(ops)]
                c = (P2POp * max(len(ops), 1))(*[
                    P2POp(kinds[k], _rank_arg(peer, f"ops[{i}] peer"), a.ptr)
                    for i, ((k, peer, _), a) in enumerate(zip(ops, args))
                ])
            except BaseException:
                self._tell_peers(fn, h, None, 1)
                raise
            self.check(fn(h, c if ops else None, len(ops)))
        for a in args:
            a.finish()

    def broadcast(self, tensor: Any, root: int) -> Any:
        """Copies rank ``root``'s ``tensor`` into ``tensor`` on every other rank (in place,
        same byte size); returns ``tensor`` (collective)."""
        fn = load_library().epcomm_group_broadcast
        with in_flight(self) as h:
            try:
                r = _rank_arg(root, "root")
                a = Arg(tensor, "tensor", output=True)
            except BaseException:
                self._tell_peers(fn, h, None, 0)
                raise
            self.check(fn(h, a.ptr, r))
        a.finish()
        return tensor

    def lost_ranks(self) -> List[int]:
        """Fault tolerance: the ranks this rank holds as lost, ascending (never this rank):
        after a call failed, the rank the failure was blamed on (dead, stalled, failed or
        gone) and every peer whose process is gone; ``[]`` while nothing failed. Works on a
        group broken by a failure. (``epcomm_group_lost_ranks``.)"""
        world = self.size
        mask = (i32 * world)()
        with in_flight(self) as h:
            self.check(_ft_library().epcomm_group_lost_ranks(h, mask, world))
        return [r for r in range(world) if mask[r]]

    def shrink(self, excluded: Sequence[int]) -> "Group":
        """Fault tolerance (as ``ncclCommShrink``): the ranks not in ``excluded`` (ascending,
        not this rank; usually ``lost_ranks()``) form a new group, renumbered in the old order,
        with the same options. Collective over the survivors, which must all pass the same list
        (otherwise every survivor raises and no group forms); a rank its peers hold as lost is
        refused. This group stays open (usually broken): close it separately.
        (``epcomm_group_shrink``.)"""
        ranks = [int(r) for r in excluded]
        for i, r in enumerate(ranks):
            if not -(2**31) <= r < 2**31:
                raise InvalidArgumentError(
                    f"excluded[{i}] is {r}; expected a rank of the group (0..{self.size})", 2
                )
        arr = (i32 * max(len(ranks), 1))(*ranks)
        new = vp()
        lib = _ft_library()
        with in_flight(self) as h:
            self.check(lib.epcomm_group_shrink(h, arr, len(ranks), ctypes.byref(new)))
        return Group._adopt(new, self._transport)

    def all_gather(self, data: bytes) -> List[bytes]:
        """Every rank's ``data`` (the same length on every rank), in rank order: for small
        metadata such as counts (collective)."""
        fn = load_library().epcomm_group_all_gather
        with in_flight(self) as h:
            try:
                raw = bytes(data)
                n, world = len(raw), self.size
                out = (ctypes.c_char * max(n * world, 1))()
                src = ctypes.create_string_buffer(raw, max(n, 1))
            except BaseException:
                self._tell_peers(fn, h, None, 0, None)
                raise
            self.check(fn(h, src, n, out))
        whole = bytes(out)[: n * world]
        return [whole[r * n : (r + 1) * n] for r in range(world)]


def _rank_arg(r: Any, what: str) -> int:
    """A rank argument as the C int32 it becomes: an integer (not a float: 1.5 is no rank) in
    int32's range, so ctypes neither raises after the peers are waiting nor truncates it."""
    v = operator.index(r)
    if not -(2**31) <= v < 2**31:
        raise InvalidArgumentError(f"{what} is {v}; expected a rank of the group", 2)
    return v


__all__: List[str] = ["Group", "SendFn", "RecvFn", "AllGatherFn"]
