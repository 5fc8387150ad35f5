"""Global-norm gradient clipping of a tensor- and data-parallel model == one process.

TP=2 x DP=2 on 4 ranks: a replicated layer norm (duplicated on both TP ranks), a column- and a
row-parallel linear. The returned norm equals the single-process norm (rtol 1e-6), and parameters
after one clipped Adam step equal the reference's (rtol 1e-5, atol 1e-6).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_parallel import (
    ColumnParallelLinear,
    DistributedDataParallel,
    DistributedDataParallelConfig,
    DistributedOptimizer,
    OptimizerConfig,
    RowParallelLinear,
    clip_grad_norm,
    initialize_model_parallel,
    parallel_state,
)
from torch import nn

HIDDEN, BATCH, MAX_NORM = 6, 8, 0.05


class _Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.norm(x))))


class _TensorParallel(nn.Module):
    def __init__(self, reference, tp_group):
        super().__init__()
        rank, size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        self.norm = copy.deepcopy(reference.norm)
        self.up = ColumnParallelLinear(HIDDEN, 4 * HIDDEN, tp_group=tp_group)
        self.down = RowParallelLinear(4 * HIDDEN, HIDDEN, tp_group=tp_group, input_is_parallel=True)
        with torch.no_grad():
            self.up.weight.copy_(reference.up.weight.chunk(size, 0)[rank])
            self.up.bias.copy_(reference.up.bias.chunk(size, 0)[rank])
            self.down.weight.copy_(reference.down.weight.chunk(size, 1)[rank])
            self.down.bias.copy_(reference.down.bias)

    def forward(self, x):
        hidden, _ = self.up(self.norm(x))
        output, _ = self.down(F.gelu(hidden))
        return output


def _clipped_step(use_distributed_optimizer):
    groups = initialize_model_parallel(tensor_model_parallel_size=2)
    dp_rank, dp_size = dist.get_rank(groups.dp), dist.get_world_size(groups.dp)
    torch.manual_seed(0)
    reference = _Reference()
    data = torch.randn(BATCH, HIDDEN)
    reference(data).square().mean().backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM).item()
    torch.optim.Adam(reference.parameters(), lr=1e-2).step()

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer)
    model = DistributedDataParallel(_TensorParallel(_Reference(), groups.tp), ddp_config, groups.dp)
    torch.manual_seed(0)
    model.module.load_state_dict(_TensorParallel(_Reference(), groups.tp).state_dict())
    per_rank = BATCH // dp_size
    model(data[dp_rank * per_rank : (dp_rank + 1) * per_rank]).square().mean().backward()
    if use_distributed_optimizer:
        optimizer = DistributedOptimizer(
            model, OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=MAX_NORM), groups
        )
        norm = optimizer.step()
    else:
        model.finish_grad_sync()
        norm = clip_grad_norm(model.parameters(), MAX_NORM, groups)
        for param in model.parameters():
            param.grad = param.main_grad
        torch.optim.Adam(model.parameters(), lr=1e-2).step()
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    expected = _TensorParallel(reference, groups.tp)
    for (name, param), target in zip(model.module.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(param, target, rtol=1e-5, atol=1e-6, msg=name)
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["ddp", "distributed-optimizer"])
def test_clipping_uses_the_global_norm_of_the_split_model(run_distributed, use_distributed_optimizer):
    run_distributed(_clipped_step, 4, use_distributed_optimizer)


def test_clip_grad_norm_without_groups_matches_torch():
    torch.manual_seed(0)
    model = _Reference()
    model(torch.randn(BATCH, HIDDEN)).square().mean().backward()
    expected = [nn.Parameter(param.detach().clone()) for param in model.parameters()]
    for target, param in zip(expected, model.parameters(), strict=True):
        target.grad = param.grad.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(expected, MAX_NORM).item()
    assert clip_grad_norm(model.parameters(), MAX_NORM) == pytest.approx(expected_norm, rel=1e-6)
    for param, target in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, target.grad, rtol=1e-6, atol=0)
