"""The parts of vLLM's `eplb_state` that its EPLB tests import."""

import torch

from epcomm import eplb_algo


def compute_logical_maps(physical_to_logical_map, num_logical_experts):
    """vLLM's signature and result types (tensors of the input's dtype) over epcomm's
    `compute_logical_maps`."""
    assert physical_to_logical_map.device.type == "cpu"
    dtype = physical_to_logical_map.dtype
    log2phy, logcnt = eplb_algo.compute_logical_maps(physical_to_logical_map, num_logical_experts)
    return torch.from_numpy(log2phy).to(dtype), torch.from_numpy(logcnt).to(dtype)


def _compute_eplb_load_stats(num_tokens_per_rank):
    """vLLM's two reductions as they are (mean and max tokens per rank, summed over layers)."""
    avg_tokens = num_tokens_per_rank.mean(dim=1).sum()
    max_tokens = num_tokens_per_rank.max(dim=1).values.sum()
    return avg_tokens, max_tokens
