"""MoE token permutation as Triton kernels, one program per token, looping over the hidden columns
in blocks: ``scatter`` writes a token's (optionally weighted) vector to each of its kept rows (the
permute, and the unpermute's backward, which also takes the dot product giving each probability's
gradient); ``gather`` sums a token's kept rows, optionally weighted (the unpermute, and the
permute's backward). Float32 arithmetic, one rounding per output; no atomics (each row belongs to
one assignment).

Imported only when the Triton backend is chosen: importing ``mcore_kernels`` never imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 1024


@triton.jit
def _scatter_kernel(
    src_ptr,
    row_map_ptr,
    weights_ptr,
    dst_ptr,
    other_ptr,
    dots_ptr,
    hidden,
    K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_DOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    for j in tl.static_range(K):
        row = tl.load(row_map_ptr + token * K + j)
        if row >= 0:
            weight = tl.full([], 1.0, tl.float32)
            if HAS_WEIGHTS:
                weight = tl.load(weights_ptr + token * K + j).to(tl.float32)
            dot = tl.zeros([BLOCK], dtype=tl.float32)
            for block in range(BLOCKS):
                start = block * BLOCK
                inside = start + cols < hidden
                x = tl.load(src_ptr + token * hidden + start + cols, mask=inside, other=0.0).to(tl.float32)
                tl.store(
                    dst_ptr + row * hidden + start + cols,
                    (x * weight).to(dst_ptr.dtype.element_ty),
                    mask=inside,
                )
                if HAS_DOTS:
                    other = tl.load(other_ptr + row * hidden + start + cols, mask=inside, other=0.0)
                    dot += x * other.to(tl.float32)
            if HAS_DOTS:
                tl.store(dots_ptr + token * K + j, tl.sum(dot, axis=0))


@triton.jit
def _gather_kernel(
    src_ptr,
    row_map_ptr,
    weights_ptr,
    dst_ptr,
    hidden,
    K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    for block in range(BLOCKS):
        start = block * BLOCK
        inside = start + cols < hidden
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(row_map_ptr + token * K + j)
            weight = tl.where(row >= 0, 1.0, 0.0)
            if HAS_WEIGHTS:
                weight = weight * tl.load(weights_ptr + token * K + j).to(tl.float32)
            safe = tl.maximum(row, 0)
            x = tl.load(
                src_ptr + safe * hidden + start + cols, mask=inside & (row + 0 * cols >= 0), other=0.0
            )
            total += x.to(tl.float32) * weight
        tl.store(dst_ptr + token * hidden + start + cols, total.to(dst_ptr.dtype.element_ty), mask=inside)


def _block(hidden: int) -> int:
    """Columns a loop step reads; the kernels loop over ``BLOCKS = cdiv(hidden, BLOCK)`` steps, a
    compile-time count (Triton 3.2's interpreter cannot loop to a run-time bound with numpy 2.4)."""
    return min(_MAX_BLOCK, triton.next_power_of_2(max(hidden, 1)))


def scatter(
    src: torch.Tensor,
    row_map: torch.Tensor,
    weights: torch.Tensor | None,
    num_rows: int,
    other: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dst [num_rows, h], dots [T, k] or None)``: ``dst[row_map[t, j]] = weights[t, j] * src[t]``
    (zeros elsewhere); with ``other [num_rows, h]``, ``dots[t, j] = <src[t], other[row_map[t, j]]>``
    (float32, zero for dropped assignments). All inputs contiguous."""
    tokens, hidden = src.shape
    dst = torch.zeros(num_rows, hidden, device=src.device, dtype=src.dtype)
    dots = None if other is None else torch.zeros(row_map.shape, device=src.device, dtype=torch.float32)
    if tokens:
        _scatter_kernel[(tokens,)](
            src,
            row_map,
            weights if weights is not None else src,
            dst,
            other if other is not None else src,
            dots if dots is not None else src,
            hidden,
            K=row_map.shape[1],
            HAS_WEIGHTS=weights is not None,
            HAS_DOTS=other is not None,
            BLOCK=_block(hidden),
            BLOCKS=triton.cdiv(hidden, _block(hidden)),
        )
    return dst, dots


def gather(src: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``[T, h]``: ``sum over kept j of weights[t, j] * src[row_map[t, j]]``. All inputs contiguous."""
    tokens, hidden = row_map.shape[0], src.shape[1]
    dst = torch.empty(tokens, hidden, device=src.device, dtype=src.dtype)
    if tokens:
        _gather_kernel[(tokens,)](
            src,
            row_map,
            weights if weights is not None else src,
            dst,
            hidden,
            K=row_map.shape[1],
            HAS_WEIGHTS=weights is not None,
            BLOCK=_block(hidden),
            BLOCKS=triton.cdiv(hidden, _block(hidden)),
        )
    return dst
