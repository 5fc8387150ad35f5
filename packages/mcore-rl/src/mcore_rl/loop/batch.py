"""One iteration's rollouts as training sequences: group-normalised advantages over the scored
completions of each prompt; failed rollouts left out and counted."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..advantages import group_advantages
from ..agents.rollout import RolloutGroup
from ..loss_config import GRPOLossConfig
from ..packing import TrainingSequence


@dataclass(frozen=True)
class RolloutBatch:
    """``sequences`` to train on; ``rewards`` of every scored rollout; ``errors`` of the failed
    ones (why scoring failed); ``skipped_groups``: prompts with fewer than two scored completions
    or filtered for zero reward variance, which give no sequence; ``group_sizes``: how many
    consecutive ``sequences`` each trained prompt gave, in order."""

    sequences: list[TrainingSequence]
    rewards: list[float]
    errors: list[str]
    skipped_groups: int
    group_sizes: list[int]


def rollout_batch(groups: Sequence[RolloutGroup], config: GRPOLossConfig) -> RolloutBatch:
    """The training sequences of ``groups``: each prompt's scored completions with their
    advantages among themselves (``group_advantages`` of ``config``)."""
    sequences, rewards, errors, skipped, sizes = [], [], [], 0, []
    for group in groups:
        scored = [r for r in group.rollouts if not r.failed]
        errors += [r.error for r in group.rollouts if r.failed]
        rewards += [r.reward for r in scored]
        if len(scored) < 2:
            skipped += 1
            continue
        advantages = group_advantages(torch.tensor([[r.reward for r in scored]]), config=config)
        if not bool(advantages.keep.all()):
            skipped += 1
            continue
        sizes.append(len(scored))
        for rollout, advantage in zip(scored, advantages.advantages[0].tolist(), strict=True):
            sequences.append(
                TrainingSequence(rollout.prompt_ids, rollout.completion_ids, rollout.logprobs, advantage)
            )
    return RolloutBatch(sequences, rewards, errors, skipped, sizes)
