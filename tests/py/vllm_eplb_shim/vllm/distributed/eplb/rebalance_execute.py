"""A stand-in for `vllm.distributed.eplb.rebalance_execute`: `move_to_buffer` with vLLM
0.34.0's signature over epcomm's transfer plan (`epcomm.eplb.LayerPlan`: which experts this
rank sends to which rank, which it receives into which buffer row, which it copies locally),
calling the communicator as vLLM's does (set_transfer_context with every rank's receive rows
for a push backend, add_send, add_recv, execute). epcomm's plan answers where every row goes;
vLLM's test then checks that a push lands where its receiver reads it."""

import numpy as np

from epcomm.eplb import LayerPlan


def _plan(old_indices, new_indices, num_local_experts, rank):
    return LayerPlan(np.asarray(old_indices).tolist(), np.asarray(new_indices).tolist(),
                     num_local_experts, rank)


def move_to_buffer(num_local_experts, old_indices, new_indices, expert_weights,
                   expert_weights_buffers, stream, ep_rank, communicator, layer_idx=0,
                   enable_migration_batching=False, migration_batches=None):
    """One layer's transfers of rank ``ep_rank`` into ``expert_weights_buffers`` (epcomm's
    plan; migration batching changes only the order of the transfers, not where rows go)."""
    ranks = np.asarray(old_indices).shape[0] // num_local_experts
    recv_rows = None
    if communicator.needs_recv_rows:
        recv_rows = []
        for r in range(ranks):
            with _plan(old_indices, new_indices, num_local_experts, r) as p:
                recv_rows.append({int(e): int(row) for e, row, _ in p.recvs.tolist()})
    communicator.set_transfer_context(old_indices, layer_idx, recv_rows)
    with _plan(old_indices, new_indices, num_local_experts, ep_rank) as p:
        for dst, src in p.local_copies.tolist():
            for w, b in zip(expert_weights, expert_weights_buffers):
                b[dst].copy_(w[src])
        for expert, src, dst_rank in p.sends.tolist():
            communicator.add_send([w[src] for w in expert_weights], dst_rank, expert_id=expert)
        for expert, row, src_rank in p.recvs.tolist():
            communicator.add_recv([b[row] for b in expert_weights_buffers], src_rank,
                                  expert_id=expert)
    communicator.execute()


def move_from_buffer(*args, **kwargs):
    raise NotImplementedError("not part of epcomm's stand-in for vLLM")
