"""A 2-rank data-parallel GRPO iteration (gloo) equals the same iteration on one rank: every rank
samples the same rollouts, trains on its share of the packed bins, and DDP's averaged gradients
give the one-rank step: the same loss and, within float32 rounding, the same weights."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import LongAnswers, build_loop


def _one_iteration():
    loop = build_loop(agent=LongAnswers(200, 20, max_digits=2), beta=0.05)
    initial = [p.detach().clone() for p in loop.policy.parameters()]
    record = loop.step()
    weights = {name: p.detach().clone() for name, p in loop.policy.named_parameters()}
    keys = ("loss", "kl", "train_reward", "trained_sequences", "trained_tokens")
    moved = max(float((a - b).abs().max()) for a, b in zip(initial, weights.values(), strict=True))
    return {k: record[k] for k in keys} | {"moved": moved}, weights


def test_two_data_parallel_ranks_equal_one(run_distributed):
    ((single, single_weights),) = run_distributed(_one_iteration, 1, timeout=120)
    ranks = run_distributed(_one_iteration, 2, timeout=180)
    for record, weights in ranks:
        assert record["trained_sequences"] == single["trained_sequences"] > 0 and single["moved"] > 1e-3
        assert record["train_reward"] == single["train_reward"]
        torch.testing.assert_close(record["loss"], single["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(record["kl"], single["kl"], rtol=1e-4, atol=1e-6)
        for name, value in single_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
