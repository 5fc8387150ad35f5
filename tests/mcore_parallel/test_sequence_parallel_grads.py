"""reduce_sequence_parallel_grads sums tagged gradients over TP ranks: main_grad first, else grad."""

import torch
import torch.distributed as dist
from mcore_parallel import reduce_sequence_parallel_grads
from torch import nn


def _reduce_tagged_gradients():
    rank = dist.get_rank()
    module = nn.Module()
    module.norm = nn.Parameter(torch.zeros(3))
    module.bias = nn.Parameter(torch.zeros(2))
    module.weight = nn.Parameter(torch.zeros(2))  # not tagged: left alone
    module.norm.sequence_parallel = module.bias.sequence_parallel = True
    module.norm.grad = torch.full((3,), 100.0)  # DDP keeps the accumulated gradient in main_grad
    module.norm.main_grad = torch.full((3,), float(rank + 1))
    module.bias.grad = torch.full((2,), float(10 * (rank + 1)))
    module.weight.grad = torch.full((2,), float(rank))
    reduce_sequence_parallel_grads(module, dist.group.WORLD)
    return (
        module.norm.main_grad.tolist(),
        module.norm.grad.tolist(),
        module.bias.grad.tolist(),
        module.weight.grad.tolist(),
    )


def test_main_grad_is_reduced_where_present_else_grad(run_distributed):
    results = run_distributed(_reduce_tagged_gradients, 2)
    for rank, (main_grad, grad, bias, weight) in enumerate(results):
        assert main_grad == [3.0] * 3
        assert grad == [100.0] * 3
        assert bias == [30.0] * 2
        assert weight == [float(rank)] * 2
