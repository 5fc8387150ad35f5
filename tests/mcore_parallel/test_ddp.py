"""DistributedDataParallel == one process on the whole batch, gradient for gradient.

Each rank builds the reference MLP from a shared seed, runs it on the full batch (mean loss), then
the DDP copy on its own slice of the batch. Averaged DDP gradients equal the reference; summed ones
equal ``dp`` times it. fp32; only the summation order differs: rtol 1e-5, atol 1e-6.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from mcore_parallel import DistributedDataParallel, DistributedDataParallelConfig
from torch import nn

BATCH, HIDDEN = 8, 6
RTOL, ATOL = 1e-5, 1e-6


def _mlp():
    return nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))


def _ddp_matches_reference(overlap, reduce_op, micro_batches):
    rank, dp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _mlp()
    data = torch.randn(micro_batches, BATCH, HIDDEN)
    for micro in data:
        (reference(micro).square().mean() / micro_batches).backward()

    config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, bucket_size=40, grad_reduce_op=reduce_op
    )
    model = DistributedDataParallel(copy.deepcopy(reference), config)
    assert len(model.buckets) > 1
    model.zero_grad_buffer()
    per_rank = BATCH // dp
    for index, micro in enumerate(data):
        local = micro[rank * per_rank : (rank + 1) * per_rank]
        last = index == micro_batches - 1
        with model.no_sync() if not last else torch.enable_grad():
            (model(local).square().mean() / micro_batches).backward()
        started = [bucket._started for bucket in model.buckets]
        assert all(started) == (overlap and last), (
            "buckets must launch from the hooks of the last micro-batch"
        )
    model.finish_grad_sync()
    factor = 1.0 if reduce_op == "average" else dp
    for (name, param), expected in zip(model.module.named_parameters(), reference.parameters(), strict=True):
        assert param.grad is None
        torch.testing.assert_close(param.main_grad, expected.grad * factor, rtol=RTOL, atol=ATOL, msg=name)
    return True


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("reduce_op", ["average", "sum"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_ddp_gradients_match_single_process(run_distributed, overlap, reduce_op, micro_batches):
    assert run_distributed(_ddp_matches_reference, 2, overlap, reduce_op, micro_batches) == [True] * 2


def _scaled_and_fp32_buffer():
    torch.manual_seed(0)
    model = DistributedDataParallel(
        _mlp().to(torch.bfloat16), DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    )
    model(torch.ones(2, HIDDEN, dtype=torch.bfloat16)).float().sum().backward()
    model.finish_grad_sync()
    before = [p.main_grad.clone() for p in model.module.parameters()]
    model.scale_gradients(0.5)
    dtypes = {p.main_grad.dtype for p in model.module.parameters()}
    return dtypes == {torch.float32} and all(
        torch.equal(p.main_grad, b * 0.5) for p, b in zip(model.module.parameters(), before, strict=True)
    )


def test_fp32_gradient_buffer_and_scaling(run_distributed):
    assert run_distributed(_scaled_and_fp32_buffer, 2) == [True] * 2
