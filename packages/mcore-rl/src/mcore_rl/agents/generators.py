"""Rollout generators: prompts of agents through an inference handle, each completion scored by
its agent; one completion per prompt, groups of them (GRPO), or best/worst pairs (DPO)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mcore_api import experimental_api

from ..inference.generation import Generation, InferenceHandle
from .agent import TaskExample
from .rollout import ContrastivePair, Rollout, RolloutGroup

_logger = logging.getLogger(__name__)


@experimental_api
def grouped_rollouts(
    handle: InferenceHandle, tasks: Sequence[TaskExample], group_size: int, **sampling: Any
) -> list[RolloutGroup]:
    """``group_size`` scored completions of each task's prompt, one ``RolloutGroup`` per task in
    order (``group_id`` = its position), from one ``handle.generate`` call (``sampling``: the
    fields of ``SamplingOptions`` but ``n``). A rollout whose reward fails is marked failed and
    the rest go on; a group whose rollouts all failed is kept, flagged ``failed``, and logged."""
    if "n" in sampling:
        raise TypeError("n: set group_size instead")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: must be an int >= 1, got {group_size!r}")
    bad = [i for i, t in enumerate(tasks) if not isinstance(t, TaskExample)]
    if bad:
        raise TypeError(f"tasks[{bad[0]}]: must be a TaskExample, got {type(tasks[bad[0]]).__name__}")
    generations = handle.generate([t.agent.get_prompt(t.example) for t in tasks], n=group_size, **sampling)
    if len(generations) != len(tasks) * group_size:
        raise RuntimeError(
            f"the handle returned {len(generations)} generations for {len(tasks)} x {group_size}"
        )
    groups = []
    for group_id, task in enumerate(tasks):
        batch = generations[group_id * group_size : (group_id + 1) * group_size]
        rollouts = [_rollout(task, group_id, g) for g in batch]
        group = RolloutGroup(group_id, task.agent.task_name, task.index, rollouts)
        if group.failed:
            _logger.warning("every rollout of group %d failed; first error: %s", group_id, rollouts[0].error)
        groups.append(group)
    return groups


@experimental_api
def single_rollouts(handle: InferenceHandle, tasks: Sequence[TaskExample], **sampling: Any) -> list[Rollout]:
    """One scored completion of each task's prompt, in order (see ``grouped_rollouts``)."""
    return [group.rollouts[0] for group in grouped_rollouts(handle, tasks, 1, **sampling)]


@experimental_api
def contrastive_pairs(groups: Sequence[RolloutGroup]) -> list[ContrastivePair]:
    """The highest- and lowest-rewarded scored rollouts of each group (the first of ties), for
    the groups that have two different rewards; the others give no preference and no pair."""
    pairs = []
    for group in groups:
        scored = [r for r in group.rollouts if not r.failed]
        if len(scored) < 2:
            continue
        best = max(scored, key=lambda r: r.reward)
        worst = min(scored, key=lambda r: r.reward)
        if best.reward > worst.reward:
            pairs.append(ContrastivePair(best, worst))
    return pairs


def _rollout(task: TaskExample, group_id: int, generation: Generation) -> Rollout:
    reward, error = task.agent.score(task.example, generation.text, task.index)
    return Rollout(
        prompt_ids=generation.prompt_ids,
        completion_ids=generation.completion_ids,
        logprobs=generation.logprobs,
        text=generation.text,
        finish_reason=generation.finish_reason,
        reward=reward,
        group_id=group_id,
        task=task.agent.task_name,
        prompt_index=task.index,
        error=error,
    )
