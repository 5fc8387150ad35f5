"""Evaluation of an agent's held-out prompts: mean reward and pass@k."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mcore_api import experimental_api

from ..inference.generation import InferenceHandle
from .agent import RewardOnlyAgent, TaskExample
from .generators import grouped_rollouts


@experimental_api
def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct (Chen et al.
    2021): ``1 - C(n - c, k) / C(n, k)``, the chance that ``k`` of the ``n`` drawn without
    replacement hold a correct one. ``ValueError`` unless ``0 <= c <= n`` and ``1 <= k <= n``."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: must be an int, got {value!r}")
    if not 0 <= c <= n:
        raise ValueError(f"c: must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k: must be in [1, n={n}], got {k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@experimental_api
@dataclass(frozen=True)
class EvaluationResult:
    """What ``evaluate`` measured: ``mean_reward`` over the scored completions (NaN if none),
    ``pass_at_k`` (``{k: mean over prompts of pass_at_k(n, correct, k)}``), ``num_prompts``,
    ``num_samples`` (``n`` per prompt) and ``num_failed`` (completions whose reward failed:
    counted as incorrect, left out of the mean reward)."""

    mean_reward: float
    pass_at_k: dict[int, float]
    num_prompts: int
    num_samples: int
    num_failed: int


@experimental_api
def evaluate(
    agent: RewardOnlyAgent,
    handle: InferenceHandle,
    *,
    n: int = 1,
    ks: Sequence[int] = (1,),
    success_reward: float = 1.0,
    examples: Sequence[Any] | None = None,
    **sampling: Any,
) -> EvaluationResult:
    """``n`` completions of each of ``examples`` (default: ``agent.evaluation_prompts()``),
    scored by ``agent``; a completion is correct when its reward is at least ``success_reward``.
    ``sampling``: the other fields of ``SamplingOptions``."""
    bad = [k for k in ks if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n]
    if bad:
        raise ValueError(f"ks: every k must be an int in [1, n={n}], got {bad[0]!r}")
    chosen = agent.evaluation_prompts() if examples is None else examples
    if not chosen:
        raise ValueError(f"agent {agent.task_name!r} has no evaluation prompts")
    tasks = [TaskExample(agent, example, index) for index, example in enumerate(chosen)]
    groups = grouped_rollouts(handle, tasks, n, **sampling)
    rewards = [r.reward for g in groups for r in g.rollouts if not r.failed]
    correct = [sum(1 for r in g.rollouts if not r.failed and r.reward >= success_reward) for g in groups]
    return EvaluationResult(
        mean_reward=sum(rewards) / len(rewards) if rewards else math.nan,
        pass_at_k={k: sum(pass_at_k(n, c, k) for c in correct) / len(correct) for k in ks},
        num_prompts=len(groups),
        num_samples=n,
        num_failed=len(groups) * n - len(rewards),
    )
