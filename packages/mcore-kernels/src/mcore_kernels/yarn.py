"""YaRN's RoPE tables: per-pair frequencies that extrapolate the fast-rotating pairs, interpolate the
slow ones (divided by the context extension ``factor``) and blend linearly across the correction
range between, and the attention temperature ``mscale`` folded into cos and sin.

A precompute run once per model (plain PyTorch on any device; a kernel would not pay for itself),
feeding ``apply_rotary``.
"""

from __future__ import annotations

import math

import torch

from .rope import rope_cos_sin, rope_inverse_frequencies


def _correction_dim(rotations: float, dim: int, base: float, original_max: int) -> float:
    """The fractional pair index whose frequency makes ``rotations`` turns over ``original_max``."""
    return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, original_max: int, round_to_int: bool = True
) -> tuple[float, float]:
    """``(low, high)`` pair indices: pairs below ``low`` extrapolate, above ``high`` interpolate.
    The bounds are where pairs make ``beta_fast`` and ``beta_slow`` turns over the original context,
    rounded outwards to whole pairs with ``round_to_int`` (fractional otherwise), clipped to
    ``[0, dim - 1]``."""
    low = _correction_dim(beta_fast, dim, base, original_max)
    high = _correction_dim(beta_slow, dim, base, original_max)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """``0.1 * mscale * ln(factor) + 1`` for ``factor > 1``, else 1."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _check(dim, base, factor, original_max, beta_fast, beta_slow) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"yarn: dim must be an even int >= 2, got {dim!r}")
    numbers = (("base", base, 1.0), ("factor", factor, None), ("beta_fast", beta_fast, 0.0))
    for name, value, above in (*numbers, ("beta_slow", beta_slow, 0.0)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"yarn: {name} must be a finite number, got {value!r}")
        if above is not None and not value > above:
            raise ValueError(f"yarn: {name} must be > {above}, got {value!r}")
    if not factor >= 1:
        raise ValueError(f"yarn: factor must be >= 1, got {factor!r}")
    if isinstance(original_max, bool) or not isinstance(original_max, int) or original_max < 1:
        raise ValueError(f"yarn: original_max must be a positive int, got {original_max!r}")


def yarn_inverse_frequencies(
    dim: int,
    base: float,
    factor: float,
    original_max: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    round_to_int: bool = True,
) -> torch.Tensor:
    """Per pair ``i < dim / 2``: ``inv_freq * (1 - ramp) + inv_freq / factor * ramp`` (float32),
    ``ramp`` rising linearly from 0 at ``low`` to 1 at ``high`` of ``yarn_correction_range`` (a
    range of zero width is widened by 0.001)."""
    _check(dim, base, factor, original_max, beta_fast, beta_slow)
    extrapolated = rope_inverse_frequencies(dim, base)
    low, high = yarn_correction_range(beta_fast, beta_slow, dim, base, original_max, round_to_int)
    if high == low:
        high = high + 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0.0, 1.0)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp)


def yarn_cos_sin(
    positions: torch.Tensor,
    dim: int,
    base: float,
    factor: float,
    original_max: int,
    *,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    mscale: float = 1.0,
    mscale_all_dim: float = 0.0,
    round_to_int: bool = True,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[*positions.shape, dim]`` float32 for ``apply_rotary``: YaRN frequencies,
    scaled by the temperature ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)``."""
    inv_freq = yarn_inverse_frequencies(dim, base, factor, original_max, beta_fast, beta_slow, round_to_int)
    scaling = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return rope_cos_sin(positions, inv_freq, scaling=scaling, interleaved=interleaved)
