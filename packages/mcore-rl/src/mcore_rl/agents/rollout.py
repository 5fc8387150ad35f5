"""The records rollout generators produce: one rollout, a group of them, a contrastive pair."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_api import experimental_api


@experimental_api
@dataclass(frozen=True)
class Rollout:
    """One scored completion: ``prompt_ids``, ``completion_ids`` and the sampling ``logprobs``
    (one per completion token) from the inference handle, its ``text`` and ``finish_reason``;
    ``reward`` (``None`` when scoring failed); ``group_id`` (the position of its prompt in the
    batch: the completions of one prompt share it), ``task`` (the agent's name) and
    ``prompt_index`` (the example's index in the agent's dataset split); ``error``: why scoring
    failed (``None`` when it did not)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str | None
    finish_reason: str
    reward: float | None
    group_id: int
    task: str
    prompt_index: int
    error: str | None = None

    @property
    def failed(self) -> bool:
        """Whether scoring failed (``error`` says why)."""
        return self.error is not None


@experimental_api
@dataclass(frozen=True)
class RolloutGroup:
    """The completions of one prompt (``group_id``, ``task``, ``prompt_index``), as GRPO needs them."""

    group_id: int
    task: str
    prompt_index: int
    rollouts: list[Rollout]

    @property
    def failed(self) -> bool:
        """Whether every rollout of the group failed (the group has no reward to learn from)."""
        return all(r.failed for r in self.rollouts)

    @property
    def rewards(self) -> list[float | None]:
        """The reward of each rollout (``None`` where it failed)."""
        return [r.reward for r in self.rollouts]


@experimental_api
@dataclass(frozen=True)
class ContrastivePair:
    """The best (``chosen``) and worst (``rejected``) scored completions of one group, for
    DPO-style preference training; ``chosen.reward > rejected.reward``."""

    chosen: Rollout
    rejected: Rollout
