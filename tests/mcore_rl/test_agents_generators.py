"""Rollout generators over a scripted handle (answers chosen per sample, so every reward is known):
group shapes and ids, one handle call per batch, contrastive pairs, and rewards that raise or are
not finite numbers failing their rollout alone, with whole failed groups kept and logged."""

import logging
import math

import pytest
from mcore_rl.agents import (
    AdditionAgent,
    AdditionExample,
    RewardOnlyAgent,
    TaskExample,
    contrastive_pairs,
    grouped_rollouts,
    single_rollouts,
)
from mcore_rl.inference import Generation, SamplingOptions


class ScriptedHandle:
    """An ``InferenceHandle`` whose completion of prompt text ``p``, sample ``j``, is
    ``script(p, j)`` (token ids: code points; log-probabilities: -(position + 1) / 10)."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompts, **sampling):
        options = SamplingOptions(**sampling)
        self.calls.append((list(prompts), options))
        generations = []
        for i, prompt in enumerate(prompts):
            for j in range(options.n):
                text = self.script(prompt, j)
                ids = [ord(c) for c in text]
                logprobs = [-(k + 1) / 10 for k in range(len(ids))]
                generations.append(Generation([ord(c) for c in prompt], ids, text, logprobs, "stop", i, j))
        return generations


def right_on_even_samples(prompt, j):
    a, b = map(int, prompt[:-1].split("+"))
    return f"{a + b}\n" if j % 2 == 0 else "0\n"


class FragileAgent(AdditionAgent):
    """Addition whose reward raises for a = 1, returns NaN for a = 2 and a string for a = 3."""

    name = "fragile"

    def get_reward(self, example, completion_text):
        if example.a == 1:
            raise KeyError("no such answer")
        return {2: math.nan, 3: "1.0"}.get(example.a, super().get_reward(example, completion_text))


def test_groups_hold_group_size_scored_completions_tagged_with_their_prompt():
    agent = AdditionAgent(20, 5, seed=1)
    handle = ScriptedHandle(right_on_even_samples)
    tasks = agent.task_examples("test")[1:4]
    groups = grouped_rollouts(handle, tasks, group_size=4, max_tokens=6, temperature=0.7)
    assert len(handle.calls) == 1
    prompts, options = handle.calls[0]
    assert prompts == [t.example.prompt for t in tasks]
    assert (options.n, options.max_tokens, options.temperature) == (4, 6, 0.7)
    assert [(g.group_id, g.task, g.prompt_index) for g in groups] == [
        (0, "addition", 1),
        (1, "addition", 2),
        (2, "addition", 3),
    ]
    for group, task in zip(groups, tasks, strict=True):
        assert group.rewards == [1.0, 0.0, 1.0, 0.0] and not group.failed
        for j, rollout in enumerate(group.rollouts):
            assert (rollout.group_id, rollout.task, rollout.prompt_index) == (
                group.group_id,
                "addition",
                task.index,
            )
            assert rollout.prompt_ids == [ord(c) for c in task.example.prompt]
            assert rollout.text == right_on_even_samples(task.example.prompt, j)
            assert rollout.completion_ids == [ord(c) for c in rollout.text]
            assert rollout.logprobs == [-(k + 1) / 10 for k in range(len(rollout.text))]
            assert rollout.error is None and rollout.finish_reason == "stop"


def test_single_rollouts_give_one_completion_per_prompt():
    agent = AdditionAgent(20, 5, seed=1)
    tasks = agent.task_examples("train")[:5]
    rollouts = single_rollouts(ScriptedHandle(right_on_even_samples), tasks, max_tokens=6)
    assert [r.group_id for r in rollouts] == list(range(5))
    assert [r.prompt_index for r in rollouts] == list(range(5))
    assert [r.reward for r in rollouts] == [1.0] * 5  # sample 0 of each prompt is right


def test_contrastive_pairs_take_the_best_and_the_worst_of_each_group():
    agent = AdditionAgent(20, 5, seed=1)
    tasks = agent.task_examples("train")[:3]
    plans = {  # per prompt, per sample: "=" for the right answer
        tasks[0].example.prompt: ["0", "=", "", "0"],
        tasks[1].example.prompt: ["="] * 4,
        tasks[2].example.prompt: ["0"] * 4,
    }

    def script(prompt, j):
        return right_on_even_samples(prompt, 0) if plans[prompt][j] == "=" else plans[prompt][j]

    groups = grouped_rollouts(ScriptedHandle(script), tasks, group_size=4)
    assert [g.rewards for g in groups] == [[0.0, 1.0, 0.0, 0.0], [1.0] * 4, [0.0] * 4]
    (pair,) = contrastive_pairs(groups)  # groups 1 and 2: no preference
    assert pair.chosen is groups[0].rollouts[1]
    assert pair.rejected is groups[0].rollouts[0]  # the first of the ties


def test_a_failing_reward_fails_its_rollout_alone(caplog):
    agent = FragileAgent(10, 5, min_digits=1, max_digits=2)
    examples = [AdditionExample(5, 6), AdditionExample(1, 2), AdditionExample(2, 2), AdditionExample(3, 4)]
    tasks = [TaskExample(agent, e, 10 + i) for i, e in enumerate(examples)]
    with caplog.at_level(logging.WARNING, logger="mcore_rl.agents.generators"):
        groups = grouped_rollouts(ScriptedHandle(right_on_even_samples), tasks, group_size=2)
    assert groups[0].rewards == [1.0, 0.0] and not groups[0].failed
    expected = [
        "agent 'fragile', prompt 11: get_reward raised KeyError: 'no such answer'",
        "agent 'fragile', prompt 12: get_reward returned nan, not a finite number",
        "agent 'fragile', prompt 13: get_reward returned str '1.0', not a number",
    ]
    for group, message in zip(groups[1:], expected, strict=True):
        assert group.failed and group.rewards == [None, None]
        assert [r.error for r in group.rollouts] == [message, message]
        assert all(r.failed and r.completion_ids for r in group.rollouts)
    warnings = [r.getMessage() for r in caplog.records]
    assert [w.split(";")[0] for w in warnings] == [f"every rollout of group {g} failed" for g in (1, 2, 3)]
    (pair,) = contrastive_pairs(groups)  # failed rollouts take no part
    assert (pair.chosen, pair.rejected) == tuple(groups[0].rollouts)


def test_bad_arguments_are_refused():
    agent = AdditionAgent(10, 5)
    handle = ScriptedHandle(right_on_even_samples)
    tasks = agent.task_examples("test")
    with pytest.raises(TypeError, match="n: set group_size instead"):
        grouped_rollouts(handle, tasks, 2, n=2)
    with pytest.raises(ValueError, match="group_size: must be an int >= 1"):
        grouped_rollouts(handle, tasks, 0)
    with pytest.raises(TypeError, match=r"tasks\[0\]: must be a TaskExample"):
        grouped_rollouts(handle, [(agent, tasks[0].example)], 2)
    with pytest.raises(TypeError, match="Can't instantiate abstract class"):
        RewardOnlyAgent()
