"""vLLM's `DefaultEplbPolicy` with every classmethod answered by epcomm: numpy arrays in and
out where vLLM's take numpy arrays, torch tensors where vLLM's `rebalance_experts` takes and
returns them."""

import torch

from epcomm import eplb_algo


class DefaultEplbPolicy:
    @classmethod
    def balanced_packing(cls, weight, num_packs):
        return eplb_algo.balanced_packing(weight, num_packs)

    @classmethod
    def replicate_experts(cls, weight, num_phy):
        return eplb_algo.replicate_experts(weight, num_phy)

    @classmethod
    def rebalance_experts_hierarchical(
        cls, weight, num_physical_experts, num_groups, num_nodes, num_gpus
    ):
        return eplb_algo.rebalance_experts_hierarchical(
            weight, num_physical_experts, num_groups, num_nodes, num_gpus
        )

    @classmethod
    def preserve_intragpu_slots(cls, phy2log, num_ranks, old_phy2log):
        return eplb_algo.preserve_intragpu_slots(phy2log, num_ranks, old_phy2log)

    @classmethod
    def rebalance_experts(
        cls,
        weight,
        num_replicas,
        num_groups,
        num_nodes,
        num_ranks,
        old_global_expert_indices=None,
    ):
        weight_np = weight.float().cpu().numpy()
        old = None
        if old_global_expert_indices is not None:
            old = old_global_expert_indices.cpu().numpy()
        phy2log = eplb_algo.rebalance_experts(
            weight_np, num_replicas, num_groups, num_nodes, num_ranks, old
        )
        return torch.from_numpy(phy2log)
