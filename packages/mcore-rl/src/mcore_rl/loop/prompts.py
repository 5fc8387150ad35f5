"""The training prompts of the loop: an agent's training split in a fresh seeded order each epoch,
resumable from a position."""

from __future__ import annotations

import random

from ..agents.agent import RewardOnlyAgent, TaskExample


class PromptStream:
    """``take(count)``: the next ``count`` examples of ``agent``'s ``"train"`` split; epoch ``e``
    visits them in the order ``random.Random(seed + e)`` shuffles. ``position`` (prompts taken so
    far) is the whole state: the same position gives the same prompts."""

    def __init__(self, agent: RewardOnlyAgent, seed: int, position: int = 0):
        self.tasks = agent.task_examples("train")
        if not self.tasks:
            raise ValueError(f"agent {agent.task_name!r} has no training examples")
        self.seed, self.position = seed, position

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[TaskExample]:
        """The next ``count`` training examples."""
        taken, orders = [], {}
        for position in range(self.position, self.position + count):
            epoch, offset = divmod(position, len(self.tasks))
            if epoch not in orders:
                orders[epoch] = self._order(epoch)
            taken.append(self.tasks[orders[epoch][offset]])
        self.position += count
        return taken
