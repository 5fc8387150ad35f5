"""Group-normalised advantages: each completion's reward against the other completions of its prompt."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from mcore_api import experimental_api

from ._checks import float_tensor
from .loss_config import GRPOLossConfig


@experimental_api
@dataclass(frozen=True)
class GroupAdvantages:
    """What ``group_advantages`` returns.

    ``advantages`` and ``keep`` have the shape of the rewards; ``zero_variance`` is ``[G]``.
    """

    advantages: torch.Tensor
    """Per completion: reward minus its group's mean, divided by the group's std + eps when scaled."""
    zero_variance: torch.Tensor
    """Bool per group: all its rewards are equal (no learning signal; its advantages are exactly 0)."""
    keep: torch.Tensor
    """Bool per completion: ``False`` for the completions of zero-variance groups when the config
    filters them (``filter_zero_variance_groups``), ``True`` everywhere otherwise."""


@experimental_api
def group_advantages(
    rewards: torch.Tensor, group_size: int | None = None, config: GRPOLossConfig | None = None
) -> GroupAdvantages:
    """GRPO's advantages of ``rewards``: ``[G, n]`` (G groups of n completions of one prompt each),
    or flat ``[G * n]`` with the completions of a group adjacent and ``group_size=n``.

    With ``config.scale_rewards == "group"``: ``(r - mean) / (std + config.advantage_eps)``, where
    ``std`` is the unbiased (Bessel-corrected, n - 1) standard deviation of the group, as TRL's
    GRPO computes it; with ``"none"``: ``r - mean`` (Dr. GRPO). Groups whose rewards are all equal
    get advantages of exactly 0 and are reported in ``zero_variance``.

    Raises ``TypeError``/``ValueError`` naming the argument: rewards not a floating-point tensor of
    1 or 2 dimensions, empty, NaN or infinite; ``group_size`` missing for flat rewards, not an int
    that divides their count, different from ``n`` for ``[G, n]`` rewards, or below 2 with
    ``scale_rewards == "group"`` (a single completion has no standard deviation).
    """
    config = GRPOLossConfig() if config is None else config
    if not isinstance(config, GRPOLossConfig):
        raise TypeError(f"config: must be a GRPOLossConfig or None, got {type(config).__name__}")
    grouped = _grouped(float_tensor("rewards", rewards), group_size)
    if grouped.shape[1] < 2 and config.scale_rewards == "group":
        raise ValueError(
            f"group_size: must be >= 2 with scale_rewards='group' (the std of one completion is "
            f"undefined), got {grouped.shape[1]}"
        )
    if not bool(torch.isfinite(grouped).all()):
        raise ValueError("rewards: must be finite, got NaN or infinite values")

    zero_variance = (grouped == grouped[:, :1]).all(dim=1)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    centred = torch.where(zero_variance[:, None], torch.zeros_like(centred), centred)
    if config.scale_rewards == "group":
        centred = centred / (grouped.std(dim=1, correction=1, keepdim=True) + config.advantage_eps)
    keep = ~zero_variance if config.filter_zero_variance_groups else torch.ones_like(zero_variance)
    return GroupAdvantages(
        advantages=centred.reshape(rewards.shape),
        zero_variance=zero_variance,
        keep=keep[:, None].expand(grouped.shape).reshape(rewards.shape),
    )


def _grouped(rewards: torch.Tensor, group_size: object) -> torch.Tensor:
    """``rewards`` as ``[G, n]``, after checking ``group_size`` against them."""
    if group_size is not None:
        if not isinstance(group_size, numbers.Integral) or isinstance(group_size, bool):
            raise TypeError(
                f"group_size: must be None or an int, got {type(group_size).__name__} {group_size!r}"
            )
        if group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {group_size}")
    if rewards.numel() == 0:
        raise ValueError(f"rewards: must not be empty, got shape {tuple(rewards.shape)}")
    if rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(
                f"group_size: must be None or {rewards.shape[1]} for rewards of shape "
                f"{tuple(rewards.shape)} ([G, n]), got {group_size}"
            )
        return rewards
    if rewards.dim() != 1:
        raise ValueError(f"rewards: must be [G, n] or flat [G * n], got shape {tuple(rewards.shape)}")
    if group_size is None:
        raise ValueError("group_size: required for flat rewards [G * n]")
    if rewards.numel() % group_size:
        raise ValueError(f"group_size: must divide the number of rewards {rewards.numel()}, got {group_size}")
    return rewards.reshape(-1, int(group_size))
