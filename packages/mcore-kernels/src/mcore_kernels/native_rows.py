"""Unchecked calls of the C++ CPU kernels on 2-D rows, for inference loops that call them hundreds
of times a step.

The ops ``rms_norm``, ``apply_rotary``, ``swiglu`` and ``paged_decode_attention`` validate their arguments in Python, pick a
backend and wrap autograd on every call: 10-30 us a call, which a decode step of a small model
pays a few hundred times (and the cores idle meanwhile). These functions call the native kernels
directly: the same kernels, so the same values as those ops' native backend, without autograd and
without the Python checks. The kernels still check what they are given (2-D contiguous rows,
matching sizes) and raise ``RuntimeError`` otherwise; CPU tensors only. Callers check once that
``native_rows_available()`` and that autograd need not record, then call these.
"""

from __future__ import annotations

import torch

from .dispatch import KernelBackendError
from .native_build import native_library_error


def native_rows_available() -> bool:
    """Whether the C++ CPU kernels are built and loaded here (builds them on the first call)."""
    return native_library_error() is None


def _kernels():
    error = native_library_error()
    if error is not None:
        raise KernelBackendError(f"the C++ CPU kernels cannot run here: {error}")
    return torch.ops.mcore_kernels_cpu


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x, weight, eps)`` of contiguous rows ``x [M, N]`` (``weight [N]``), no autograd."""
    return _kernels().rms_norm(x, weight, None, eps, False)[0]


def rotary_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` (pairs ``(j, j + r/2)``) of contiguous rows ``x [R, d]`` by float32 tables
    ``cos, sin [C, r]``, table row ``i`` rotating rows ``i * R/C .. (i + 1) * R/C - 1``; no autograd."""
    return _kernels().rotary(x, cos, sin, False, False)


def swiglu_rows(x: torch.Tensor) -> torch.Tensor:
    """``swiglu`` of contiguous rows ``x [M, 2K]`` (``[gate, up]`` halves): ``[M, K]``, no autograd."""
    return _kernels().swiglu(x)


def paged_decode_attention_rows(
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window_size: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``paged_decode_attention`` on the C++ CPU kernel: contiguous ``query [B, n, d]``, cache
    blocks ``[num_blocks, block_size, g, d]``, ``block_table [B, W]`` (int32 or int64),
    ``positions [B]`` (int64), ``window_size`` 0 for none, ``sinks`` float32 ``[n]`` or ``None``;
    ``[B, n, d]``. The kernel checks the shapes and dtypes, and every position and block it reads."""
    return _kernels().paged_decode_attention(
        query, key_blocks, value_blocks, block_table, positions, scale, window_size, sinks
    )
