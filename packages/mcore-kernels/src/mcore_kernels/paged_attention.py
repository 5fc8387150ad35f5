"""``paged_decode_attention``: one query per sequence attending over its keys and values in a
paged KV cache, read through the sequence's block table. On the CPU it runs mcore-kernels' C++
kernel (``native_build``) when it builds here, else the PyTorch reference (``dispatch``)."""

from __future__ import annotations

import torch

from . import paged_attention_reference
from .dispatch import select_backend

_OP = "paged_decode_attention"


def paged_decode_attention(
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    window_size: int | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of ``query [B, n, d]`` over a paged cache ``key_blocks, value_blocks
    [num_blocks, block_size, g, d]`` (``n`` a multiple of ``g``: grouped-query heads share
    keys). Sequence ``b`` is at position ``positions[b]`` and its keys at positions ``0 ..
    positions[b]`` live in blocks ``block_table[b, 0], block_table[b, 1], ...``; it sees those
    keys, or with ``window_size`` the last ``window_size`` of them. ``sink_logits [n]`` join each
    head's softmax denominator. Scores and softmax are float32; returns ``[B, n, d]`` in
    ``query``'s dtype."""
    _check(query, key_blocks, value_blocks, block_table, positions, scale, window_size, sink_logits)
    sinks = None if sink_logits is None else sink_logits.float().contiguous()
    if select_backend(_OP, query, kernels=("native",)) == "reference":
        return paged_attention_reference.paged_decode_attention(
            query, key_blocks, value_blocks, block_table, positions, scale, window_size, sinks
        )
    return torch.ops.mcore_kernels_cpu.paged_decode_attention(
        query.contiguous(),
        key_blocks.contiguous(),
        value_blocks.contiguous(),
        block_table.contiguous(),
        positions.contiguous(),
        float(scale),
        0 if window_size is None else int(window_size),
        sinks,
    )


def _check(query, key_blocks, value_blocks, block_table, positions, scale, window_size, sink_logits) -> None:
    tensors = {"query": query, "key_blocks": key_blocks, "value_blocks": value_blocks}
    tensors.update(block_table=block_table, positions=positions)
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a tensor, got {type(tensor).__name__}")
    if query.dim() != 3 or key_blocks.dim() != 4:
        raise ValueError(
            f"{_OP}: query must be [B, n, d] and key_blocks [num_blocks, block_size, g, d], got "
            f"{tuple(query.shape)} and {tuple(key_blocks.shape)}"
        )
    if value_blocks.shape != key_blocks.shape:
        raise ValueError(
            f"{_OP}: value_blocks {tuple(value_blocks.shape)} differ from key_blocks {tuple(key_blocks.shape)}"
        )
    batch, heads, dim = query.shape
    groups = key_blocks.shape[2]
    if key_blocks.shape[3] != dim or heads % groups:
        raise ValueError(
            f"{_OP}: query heads {heads} of dim {dim} do not fit {groups} key heads of dim {key_blocks.shape[3]}"
        )
    if not query.is_floating_point() or key_blocks.dtype != query.dtype or value_blocks.dtype != query.dtype:
        raise TypeError(
            f"{_OP}: query, key_blocks and value_blocks must share one floating dtype, got "
            f"{query.dtype}, {key_blocks.dtype}, {value_blocks.dtype}"
        )
    if (
        block_table.dim() != 2
        or block_table.shape[0] != batch
        or block_table.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"{_OP}: block_table must be int32/int64 [B={batch}, W], got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if positions.shape != (batch,) or positions.dtype != torch.int64:
        raise ValueError(
            f"{_OP}: positions must be int64 [B={batch}], got {positions.dtype} {tuple(positions.shape)}"
        )
    if not scale > 0:
        raise ValueError(f"{_OP}: scale must be positive, got {scale}")
    if window_size is not None and (
        isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1
    ):
        raise ValueError(f"{_OP}: window_size must be a positive int or None, got {window_size!r}")
    if sink_logits is not None and (
        not isinstance(sink_logits, torch.Tensor) or sink_logits.shape != (heads,)
    ):
        raise ValueError(f"{_OP}: sink_logits must be a tensor of shape [{heads}]")
    devices = {t.device for t in (query, key_blocks, value_blocks, block_table, positions)}
    if len(devices) > 1:
        raise ValueError(f"{_OP}: all tensors must be on one device, got {sorted(map(str, devices))}")
