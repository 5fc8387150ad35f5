"""Argument checks the losses share: each error names the argument and what it must be."""

from __future__ import annotations

import math
import numbers

import torch


def is_real(value: object) -> bool:
    """Whether ``value`` is a finite real number (``bool`` is not)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def float_tensor(name: str, value: object) -> torch.Tensor:
    """``value``, after checking it is a floating-point tensor (``TypeError`` naming ``name`` if not)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: must be a floating-point torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name}: must be a floating-point tensor, got dtype {value.dtype}")
    return value


def like(name: str, value: object, reference: torch.Tensor, reference_name: str) -> torch.Tensor:
    """``value``, after checking it is a floating-point tensor of ``reference``'s shape and device."""
    tensor = float_tensor(name, value)
    if tensor.shape != reference.shape:
        raise ValueError(
            f"{name}: must have the shape of {reference_name} {tuple(reference.shape)}, got {tuple(tensor.shape)}"
        )
    if tensor.device != reference.device:
        raise ValueError(f"{name}: must be on {reference.device} like {reference_name}, got {tensor.device}")
    return tensor


def token_mask(name: str, value: object, reference: torch.Tensor, reference_name: str) -> torch.Tensor:
    """``value`` as a bool tensor, after checking it is a bool or integer tensor of ``reference``'s
    shape and device (non-zero integers count as ``True``)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: must be a bool or integer torch.Tensor, got {type(value).__name__}")
    if value.is_floating_point() or value.is_complex():
        raise TypeError(f"{name}: must be a bool or integer tensor, got dtype {value.dtype}")
    if value.shape != reference.shape:
        raise ValueError(
            f"{name}: must have the shape of {reference_name} {tuple(reference.shape)}, got {tuple(value.shape)}"
        )
    if value.device != reference.device:
        raise ValueError(f"{name}: must be on {reference.device} like {reference_name}, got {value.device}")
    return value if value.dtype == torch.bool else value != 0
