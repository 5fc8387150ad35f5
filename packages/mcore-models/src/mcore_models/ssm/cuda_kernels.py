"""The CUDA kernels of ``mamba_ssm`` and ``causal_conv1d`` as optional accelerators of
``ssd_chunked_scan`` and ``causal_conv1d``.

Used for CUDA tensors that are not float64, when the package is installed; imported at the first
such call, never at import time, never for CPU tensors. ``mamba_chunk_scan_combined`` takes our
layouts (``x [b, s, h, p]``, ``B``/``C [b, s, g, n]``, states ``[b, h, p, n]``) and, given time
steps already softplus'ed and clamped (no ``dt_bias``, ``dt_softplus`` or ``dt_limit``), computes
the same recurrence. ``causal_conv1d_fn`` takes ``x [b, channels, s]`` and, with states, needs
``x`` and the states channel-last in memory (stride 1 along the channels), which the transpose of
our ``[b, s, channels]`` is; it takes kernel widths 2 to 4. The ``gpu`` tests hold both to the
PyTorch functions.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

CONV_KERNEL_WIDTHS = (2, 3, 4)


@functools.cache
def _load(module: str, name: str) -> Callable | None:
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def _on_cuda(tensors: tuple[torch.Tensor | None, ...]) -> bool:
    present = [t for t in tensors if t is not None]
    return all(t.is_cuda and t.dtype != torch.float64 for t in present)


def chunk_scan_kernel(*tensors: torch.Tensor | None) -> Callable | None:
    """``mamba_ssm``'s ``mamba_chunk_scan_combined`` when it applies to ``tensors`` (all on CUDA,
    none float64, the package installed), else ``None``."""
    return (
        _load("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined") if _on_cuda(tensors) else None
    )


def conv_kernel(width: int, *tensors: torch.Tensor | None) -> Callable | None:
    """``causal_conv1d``'s ``causal_conv1d_fn`` when it applies to a convolution of ``width`` over
    ``tensors`` (a width it takes, all on CUDA, none float64, the package installed), else ``None``."""
    if width not in CONV_KERNEL_WIDTHS or not _on_cuda(tensors):
        return None
    return _load("causal_conv1d", "causal_conv1d_fn")
