"""YaRN: RoPE frequencies that interpolate slow dimensions, extrapolate fast ones, plus a temperature."""

from __future__ import annotations

import math

import torch

from ..config.transformer_config import TransformerConfig
from .rope import RotaryEmbedding, rope_inverse_frequencies


def yarn_correction_dim(rotations: float, dim: int, base: float, original_max: int) -> float:
    """The (fractional) dimension index whose frequency completes ``rotations`` turns over ``original_max``."""
    return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, original_max: int, round_to_int: bool
) -> tuple[float, float]:
    """``(low, high)``: dims below ``low`` extrapolate, above ``high`` interpolate, clipped to ``[0, dim-1]``."""
    low = yarn_correction_dim(beta_fast, dim, base, original_max)
    high = yarn_correction_dim(beta_slow, dim, base, original_max)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """``0.1 * mscale * ln(factor) + 1`` for ``factor > 1``, else 1."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_inverse_frequencies(
    dim: int,
    base: float,
    factor: float,
    original_max: int,
    beta_fast: float,
    beta_slow: float,
    round_to_int: bool = True,
) -> torch.Tensor:
    """Per-pair blend of ``inv_freq`` (extrapolation) and ``inv_freq / factor`` (interpolation)."""
    extrapolated = rope_inverse_frequencies(dim, base)
    interpolated = extrapolated / factor
    low, high = yarn_correction_range(beta_fast, beta_slow, dim, base, original_max, round_to_int)
    if high == low:
        high = high + 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0.0, 1.0)
    return interpolated * ramp + extrapolated * (1 - ramp)


class YarnRotaryEmbedding(RotaryEmbedding):
    """RoPE with YaRN frequencies and temperature ``mscale(f, yarn_mscale) / mscale(f, yarn_mscale_all_dim)``."""

    @staticmethod
    def inverse_frequencies(config: TransformerConfig, dim: int) -> torch.Tensor:
        return yarn_inverse_frequencies(
            dim,
            config.rotary_base,
            config.yarn_rotary_scaling_factor,
            config.yarn_original_max_position_embeddings,
            config.yarn_beta_fast,
            config.yarn_beta_slow,
            config.yarn_correction_range_round_to_int,
        )

    @staticmethod
    def scaling(config: TransformerConfig) -> float:
        factor = config.yarn_rotary_scaling_factor
        return yarn_mscale(factor, config.yarn_mscale) / yarn_mscale(factor, config.yarn_mscale_all_dim)
