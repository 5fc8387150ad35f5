"""Expert capacity: how many assignments an expert takes, and which ones are dropped beyond it."""

from __future__ import annotations

import math

import torch


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """``ceil(num_tokens * topk / num_experts * capacity_factor)``: the assignments one expert takes."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def capacity_keep_mask(
    probs: torch.Tensor, indices: torch.Tensor, num_experts: int, capacity: int, policy: str
) -> torch.Tensor:
    """``[T, k]`` bool: which assignments survive when each expert takes at most ``capacity``.

    ``policy="probs"`` keeps each expert's ``capacity`` highest-probability assignments,
    ``"position"`` its first ``capacity`` tokens in token order.
    """
    num_tokens = probs.shape[0]
    routed = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=probs.device)
    routed.scatter_(1, indices, True)
    if capacity >= num_tokens:
        return torch.ones_like(indices, dtype=torch.bool)
    if policy == "probs":
        dense = torch.full((num_tokens, num_experts), -1.0, dtype=torch.float32, device=probs.device)
        dense.scatter_(1, indices, probs.detach().float())
        chosen = dense.topk(capacity, dim=0).indices  # [capacity, E]
        kept = torch.zeros_like(routed).scatter_(0, chosen, True) & routed
    elif policy == "position":
        kept = routed & (routed.cumsum(dim=0) <= capacity)
    else:
        raise ValueError(f"moe_token_drop_policy must be 'probs' or 'position', got {policy!r}")
    return kept.gather(1, indices)
