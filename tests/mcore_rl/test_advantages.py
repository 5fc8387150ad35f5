"""group_advantages against hand-computed values, and its typed errors."""

import math

import pytest
import torch
from mcore_rl import GRPOLossConfig, group_advantages

EPS = 1e-4  # the default advantage_eps (TRL's)


def test_group_scaling_divides_by_the_unbiased_std_plus_eps():
    rewards = torch.tensor([[1.0, 2.0, 4.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    # group 0: mean 7/3, unbiased variance ((4/3)^2 + (1/3)^2 + (5/3)^2) / 2 = 7/3
    std0 = math.sqrt(7 / 3)
    # group 1: mean 1/3, unbiased variance ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = 1/3
    std1 = math.sqrt(1 / 3)
    expected = [
        [(1 - 7 / 3) / (std0 + EPS), (2 - 7 / 3) / (std0 + EPS), (4 - 7 / 3) / (std0 + EPS)],
        [(0 - 1 / 3) / (std1 + EPS), (1 - 1 / 3) / (std1 + EPS), (0 - 1 / 3) / (std1 + EPS)],
    ]
    result = group_advantages(rewards)
    torch.testing.assert_close(result.advantages, torch.tensor(expected, dtype=torch.float64))
    assert result.zero_variance.tolist() == [False, False]
    assert result.keep.tolist() == [[True] * 3, [True] * 3]


def test_mean_only_scaling_centres_the_rewards():
    rewards = torch.tensor([[1.0, 2.0, 4.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    expected = [[1 - 7 / 3, 2 - 7 / 3, 4 - 7 / 3], [-1 / 3, 2 / 3, -1 / 3]]
    result = group_advantages(rewards, config=GRPOLossConfig(scale_rewards="none"))
    torch.testing.assert_close(result.advantages, torch.tensor(expected, dtype=torch.float64))


def test_flat_rewards_with_group_size_equal_the_grouped_ones():
    flat = torch.tensor([1.0, 2.0, 4.0, 0.0, 1.0, 0.0])
    grouped = group_advantages(flat.view(2, 3))
    result = group_advantages(flat, group_size=3)
    assert result.advantages.shape == (6,) and result.keep.shape == (6,)
    assert torch.equal(result.advantages, grouped.advantages.view(6))
    assert result.zero_variance.shape == (2,)


def test_custom_eps():
    rewards = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    # mean 1/2, unbiased std sqrt(((1/2)^2 + (1/2)^2) / 1) = sqrt(1/2)
    std = math.sqrt(0.5)
    result = group_advantages(rewards, config=GRPOLossConfig(advantage_eps=0.5))
    torch.testing.assert_close(
        result.advantages, torch.tensor([[-0.5 / (std + 0.5), 0.5 / (std + 0.5)]], dtype=torch.float64)
    )


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_zero_variance_groups_get_zero_advantages_and_are_filtered_on_request(scale_rewards):
    # 0.1 three times: the float mean is not exactly 0.1, yet the advantages are exactly 0
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.1, 0.1, 0.1], [2.0, 2.0, 2.0]], dtype=torch.float64)
    unfiltered = group_advantages(rewards, config=GRPOLossConfig(scale_rewards=scale_rewards))
    assert unfiltered.zero_variance.tolist() == [False, True, True]
    assert unfiltered.keep.all()
    assert (unfiltered.advantages[1:] == 0).all()

    filtered = group_advantages(
        rewards,
        config=GRPOLossConfig(scale_rewards=scale_rewards, filter_zero_variance_groups=True),
    )
    assert filtered.keep.tolist() == [[True] * 3, [False] * 3, [False] * 3]
    assert torch.equal(filtered.advantages, unfiltered.advantages)
    flat = group_advantages(
        rewards.view(-1), 3, GRPOLossConfig(scale_rewards=scale_rewards, filter_zero_variance_groups=True)
    )
    assert flat.keep.tolist() == [True] * 3 + [False] * 6


def test_one_completion_per_group_without_scaling_is_allowed():
    result = group_advantages(torch.tensor([3.0, 5.0]), 1, GRPOLossConfig(scale_rewards="none"))
    assert result.advantages.tolist() == [0.0, 0.0]
    assert result.zero_variance.tolist() == [True, True]


BAD_INPUTS = [
    # (rewards, group_size, config, error, argument named)
    ([1.0, 0.0], None, None, TypeError, "rewards"),
    (torch.tensor([[1, 0], [0, 1]]), None, None, TypeError, "rewards"),
    (torch.tensor([[1.0, float("nan")]]), None, None, ValueError, "rewards"),
    (torch.tensor([[1.0, float("inf")]]), None, None, ValueError, "rewards"),
    (torch.zeros(2, 2, 2), None, None, ValueError, "rewards"),
    (torch.zeros(0), 2, None, ValueError, "rewards"),
    (torch.zeros(4), None, None, ValueError, "group_size"),
    (torch.zeros(5), 2, None, ValueError, "group_size"),
    (torch.zeros(2, 3), 2, None, ValueError, "group_size"),
    (torch.zeros(4), 1, None, ValueError, "group_size"),
    (torch.zeros(4, 1), None, None, ValueError, "group_size"),
    (torch.zeros(4), 0, None, ValueError, "group_size"),
    (torch.zeros(4), 2.0, None, TypeError, "group_size"),
    (torch.zeros(4), True, None, TypeError, "group_size"),
    (torch.zeros(4), 2, {"scale_rewards": "none"}, TypeError, "config"),
]


@pytest.mark.parametrize(("rewards", "group_size", "config", "error", "argument"), BAD_INPUTS)
def test_bad_inputs_raise_typed_errors_naming_the_argument(rewards, group_size, config, error, argument):
    with pytest.raises(error, match=f"^{argument}:"):
        group_advantages(rewards, group_size, config)
