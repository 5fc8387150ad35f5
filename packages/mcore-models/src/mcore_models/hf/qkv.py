"""Between separate q/k/v projections and the fused, group-interleaved ``linear_qkv`` layout."""

from __future__ import annotations

import torch


def pack_qkv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_groups: int, head_dim: int
) -> torch.Tensor:
    """Rows ``[q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]`` from separate
    ``[n*d, ...]``, ``[g*d, ...]``, ``[g*d, ...]`` tensors (weights or biases)."""
    rest = query.shape[1:]
    q = query.reshape(num_groups, -1, *rest)
    k = key.reshape(num_groups, head_dim, *rest)
    v = value.reshape(num_groups, head_dim, *rest)
    return torch.cat((q, k, v), dim=1).reshape(-1, *rest)


def unpack_qkv(
    fused: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_qkv``."""
    rest = fused.shape[1:]
    per_group = num_heads // num_groups
    grouped = fused.reshape(num_groups, (per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)
