"""The reward-only agent: a dataset of prompts and a reward for each completion's text."""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mcore_api import experimental_api

from ..inference.generation import Prompt


@experimental_api
class RewardOnlyAgent(ABC):
    """An environment that scores whole completions: subclasses give ``get_dataset(split)`` (the
    examples of ``"train"`` or ``"test"``), ``get_prompt(example)`` (a text or token ids) and
    ``get_reward(example, completion_text)`` (a finite float). ``evaluation_prompts()`` is the
    held-out split by default. ``name`` tags the agent's rollouts (default: the class name).
    Agents know nothing of the trainer: rollout generators pass them a handle's completions."""

    name: str = ""

    @property
    def task_name(self) -> str:
        """``name``, or the class name when it is empty."""
        return self.name or type(self).__name__

    @abstractmethod
    def get_dataset(self, split: str) -> Sequence[Any]:
        """The examples of ``split`` (``"train"`` or ``"test"``)."""

    @abstractmethod
    def get_prompt(self, example: Any) -> Prompt:
        """The prompt of ``example``: a text or token ids."""

    @abstractmethod
    def get_reward(self, example: Any, completion_text: str) -> float:
        """The reward of ``completion_text`` as an answer to ``example``."""

    def evaluation_prompts(self) -> Sequence[Any]:
        """The examples to evaluate on: ``get_dataset("test")``."""
        return self.get_dataset("test")

    def task_examples(self, split: str) -> list[TaskExample]:
        """Every example of ``split``, tagged with this agent and its index."""
        return [TaskExample(self, example, index) for index, example in enumerate(self.get_dataset(split))]

    def score(
        self, example: Any, completion_text: str | None, prompt_index: int
    ) -> tuple[float | None, str | None]:
        """``(reward, None)``, or ``(None, error)`` when ``get_reward`` raises or returns something
        that is not a finite number; the error names the agent, the prompt index and the cause."""
        where = f"agent {self.task_name!r}, prompt {prompt_index}"
        if completion_text is None:
            return None, f"{where}: the inference handle returned no text (it has no tokenizer)"
        try:
            reward = self.get_reward(example, completion_text)
        except Exception as error:  # the agent's code: its failure is this rollout's
            return None, f"{where}: get_reward raised {type(error).__name__}: {error}"
        if not isinstance(reward, numbers.Real) or isinstance(reward, bool):
            return None, f"{where}: get_reward returned {type(reward).__name__} {reward!r:.50}, not a number"
        if not math.isfinite(reward):
            return None, f"{where}: get_reward returned {reward}, not a finite number"
        return float(reward), None


@experimental_api
@dataclass(frozen=True)
class TaskExample:
    """One example of an agent's dataset: the ``agent``, the ``example`` and its ``index`` in the split."""

    agent: RewardOnlyAgent
    example: Any
    index: int
