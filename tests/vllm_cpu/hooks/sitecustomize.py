"""Test hooks for tests/vllm_cpu/run.py, loaded by every Python process the test starts (the
driver puts this directory on PYTHONPATH; vLLM's CPU workers are spawned, so nothing else of
the driver reaches them). Nothing happens unless ``EPCOMM_VLLM_TEST_HOOK`` is set, to a
comma-separated list of:

* ``stats``: each process writes what epcomm's all2all manager moved (its ``stats``, the
  manager's class and transport) to ``$EPCOMM_VLLM_TEST_STATS/stats-<pid>.json`` after every
  dispatch and combine: the proof that epcomm's manager served vLLM's calls.
* ``broken-combine``: epcomm's combine doubles what it returns (a deliberately wrong
  reduction: the negative control, which the greedy-token comparison must catch).
* ``control``: vLLM's own ``AgRsAll2AllManager`` gets the ``all_gatherv`` and
  ``reduce_scatterv`` vLLM's CPU communicator lacks, written with plain torch.distributed gloo
  collectives (pad to the largest count and ``all_gather``; ``all_reduce`` and slice): the
  plain-torch control (run with ``EPCOMM_VLLM_MANAGER=0``).
"""

import os

_modes = [m for m in os.environ.get("EPCOMM_VLLM_TEST_HOOK", "").split(",") if m]


def _stats():
    import json

    from epcomm.vllm import EpcommAll2AllManager

    out_dir = os.environ["EPCOMM_VLLM_TEST_STATS"]

    def record(self):
        path = os.path.join(out_dir, f"stats-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "class": type(self).__name__,
                       "transport": self.transport, "world_size": self.world_size,
                       "rank": self.rank, **self.stats}, f)
        os.replace(path + ".tmp", path)

    gather, combine = EpcommAll2AllManager._gather, EpcommAll2AllManager._combine

    def _gather(self, tensors, is_sequence_parallel):
        out = gather(self, tensors, is_sequence_parallel)
        record(self)
        return out

    def _combine(self, hidden_states, is_sequence_parallel, output):
        out = combine(self, hidden_states, is_sequence_parallel, output)
        record(self)
        return out

    EpcommAll2AllManager._gather = _gather
    EpcommAll2AllManager._combine = _combine


def _broken_combine():
    from epcomm.vllm import EpcommAll2AllManager

    combine = EpcommAll2AllManager._combine

    def _combine(self, hidden_states, is_sequence_parallel, output):
        out = combine(self, hidden_states, is_sequence_parallel, output)
        out.mul_(2)  # the deliberate defect
        return out

    EpcommAll2AllManager._combine = _combine


def _control():
    import torch
    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    def all_gatherv(self, input_, dim=0, sizes=None):
        assert dim == 0, dim
        world = self.world_size

        def one(t):
            counts = sizes if sizes is not None else [t.shape[0]] * world
            top = max(counts)
            padded = t.new_zeros((top,) + tuple(t.shape[1:]))
            padded[: t.shape[0]] = t
            parts = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(parts, padded, group=self.device_group)
            return torch.cat([p[:n] for p, n in zip(parts, counts)])

        if isinstance(input_, (list, tuple)):
            return [one(t) for t in input_]
        return one(input_)

    def reduce_scatterv(self, input_, dim=-1, sizes=None):
        assert dim == 0, dim
        world = self.world_size
        counts = sizes if sizes is not None else [input_.shape[0] // world] * world
        x = input_.contiguous().clone()
        dist.all_reduce(x, group=self.device_group)
        start = sum(counts[: self.rank_in_group])
        return x[start:start + counts[self.rank_in_group]].clone()

    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv


for _m in _modes:
    {"stats": _stats, "broken-combine": _broken_combine, "control": _control}[_m]()
