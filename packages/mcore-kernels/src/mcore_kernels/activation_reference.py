"""MLP activations in plain PyTorch: the numerical oracle of the Triton kernels and the path every
non-CUDA tensor takes, with a hand-written backward that recomputes from the saved input (autograd
of the formula would keep the activated gate and the clamped halves as well). It runs the
operations autograd of the plain formula would, in the same order (torch's own SiLU and GELU and
their backwards), so that in float32 both agree bit for bit.

Inputs are rows ``x [M, K]``. A gated activation splits each row into a gate and a linear half,
either as the two halves ``[gate, up]`` of the row (``interleaved=False``, mcore's layout) or as
alternating columns ``gate, up, gate, up, ...`` (``interleaved=True``, GPT-OSS's checkpoint layout),
and returns ``act(gate') * (up' + offset)`` ``[M, K/2]``, where with a ``clamp`` value ``c``
``gate' = min(gate, c)`` and ``up' = clamp(up, -c, c)`` (GPT-OSS), else ``gate' = gate, up' = up``.
A plain activation returns ``act(x)`` ``[M, K]``. With per-row ``probs [M]`` (a token's router
probability) the result is also multiplied by ``probs``, and ``probs`` gets a gradient.

Arithmetic is in float32 (float64 for float64 inputs) and the output is rounded once to ``x``'s
dtype. Clamping passes the gradient where the input lies inside the closed range, bounds included
(the subgradient 1 that torch's derivative table documents for ``clamp``; some torch releases give 0
at a bound instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The activations of the gate (or of the whole input, for plain ones).
KINDS = ("silu", "gelu", "quick_gelu", "squared_relu")


@dataclass(frozen=True)
class ActivationSpec:
    """What to compute: ``kind`` (one of ``KINDS``), gated or plain, quick-GELU's ``alpha``, the
    linear half's ``offset``, the ``clamp`` value (``None``: none) and the gated layout."""

    kind: str
    gated: bool
    alpha: float = 1.702
    offset: float = 0.0
    clamp: float | None = None
    interleaved: bool = False


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)


def _value(x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """``act(x)``, with torch's own SiLU and GELU."""
    if spec.kind == "silu":
        return F.silu(x)
    if spec.kind == "gelu":
        return F.gelu(x)
    if spec.kind == "quick_gelu":
        return x * torch.sigmoid(spec.alpha * x)
    return F.relu(x).square()  # squared_relu


def _input_gradient(grad: torch.Tensor, x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """``grad * act'(x)`` in the operations autograd runs through ``_value`` (torch's SiLU and GELU
    backwards), so that in float32 it equals, bit for bit, the gradient of the plain formula."""
    if spec.kind == "silu":
        return torch.ops.aten.silu_backward(grad, x)
    if spec.kind == "gelu":
        return torch.ops.aten.gelu_backward(grad, x)
    if spec.kind == "quick_gelu":
        s = torch.sigmoid(spec.alpha * x)
        return grad * s + torch.ops.aten.sigmoid_backward(grad * x, s) * spec.alpha
    return grad * (2 * x.clamp(min=0))  # squared_relu


def _halves(x: torch.Tensor, spec: ActivationSpec) -> tuple[torch.Tensor, torch.Tensor]:
    if spec.interleaved:
        return x[:, 0::2], x[:, 1::2]
    return x.chunk(2, dim=-1)


def _clamped(gate: torch.Tensor, up: torch.Tensor, spec: ActivationSpec):
    """``(gate', up', gate passes gradient, up passes gradient)``."""
    if spec.clamp is None:
        return gate, up, None, None
    c = spec.clamp
    return gate.clamp(max=c), up.clamp(-c, c), gate <= c, (up >= -c) & (up <= c)


def activation_forward(x: torch.Tensor, probs: torch.Tensor | None, spec: ActivationSpec) -> torch.Tensor:
    """The activation of ``x [M, K]``, weighted by ``probs [M]`` when given."""
    xf = x.to(_compute_dtype(x))
    if spec.gated:
        gate, up, _, _ = _clamped(*_halves(xf, spec), spec)
        out = _value(gate, spec) * (up + spec.offset)
    else:
        out = _value(xf, spec)
    if probs is not None:
        out = out * probs.to(out.dtype).unsqueeze(-1)
    return out.to(x.dtype)


def activation_backward(
    dout: torch.Tensor, x: torch.Tensor, probs: torch.Tensor | None, spec: ActivationSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dprobs)`` from ``dout`` (the output's gradient); ``dprobs`` is ``None`` without probs."""
    xf = x.to(_compute_dtype(x))
    dof = dout.to(xf.dtype)
    weighted = dof if probs is None else dof * probs.to(xf.dtype).unsqueeze(-1)
    if not spec.gated:
        dx = _input_gradient(weighted, xf, spec)
        dprobs = None if probs is None else (dof * _value(xf, spec)).sum(-1).to(probs.dtype)
        return dx.to(x.dtype), dprobs
    gate, up, gate_passes, up_passes = _clamped(*_halves(xf, spec), spec)
    value = _value(gate, spec)
    linear = up + spec.offset
    dgate = _input_gradient(weighted * linear, gate, spec)
    dup = weighted * value
    if gate_passes is not None:
        dgate = dgate * gate_passes
        dup = dup * up_passes
    dx = torch.empty_like(xf)
    dx_gate, dx_up = _halves(dx, spec)
    dx_gate.copy_(dgate)
    dx_up.copy_(dup)
    dprobs = None if probs is None else (dof * (value * linear)).sum(-1).to(probs.dtype)
    return dx.to(x.dtype), dprobs
