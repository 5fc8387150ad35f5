"""Rotary position embedding: ``apply_rotary`` (the public entry point, an autograd function over
either backend, ``dispatch``), and the cos/sin tables it reads (``rope_inverse_frequencies``,
``rope_cos_sin``)."""

from __future__ import annotations

import importlib
import math

import torch

from . import rope_native, rope_reference
from .dispatch import autograd_records, select_elementwise_backend


def _backend(name: str):
    if name == "reference":
        return rope_reference
    if name == "native":
        return rope_native
    return importlib.import_module("mcore_kernels.rope_triton")


class _RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, group, interleaved, backend):
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.options = (interleaved, backend, shape)
        return _backend(backend).rotate(rows, cos, sin, interleaved, False).view(shape)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        interleaved, backend, shape = ctx.options
        rows = grad.reshape(-1, shape[-1]).contiguous()
        return (
            _backend(backend).rotate(rows, cos, sin, interleaved, True).view(shape),
            None,
            None,
            None,
            None,
            None,
        )


def _table_rows(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``cos, sin`` as ``[C, r]`` rows and the number of consecutive rows of ``x`` sharing one: the
    trailing dimensions of ``x`` over which the tables broadcast (typically the heads) are not expanded."""
    lead = tuple(x.shape[:-1])
    rotary = cos.shape[-1]
    cos_full, sin_full = cos.expand(*lead, rotary), sin.expand(*lead, rotary)
    shared = 0
    for dim in reversed(range(len(lead))):
        if lead[dim] != 1 and (cos_full.stride(dim) != 0 or sin_full.stride(dim) != 0):
            break
        shared += 1
    index = (slice(None),) * (len(lead) - shared) + (0,) * shared
    group = math.prod(lead[len(lead) - shared :])
    return (
        cos_full[index].reshape(-1, rotary).contiguous(),
        sin_full[index].reshape(-1, rotary).contiguous(),
        group,
    )


def _check(x, cos, sin) -> None:
    for name, tensor in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"apply_rotary: {name} must be a tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"apply_rotary: {name} must be a floating-point tensor, got {tensor.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"apply_rotary: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(
            f"apply_rotary: cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    rotary = cos.shape[-1] if cos.dim() else 0
    if rotary < 2 or rotary % 2 or rotary > x.shape[-1]:
        raise ValueError(
            f"apply_rotary: the tables' last dimension (the rotary dimensions) must be even and in "
            f"[2, {x.shape[-1]}] (x's last dimension), got {rotary}"
        )
    lead, table = tuple(x.shape[:-1]), tuple(cos.shape[:-1])
    expandable = len(table) <= len(lead) and all(
        size in (1, target) for size, target in zip(reversed(table), reversed(lead), strict=False)
    )
    if not expandable:  # checked by hand: torch.broadcast_shapes costs about 50 us a call
        raise ValueError(
            f"apply_rotary: cos and sin {tuple(cos.shape)} must broadcast to x's leading dimensions "
            f"{tuple(x.shape[:-1])} with a last dimension of their own"
        )
    for name, tensor in (("cos", cos), ("sin", sin)):
        if tensor.device != x.device:
            raise ValueError(f"apply_rotary: {name} must be on x's device {x.device}, got {tensor.device}")


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first ``r`` dimensions of ``x [..., d]`` by the tables ``cos, sin [..., r]``
    (which broadcast over ``x``'s leading dimensions, e.g. ``[s, b, 1, r]`` for ``x [s, b, heads,
    d]``); the other ``d - r`` dimensions (partial rotary) pass through. Pairs are ``(j, j + r/2)``
    or, with ``interleaved``, ``(2j, 2j + 1)``, matching the layout ``rope_cos_sin`` built the
    tables in. Computed in float32, returned in ``x``'s dtype. Differentiable in ``x`` (the tables
    get no gradient). Apply it to queries and keys alike."""
    _check(x, cos, sin)
    backend = select_elementwise_backend("apply_rotary", x)
    if x.numel() == 0:
        return x.clone()
    cos_rows, sin_rows, group = _table_rows(x, cos, sin)
    if backend == "native" and not autograd_records(x):  # inference: the kernel without autograd
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return rope_native.rotate(rows, cos_rows, sin_rows, bool(interleaved), False).view(x.shape)
    return _RotaryFunction.apply(x, cos_rows, sin_rows, group, bool(interleaved), backend)


def rope_inverse_frequencies(dim: int, base: float) -> torch.Tensor:
    """``base ** (-2i / dim)`` for ``i < dim / 2``: RoPE's angle per position of each pair, float32."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"rope_inverse_frequencies: dim must be an even int >= 2, got {dim!r}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
        raise ValueError(f"rope_inverse_frequencies: base must be a number > 1, got {base!r}")
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def rope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    scaling: float = 1.0,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[*positions.shape, 2 * len(inv_freq)]`` float32: the angles
    ``position * inv_freq`` laid out for ``apply_rotary`` (both halves, or both entries of each
    interleaved pair, hold pair ``i``'s angle), times ``scaling`` (YaRN's attention temperature)."""
    if (
        not isinstance(positions, torch.Tensor)
        or not isinstance(inv_freq, torch.Tensor)
        or inv_freq.dim() != 1
    ):
        raise TypeError("rope_cos_sin: positions must be a tensor and inv_freq a 1-D tensor")
    angles = positions.unsqueeze(-1).float() * inv_freq.to(device=positions.device, dtype=torch.float32)
    angles = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return angles.cos() * scaling, angles.sin() * scaling
