"""Attention over a paged KV cache in plain PyTorch."""

from __future__ import annotations

import torch


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_slots: torch.Tensor,
    query_positions: torch.Tensor,
    *,
    scale: float,
    window_size: int | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``B`` sequences over their cached keys.

    ``query [B, Q, n, d]``: ``Q`` query tokens per sequence at ``query_positions [B, Q]``.
    ``key_cache, value_cache [slots, g, d]``: the cache of one layer, flattened over blocks.
    ``key_slots [B, L]``: the cache slot of each sequence's key at positions ``0 .. L - 1``
    (any valid slot past a sequence's end: a query at position ``p`` sees keys ``<= p`` only,
    and ``p - j < window_size`` with a window). ``sink_logits [n]`` join each softmax
    denominator. Scores and softmax are float32. Returns ``[B, Q, n * d]``.
    """
    batch, num_queries, num_heads, head_dim = query.shape
    groups = key_cache.shape[1]
    per_group = num_heads // groups
    keys = key_cache[key_slots].permute(0, 2, 3, 1).unsqueeze(2)  # [B, g, 1, d, L]
    values = value_cache[key_slots].permute(0, 2, 1, 3).unsqueeze(2)  # [B, g, 1, L, d]
    q = query.view(batch, num_queries, groups, per_group, head_dim).permute(0, 2, 3, 1, 4)  # [B, g, r, Q, d]
    scores = torch.matmul(q, keys).float() * scale  # [B, g, r, Q, L]
    key_positions = torch.arange(key_slots.shape[1], device=query.device)
    distance = query_positions[:, :, None] - key_positions  # [B, Q, L]
    allowed = distance >= 0
    if window_size is not None:
        allowed &= distance < window_size
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if sink_logits is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sinks = sink_logits.float().view(1, groups, per_group, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1]
    context = torch.matmul(probs.to(values.dtype), values)  # [B, g, r, Q, d]
    return context.permute(0, 3, 1, 2, 4).reshape(batch, num_queries, num_heads * head_dim)
