"""Weighted multi-task mixing: the stream follows the weights, is a function of the seed (whatever
the batch sizes it is read in), passes through each agent's whole dataset before repeating, and
refuses bad agents and weights."""

from collections import Counter

import pytest
from mcore_rl.agents import RewardOnlyAgent, TaskMixture


class ListAgent(RewardOnlyAgent):
    """Examples ``0..size-1`` in train; the prompt is the example's text; reward 0."""

    def __init__(self, name, size):
        self.name, self.size = name, size

    def get_dataset(self, split):
        return list(range(self.size)) if split == "train" else []

    def get_prompt(self, example):
        return f"{self.name}:{example}"

    def get_reward(self, example, completion_text):
        return 0.0


def agents():
    return [(ListAgent("a", 7), 1.0), (ListAgent("b", 5), 2.0), (ListAgent("c", 11), 7.0)]


def test_the_stream_follows_the_weights():
    draws = TaskMixture(agents(), seed=3).sample(20_000)
    counts = Counter(task.agent.name for task in draws)
    for name, share in (("a", 0.1), ("b", 0.2), ("c", 0.7)):
        assert counts[name] / 20_000 == pytest.approx(share, abs=0.01)


def test_the_stream_is_a_function_of_the_seed():
    def key(tasks):
        return [(t.agent.name, t.index) for t in tasks]

    whole = key(TaskMixture(agents(), seed=3).sample(50))
    mixture = TaskMixture(agents(), seed=3)
    assert key(mixture.sample(20)) + key(mixture.sample(0)) + key(mixture.sample(30)) == whole
    assert key(TaskMixture(agents(), seed=4).sample(50)) != whole


def test_each_agent_passes_through_its_dataset_before_repeating():
    tasks = TaskMixture(agents(), seed=0).sample(300)
    for name, size in (("a", 7), ("b", 5), ("c", 11)):
        indices = [t.index for t in tasks if t.agent.name == name]
        passes = [indices[i : i + size] for i in range(0, len(indices) - size + 1, size)]
        assert len(passes) >= 2 and all(sorted(p) == list(range(size)) for p in passes)
        assert passes[0] != passes[1]  # reshuffled at every pass
    assert all(t.example == t.index for t in tasks)


def test_bad_agents_and_weights_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        TaskMixture([])
    with pytest.raises(ValueError, match=r"agents\[1\]: weight must be a finite number > 0, got 0"):
        TaskMixture([(ListAgent("a", 3), 1.0), (ListAgent("b", 3), 0)])
    with pytest.raises(ValueError, match="weight must be a finite number > 0, got nan"):
        TaskMixture([(ListAgent("a", 3), float("nan"))])
    with pytest.raises(TypeError, match=r"agents\[0\]: must be an \(agent, weight\) pair"):
        TaskMixture([("a", 1.0)])
    with pytest.raises(ValueError, match="task names must be distinct"):
        TaskMixture([(ListAgent("a", 3), 1.0), (ListAgent("a", 4), 1.0)])
    with pytest.raises(ValueError, match="'a' has no 'test' examples"):
        TaskMixture([(ListAgent("a", 3), 1.0)], split="test")
    with pytest.raises(ValueError, match="count: must be an int >= 0"):
        TaskMixture(agents()).sample(-1)
