"""Rotary position embedding as a Triton kernel: the same arithmetic as ``rope_reference`` (float32,
one rounding of the output). Each program rotates a block of rows; a row's table row is its index
divided by the group size, so the tables are read once per token rather than expanded per head.
The backward is the same kernel with the transposed rotation.

Imported only when the Triton backend is chosen: importing ``mcore_kernels`` never imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements per program (rows x rotary pairs), at most.
_BLOCK_ELEMENTS = 4096


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_rows,
    group,
    width,
    rotary,
    INTERLEAVED: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    present = rows < n_rows
    x_base = rows.to(tl.int64)[:, None] * width
    table_base = (rows // group).to(tl.int64)[:, None] * rotary
    pairs = tl.arange(0, BLOCK_PAIRS)
    inside = present[:, None] & (pairs < rotary // 2)[None, :]
    if INTERLEAVED:
        first = 2 * pairs[None, :]
        second = first + 1
    else:
        first = pairs[None, :]
        second = first + rotary // 2
    a = tl.load(x_ptr + x_base + first, mask=inside, other=0.0)
    b = tl.load(x_ptr + x_base + second, mask=inside, other=0.0).to(tl.float32)
    cos_a = tl.load(cos_ptr + table_base + first, mask=inside, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_ptr + table_base + second, mask=inside, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_ptr + table_base + first, mask=inside, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_ptr + table_base + second, mask=inside, other=0.0).to(tl.float32)
    af = a.to(tl.float32)
    if TRANSPOSE:
        out_a = af * cos_a + b * sin_b
        out_b = b * cos_b - af * sin_a
    else:
        out_a = af * cos_a - b * sin_a
        out_b = b * cos_b + af * sin_b
    tl.store(out_ptr + x_base + first, out_a.to(a.dtype), mask=inside)
    tl.store(out_ptr + x_base + second, out_b.to(a.dtype), mask=inside)
    if BLOCK_PASS > 0:  # the dimensions past the rotary ones are copied
        rest = rotary + tl.arange(0, BLOCK_PASS)[None, :]
        copied = present[:, None] & (rest < width)
        tl.store(out_ptr + x_base + rest, tl.load(x_ptr + x_base + rest, mask=copied), mask=copied)


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, transpose: bool
) -> torch.Tensor:
    """As ``rope_reference.rotate``, for contiguous ``x [R, d]`` and ``cos, sin [C, r]``."""
    rows, width = x.shape
    tables, rotary = cos.shape
    out = torch.empty_like(x)
    if rows == 0:
        return out
    block_pairs = triton.next_power_of_2(rotary // 2)
    block_pass = 0 if rotary == width else triton.next_power_of_2(width - rotary)
    block_m = min(triton.next_power_of_2(rows), max(1, _BLOCK_ELEMENTS // block_pairs))
    _rope_kernel[(triton.cdiv(rows, block_m),)](
        x,
        cos,
        sin,
        out,
        rows,
        rows // tables,
        width,
        rotary,
        INTERLEAVED=interleaved,
        TRANSPOSE=transpose,
        BLOCK_M=block_m,
        BLOCK_PAIRS=block_pairs,
        BLOCK_PASS=block_pass,
    )
    return out
