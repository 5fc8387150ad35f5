"""Normalization layers picked by ``TransformerConfig.normalization``."""

from __future__ import annotations

import torch

from ..config.transformer_config import TransformerConfig


class _RMSNormFunction(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim with the ops (float32 for half types)
    and rounding of ``torch.nn.functional.rms_norm``, and a hand-written backward: the same
    formulas in fewer passes and temporaries than autograd runs through the composite."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        compute = torch.promote_types(x.dtype, torch.float32)
        x_, weight_ = x.to(compute), weight.to(compute)
        rstd = torch.rsqrt(x_.pow(2).mean(-1, keepdim=True).add_(eps))
        normed = x_ * rstd
        ctx.save_for_backward(x_, weight_, rstd, normed)
        ctx.dtypes = x.dtype, weight.dtype
        return (normed * weight_).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd, normed = ctx.saved_tensors
        x_dtype, weight_dtype = ctx.dtypes
        grad = grad.to(x.dtype)
        grad_weight = (grad * normed).sum_to_size(weight.shape)
        grad_normed = grad * weight
        # Through rstd: d rsqrt(v) = -0.5 rstd^3 dv, d mean(x^2) = 2x / n; the same ops autograd runs.
        grad_rstd = (grad_normed * x).sum_to_size(rstd.shape)
        grad_mean = -0.5 * grad_rstd * rstd.pow(3) / x.shape[-1]
        grad_x = grad_normed.mul_(rstd).add_(x * (2.0 * grad_mean))
        return grad_x.to(x_dtype), grad_weight.to(weight_dtype), None


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` over the last dim (with a weight), computed by ``_RMSNormFunction``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return _RMSNormFunction.apply(x, self.weight, eps)


def build_norm(config: TransformerConfig, hidden_size: int, eps: float | None = None) -> torch.nn.Module:
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight) over the last ``hidden_size`` dims."""
    eps = config.layernorm_epsilon if eps is None else eps
    dtype = config.params_dtype
    if config.normalization == "RMSNorm":
        return RMSNorm(hidden_size, eps=eps, dtype=dtype)
    return torch.nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
