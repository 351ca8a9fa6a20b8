"""The host transport over a torch.distributed process group (CPU uint8 tensors; gloo)."""

from __future__ import annotations

from typing import Any


class TorchTransport:
    """send/recv/all_gather/all_to_allv for ``Group.host`` over ``process_group`` (None: the world).
    Zero-byte messages are not sent: both sides know the size, so both skip them."""

    def __init__(self, process_group: Any = None):
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        # Group rank -> global rank, which send/recv address.
        self._global = dist.get_process_group_ranks(self.group)

    def _tensor(self, view: memoryview) -> Any:
        return self._torch.frombuffer(view, dtype=self._torch.uint8)

    def send(self, peer: int, data: memoryview) -> None:
        """Blocking send of ``data`` to group rank ``peer``."""
        if len(data):
            self._dist.send(self._tensor(data), dst=self._global[peer], group=self.group)

    def recv(self, peer: int, out: memoryview) -> None:
        """Blocking receive into ``out`` (in place) from group rank ``peer``."""
        if len(out):
            self._dist.recv(self._tensor(out), src=self._global[peer], group=self.group)

    def all_gather(self, data: memoryview, out: memoryview) -> None:
        """Every rank's ``data`` into ``out`` in rank order (the slices are written in place)."""
        if not len(data):
            return
        parts = list(self._tensor(out).chunk(self.world_size))
        self._dist.all_gather(parts, self._tensor(data), group=self.group)

    def all_to_allv(self, data: memoryview, data_sizes: list, out: memoryview,
                    out_sizes: list) -> None:
        """``data_sizes[p]`` bytes of ``data`` to each rank p and ``out_sizes[p]`` bytes from
        each into ``out`` (in place): one ``all_to_all_single`` with split sizes."""
        self._dist.all_to_all_single(
            self._tensor(out), self._tensor(data), output_split_sizes=out_sizes,
            input_split_sizes=data_sizes, group=self.group,
        )
