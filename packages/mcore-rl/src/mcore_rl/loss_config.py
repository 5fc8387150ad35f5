"""``GRPOLossConfig``: the settings of GRPO's advantages and policy loss, checked when built."""

import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Literal, get_args, get_origin

from mcore_api import experimental_api


def _field(default, *, help: str, minimum: float | None = None):
    # The metadata keys of mcore_parallel's config_field, so that a generated command line can read them.
    return field(default=default, metadata={"help": help, "flag": None, "minimum": minimum})


@experimental_api
@dataclass(frozen=True)
class GRPOLossConfig:
    """Settings of ``group_advantages`` and ``grpo_loss``; defaults are TRL's ``GRPOConfig`` defaults.

    Raises ``TypeError`` (wrong type) or ``ValueError`` (out of range) naming the field.
    """

    clip_low: float = _field(
        0.2, minimum=0.0, help="The ratio is clipped from below at 1 - clip_low (TRL's epsilon); in [0, 1]."
    )
    clip_high: float = _field(
        0.2, minimum=0.0, help="The ratio is clipped from above at 1 + clip_high (TRL's epsilon_high)."
    )
    beta: float = _field(
        0.0, minimum=0.0, help="Weight of the KL penalty to the reference policy; 0 needs no reference."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = _field(
        "k3", help="Per-token KL estimator: k1, k2 or k3 (TRL's)."
    )
    entropy_coef: float = _field(0.0, minimum=0.0, help="Weight of the entropy bonus; 0 needs no entropies.")
    tis_cap: float | None = _field(
        None,
        minimum=0.0,
        help="Truncated importance sampling against the inference engine's log-probs: the per-token "
        "weight exp(old_logp - inference_logp) is capped at this value; None turns the correction off.",
    )
    aggregation: Literal["token_mean", "sequence_mean"] = _field(
        "token_mean",
        help="token_mean: mean over all unmasked tokens of the batch; sequence_mean: mean over each "
        "sequence's tokens, then over the sequences.",
    )
    scale_rewards: Literal["group", "none"] = _field(
        "group", help="group: advantages divided by their group's standard deviation; none: centred only."
    )
    filter_zero_variance_groups: bool = _field(
        False, help="Mark the completions of groups whose rewards are all equal as not kept."
    )
    advantage_eps: float = _field(
        1e-4, minimum=0.0, help="Added to the group standard deviation before dividing (TRL's 1e-4)."
    )

    def __post_init__(self) -> None:
        for spec in fields(self):
            choices = get_args(spec.type) if get_origin(spec.type) is Literal else ()
            if choices and getattr(self, spec.name) not in choices:
                raise ValueError(f"{spec.name}: must be one of {choices}, got {getattr(self, spec.name)!r}")
        if not isinstance(self.filter_zero_variance_groups, bool):
            raise TypeError(
                f"filter_zero_variance_groups: must be a bool, got {self.filter_zero_variance_groups!r}"
            )
        _check_number("clip_low", self.clip_low, "in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        for name in ("clip_high", "beta", "entropy_coef"):
            _check_number(name, getattr(self, name), ">= 0", lambda v: v >= 0.0)
        if self.tis_cap is not None:
            _check_number("tis_cap", self.tis_cap, "None or > 0", lambda v: v > 0.0)
        _check_number("advantage_eps", self.advantage_eps, "> 0", lambda v: v > 0.0)


def _check_number(name: str, value: object, allowed: str, within) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name}: must be a number {allowed}, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or not within(value):
        raise ValueError(f"{name}: must be {allowed}, got {value!r}")
