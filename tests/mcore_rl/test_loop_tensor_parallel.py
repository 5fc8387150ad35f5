"""A GRPO iteration of a policy split over 2 tensor-parallel ranks (the engine's copy too) equals
the iteration of the same weights on one rank: the same rollouts and rewards, loss, and updated
full weights (gathered from the shards) within float32 rounding."""

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from mcore_models import GPTModel, gather_full_tensor, shard_full_tensor, state_tensors
from mcore_parallel import destroy_model_parallel, initialize_model_parallel
from mcore_rl.loop import CharTokenizer, GRPOLoop, GRPOLoopConfig

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import FAST, TINY, VariedRewards


def _vocab_padded(full, local, policy):
    """``full`` with zero rows up to the padded vocabulary where it is a vocabulary-sized tensor."""
    if full.shape[0] != policy.vocab_size or policy.padded_vocab_size == policy.vocab_size:
        return full
    return torch.cat([full, full.new_zeros(policy.padded_vocab_size - full.shape[0], *full.shape[1:])])


def _iteration(path, tensor_parallel):
    destroy_model_parallel()
    groups = initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    tokenizer = CharTokenizer()
    torch.manual_seed(0)
    config = dataclasses.replace(TINY.transformer_config(), tensor_model_parallel_size=tensor_parallel)
    policy = GPTModel(config, tokenizer.vocab_size, pg_collection=groups)
    tensors, rank = state_tensors(policy), dist.get_rank(groups.tp)
    if tensor_parallel == 1:
        torch.save({name: t.detach() for name, t in tensors.items()}, path)
    else:  # the one-rank policy's weights, cut into this rank's shards
        full = torch.load(path)
        with torch.no_grad():
            for name, local in tensors.items():
                local.copy_(
                    shard_full_tensor(local, _vocab_padded(full[name], local, policy), rank, tensor_parallel)
                )
    agent = VariedRewards(200, 20, max_digits=2)
    loop = GRPOLoop(policy, agent, tokenizer, GRPOLoopConfig(**FAST), groups)
    record = loop.step()
    weights = {name: gather_full_tensor(t, groups.tp) for name, t in state_tensors(loop.policy).items()}
    return {k: record[k] for k in ("train_reward", "trained_tokens", "loss", "grad_norm")}, weights


def test_two_tensor_parallel_ranks_equal_one(run_distributed, tmp_path):
    path = str(tmp_path / "initial.pt")
    ((single, single_weights),) = run_distributed(_iteration, 1, path, 1, timeout=120)
    for record, weights in run_distributed(_iteration, 2, path, 2, timeout=180):
        assert record["trained_tokens"] == single["trained_tokens"] > 0
        assert record["train_reward"] == single["train_reward"]
        torch.testing.assert_close(record["loss"], single["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(record["grad_norm"], single["grad_norm"], rtol=1e-4, atol=1e-6)
        for name, value in single_weights.items():
            assert not torch.equal(value, torch.load(path)[name]) or "norm" in name
            rows = weights[name][: value.shape[0]]  # without the vocabulary padding of TP 2
            # Adam's first step (lr 1e-2): gradients near eps round to 1e-5 apart; a wrong one
            # moves a weight by up to lr
            torch.testing.assert_close(rows, value, rtol=1e-4, atol=1e-4, msg=name)
