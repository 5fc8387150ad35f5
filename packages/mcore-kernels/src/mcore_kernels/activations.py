"""The MLP activations' public entry points (``swiglu``, ``geglu``, ``quick_geglu``,
``clamped_swiglu``, ``quick_gelu``, ``squared_relu``), an autograd function over either backend
(``dispatch``), and the checks that turn bad arguments into errors naming them."""

from __future__ import annotations

import importlib
import math

import torch

from . import activation_native, activation_reference
from .activation_reference import ActivationSpec
from .dispatch import autograd_records, select_backend, select_elementwise_backend


def _backend(name: str):
    if name == "reference":
        return activation_reference
    if name == "native":
        return activation_native
    return importlib.import_module("mcore_kernels.activation_triton")


class _ActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, spec, backend):
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).contiguous()
        weights = None if probs is None else probs.reshape(-1).contiguous()
        out = _backend(backend).activation_forward(rows, weights, spec)
        ctx.save_for_backward(rows, weights)
        ctx.options = (spec, backend, shape, None if probs is None else probs.shape)
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        rows, weights = ctx.saved_tensors
        spec, backend, shape, probs_shape = ctx.options
        dx, dprobs = _backend(backend).activation_backward(
            dout.reshape(rows.shape[0], dout.shape[-1]).contiguous(), rows, weights, spec
        )
        return dx.view(shape), None if dprobs is None else dprobs.view(probs_shape), None, None


def _number(op: str, name: str, value, *, positive: bool = False, non_negative: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{op}: {name} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{op}: {name} must be > 0, got {value!r}")
    if non_negative and not value >= 0:
        raise ValueError(f"{op}: {name} must be >= 0, got {value!r}")


def _activate(op: str, x, probs, spec: ActivationSpec) -> torch.Tensor:
    for name, tensor in (("x", x), ("probs", probs)):
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(tensor).__name__}")
        if tensor is not None and not tensor.is_floating_point():
            raise TypeError(f"{op}: {name} must be a floating-point tensor, got {tensor.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if spec.gated and x.shape[-1] % 2:
        raise ValueError(
            f"{op}: x's last dimension holds the gate and the linear half and must be even, got {x.shape[-1]}"
        )
    if probs is not None:
        allowed = (tuple(x.shape[:-1]), (*x.shape[:-1], 1))
        if tuple(probs.shape) not in allowed or probs.device != x.device:
            raise ValueError(
                f"{op}: probs must have shape {allowed[0]} or {allowed[1]} (one weight per token) on "
                f"{x.device}, got {tuple(probs.shape)} on {probs.device}"
            )
    _number(op, "alpha", spec.alpha)
    _number(op, "offset", spec.offset)
    if spec.clamp is not None:
        _number(op, "limit" if op == "clamped_swiglu" else "clamp", spec.clamp, non_negative=True)
    if spec == activation_native.PLAIN_SWIGLU and probs is None:  # the one with a native kernel
        backend = select_elementwise_backend(op, x)
        if backend == "native" and not autograd_records(x):  # inference: the kernel without autograd
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return activation_native.activation_forward(rows, None, spec).view(
                *x.shape[:-1], x.shape[-1] // 2
            )
    else:
        backend = select_backend(op, x)
    return _ActivationFunction.apply(x, probs, spec, backend)


def swiglu(
    x: torch.Tensor,
    probs: torch.Tensor | None = None,
    *,
    offset: float = 0.0,
    clamp: float | None = None,
    interleaved: bool = False,
) -> torch.Tensor:
    """``silu(gate) * (up + offset)`` over ``x``'s last dimension ``[gate, up]`` (alternating
    columns with ``interleaved``), times ``probs`` per token when given; with ``clamp``,
    ``gate <= clamp`` and ``|up| <= clamp`` first. Differentiable in ``x`` and ``probs``."""
    return _activate("swiglu", x, probs, ActivationSpec("silu", True, 1.702, offset, clamp, interleaved))


def geglu(
    x: torch.Tensor,
    probs: torch.Tensor | None = None,
    *,
    offset: float = 0.0,
    clamp: float | None = None,
    interleaved: bool = False,
) -> torch.Tensor:
    """``gelu(gate) * (up + offset)`` (the exact, erf GELU), otherwise as ``swiglu``."""
    return _activate("geglu", x, probs, ActivationSpec("gelu", True, 1.702, offset, clamp, interleaved))


def quick_geglu(
    x: torch.Tensor,
    probs: torch.Tensor | None = None,
    *,
    alpha: float = 1.702,
    offset: float = 0.0,
    clamp: float | None = None,
    interleaved: bool = False,
) -> torch.Tensor:
    """``gate * sigmoid(alpha * gate) * (up + offset)``, otherwise as ``swiglu``."""
    spec = ActivationSpec("quick_gelu", True, alpha, offset, clamp, interleaved)
    return _activate("quick_geglu", x, probs, spec)


def clamped_swiglu(
    x: torch.Tensor,
    probs: torch.Tensor | None = None,
    *,
    alpha: float = 1.702,
    limit: float = 7.0,
    interleaved: bool = False,
) -> torch.Tensor:
    """GPT-OSS's activation: ``g * sigmoid(alpha * g) * (u + 1)`` with ``g = min(gate, limit)``,
    ``u = clamp(up, -limit, limit)``; ``quick_geglu`` with ``offset=1, clamp=limit``."""
    spec = ActivationSpec("quick_gelu", True, alpha, 1.0, limit, interleaved)
    return _activate("clamped_swiglu", x, probs, spec)


def quick_gelu(x: torch.Tensor, probs: torch.Tensor | None = None, *, alpha: float = 1.702) -> torch.Tensor:
    """``x * sigmoid(alpha * x)`` elementwise, times ``probs`` per token when given."""
    return _activate("quick_gelu", x, probs, ActivationSpec("quick_gelu", False, alpha))


def squared_relu(x: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """``relu(x) ** 2`` elementwise, times ``probs`` per token when given."""
    return _activate("squared_relu", x, probs, ActivationSpec("squared_relu", False))
