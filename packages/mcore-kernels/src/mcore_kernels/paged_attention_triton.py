"""Attention over a paged KV cache as one Triton kernel, for decode rows and prefill chunks alike.

A program takes one sequence, a tile of its queries and one key head: the tile's rows are
``BLOCK_Q`` query tokens times the ``BLOCK_H`` query heads that share the key head (grouped-query
heads folded into the rows, so keys are read once per group). It walks the keys the tile can see in
tiles of ``BLOCK_N`` positions, each key's cache slot looked up in the sequence's block table (so any
block size), with a running maximum and sum (float32 scores and softmax; a sink starts the sum at
one with the sink logit as the maximum). The loop runs ``KEY_TILES`` steps, a compile-time count
from the block table's width rounded up to a power of two (Triton 3.2's interpreter cannot loop to
a run-time bound; a CUDA graph replays a fixed grid); steps past the tile's last key do nothing.

Imported only when the Triton backend is chosen: importing ``mcore_kernels`` never imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 16  # key positions per step
PREFILL_ROWS = 64  # rows (query tokens x grouped heads) of a tile when sequences have several queries
DECODE_ROWS = 16  # the least a tile holds: tl.dot takes at least 16 rows


@triton.jit
def _key_tile(
    q, m, z, acc, k_ptr, v_ptr, table_ptr, seq, group, table_width, block_size, num_kv_heads,
    key_start, last_key, q_pos, scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One step of the online softmax over keys ``key_start .. key_start + BLOCK_N - 1``."""
    keys = key_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    present = keys <= last_key
    block = tl.load(table_ptr + seq * table_width + keys // block_size, mask=present, other=0)
    slot = block.to(tl.int64) * block_size + keys % block_size
    offsets = (slot * num_kv_heads + group)[:, None] * HEAD_DIM + dims[None, :]
    inside = present[:, None] & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + offsets, mask=inside, other=0.0)
    v = tl.load(v_ptr + offsets, mask=inside, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    distance = q_pos[:, None] - keys[None, :]
    visible = present[None, :] & (distance >= 0)
    if HAS_WINDOW:
        visible = visible & (distance < window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    z = z * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, z, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, starts_ptr, lens_ptr, sink_ptr, out_ptr,
    table_width, block_size, num_kv_heads, num_heads, scale, window,
    HEADS_PER_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, KEY_TILES: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    group = tl.program_id(2)
    q_start = tl.load(starts_ptr + seq)
    q_len = tl.load(starts_ptr + seq + 1) - q_start
    if tile * BLOCK_Q < q_len:
        seq_len = tl.load(lens_ptr + seq)
        rows = tl.arange(0, BLOCK_Q * BLOCK_H)
        token = tile * BLOCK_Q + rows // BLOCK_H
        head = group * HEADS_PER_GROUP + rows % BLOCK_H
        row_valid = (token < q_len) & (rows % BLOCK_H < HEADS_PER_GROUP)
        q_pos = seq_len - q_len + token  # the queries are the sequence's last q_len positions
        dims = tl.arange(0, BLOCK_D)
        row_offsets = ((q_start + token) * num_heads + head)[:, None] * HEAD_DIM + dims[None, :]
        inside = row_valid[:, None] & (dims[None, :] < HEAD_DIM)
        q = tl.load(q_ptr + row_offsets, mask=inside, other=0.0)
        last_key = tl.minimum(seq_len - q_len + tile * BLOCK_Q + BLOCK_Q, seq_len) - 1
        first_key = tl.zeros([], tl.int64)
        if HAS_WINDOW:
            first_key = tl.maximum(seq_len - q_len + tile * BLOCK_Q - window + 1, 0).to(tl.int64)
        first_key = first_key // BLOCK_N * BLOCK_N
        m = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
        z = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
        if HAS_SINK:  # the sink's term exp(sink - m) = 1 with the sink as the running maximum
            m = tl.load(sink_ptr + head, mask=row_valid, other=0.0).to(tl.float32)
            z = tl.full([BLOCK_Q * BLOCK_H], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_D], tl.float32)
        for step in range(KEY_TILES):
            key_start = first_key + step * BLOCK_N
            if key_start <= last_key:
                m, z, acc = _key_tile(
                    q, m, z, acc, k_ptr, v_ptr, table_ptr, seq, group, table_width, block_size,
                    num_kv_heads, key_start, last_key, q_pos, scale, window,
                    HEAD_DIM, BLOCK_D, BLOCK_N, HAS_WINDOW, PRECISION,
                )  # fmt: skip
        out = acc / tl.where(z > 0.0, z, 1.0)[:, None]
        tl.store(out_ptr + row_offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


def paged_attention(
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    query_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    window_size: int | None,
    sink_logits: torch.Tensor | None,
) -> torch.Tensor:
    """See ``mcore_kernels.paged_attention``; ``query`` and the blocks contiguous, ``sink_logits``
    float32 or ``None``."""
    tokens, heads, dim = query.shape
    _, block_size, groups, _ = key_blocks.shape
    out = torch.empty_like(query)
    if tokens == 0 or max_query_len == 0:
        return out
    per_group = heads // groups
    block_h = triton.next_power_of_2(per_group)
    rows = max(DECODE_ROWS if max_query_len == 1 else PREFILL_ROWS, block_h)
    block_q = rows // block_h
    key_tiles = triton.next_power_of_2(triton.cdiv(block_table.shape[1] * block_size, BLOCK_N))
    grid = (len(seq_lens), triton.cdiv(max_query_len, block_q), groups)
    _paged_attention_kernel[grid](
        query, key_blocks, value_blocks, block_table, query_starts, seq_lens,
        sink_logits if sink_logits is not None else query, out,
        block_table.shape[1], block_size, groups, heads, float(scale), window_size or 0,
        HEADS_PER_GROUP=per_group, HEAD_DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_N=BLOCK_N, KEY_TILES=key_tiles,
        HAS_WINDOW=window_size is not None, HAS_SINK=sink_logits is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
