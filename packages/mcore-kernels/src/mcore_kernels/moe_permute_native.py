"""MoE token permutation on the CPU: ``scatter`` and ``gather`` of ``moe_permute_triton`` (same
arguments and results) over the C++ kernels of ``csrc/moe_rows.cpp`` (``native_build``)."""

from __future__ import annotations

import torch


def scatter(
    src: torch.Tensor,
    row_map: torch.Tensor,
    weights: torch.Tensor | None,
    num_rows: int,
    other: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``moe_permute_triton.scatter`` on the CPU: ``dst[row_map[t, j]] = weights[t, j] * src[t]``
    and, with ``other``, the dot products ``dots [T, k]``."""
    dst, dots = torch.ops.mcore_kernels_cpu.moe_scatter_rows(src, row_map, weights, num_rows, other)
    return dst, None if other is None else dots


def gather(src: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``moe_permute_triton.gather`` on the CPU: ``[T, h]``, the weighted sums of the named rows."""
    return torch.ops.mcore_kernels_cpu.moe_gather_rows(src, row_map, weights)
