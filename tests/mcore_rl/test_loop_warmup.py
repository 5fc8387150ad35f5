"""``supervised_warmup``: cross entropy on the answers of the split it is given (the default run's
``"warmup"`` sums, disjoint from the RL prompts), the loss falling; an empty split is refused."""

import sys
from pathlib import Path

import torch
from mcore_models import GPTModel
from mcore_parallel import destroy_model_parallel, initialize_model_parallel
from mcore_rl.agents import AdditionAgent
from mcore_rl.loop import CharTokenizer, WarmupConfig, supervised_warmup

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
