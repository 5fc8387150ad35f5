"""``mamba_ssm``'s CUDA kernel as an optional accelerator of ``ssd_chunked_scan``.

Used for CUDA tensors that are not float64, when the ``mamba_ssm`` package is installed; it is
imported at the first such call, never at import time, and never for CPU tensors. Its
``mamba_chunk_scan_combined`` takes the same layouts (``x [b, s, h, p]``, ``B``/``C [b, s, g, n]``,
states ``[b, h, p, n]``) and, given time steps already softplus'ed and clamped (no ``dt_bias``,
no ``dt_softplus``, no ``dt_limit``), computes the same recurrence; the ``gpu`` test holds it to
the PyTorch scan.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch


@functools.cache
def _mamba_chunk_scan() -> Callable | None:
    try:
        module = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
    except ImportError:
        return None
    return module.mamba_chunk_scan_combined


def chunk_scan_kernel(*tensors: torch.Tensor | None) -> Callable | None:
    """``mamba_ssm``'s ``mamba_chunk_scan_combined`` when it applies to ``tensors`` (all on CUDA,
    none float64, the package installed), else ``None``."""
    present = [t for t in tensors if t is not None]
    if not all(t.is_cuda and t.dtype != torch.float64 for t in present):
        return None
    return _mamba_chunk_scan()
