"""A 2-rank data-parallel GRPO iteration (gloo) equals the same iteration on one rank: each rank
generates half of the prompts' rollouts, the groups are gathered, each rank trains on its share
of the packed bins, and DDP's averaged gradients give the one-rank step: the same rewards and
loss and, within float32 rounding, the same weights. The two ranks shard the optimizer state
(``distributed_optimizer``); their checkpoint holds the same whole Adam state as the one rank's."""

import sys
from pathlib import Path

import torch
from mcore_rl.loop import save_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import VariedRewards, build_loop


def _one_iteration(directory, distributed_optimizer):
    loop = build_loop(
        agent=VariedRewards(200, 20, max_digits=2), beta=0.05, distributed_optimizer=distributed_optimizer
    )
    initial = [p.detach().clone() for p in loop.policy.parameters()]
    generated, generate = [], loop.handle.generate
    loop.handle.generate = lambda prompts, **sampling: (
        generated.extend(prompts) or generate(prompts, **sampling)
    )
    record = loop.step()
    weights = {name: p.detach().clone() for name, p in loop.policy.named_parameters()}
    keys = ("loss", "kl", "train_reward", "trained_sequences", "trained_tokens")
    save_checkpoint(loop, directory)
    moved = max(float((a - b).abs().max()) for a, b in zip(initial, weights.values(), strict=True))
    extra = {"moved": moved, "generated": len(generated), "optimizer": type(loop.optimizer).__name__}
    return {k: record[k] for k in keys} | extra, weights


def _adam_state(directory):
    return torch.load(Path(directory) / "rl_state.pt", weights_only=False)["optimizer"]


def test_two_data_parallel_ranks_equal_one(run_distributed, tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    ((single, single_weights),) = run_distributed(_one_iteration, 1, one, False, timeout=120)
    ranks = run_distributed(_one_iteration, 2, two, True, timeout=180)
    for record, weights in ranks:
        assert record["trained_sequences"] == single["trained_sequences"] > 0 and single["moved"] > 1e-3
        assert record["train_reward"] == single["train_reward"]
        assert (single["optimizer"], record["optimizer"]) == ("LocalOptimizer", "DistributedOptimizer")
        assert record["generated"] == single["generated"] // 2 > 0  # each rank samples its half
        torch.testing.assert_close(record["loss"], single["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(record["kl"], single["kl"], rtol=1e-4, atol=1e-6)
        # Adam's first step (lr 1e-2) moves each weight by lr * g / (|g| + eps), so float32
        # rounding in gradients near eps (other matmul shapes on two ranks) shows up as 1e-6 to
        # 1e-5; a wrong gradient moves weights by up to lr
        for name, value in single_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-4, msg=name)
    sharded, whole = _adam_state(two), _adam_state(one)
    assert sharded.keys() == whole.keys()
    for name, state in whole.items():
        for key, value in state.items():
            atol = 1e-4 if key == "main" else 1e-6  # the main weights: as the weights above
            torch.testing.assert_close(sharded[name][key], value, rtol=1e-4, atol=atol, msg=f"{name} {key}")
