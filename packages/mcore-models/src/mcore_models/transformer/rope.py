"""Rotary position embedding: inverse frequencies (plain, linear- or llama3-scaled) and the cos/sin
tables mcore-kernels' ``apply_rotary`` rotates queries and keys by."""

from __future__ import annotations

import math

import torch
from mcore_kernels import rope_cos_sin, rope_inverse_frequencies

from ..config.transformer_config import TransformerConfig


def llama3_scaled_frequencies(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_max: int
) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, a linear blend
    (in ``original_max / wavelength``) between them."""
    wavelength = 2 * math.pi / inv_freq
    ratio = original_max / wavelength  # rotations over the original context
    blend = ((ratio - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return inv_freq / factor * (1 - blend) + inv_freq * blend


class RotaryEmbedding(torch.nn.Module):
    """Cos/sin tables for positions; ``forward(position_ids [b, s])`` -> ``(cos, sin)`` each ``[s, b, 1, d]``.

    ``d`` is ``config.rotary_dim``: with ``rotary_percent`` < 1 the tables cover the first ``d``
    channels of each head and ``apply_rotary`` passes the others through. Rotation is in the
    half-split layout (dims ``i`` and ``i + d/2`` pair up). ``attention_scaling`` multiplies cos
    and sin (YaRN's temperature; 1 otherwise).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        inv_freq = self.inverse_frequencies(config, config.rotary_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = self.scaling(config)

    @staticmethod
    def inverse_frequencies(config: TransformerConfig, dim: int) -> torch.Tensor:
        inv_freq = rope_inverse_frequencies(dim, config.rotary_base)
        if config.rope_scaling_type == "linear":
            return inv_freq / config.rope_scaling_factor
        if config.rope_scaling_type == "llama3":
            return llama3_scaled_frequencies(
                inv_freq,
                config.rope_scaling_factor,
                config.rope_low_freq_factor,
                config.rope_high_freq_factor,
                config.rope_original_max_position_embeddings,
            )
        return inv_freq

    @staticmethod
    def scaling(config: TransformerConfig) -> float:
        return 1.0

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(position_ids.t(), self.inv_freq, scaling=self.attention_scaling)
        return cos.unsqueeze(2), sin.unsqueeze(2)
