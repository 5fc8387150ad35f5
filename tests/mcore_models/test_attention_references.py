"""Sink softmax, YaRN, rope scaling and masks against values computed by hand."""

import math

import pytest
import torch
from mcore_kernels import rope_inverse_frequencies, yarn_inverse_frequencies, yarn_mscale
from mcore_models.transformer.attention_mask import allowed_keys
from mcore_models.transformer.core_attention import sink_softmax
from mcore_models.transformer.rope import llama3_scaled_frequencies


def test_off_by_one_softmax_by_hand():
    # logits 0 and ln 2 plus a sink fixed at 0: denominator 1 + 2 + 1 = 4
    scores = torch.tensor([0.0, math.log(2.0)]).view(1, 1, 1, 2)
    probs = sink_softmax(scores, torch.zeros(1))
    torch.testing.assert_close(probs.view(-1), torch.tensor([0.25, 0.5]), rtol=0, atol=1e-7)


def test_learnable_sink_softmax_by_hand_and_its_gradient():
    # two heads; sinks ln 3 and -inf (vanilla): head 0 denominator 1 + 2 + 3 = 6
    scores = torch.tensor([[0.0, math.log(2.0)], [0.0, math.log(2.0)]]).view(1, 2, 1, 2)
    sink = torch.tensor([math.log(3.0), -math.inf], requires_grad=True)
    probs = sink_softmax(scores, sink)
    expected = torch.tensor([[1 / 6, 2 / 6], [1 / 3, 2 / 3]])
    torch.testing.assert_close(probs.view(2, 2), expected, rtol=0, atol=1e-7)
    # d(sum of head-0 probabilities)/d sink = -p_sink * sum(p) = -(1/2) * (1/2) = -1/4
    probs[0, 0].sum().backward()
    assert sink.grad[0].item() == pytest.approx(-0.25, abs=1e-7)


def test_yarn_frequencies_and_temperature_by_hand():
    # dim 8, base 1e4: plain inverse frequencies 1, 0.1, 0.01, 0.001. With original context 64,
    # beta_fast 32 / beta_slow 1 the correction dims are 8 ln(64 / 64pi) / 2 ln 1e4 = -0.497 and
    # 8 ln(64 / 2pi) / 2 ln 1e4 = 1.008, rounded outwards to [0, 2]: ramp 0, 0.5, 1, 1 towards
    # interpolation (frequency / 4).
    freqs = yarn_inverse_frequencies(8, 10000.0, 4.0, 64, 32.0, 1.0, round_to_int=True)
    torch.testing.assert_close(freqs, torch.tensor([1.0, 0.0625, 0.0025, 0.00025]), rtol=1e-6, atol=0)
    # unrounded: range [0, 1.00806], so pair 1 is 0.79 % extrapolated
    high = 8 * math.log(64 / (2 * math.pi)) / (2 * math.log(10000.0))
    ramp = 1 / high
    expected_pair_1 = 0.1 * (1 - ramp) + 0.025 * ramp
    freqs = yarn_inverse_frequencies(8, 10000.0, 4.0, 64, 32.0, 1.0, round_to_int=False)
    assert freqs[1].item() == pytest.approx(expected_pair_1, rel=1e-6)
    assert yarn_mscale(4.0) == pytest.approx(1 + 0.1 * math.log(4.0))
    assert yarn_mscale(1.0) == 1.0


def test_yarn_rotary_tables_carry_the_temperature():
    from mcore_models import TransformerConfig, YarnRotaryEmbedding

    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        position_embedding_type="yarn",
        yarn_rotary_scaling_factor=4.0,
        yarn_original_max_position_embeddings=64,
        yarn_mscale=1.0,
        yarn_mscale_all_dim=0.0,
    )
    cos, sin = YarnRotaryEmbedding(config)(torch.tensor([[0, 3]]))
    mscale = 1 + 0.1 * math.log(4.0)
    # position 3, pair 1 (frequency 0.0625) sits in dims 1 and 5 of the half-split layout
    assert cos[1, 0, 0, 1].item() == pytest.approx(math.cos(3 * 0.0625) * mscale, rel=1e-6)
    assert sin[1, 0, 0, 5].item() == pytest.approx(math.sin(3 * 0.0625) * mscale, rel=1e-6)
    assert cos[0, 0, 0, 0].item() == pytest.approx(mscale, rel=1e-6)


def test_llama3_scaling_by_hand():
    # wavelengths 2pi/f; original context 64, factors 1 (low) and 4 (high): wavelengths above 64
    # are divided by 8, below 16 kept, in between blended by (64 / wavelength - 1) / 3.
    inv = torch.tensor([1.0, 2 * math.pi / 32, 2 * math.pi / 1000])
    scaled = llama3_scaled_frequencies(inv, 8.0, 1.0, 4.0, 64)
    blend = (64 / 32 - 1) / 3
    expected = torch.tensor([1.0, inv[1].item() * (blend + (1 - blend) / 8), inv[2].item() / 8])
    torch.testing.assert_close(scaled, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(rope_inverse_frequencies(4, 100.0), torch.tensor([1.0, 0.1]))


def test_mask_causal_window_and_documents():
    allowed = allowed_keys(5, window_size=2, segment_ids=torch.tensor([[0, 0, 0, 1, 1]]))[0, 0].int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 1, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1],
        ]
    )
    assert torch.equal(allowed, expected)
