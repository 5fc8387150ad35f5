"""GRPOLossConfig: TRL's defaults, and a typed error naming the field for every bad value."""

import dataclasses

import pytest
from mcore_rl import GRPOLossConfig


def test_defaults_are_trls():
    config = GRPOLossConfig()
    assert (config.clip_low, config.clip_high, config.beta) == (0.2, 0.2, 0.0)
    assert (config.kl_estimator, config.entropy_coef, config.tis_cap) == ("k3", 0.0, None)
    assert (config.aggregation, config.scale_rewards) == ("token_mean", "group")
    assert (config.filter_zero_variance_groups, config.advantage_eps) == (False, 1e-4)


def test_every_field_has_help_for_a_generated_command_line():
    assert all(field.metadata["help"] for field in dataclasses.fields(GRPOLossConfig))


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("clip_low", -0.1, ValueError),
        ("clip_low", 1.5, ValueError),
        ("clip_low", "0.2", TypeError),
        ("clip_low", None, TypeError),
        ("clip_high", -0.01, ValueError),
        ("clip_high", float("inf"), ValueError),
        ("clip_high", True, TypeError),
        ("beta", -1.0, ValueError),
        ("beta", float("nan"), ValueError),
        ("kl_estimator", "k4", ValueError),
        ("kl_estimator", "K3", ValueError),
        ("entropy_coef", -0.01, ValueError),
        ("entropy_coef", "0", TypeError),
        ("tis_cap", 0.0, ValueError),
        ("tis_cap", -2.0, ValueError),
        ("tis_cap", "2", TypeError),
        ("aggregation", "mean", ValueError),
        ("scale_rewards", "batch", ValueError),
        ("scale_rewards", None, ValueError),
        ("filter_zero_variance_groups", 1, TypeError),
        ("advantage_eps", 0.0, ValueError),
        ("advantage_eps", None, TypeError),
    ],
)
def test_bad_values_raise_typed_errors_naming_the_field(field, value, error):
    with pytest.raises(error, match=f"^{field}:"):
        GRPOLossConfig(**{field: value})


def test_good_edge_values_are_accepted():
    GRPOLossConfig(clip_low=0.0, clip_high=0.0, tis_cap=1, beta=0, entropy_coef=0)
    GRPOLossConfig(clip_low=1.0, clip_high=10.0, kl_estimator="k1", aggregation="sequence_mean")
