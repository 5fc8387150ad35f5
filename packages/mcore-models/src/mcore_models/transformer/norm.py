"""Normalization layers picked by ``TransformerConfig.normalization``."""

from __future__ import annotations

import torch

from ..config.transformer_config import TransformerConfig


def build_norm(config: TransformerConfig, hidden_size: int, eps: float | None = None) -> torch.nn.Module:
    """``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight) over the last ``hidden_size`` dims."""
    eps = config.layernorm_epsilon if eps is None else eps
    dtype = config.params_dtype
    if config.normalization == "RMSNorm":
        return torch.nn.RMSNorm(hidden_size, eps=eps, dtype=dtype)
    return torch.nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)
