"""Normalization layers picked by ``TransformerConfig.normalization``."""

from __future__ import annotations

import torch
from mcore_kernels import layer_norm, rms_norm

from ..config.transformer_config import TransformerConfig


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` over the last dim (with a weight), computed by mcore-kernels' ``rms_norm``
    (statistics in float32, rounded once; its Triton kernel on CUDA)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return rms_norm(x, self.weight, eps)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` over the last dim (with weight and bias), computed by mcore-kernels'
    ``layer_norm`` (torch's own on the CPU; its Triton kernel on CUDA)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


def build_norm(config: TransformerConfig, hidden_size: int, eps: float | None = None) -> torch.nn.Module:
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight) over the last ``hidden_size`` dims."""
    eps = config.layernorm_epsilon if eps is None else eps
    dtype = config.params_dtype
    if config.normalization == "RMSNorm":
        return RMSNorm(hidden_size, eps=eps, dtype=dtype)
    return LayerNorm(hidden_size, eps=eps, dtype=dtype)
