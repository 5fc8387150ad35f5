"""Attention over a paged KV cache in plain PyTorch."""

from __future__ import annotations

import torch
from mcore_api import internal_api


@internal_api
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
    denominator (computed in float32; without sinks PyTorch's fused attention does the work).
    Returns ``[B, Q, n * d]``.
    """
    batch, num_queries, num_heads, head_dim = query.shape
    groups = key_cache.shape[1]
    length = key_slots.shape[1]
    flat_slots = key_slots.reshape(-1)
    keys = key_cache.index_select(0, flat_slots).view(batch, length, groups, head_dim).transpose(1, 2)
    values = value_cache.index_select(0, flat_slots).view(batch, length, groups, head_dim).transpose(1, 2)
    distance = query_positions[:, :, None] - torch.arange(length, device=query.device)  # [B, Q, L]
    allowed = distance >= 0
    if window_size is not None:
        allowed &= distance < window_size
    q = query.transpose(1, 2)  # [B, n, Q, d]
    if sink_logits is None:
        context = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=allowed[:, None], scale=scale, enable_gqa=True
        )
    else:
        per_group = num_heads // groups
        keys, values = keys.repeat_interleave(per_group, 1), values.repeat_interleave(per_group, 1)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [B, n, Q, L]
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        sinks = sink_logits.float().view(1, num_heads, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1]
        context = torch.matmul(probs.to(values.dtype), values)
    return context.transpose(1, 2).reshape(batch, num_queries, num_heads * head_dim)
