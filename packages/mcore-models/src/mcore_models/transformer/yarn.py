"""YaRN: RoPE frequencies that interpolate slow dimensions, extrapolate fast ones, plus a temperature
(mcore-kernels' ``yarn_inverse_frequencies`` and ``yarn_mscale``)."""

from __future__ import annotations

import torch
from mcore_kernels import yarn_inverse_frequencies, yarn_mscale

from ..config.transformer_config import TransformerConfig
from .rope import RotaryEmbedding


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
