"""YaRN's tables: hand-computed correction ranges, temperatures and ramps, and agreement with
mcore-models' YaRN rotary embedding (integer and fractional correction bounds); argument errors."""

import math

import pytest
import torch
from mcore_kernels import (
    apply_rotary,
    rope_inverse_frequencies,
    yarn_correction_range,
    yarn_cos_sin,
    yarn_inverse_frequencies,
    yarn_mscale,
)


def test_correction_range_by_hand():
    # dim 64, base 10000, original context 4096: the pair making r turns is
    # 64 * ln(4096 / (2 pi r)) / (2 ln 10000)
    low = 64 * math.log(4096 / (2 * math.pi * 32)) / (2 * math.log(10000))  # 10.47...
    high = 64 * math.log(4096 / (2 * math.pi * 1)) / (2 * math.log(10000))  # 22.52...
    assert yarn_correction_range(32, 1, 64, 10000, 4096, round_to_int=False) == pytest.approx((low, high))
    assert yarn_correction_range(32, 1, 64, 10000, 4096) == (10, 23)  # floor and ceil
    # clipped to [0, dim - 1]
    assert yarn_correction_range(1e6, 1e-12, 16, 10000, 64, round_to_int=False) == (0, 15)


def test_mscale_by_hand():
    assert yarn_mscale(1.0) == 1.0 and yarn_mscale(0.5, 3.0) == 1.0
    assert yarn_mscale(4.0) == pytest.approx(0.1 * math.log(4.0) + 1)
    assert yarn_mscale(4.0, 0.707) == pytest.approx(0.0707 * math.log(4.0) + 1)


@pytest.mark.parametrize("round_to_int", [True, False])
def test_inverse_frequencies_blend_extrapolation_into_interpolation(round_to_int):
    dim, factor = 64, 8.0
    plain = rope_inverse_frequencies(dim, 10000.0)
    inv_freq = yarn_inverse_frequencies(dim, 10000.0, factor, 4096, 32.0, 1.0, round_to_int)
    low, high = yarn_correction_range(32.0, 1.0, dim, 10000.0, 4096, round_to_int)
    pairs = torch.arange(dim // 2, dtype=torch.float32)
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)
    torch.testing.assert_close(inv_freq, plain * (1 - ramp) + plain / factor * ramp)
    below, above = pairs <= low, pairs >= high
    torch.testing.assert_close(inv_freq[below], plain[below])  # fast pairs: extrapolated, unchanged
    torch.testing.assert_close(inv_freq[above], plain[above] / factor)  # slow pairs: interpolated


def test_a_zero_width_range_is_widened():
    # equal betas: low == high after rounding; the ramp is then a step at that pair
    inv_freq = yarn_inverse_frequencies(32, 10000.0, 4.0, 2048, 8.0, 8.0, True)
    plain = rope_inverse_frequencies(32, 10000.0)
    step = yarn_correction_range(8.0, 8.0, 32, 10000.0, 2048)[0]
    torch.testing.assert_close(inv_freq[: step + 1], plain[: step + 1])
    torch.testing.assert_close(inv_freq[step + 1 :], plain[step + 1 :] / 4.0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_cos_sin_carry_the_temperature(interleaved):
    positions = torch.arange(6)
    cos, sin = yarn_cos_sin(
        positions, 16, 10000.0, 4.0, 64, mscale=1.0, mscale_all_dim=0.5, interleaved=interleaved
    )
    assert cos.shape == sin.shape == (6, 16) and cos.dtype == torch.float32
    temperature = (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1)
    angles = positions[:, None].float() * yarn_inverse_frequencies(16, 10000.0, 4.0, 64)
    angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    torch.testing.assert_close(cos, angles.cos() * temperature)
    torch.testing.assert_close(sin, angles.sin() * temperature)


@pytest.mark.parametrize("round_to_int", [True, False])
@pytest.mark.parametrize(("mscale", "mscale_all_dim"), [(1.0, 0.0), (0.707, 0.707), (1.0, 0.5)])
def test_matches_mcore_models_yarn(round_to_int, mscale, mscale_all_dim):
    pytest.importorskip("mcore_models")
    from mcore_models import TransformerConfig
    from mcore_models.transformer import yarn as models_yarn
    from mcore_models.transformer.rope import apply_rotary as models_apply_rotary

    config = TransformerConfig(
        num_layers=1,
        hidden_size=256,
        num_attention_heads=4,
        position_embedding_type="yarn",
        rotary_base=10000.0,
        yarn_rotary_scaling_factor=40.0,
        yarn_original_max_position_embeddings=4096,
        yarn_beta_fast=32.0,
        yarn_beta_slow=1.0,
        yarn_mscale=mscale,
        yarn_mscale_all_dim=mscale_all_dim,
        yarn_correction_range_round_to_int=round_to_int,
    )
    assert yarn_correction_range(
        32.0, 1.0, 64, 10000.0, 4096, round_to_int
    ) == models_yarn.yarn_correction_range(32.0, 1.0, 64, 10000.0, 4096, round_to_int)
    rope = models_yarn.YarnRotaryEmbedding(config)
    position_ids = torch.arange(3 * 50).view(3, 50) * 97  # [b, s], past the original context
    cos, sin = rope(position_ids)  # [s, b, 1, 64]
    ours_cos, ours_sin = yarn_cos_sin(
        position_ids.t(),
        64,
        10000.0,
        40.0,
        4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
        round_to_int=round_to_int,
    )
    torch.testing.assert_close(ours_cos.unsqueeze(2), cos, rtol=0, atol=0)
    torch.testing.assert_close(ours_sin.unsqueeze(2), sin, rtol=0, atol=0)
    x = torch.randn(50, 3, 4, 64)
    torch.testing.assert_close(apply_rotary(x, cos, sin), models_apply_rotary(x, cos, sin), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        (dict(dim=15), "dim must be an even int"),
        (dict(base=1.0), "base must be > 1.0"),
        (dict(factor=0.5), "factor must be >= 1"),
        (dict(factor=float("inf")), "factor must be a finite number"),
        (dict(original_max=0), "original_max must be a positive int"),
        (dict(beta_fast=0.0), "beta_fast must be > 0.0"),
        (dict(beta_slow="1"), "beta_slow must be a finite number"),
    ],
)
def test_bad_arguments_are_named(arguments, match):
    call = dict(dim=16, base=10000.0, factor=4.0, original_max=64, beta_fast=32.0, beta_slow=1.0) | arguments
    with pytest.raises(ValueError, match=match):
        yarn_inverse_frequencies(**call)
