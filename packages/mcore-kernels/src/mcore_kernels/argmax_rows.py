"""``argmax_rows``: each row's greedy token and whether it has one, in one pass over the logits
in their own dtype (a C++ CPU kernel, ``native_build``; the PyTorch reference elsewhere)."""

from __future__ import annotations

import torch

from .dispatch import NATIVE_ELEMENTWISE_DTYPES, KernelBackendError, requested_backend, select_backend

_OP = "argmax_rows"


def argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, finite)`` of ``logits [R, V]``: the column of each row's first maximum (int64
    ``[R]``), and whether that maximum is finite (bool ``[R]``). A row with a NaN, a ``+inf`` or
    only ``-inf`` is not finite, and its index is unspecified: no token can be sampled from it."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"{_OP}: logits must be a floating-point tensor, got {_describe(logits)}")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"{_OP}: logits must be [R, V] with V > 0, got shape {tuple(logits.shape)}")
    if _backend(logits) == "native":
        return torch.ops.mcore_kernels_cpu.argmax_rows(logits)
    values = logits.float()
    return values.argmax(dim=-1), torch.isfinite(values.amax(dim=-1))


def _backend(logits: torch.Tensor) -> str:
    """``select_backend``'s choice; ``auto`` runs float64 on the reference, a forced ``native``
    refuses it (``KernelBackendError``)."""
    backend = select_backend(_OP, logits, kernels=("native",))
    if backend == "native" and logits.dtype not in NATIVE_ELEMENTWISE_DTYPES:
        if requested_backend() == "native":
            raise KernelBackendError(
                f"{_OP}: the native backend was forced but its kernel takes float32, bfloat16 or "
                f"float16, not {logits.dtype}"
            )
        return "reference"
    return backend


def _describe(value) -> str:
    return str(value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
