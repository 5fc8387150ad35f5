"""causal_conv1d and its decode step against a per-position loop and against each other."""

import pytest
import torch
import torch.nn.functional as F
from mcore_models.ssm import causal_conv1d, causal_conv1d_step


def _loop_oracle(x, weight, bias, activation, initial_state):
    """y[:, t, c] = bias[c] + sum_k weight[c, k] * u[t - (width - 1) + k], u = state ++ x."""
    batch, seqlen, channels = x.shape
    width = weight.shape[1]
    history = initial_state if initial_state is not None else x.new_zeros(batch, channels, width - 1)
    y = x.new_zeros(batch, seqlen, channels)
    for t in range(seqlen):
        for k in range(width):
            source = t - (width - 1) + k
            u = x[:, source] if source >= 0 else history[:, :, width - 1 + source]
            y[:, t] += weight[:, k] * u
        if bias is not None:
            y[:, t] += bias
    return F.silu(y) if activation == "silu" else y


def _inputs(batch, seqlen, channels, width, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, seqlen, channels, generator=gen, dtype=torch.float64),
        torch.randn(channels, width, generator=gen, dtype=torch.float64),
        torch.randn(channels, generator=gen, dtype=torch.float64),
        torch.randn(batch, channels, width - 1, generator=gen, dtype=torch.float64),
    )


def test_hand_computed_values():
    x = torch.tensor([1.0, 1.0, 1.0, 2.0], dtype=torch.float64).view(1, 4, 1)
    weight = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    y, state = causal_conv1d(
        x, weight, torch.tensor([0.5], dtype=torch.float64), activation=None, return_final_state=True
    )
    # 3*1 + .5, 2*1 + 3*1 + .5, 1 + 2 + 3 + .5, 1 + 2 + 3*2 + .5
    torch.testing.assert_close(y.flatten(), torch.tensor([3.5, 5.5, 6.5, 9.5], dtype=torch.float64))
    torch.testing.assert_close(state.flatten(), torch.tensor([1.0, 2.0], dtype=torch.float64))


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("seqlen", [1, 2, 9])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize(("with_bias", "with_state"), [(False, False), (True, False), (True, True)])
def test_matches_loop_oracle(width, seqlen, activation, with_bias, with_state):
    x, weight, bias, state = _inputs(2, seqlen, 3, width, seed=width * 10 + seqlen)
    bias = bias if with_bias else None
    state = state if with_state else None
    y = causal_conv1d(x, weight, bias, activation=activation, initial_state=state)
    torch.testing.assert_close(y, _loop_oracle(x, weight, bias, activation, state), rtol=0.0, atol=1e-12)


@pytest.mark.parametrize("width", [1, 4])
def test_decode_steps_match_full_convolution(width):
    x, weight, bias, initial = _inputs(2, 7, 3, width)
    y_full, state_full = causal_conv1d(x, weight, bias, initial_state=initial, return_final_state=True)
    state, outputs = initial, []
    for t in range(x.shape[1]):
        before = state.clone()
        y_t, new_state = causal_conv1d_step(state, x[:, t], weight, bias, activation="silu")
        assert torch.equal(state, before)
        outputs.append(y_t)
        state = new_state
    torch.testing.assert_close(torch.stack(outputs, dim=1), y_full, rtol=0.0, atol=1e-12)
    torch.testing.assert_close(state, state_full, rtol=0.0, atol=0.0)


def test_short_sequence_final_state_is_zero_padded_or_continues_the_initial_state():
    x, weight, bias, initial = _inputs(2, 2, 3, 5)
    _, state = causal_conv1d(x, weight, bias, return_final_state=True)
    expected = torch.cat([torch.zeros(2, 3, 2, dtype=torch.float64), x.transpose(1, 2)], dim=-1)
    assert torch.equal(state, expected)
    _, state = causal_conv1d(x, weight, bias, initial_state=initial, return_final_state=True)
    assert torch.equal(state, torch.cat([initial[..., 2:], x.transpose(1, 2)], dim=-1))


def test_width_one_has_an_empty_state():
    x, weight, bias, initial = _inputs(2, 3, 3, 1)
    y, state = causal_conv1d(x, weight, bias, activation=None, initial_state=initial, return_final_state=True)
    assert state.shape == (2, 3, 0)
    torch.testing.assert_close(y, x * weight[:, 0] + bias)


@pytest.mark.parametrize("split_at", [1, 2, 5])
def test_continuing_from_the_final_state_equals_one_call(split_at):
    x, weight, bias, _ = _inputs(2, 8, 3, 4)
    y_full, state_full = causal_conv1d(x, weight, bias, return_final_state=True)
    y_first, state_mid = causal_conv1d(x[:, :split_at], weight, bias, return_final_state=True)
    y_second, state_end = causal_conv1d(
        x[:, split_at:], weight, bias, initial_state=state_mid, return_final_state=True
    )
    torch.testing.assert_close(torch.cat([y_first, y_second], dim=1), y_full, rtol=0.0, atol=1e-12)
    assert torch.equal(state_end, state_full)


def test_low_precision_input_keeps_its_dtype():
    x, weight, bias, _ = _inputs(2, 6, 3, 4)
    y, state = causal_conv1d(x.bfloat16(), weight.float(), bias.float(), return_final_state=True)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.bfloat16
    reference = _loop_oracle(
        x.bfloat16().double(), weight.float().double(), bias.float().double(), "silu", None
    )
    torch.testing.assert_close(y.double(), reference, rtol=1.6e-2, atol=1e-2)
