"""The PyTorch reference of decode attention over a paged KV cache: the numerical oracle of the
native kernel, and the path wherever that kernel cannot run."""

from __future__ import annotations

import torch


def paged_decode_attention(
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window_size: int | None,
    sink_logits: torch.Tensor | None,
) -> torch.Tensor:
    """See ``mcore_kernels.paged_decode_attention``; scores and softmax in float32."""
    batch, heads, dim = query.shape
    _, block_size, groups, _ = key_blocks.shape
    width = block_table.shape[1]
    if len(positions) and not 0 <= int(positions.min()) <= int(positions.max()) < width * block_size:
        raise ValueError(
            f"paged_decode_attention: positions must lie in the {width} blocks of the block table"
        )
    slots = block_table.long()[:, :, None] * block_size + torch.arange(block_size, device=query.device)
    slots = slots.reshape(batch, width * block_size)  # the cache row of each key position
    keys = key_blocks.reshape(-1, groups, dim)[slots].float()  # [B, L, g, d]
    values = value_blocks.reshape(-1, groups, dim)[slots].float()
    per_group = heads // groups
    q = query.float().view(batch, groups, per_group, dim)
    scores = torch.einsum("bghd,blgd->bghl", q, keys) * scale
    distance = positions.view(-1, 1) - torch.arange(width * block_size, device=query.device)
    visible = distance >= 0
    if window_size is not None:
        visible &= distance < window_size
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sink_logits is not None:
        sinks = sink_logits.float().view(1, groups, per_group, 1).expand(batch, -1, -1, 1)
        scores = torch.cat([scores, sinks], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : width * block_size]
    context = torch.einsum("bghl,blgd->bghd", probs, values)
    return context.reshape(batch, heads, dim).to(query.dtype)
