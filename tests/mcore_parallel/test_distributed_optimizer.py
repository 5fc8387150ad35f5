"""Distributed (ZeRO-1) optimizer == torch Adam/AdamW on one process; sharded state; fp32 reduce-scatter.

fp32 runs: parameters after three steps agree with the single-process optimizer to rtol 1e-5,
atol 1e-6 (summation order only). bf16 model parameters with fp32 main copies track the fp32 run to
a relative error of 2e-2 (bf16 forward/backward).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from mcore_parallel import (
    ConfigError,
    DistributedDataParallel,
    DistributedDataParallelConfig,
    DistributedOptimizer,
    OptimizerConfig,
    parse_dataclasses,
    relative_difference,
)
from torch import nn

BATCH, HIDDEN, STEPS = 8, 6, 3
RTOL, ATOL = 1e-5, 1e-6


def _mlp():
    return nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))


def _train(decoupled, dtype, offload_fraction, overlap):
    rank, dp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _mlp()
    data = torch.randn(STEPS, BATCH, HIDDEN)
    config = OptimizerConfig(
        lr=1e-2,
        weight_decay=0.1,
        decoupled_weight_decay=decoupled,
        optimizer_cpu_offload=offload_fraction is not None,
        optimizer_offload_fraction=offload_fraction or 1.0,
    )
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=overlap,
        bucket_size=50,
        grad_reduce_in_fp32=dtype != torch.float32,
    )
    model = DistributedDataParallel(copy.deepcopy(reference).to(dtype), ddp_config)
    optimizer = DistributedOptimizer(model, config)
    adam = torch.optim.AdamW if decoupled else torch.optim.Adam
    reference_optimizer = adam(reference.parameters(), lr=1e-2, weight_decay=0.1)
    per_rank = BATCH // dp
    for batch in data:
        reference_optimizer.zero_grad()
        reference(batch).square().mean().backward()
        reference_optimizer.step()
        optimizer.zero_grad()
        model(batch[rank * per_rank : (rank + 1) * per_rank].to(dtype)).float().square().mean().backward()
        optimizer.step()
    if offload_fraction is not None:
        total = sum(m.numel() for m in optimizer.main_params)
        assert 0 < optimizer.offloaded_numel <= offload_fraction * total
    errors = []
    for (name, param), expected in zip(model.module.named_parameters(), reference.parameters(), strict=True):
        assert param.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(param, expected, rtol=RTOL, atol=ATOL, msg=name)
        errors.append(relative_difference(param.float(), expected.detach()))
    assert all(m.dtype == torch.float32 for m in optimizer.main_params)
    return max(errors)


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("offload_fraction", [None, 0.5], ids=["device", "offload-half"])
def test_distributed_optimizer_matches_torch_adam(run_distributed, decoupled, offload_fraction):
    run_distributed(_train, 2, decoupled, torch.float32, offload_fraction, True)


def test_bf16_parameters_with_fp32_main_copies(run_distributed):
    errors = run_distributed(_train, 2, True, torch.bfloat16, None, False)
    assert max(errors) < 2e-2, errors


def _state_bytes():
    torch.manual_seed(0)
    model = DistributedDataParallel(
        _mlp(), DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=50)
    )
    optimizer = DistributedOptimizer(model, OptimizerConfig())
    model(torch.randn(2, HIDDEN)).sum().backward()
    optimizer.step()
    numel = sum(p.numel() for p in model.module.parameters())
    return optimizer.state_bytes(), 3 * 4 * numel, len(model.buckets)  # main + exp_avg + exp_avg_sq


def test_optimizer_state_is_sharded(run_distributed):
    dp = 4
    results = run_distributed(_state_bytes, dp)
    for per_rank, replicated, buckets in results:
        # Each bucket is padded to a multiple of dp, so a rank holds at most one extra element per bucket.
        assert replicated / dp <= per_rank <= replicated / dp + 3 * 4 * buckets, (per_rank, replicated)


def _reduce_scatter_errors():
    rank, dp = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    values = [torch.randn(64, generator=generator) * (1 + 30 * r) for r in range(dp)]
    values = [v.to(torch.bfloat16) for v in values]  # what each rank's bf16 gradient holds
    exact = torch.stack([v.float() for v in values]).sum(0)
    errors = {}
    for fp32_accumulation in (False, True):
        model = DistributedDataParallel(
            nn.Linear(8, 8, bias=False).to(torch.bfloat16),
            DistributedDataParallelConfig(
                use_distributed_optimizer=True,
                grad_reduce_op="sum",
                reduce_scatter_with_fp32_accumulation=fp32_accumulation,
            ),
        )
        (bucket,) = model.buckets
        bucket.grad_data.copy_(values[rank])
        model.finish_grad_sync()
        shard = exact.narrow(0, bucket.shard_start, bucket.shard_numel)
        errors[fp32_accumulation] = relative_difference(bucket.main_grad_shard.float(), shard)
        assert bucket.main_grad_shard.dtype == (torch.float32 if fp32_accumulation else torch.bfloat16)
    return errors


def test_fp32_accumulating_reduce_scatter_is_closer_to_fp32(run_distributed):
    for errors in run_distributed(_reduce_scatter_errors, 4):
        assert errors[True] < 1e-6 and errors[False] > 1e-3, errors


def test_configs_validate_and_join_the_cli():
    ddp, optim = parse_dataclasses(
        [DistributedDataParallelConfig, OptimizerConfig],
        [
            "--use-distributed-optimizer",
            "--ddp-bucket-size",
            "100",
            "--lr",
            "0.5",
            "--no-decoupled-weight-decay",
        ],
    )
    assert ddp.use_distributed_optimizer and ddp.bucket_size == 100
    assert optim.lr == 0.5 and not optim.decoupled_weight_decay
    with pytest.raises(ConfigError, match="use_distributed_optimizer"):
        DistributedDataParallelConfig(reduce_scatter_with_fp32_accumulation=True)
    with pytest.raises(ConfigError, match="grad_reduce_op"):
        DistributedDataParallelConfig(grad_reduce_op="max")
    with pytest.raises(ConfigError, match="optimizer_offload_fraction"):
        OptimizerConfig(optimizer_offload_fraction=1.5)


def _needs_distributed_optimizer():
    with pytest.raises(ConfigError, match="use_distributed_optimizer"):
        DistributedOptimizer(DistributedDataParallel(_mlp()))


def test_distributed_optimizer_needs_sharded_buffers(run_distributed):
    run_distributed(_needs_distributed_optimizer, 1)
