"""``supervised_warmup``: cross entropy on the answers of the split it is given (the default run's
``"warmup"`` sums, disjoint from the RL prompts), the loss falling; an empty split is refused."""

import random
import sys
from pathlib import Path

import pytest
import torch
from mcore_models import GPTModel
from mcore_parallel import ConfigError, destroy_model_parallel, initialize_model_parallel
from mcore_rl.agents import AdditionAgent
from mcore_rl.loop import CharTokenizer, WarmupConfig, supervised_warmup
from mcore_rl.loop.warmup import _demonstrations, flawed_answer

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import TINY


class SplitSpy(AdditionAgent):
    """Records which splits the warm-up reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read = []

    def get_dataset(self, split):
        self.read.append(split)
        return super().get_dataset(split)


def _warm_up():
    destroy_model_parallel()
    groups = initialize_model_parallel()
    tokenizer = CharTokenizer()
    torch.manual_seed(0)
    model = GPTModel(TINY.transformer_config(), tokenizer.vocab_size, pg_collection=groups)
    agent = SplitSpy(50, 10, num_warmup=200, max_digits=2)
    losses = supervised_warmup(
        model, agent, tokenizer, WarmupConfig(sft_steps=60, sft_lr=1e-2), split="warmup"
    )
    try:
        supervised_warmup(model, AdditionAgent(50, 10), tokenizer, WarmupConfig(sft_steps=1), split="warmup")
    except ValueError as error:
        refused = str(error)
    return agent.read, losses, refused, model.training


def test_warmup_trains_on_its_split_and_refuses_an_empty_one(run_distributed):
    ((read, losses, refused, training),) = run_distributed(_warm_up, 1, timeout=120)
    assert read == ["warmup"] and len(losses) == 60 and not training
    assert sum(losses[-10:]) < 0.8 * sum(losses[:10])  # from about ln(13) = 2.56
    assert "the agent's 'warmup' split has no examples" in refused


def test_no_steps_need_no_examples():
    config = WarmupConfig(sft_steps=0)
    assert (
        supervised_warmup(torch.nn.Linear(1, 1), AdditionAgent(5, 5), CharTokenizer(), config, split="warmup")
        == []
    )


def test_flawed_answer_is_one_more_in_the_last_digit():
    assert [flawed_answer(a) for a in ("57", "9", "109", "0")] == ["58", "0", "100", "1"]


def test_demonstrations_are_flawed_at_the_configured_rate():
    agent = AdditionAgent(10, 10, num_warmup=400, max_digits=2)
    examples = list(agent.get_dataset("warmup")) * 10
    for rate in (0.0, 0.3, 1.0):
        shown = _demonstrations(examples, rate, random.Random(0))
        flawed = [answer != e.answer for (prompt, answer), e in zip(shown, examples, strict=True)]
        assert all(prompt == e.prompt for (prompt, _), e in zip(shown, examples, strict=True))
        assert abs(sum(flawed) / len(flawed) - rate) < 0.02, rate
        assert all(
            answer == flawed_answer(e.answer)
            for (_, answer), e, f in zip(shown, examples, flawed, strict=True)
            if f
        )


def test_an_error_rate_outside_0_1_is_refused():
    with pytest.raises(ConfigError, match="demo_error_rate"):
        WarmupConfig(demo_error_rate=1.5)
