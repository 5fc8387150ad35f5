"""gated_rms_norm against the formula written out group by group."""

import pytest
import torch
from mcore_models.ssm import gated_rms_norm


def _formula(x, z, weight, eps, group_size, norm_before_gate):
    gate = z * torch.sigmoid(z)
    values = x if norm_before_gate else x * gate
    out = torch.empty_like(values)
    for start in range(0, x.shape[-1], group_size):
        group = values[..., start : start + group_size]
        rms = torch.sqrt((group * group).sum(dim=-1, keepdim=True) / group_size + eps)
        out[..., start : start + group_size] = group / rms
    out = out * weight
    return out * gate if norm_before_gate else out


def _inputs(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, z = (torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(2))
    return x, z, torch.randn(shape[-1], generator=gen, dtype=torch.float64)


def test_hand_computed_single_group():
    # x = [3, 4] with an open gate (z = 30, silu(30) = 30 to 1e-11): rms = sqrt(12.5 * 900)
    x = torch.tensor([3.0, 4.0], dtype=torch.float64)
    z = torch.full((2,), 30.0, dtype=torch.float64)
    weight = torch.tensor([1.0, 2.0], dtype=torch.float64)
    y = gated_rms_norm(x, z, weight, eps=0.0, group_size=2)
    expected = torch.tensor([3.0, 8.0], dtype=torch.float64) / 12.5**0.5
    torch.testing.assert_close(y, expected, rtol=1e-9, atol=0.0)


@pytest.mark.parametrize("group_size", [2, 4, 8])
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_matches_formula(group_size, norm_before_gate):
    x, z, weight = _inputs(2, 3, 8, seed=group_size)
    y = gated_rms_norm(x, z, weight, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    torch.testing.assert_close(
        y, _formula(x, z, weight, 1e-5, group_size, norm_before_gate), rtol=1e-12, atol=1e-12
    )


def test_gate_order_and_grouping_change_the_result():
    x, z, weight = _inputs(4, 8)
    after = gated_rms_norm(x, z, weight, eps=1e-6, group_size=8)
    assert not torch.allclose(
        after, gated_rms_norm(x, z, weight, eps=1e-6, group_size=8, norm_before_gate=True)
    )
    assert not torch.allclose(after, gated_rms_norm(x, z, weight, eps=1e-6, group_size=4))


def test_low_precision_input_keeps_its_dtype():
    x, z, weight = _inputs(3, 16)
    y = gated_rms_norm(x.bfloat16(), z.bfloat16(), weight.float(), eps=1e-5, group_size=4)
    assert y.dtype == torch.bfloat16
    reference = _formula(
        x.bfloat16().double(), z.bfloat16().double(), weight.float().double(), 1e-5, 4, False
    )
    torch.testing.assert_close(y.double(), reference, rtol=1.6e-2, atol=1e-2)
