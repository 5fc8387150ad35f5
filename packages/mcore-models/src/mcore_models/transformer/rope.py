"""Rotary position embedding: inverse frequencies (plain, linear- or llama3-scaled) and their use."""

from __future__ import annotations

import math

import torch

from ..config.transformer_config import TransformerConfig


def rope_inverse_frequencies(dim: int, base: float) -> torch.Tensor:
    """``base ** (-2i / dim)`` for ``i < dim / 2``, float32."""
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


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

    Rotation is in the half-split layout (dims ``i`` and ``i + d/2`` pair up). ``attention_scaling``
    multiplies cos and sin (YaRN's temperature; 1 otherwise).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        dim = config.kv_channels
        inv_freq = self.inverse_frequencies(config, dim)
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
        angles = position_ids.t().unsqueeze(-1).float() * self.inv_freq.to(position_ids.device)  # [s, b, d/2]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(2)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    """``x * cos + [-x2 * sin1, x1 * sin2]`` in float32 (``x = [x1, x2]``, ``sin = [sin1, sin2]``), or
    with ``transpose`` the transposed map ``x * cos + [x2 * sin2, -x1 * sin1]``; halves updated in place."""
    x = x.float()
    out = x * cos
    first, second = x.chunk(2, dim=-1)
    sin_first, sin_second = sin.chunk(2, dim=-1)
    out_first, out_second = out.chunk(2, dim=-1)
    if transpose:
        out_first.add_(second * sin_second)
        out_second.sub_(first * sin_first)
    else:
        out_first.sub_(second * sin_first)
        out_second.add_(first * sin_second)
    return out


class _ApplyRotary(torch.autograd.Function):
    """The rotation with its transpose as the backward: no ``cat`` or ``neg``, three passes over ``x``
    each way instead of about five; for float32 ``x``, bit for bit what autograd of the plain formula gives."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return _rotate(x, cos, sin, transpose=False).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, transpose=True).to(ctx.dtype), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [s, b, n, d]`` by the tables of ``RotaryEmbedding``; computed in float32."""
    return _ApplyRotary.apply(x, cos, sin)
