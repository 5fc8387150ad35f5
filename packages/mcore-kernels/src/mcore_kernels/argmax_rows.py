"""``argmax_rows``: each row's greedy token and whether it has one, in one pass over the logits
in their own dtype (a C++ CPU kernel, ``native_build``; the PyTorch reference elsewhere)."""

from __future__ import annotations

import torch

from .dispatch import select_elementwise_backend

_OP = "argmax_rows"


def argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, finite)`` of ``logits [R, V]``: the column of each row's first maximum (int64
    ``[R]``), and whether that maximum is finite (bool ``[R]``). A row with a NaN, a ``+inf`` or
    only ``-inf`` is not finite, and its index is unspecified: no token can be sampled from it."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"{_OP}: logits must be a floating-point tensor, got {_describe(logits)}")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"{_OP}: logits must be [R, V] with V > 0, got shape {tuple(logits.shape)}")
    if select_elementwise_backend(_OP, logits, kernels=("native",)) == "native":
        return torch.ops.mcore_kernels_cpu.argmax_rows(logits)
    values = logits.float()
    return values.argmax(dim=-1), torch.isfinite(values.amax(dim=-1))


def _describe(value) -> str:
    return str(value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
