"""Agents through a real inference handle (``HFHandle`` on a tiny random-weight Llama with a
character tokenizer): a seeded mixture of two addition tasks sampled into GRPO groups carries
exactly the handle's tokens and log-probabilities, each rollout scored by its own task on the
handle's text, and greedy evaluation agrees with scoring the greedy completions by hand."""

import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
from mcore_models.data import Tokenizer  # noqa: E402
from mcore_rl.agents import AdditionAgent, TaskMixture, evaluate, grouped_rollouts  # noqa: E402
from mcore_rl.inference import HFHandle  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "mcore_inference"))
from serve_process import write_tiny_hf_model  # noqa: E402

SAMPLING = dict(max_tokens=4, temperature=1.0, seed=3)


class ShortAddition(AdditionAgent):
    name = "short"


@pytest.fixture(scope="module")
def handle(tmp_path_factory):
    model_dir = write_tiny_hf_model(tmp_path_factory.mktemp("rollouts") / "tiny-llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return HFHandle(model, Tokenizer.from_file(model_dir / "tokenizer.json"))


def test_mixed_groups_carry_the_handles_samples_scored_by_their_task(handle):
    tasks = [
        (AdditionAgent(50, 10, min_digits=2, max_digits=3, partial_credit=True), 1.0),
        (ShortAddition(20, 5, max_digits=1, partial_credit=True), 1.0),
    ]
    batch = TaskMixture(tasks, seed=1).sample(4)
    groups = grouped_rollouts(handle, batch, group_size=3, **SAMPLING)
    generations = handle.generate([t.example.prompt for t in batch], n=3, **SAMPLING)
    assert [g.task for g in groups] == [t.agent.task_name for t in batch]
    assert {g.task for g in groups} == {"addition", "short"}  # seed 1 draws both
    rollouts = [r for g in groups for r in g.rollouts]
    assert [r.completion_ids for r in rollouts] == [g.completion_ids for g in generations]
    assert [r.logprobs for r in rollouts] == [g.logprobs for g in generations]
    for group, task in zip(groups, batch, strict=True):
        assert group.prompt_index == task.index
        for rollout in group.rollouts:
            assert rollout.prompt_ids == [ord(c) for c in task.example.prompt]
            assert rollout.reward == task.agent.get_reward(task.example, rollout.text)


def test_greedy_evaluation_scores_the_greedy_completions(handle):
    agent = AdditionAgent(20, 6, partial_credit=True)
    result = evaluate(agent, handle, n=1, temperature=0, max_tokens=4)
    greedy = handle.generate([e.prompt for e in agent.evaluation_prompts()], temperature=0, max_tokens=4)
    rewards = [agent.get_reward(e, g.text) for e, g in zip(agent.evaluation_prompts(), greedy, strict=True)]
    assert result.mean_reward == pytest.approx(sum(rewards) / len(rewards))
    assert result.pass_at_k == {1: sum(r == 1.0 for r in rewards) / len(rewards)}
