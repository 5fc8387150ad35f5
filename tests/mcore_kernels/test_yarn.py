"""YaRN's tables: hand-computed correction ranges, temperatures and ramps, and agreement with
Hugging Face's YaRN (integer and fractional correction bounds); argument errors."""

import math

import pytest
import torch
from mcore_kernels import (
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
@pytest.mark.parametrize(("mscale", "mscale_all_dim"), [(None, None), (0.707, 0.707), (1.0, 0.5)])
def test_matches_hugging_face_yarn(round_to_int, mscale, mscale_all_dim):
    """Frequencies and temperature of transformers' YaRN (its ``truncate`` is ``round_to_int``;
    without ``mscale``s it uses ``yarn_mscale(factor)``, ours with ``mscale_all_dim=0``)."""
    transformers = pytest.importorskip("transformers")
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0}
    parameters |= {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
    parameters |= {"truncate": round_to_int}
    if mscale is not None:
        parameters |= {"mscale": mscale, "mscale_all_dim": mscale_all_dim}
    config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=40 * 4096, rope_parameters=parameters
    )
    inv_freq, temperature = rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = yarn_inverse_frequencies(64, 10000.0, 40.0, 4096, 32.0, 1.0, round_to_int)
    torch.testing.assert_close(ours, inv_freq.float(), rtol=1e-6, atol=0)
    mscale, mscale_all_dim = (1.0, 0.0) if mscale is None else (mscale, mscale_all_dim)
    assert yarn_mscale(40.0, mscale) / yarn_mscale(40.0, mscale_all_dim) == pytest.approx(temperature)
    positions = torch.arange(150) * 97  # past the original context
    cos, sin = yarn_cos_sin(
        positions,
        64,
        10000.0,
        40.0,
        4096,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
        round_to_int=round_to_int,
    )
    angles = positions[:, None].double() * inv_freq.double()
    angles = torch.cat((angles, angles), -1)
    torch.testing.assert_close(cos.double(), angles.cos() * temperature, rtol=0, atol=2e-3)
    torch.testing.assert_close(sin.double(), angles.sin() * temperature, rtol=0, atol=2e-3)


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
