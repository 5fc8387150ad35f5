"""Attention over a paged KV cache, read through block tables: ``paged_decode_attention`` (one
query per sequence) and ``paged_attention`` (sequences of several queries, e.g. prefill chunks,
causal within them). On CUDA they run one Triton kernel (``paged_attention_triton``); on the CPU
decode runs mcore-kernels' C++ kernel (``native_build``) when it builds here; elsewhere the PyTorch
references (``dispatch``)."""

from __future__ import annotations

import importlib

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
    backend = select_backend(_OP, query, kernels=("triton", "native"))
    if backend == "reference":
        return paged_attention_reference.paged_decode_attention(
            query, key_blocks, value_blocks, block_table, positions, scale, window_size, sinks
        )
    if backend == "triton":
        starts = torch.arange(len(positions) + 1, device=query.device)
        return _triton(
            query, key_blocks, value_blocks, block_table, starts, positions + 1, 1, scale, window_size, sinks
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


def paged_attention(
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    window_size: int | None = None,
    sink_logits: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``B`` sequences' queries ``query [T, n, d]`` over a paged cache
    ``key_blocks, value_blocks [num_blocks, block_size, g, d]`` that already holds their keys.
    Sequence ``b``'s queries are rows ``query_starts[b] .. query_starts[b + 1] - 1`` (int64
    ``[B + 1]``, from 0 to ``T``), the last of its ``seq_lens[b]`` positions (int64 ``[B]``),
    whose keys live in blocks ``block_table[b, 0], ...``. A query at position ``p`` sees keys
    ``<= p``, with ``window_size`` fewer than ``window_size`` back; ``sink_logits [n]`` join each
    head's denominator. ``max_query_len`` (the longest sequence's queries) spares the Triton path
    reading it from the device. Float32 scores and softmax; ``[T, n, d]`` in ``query``'s dtype."""
    _check_cache("paged_attention", query, key_blocks, value_blocks, scale, window_size, sink_logits)
    _check_sequences(query, block_table, query_starts, seq_lens, max_query_len)
    sinks = None if sink_logits is None else sink_logits.float().contiguous()
    if select_backend("paged_attention", query) == "reference":
        return paged_attention_reference.paged_attention(
            query, key_blocks, value_blocks, block_table, query_starts, seq_lens, scale, window_size, sinks
        )
    if max_query_len is None:
        max_query_len = int((query_starts[1:] - query_starts[:-1]).max()) if len(seq_lens) else 0
    return _triton(
        query,
        key_blocks,
        value_blocks,
        block_table,
        query_starts,
        seq_lens,
        max_query_len,
        scale,
        window_size,
        sinks,
    )


def _triton(query, key_blocks, value_blocks, table, starts, seq_lens, max_query_len, scale, window, sinks):
    kernels = importlib.import_module("mcore_kernels.paged_attention_triton")
    return kernels.paged_attention(
        query.contiguous(),
        key_blocks.contiguous(),
        value_blocks.contiguous(),
        table.contiguous(),
        starts.contiguous(),
        seq_lens.contiguous(),
        max_query_len,
        scale,
        window,
        sinks,
    )


def _check_sequences(query, block_table, query_starts, seq_lens, max_query_len) -> None:
    for name, tensor in {
        "block_table": block_table,
        "query_starts": query_starts,
        "seq_lens": seq_lens,
    }.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"paged_attention: {name} must be a tensor, got {type(tensor).__name__}")
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int64:
        raise ValueError(
            f"paged_attention: seq_lens must be int64 [B], got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    batch = len(seq_lens)
    if query_starts.shape != (batch + 1,) or query_starts.dtype != torch.int64:
        raise ValueError(
            f"paged_attention: query_starts must be int64 [B + 1 = {batch + 1}], got "
            f"{query_starts.dtype} {tuple(query_starts.shape)}"
        )
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"paged_attention: block_table must be [B={batch}, W], got {tuple(block_table.shape)}"
        )
    if max_query_len is not None and (
        isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0
    ):
        raise ValueError(
            f"paged_attention: max_query_len must be a non-negative int or None, got {max_query_len!r}"
        )
    if {t.device for t in (query, block_table, query_starts, seq_lens)} != {query.device}:
        raise ValueError("paged_attention: all tensors must be on one device")


def _check(query, key_blocks, value_blocks, block_table, positions, scale, window_size, sink_logits) -> None:
    for name, tensor in {"block_table": block_table, "positions": positions}.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a tensor, got {type(tensor).__name__}")
    _check_cache(_OP, query, key_blocks, value_blocks, scale, window_size, sink_logits)
    batch = query.shape[0]
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
    devices = {t.device for t in (query, key_blocks, value_blocks, block_table, positions)}
    if len(devices) > 1:
        raise ValueError(f"{_OP}: all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_cache(op, query, key_blocks, value_blocks, scale, window_size, sink_logits) -> None:
    """The checks both ops share: the query, the cache blocks and the options."""
    for name, tensor in {"query": query, "key_blocks": key_blocks, "value_blocks": value_blocks}.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(tensor).__name__}")
    if query.dim() != 3 or key_blocks.dim() != 4:
        raise ValueError(
            f"{op}: query must be [B, n, d] and key_blocks [num_blocks, block_size, g, d], got "
            f"{tuple(query.shape)} and {tuple(key_blocks.shape)}"
        )
    if value_blocks.shape != key_blocks.shape:
        raise ValueError(
            f"{op}: value_blocks {tuple(value_blocks.shape)} differ from key_blocks {tuple(key_blocks.shape)}"
        )
    _, heads, dim = query.shape
    groups = key_blocks.shape[2]
    if key_blocks.shape[3] != dim or heads % groups:
        raise ValueError(
            f"{op}: query heads {heads} of dim {dim} do not fit {groups} key heads of dim {key_blocks.shape[3]}"
        )
    if not query.is_floating_point() or key_blocks.dtype != query.dtype or value_blocks.dtype != query.dtype:
        raise TypeError(
            f"{op}: query, key_blocks and value_blocks must share one floating dtype, got "
            f"{query.dtype}, {key_blocks.dtype}, {value_blocks.dtype}"
        )
    if not scale > 0:
        raise ValueError(f"{op}: scale must be positive, got {scale}")
    if window_size is not None and (
        isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1
    ):
        raise ValueError(f"{op}: window_size must be a positive int or None, got {window_size!r}")
    if sink_logits is not None and (
        not isinstance(sink_logits, torch.Tensor) or sink_logits.shape != (heads,)
    ):
        raise ValueError(f"{op}: sink_logits must be a tensor of shape [{heads}]")
    if key_blocks.device != query.device or value_blocks.device != query.device:
        raise ValueError(f"{op}: the query and the cache blocks must be on one device")
