"""Weighted multi-task mixing: one stream of prompts drawn from several agents."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from mcore_api import experimental_api

from .agent import RewardOnlyAgent, TaskExample


@experimental_api
class TaskMixture:
    """A stream of ``TaskExample`` s from several agents of ``split``: each draw picks an agent
    with probability proportional to its weight, then that agent's next example in a shuffled
    order of its dataset (reshuffled at every pass). The stream is a function of ``seed``:
    the same seed gives the same prompts, whatever the batch sizes it is read in.

    ``agents``: ``(agent, weight)`` pairs, weights finite and > 0, task names distinct
    (``TypeError``/``ValueError`` naming the pair otherwise; an agent with an empty split is a
    ``ValueError``)."""

    def __init__(self, agents: Sequence[tuple[RewardOnlyAgent, float]], seed: int = 0, split: str = "train"):
        if not agents:
            raise ValueError("agents: give at least one (agent, weight) pair")
        for i, pair in enumerate(agents):
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], RewardOnlyAgent)):
                raise TypeError(f"agents[{i}]: must be an (agent, weight) pair with a RewardOnlyAgent")
            weight = pair[1]
            if (
                isinstance(weight, bool)
                or not isinstance(weight, (int, float))
                or not (math.isfinite(weight) and weight > 0)
            ):
                raise ValueError(f"agents[{i}]: weight must be a finite number > 0, got {weight!r}")
        names = [agent.task_name for agent, _ in agents]
        if len(set(names)) != len(names):
            raise ValueError(f"agents: task names must be distinct, got {names}")
        self.agents = [agent for agent, _ in agents]
        self.weights = [float(weight) for _, weight in agents]
        self.split = split
        self._datasets = [agent.get_dataset(split) for agent in self.agents]
        empty = [n for n, d in zip(names, self._datasets, strict=True) if len(d) == 0]
        if empty:
            raise ValueError(f"agents: {empty[0]!r} has no {split!r} examples")
        self._rng = random.Random(seed)
        self._orders: list[list[int]] = [[] for _ in self.agents]
        self._shufflers = [random.Random(f"{seed}/{name}") for name in names]

    def sample(self, count: int) -> list[TaskExample]:
        """The next ``count`` examples of the stream."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count: must be an int >= 0, got {count!r}")
        chosen = self._rng.choices(range(len(self.agents)), weights=self.weights, k=count)
        return [self._next(a) for a in chosen]

    def _next(self, a: int) -> TaskExample:
        if not self._orders[a]:
            order = list(range(len(self._datasets[a])))
            self._shufflers[a].shuffle(order)
            self._orders[a] = order[::-1]  # popped from the end
        index = self._orders[a].pop()
        return TaskExample(self.agents[a], self._datasets[a][index], index)
