"""A stand-in for `vllm.distributed.eplb.migration_scheduler` over epcomm
(`epcomm.eplb_algo.schedule_migration_batches`): `MigrationFlow` and the batches of one layer.
What epcomm has no entry point for raises NotImplementedError saying so."""

from dataclasses import dataclass, field
from typing import List

import epcomm.eplb_algo as _algo


@dataclass
class MigrationFlow:
    src_rank: int
    dst_rank: int
    expert_ids: List[int] = field(default_factory=list)


def schedule_migration_batches(num_local_experts, old_indices, new_indices):
    """epcomm's batches of one layer, as vLLM's MigrationFlow lists."""
    return [[MigrationFlow(s, d, list(e)) for s, d, e in batch]
            for batch in _algo.schedule_migration_batches(num_local_experts, old_indices,
                                                          new_indices)]


def schedule_migration_batches_for_layers(*args, **kwargs):
    raise NotImplementedError("not part of epcomm's stand-in for vLLM")
