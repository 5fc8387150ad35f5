"""``rms_norm`` and ``layer_norm``: the public entry points, an autograd function over either
backend (``dispatch``), and the checks that turn bad arguments into errors naming them."""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from . import norm_native, norm_reference
from .dispatch import autograd_records, select_backend, select_elementwise_backend


def _backend(name: str):
    if name == "reference":
        return norm_reference
    if name == "native":
        return norm_native
    return importlib.import_module("mcore_kernels.norm_triton")


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, zero_centered_gamma, rms, backend):
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).contiguous()
        extra = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()
        y, h, mean, rstd = _backend(backend).norm_forward(
            rows, weight, bias, extra, eps, zero_centered_gamma, rms
        )
        ctx.save_for_backward(h, weight, mean, rstd)
        ctx.options = (zero_centered_gamma, rms, bias is not None, residual is not None, backend, shape)
        ctx.bias_dtype = None if bias is None else bias.dtype
        if residual is None:
            return y.view(shape)
        return y.view(shape), h.view(shape)

    @staticmethod
    def backward(ctx, dy, dh_out=None):
        h, weight, mean, rstd = ctx.saved_tensors
        zero_centered_gamma, rms, has_bias, has_residual, backend, shape = ctx.options
        rows = dy.reshape(-1, shape[-1]).contiguous()
        extra = None if dh_out is None else dh_out.reshape(-1, shape[-1]).contiguous()
        dh, dweight, dbias = _backend(backend).norm_backward(
            rows, extra, h, weight, mean, rstd, zero_centered_gamma, rms, has_bias
        )
        dh = dh.view(shape)
        dbias = None if dbias is None else dbias.to(ctx.bias_dtype)
        return dh, dweight, dbias, dh if has_residual else None, None, None, None, None


def _check(
    op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual, eps: float
) -> None:
    for name, tensor in (("x", x), ("weight", weight), ("bias", bias), ("residual", residual)):
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(tensor).__name__}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{op}: x must be a floating-point tensor, got {x.dtype}")
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tuple(tensor.shape) != (x.shape[-1],):
            raise ValueError(f"{op}: {name} must have shape ({x.shape[-1]},), got {tuple(tensor.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"{op}: residual must match x ({tuple(x.shape)}, {x.dtype}), "
            f"got {tuple(residual.shape)}, {residual.dtype}"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"{op}: eps must be a positive number, got {eps!r}")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
    zero_centered_gamma: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``h * rsqrt(mean(h^2) + eps) * gamma`` over the last dimension, ``h = x`` or, with
    ``residual``, ``x + residual``; ``gamma`` is ``weight`` or, with ``zero_centered_gamma``,
    ``1 + weight``. Statistics in float32, the output in ``x``'s dtype. Returns the output, or
    ``(output, h)`` with a residual (``h`` is the next residual stream). Differentiable."""
    _check("rms_norm", x, weight, None, residual, eps)
    backend = select_elementwise_backend("rms_norm", x)
    if backend == "native" and not autograd_records(x, weight, residual):
        return _native_rms_norm(x, weight, residual, float(eps), zero_centered_gamma)
    return _NormFunction.apply(x, weight, None, residual, float(eps), zero_centered_gamma, True, backend)


def _native_rms_norm(x, weight, residual, eps, zero_centered_gamma):
    """The C++ CPU kernel's forward (``native_build``) called directly, where autograd records
    nothing (inference): no autograd function around it, the same results."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).contiguous()
    extra = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()
    y, h, _, _ = norm_native.norm_forward(rows, weight, None, extra, eps, zero_centered_gamma, True)
    return y.view(shape) if residual is None else (y.view(shape), h.view(shape))


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    residual: torch.Tensor | None = None,
    zero_centered_gamma: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``(h - mean) * rsqrt(var + eps) * gamma + bias`` over the last dimension, with ``h``,
    ``gamma`` and the return value as in ``rms_norm``. Differentiable.

    On the reference backend a plain call (no residual, no zero-centred gamma, ``weight`` and
    ``bias`` in ``x``'s dtype) is ``F.layer_norm``, so its values and gradients are torch's own."""
    _check("layer_norm", x, weight, bias, residual, eps)
    backend = select_backend("layer_norm", x)
    plain = residual is None and not zero_centered_gamma
    if backend == "reference" and plain and all(t.dtype == x.dtype for t in (weight, bias) if t is not None):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, float(eps))
    return _NormFunction.apply(x, weight, bias, residual, float(eps), zero_centered_gamma, False, backend)
