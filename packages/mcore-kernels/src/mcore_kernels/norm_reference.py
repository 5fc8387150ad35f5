"""RMSNorm and LayerNorm in plain PyTorch: the numerical oracle of the Triton kernels and the path
every non-CUDA tensor takes, with a hand-written backward that saves only the normalized input and
its per-row statistics.

Rows are the last dimension of ``x [M, N]``. With a residual, the normalized input is
``h = x + residual`` (added in ``x``'s dtype, as an unfused ``x + residual`` would) and is also
returned: it is the next residual stream. Statistics, normalization and the scale and shift are
computed in float32 (float64 for float64 inputs) and the output is rounded once to ``x``'s dtype. ``zero_centered_gamma``
scales by ``1 + weight``.
"""

from __future__ import annotations

import torch


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 tensors (which gradient checks use)."""
    return torch.promote_types(tensor.dtype, torch.float32)


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    gamma = weight.to(_compute_dtype(weight))
    return gamma + 1.0 if zero_centered_gamma else gamma


def norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, mean, rstd)`` for ``x [M, N]``: the output, the normalized input, and per row the
    mean (zeros for RMSNorm) and ``1 / sqrt(var + eps)`` (float32, ``[M]``)."""
    h = x if residual is None else x + residual
    hf = h.to(_compute_dtype(h))
    mean = torch.zeros(h.shape[0], dtype=hf.dtype, device=h.device) if rms else hf.mean(-1)
    centered = hf if rms else hf - mean.unsqueeze(-1)
    rstd = torch.rsqrt(centered.pow(2).mean(-1) + eps)
    y = centered * rstd.unsqueeze(-1) * _gamma(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype), h, mean, rstd


def _rms_input_gradient(dnormed: torch.Tensor, h: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """RMSNorm's ``dh`` in the operations and order autograd runs through ``h * rsqrt(mean(h^2) +
    eps)``: ``d rsqrt(v) = -0.5 rstd^3 dv`` and ``d mean(h^2) = 2h / N``, so that in float32 it
    equals, bit for bit, the gradient of ``torch.nn.functional.rms_norm``."""
    grad_rstd = (dnormed * h).sum(-1, keepdim=True)
    grad_mean = -0.5 * grad_rstd * rstd.pow(3) / h.shape[-1]
    return dnormed * rstd + h * (2.0 * grad_mean)


def norm_backward(
    dy: torch.Tensor,
    dh_out: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered_gamma: bool,
    rms: bool,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dh, dweight, dbias)`` from ``dy [M, N]`` and ``dh_out`` (the gradient of the returned
    residual stream, or ``None``); ``dh`` is the gradient of both ``x`` and ``residual``."""
    dyf = dy.to(_compute_dtype(dy))
    normed = (h.to(dyf.dtype) - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    dnormed = dyf * _gamma(weight, zero_centered_gamma)
    if rms:
        dh = _rms_input_gradient(dnormed, h.to(dyf.dtype), rstd.unsqueeze(-1))
    else:
        projection = (dnormed * normed).mean(-1, keepdim=True)
        dh = rstd.unsqueeze(-1) * (dnormed - dnormed.mean(-1, keepdim=True) - normed * projection)
    if dh_out is not None:
        dh = dh + dh_out.to(dh.dtype)
    dweight = (dyf * normed).sum(0).to(weight.dtype)
    dbias = dyf.sum(0).to(weight.dtype) if has_bias else None
    return dh.to(h.dtype), dweight, dbias
