"""The supervised warm-up of the embedded default: the policy learns to write sums before RL."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
from mcore_api import experimental_api
from mcore_models import GPTModel

from ..agents.addition import AdditionAgent, AdditionExample
from ..packing.pack import IGNORE_INDEX
from .config import WarmupConfig


def flawed_answer(answer: str) -> str:
    """``answer`` with its last digit one more (mod 10): a plausible wrong demonstration."""
    return answer[:-1] + str((int(answer[-1]) + 1) % 10)


def answer_batch(pairs: Sequence[tuple[str, str]], tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[b, s]`` of each ``prompt + answer + end`` of ``pairs``, right-padded, and labels:
    the next token where it is part of the answer or the end, ``IGNORE_INDEX`` elsewhere."""
    rows = [
        (tokenizer.encode(prompt), [*tokenizer.encode(answer), tokenizer.eod_id]) for prompt, answer in pairs
    ]
    width = max(len(p) + len(a) for p, a in rows)
    tokens = torch.full((len(rows), width), tokenizer.pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for row, (prompt, answer) in enumerate(rows):
        full = torch.tensor(prompt + answer)
        tokens[row, : len(full)] = full
        labels[row, len(prompt) - 1 : len(full) - 1] = full[len(prompt) :]
    return tokens, labels


def _demonstrations(
    examples: Sequence[AdditionExample], error_rate: float, rng: random.Random
) -> list[tuple[str, str]]:
    """``(prompt, answer)`` of each example, the answer flawed with probability ``error_rate``."""
    return [(e.prompt, flawed_answer(e.answer) if rng.random() < error_rate else e.answer) for e in examples]


@experimental_api
def supervised_warmup(
    model: GPTModel,
    agent: AdditionAgent,
    tokenizer,
    config: WarmupConfig,
    *,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    split: str = "train",
) -> list[float]:
    """``config.sft_steps`` AdamW steps of cross entropy on the answers (and end token) of random
    batches of ``agent``'s ``split``, each answer flawed (``flawed_answer``) with probability
    ``config.demo_error_rate``, the learning rate falling linearly to a tenth; returns
    each step's loss (``on_step(step, loss)`` after each). Leaves ``model`` in eval mode.
    ``ValueError`` when ``split`` has no examples and there are steps to take."""
    examples = list(agent.get_dataset(split))
    if not examples and config.sft_steps:
        raise ValueError(f"split: the agent's {split!r} split has no examples to warm up on")
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.sft_lr, weight_decay=0.0)
    losses = []
    model.train()
    for step in range(config.sft_steps):
        for group in optimizer.param_groups:
            group["lr"] = config.sft_lr * (1 - 0.9 * step / config.sft_steps)
        shown = rng.sample(examples, min(config.sft_batch_size, len(examples)))
        tokens, labels = answer_batch(_demonstrations(shown, config.demo_error_rate, rng), tokenizer)
        per_token = model(tokens, labels=labels)
        loss = per_token.sum() / (labels != IGNORE_INDEX).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step + 1, losses[-1])
    model.eval()
    return losses
