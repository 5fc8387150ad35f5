"""Expert parameters in DDP, the distributed optimizer and the gradient norm (4 ranks, EP = 2).

A dense linear (the same on every rank) and an "expert" linear marked ``expert_parallel`` whose
weights depend on the expert-parallel rank. Each rank has its own inputs. Oracle, computed on
every rank: the dense gradient is the mean of all four ranks' gradients; the expert gradient of
EP rank ``e`` is the sum over the ranks holding expert ``e`` (its expert-data-parallel group)
divided by the full data-parallel size; the global norm counts each of the two experts once.
"""

import math

import pytest
import torch
import torch.distributed as dist
from mcore_parallel import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    DistributedOptimizer,
    OptimizerConfig,
    clip_grad_norm,
)
from torch import nn


def _expert(ep_rank):
    torch.manual_seed(1 + ep_rank)
    return nn.Linear(4, 3)


def _inputs(rank):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(10 + rank))


def _grads(module, x):
    module.zero_grad()
    module(x).square().sum().backward()
    return [p.grad.clone() for p in module.parameters()]


def _body(use_distributed_optimizer):
    from mcore_parallel import destroy_model_parallel, initialize_model_parallel

    destroy_model_parallel()
    groups = initialize_model_parallel(expert_model_parallel_size=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    ep_ranks = [None] * world
    dist.all_gather_object(ep_ranks, dist.get_rank(groups.ep))
    ep_rank = ep_ranks[rank]

    torch.manual_seed(0)
    dense, expert = nn.Linear(4, 3), _expert(ep_rank)
    for param in expert.parameters():
        param.expert_parallel = True
    config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer, bucket_size=8)
    ddp = DistributedDataParallel(nn.ModuleList([dense, expert]), config, groups.dp, groups.expert_dp)
    assert {b.dp_group for b in ddp.buckets} == {groups.dp, groups.expert_dp}
    x = _inputs(rank)
    (dense(x).square().sum() + expert(x).square().sum()).backward()

    torch.manual_seed(0)
    dense_copy = nn.Linear(4, 3)
    expected_dense = [
        sum(g) / world for g in zip(*(_grads(dense_copy, _inputs(r)) for r in range(world)), strict=True)
    ]
    expected_expert = {}
    for e in (0, 1):
        copy = _expert(e)
        holders = [r for r in range(world) if ep_ranks[r] == e]
        expected_expert[e] = [
            sum(g) / world for g in zip(*(_grads(copy, _inputs(r)) for r in holders), strict=True)
        ]
    expected_norm = math.sqrt(
        sum(g.double().square().sum().item() for g in expected_dense)
        + sum(g.double().square().sum().item() for e in (0, 1) for g in expected_expert[e])
    )

    if use_distributed_optimizer:
        optimizer = DistributedOptimizer(ddp, OptimizerConfig(lr=0.0, clip_grad=0.0), groups)
        norm = optimizer.step()
        states = optimizer.gather_param_states()  # whole values back from the shards
        mains = [states[p]["main"] for p in [*dense.parameters(), *expert.parameters()]]
        values_ok = all(
            torch.equal(m, p.detach())
            for m, p in zip(mains, [*dense.parameters(), *expert.parameters()], strict=True)
        )
        return abs(norm - expected_norm) / expected_norm, values_ok

    ddp.finish_grad_sync()
    errors = [
        (p.main_grad - g).abs().max().item()
        for p, g in zip(
            [*dense.parameters(), *expert.parameters()],
            expected_dense + expected_expert[ep_rank],
            strict=True,
        )
    ]
    norm = clip_grad_norm([*dense.parameters(), *expert.parameters()], 0.0, groups)
    return max(errors), abs(norm - expected_norm) / expected_norm


@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["ddp", "distributed-optimizer"])
def test_expert_gradients_reduce_over_the_expert_data_parallel_group(
    use_distributed_optimizer, run_distributed
):
    results = run_distributed(_body, 4, use_distributed_optimizer, timeout=60)
    if use_distributed_optimizer:
        assert all(error < 1e-6 and values_ok for error, values_ok in results), results
    else:
        assert all(grad_error < 1e-6 and norm_error < 1e-6 for grad_error, norm_error in results), results
