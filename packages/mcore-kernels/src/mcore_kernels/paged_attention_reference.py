"""The PyTorch references of attention over a paged KV cache (decode rows, and sequences of
several queries such as prefill chunks): the numerical oracles of the native and Triton kernels,
and the path wherever those cannot run."""

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


def paged_attention(
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window_size: int | None,
    sink_logits: torch.Tensor | None,
) -> torch.Tensor:
    """See ``mcore_kernels.paged_attention``: each query row as a decode row at its own position
    over its sequence's block table row."""
    query_lens = query_starts[1:] - query_starts[:-1]
    if len(seq_lens) and (
        int(query_starts[0]) != 0
        or int(query_starts[-1]) != query.shape[0]
        or int(query_lens.min()) < 0
        or bool((seq_lens < query_lens).any())
    ):
        raise ValueError(
            "paged_attention: query_starts must rise from 0 to the query's tokens and every "
            "sequence must hold at least its queries (seq_lens >= query lengths)"
        )
    sequence = torch.repeat_interleave(torch.arange(len(seq_lens), device=query.device), query_lens)
    row = torch.arange(query.shape[0], device=query.device)
    positions = seq_lens[sequence] - query_lens[sequence] + row - query_starts[sequence]
    return paged_decode_attention(
        query, key_blocks, value_blocks, block_table[sequence], positions, scale, window_size, sink_logits
    )
