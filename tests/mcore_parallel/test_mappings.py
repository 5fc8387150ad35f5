"""The autograd mappings: forward and backward against values worked out from every rank's inputs.

Rank r feeds ``x(r)`` and backpropagates ``g(r)``; both are known on every rank, so each rank
computes what it should get locally.
"""

import pytest
import torch
import torch.distributed as dist
from mcore_parallel import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)


def x(rank, shape=(4, 4)):
    return torch.arange(16.0).view(shape) + 100 * rank


def g(rank, shape):
    return torch.arange(float(torch.Size(shape).numel())).view(shape) * (rank + 1) - 3


def _run(name):
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    ranks = range(world)
    full = x(0)  # replicated input for the scatters
    cases = {
        # name: (input on this rank, mapping, expected output, expected input grad as a function of g)
        "copy": (x(rank), copy_to_tensor_model_parallel_region, x(rank), lambda gs: sum(gs)),
        "reduce": (
            x(rank),
            reduce_from_tensor_model_parallel_region,
            sum(x(r) for r in ranks),
            lambda gs: gs[rank],
        ),
        "scatter": (
            full,
            scatter_to_tensor_model_parallel_region,
            full.chunk(world, -1)[rank],
            lambda gs: torch.cat(gs, -1),
        ),
        "gather": (
            x(rank),
            gather_from_tensor_model_parallel_region,
            torch.cat([x(r) for r in ranks], -1),
            lambda gs: gs[rank].chunk(world, -1)[rank],
        ),
        "scatter_seq": (
            full,
            scatter_to_sequence_parallel_region,
            full.chunk(world, 0)[rank],
            lambda gs: torch.cat(gs, 0),
        ),
        "gather_seq": (
            x(rank),
            gather_from_sequence_parallel_region,
            torch.cat([x(r) for r in ranks], 0),
            lambda gs: sum(gs).chunk(world, 0)[rank],
        ),
        "gather_seq_no_tp_grad": (
            x(rank),
            lambda t, grp: gather_from_sequence_parallel_region(t, grp, tensor_parallel_output_grad=False),
            torch.cat([x(r) for r in ranks], 0),
            lambda gs: gs[rank].chunk(world, 0)[rank],
        ),
        "reduce_scatter_seq": (
            x(rank),
            reduce_scatter_to_sequence_parallel_region,
            sum(x(r) for r in ranks).chunk(world, 0)[rank],
            lambda gs: torch.cat(gs, 0),
        ),
    }
    value, mapping, expected_out, expected_grad = cases[name]
    value = value.clone().requires_grad_()
    out = mapping(value, group)
    grads = [g(r, out.shape) for r in ranks]
    # A scalar backward: backward(gradient) would import sympy in every forked rank.
    (out * grads[rank]).sum().backward()
    assert torch.equal(out, expected_out), f"{name} forward: {out} != {expected_out}"
    assert torch.equal(value.grad, expected_grad(grads)), f"{name} backward: {value.grad}"


MAPPINGS = [
    "copy",
    "reduce",
    "scatter",
    "gather",
    "scatter_seq",
    "gather_seq",
    "gather_seq_no_tp_grad",
    "reduce_scatter_seq",
]


@pytest.mark.parametrize("name", MAPPINGS)
def test_mapping_on_two_ranks(run_distributed, name):
    run_distributed(_run, 2, name)


def test_mappings_on_four_ranks(run_distributed):
    run_distributed(lambda: [_run(name) for name in MAPPINGS], 4)


def _uneven_all_to_all():
    rank = dist.get_rank()
    # Rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 2 rows to rank 0 and 1 to itself.
    send = [1, 2] if rank == 0 else [2, 1]
    receive = [1, 2] if rank == 0 else [2, 1]
    rows = (torch.arange(3.0) + 10 * rank).unsqueeze(-1).repeat(1, 2).requires_grad_()
    out = all_to_all(rows, dist.group.WORLD, output_split_sizes=receive, input_split_sizes=send)
    weights = torch.arange(6.0).view(3, 2) + 1 + 100 * rank
    (out * weights).sum().backward()
    return out[:, 0].tolist(), rows.grad[:, 0].tolist()


def test_all_to_all_with_uneven_splits_and_its_gradient(run_distributed):
    (out0, grad0), (out1, grad1) = run_distributed(_uneven_all_to_all, 2)
    assert out0 == [0.0, 10.0, 11.0] and out1 == [1.0, 2.0, 12.0]
    # The gradient of a row is the weight applied where it landed.
    # rank0 row0 -> rank0 position 0 (weight 1); rows 1, 2 -> rank1 positions 0, 1 (weights 101, 103).
    assert grad0 == [1.0, 101.0, 103.0]
    # rank1 rows 0, 1 -> rank0 positions 1, 2 (weights 3, 5); row 2 -> rank1 position 2 (weight 105).
    assert grad1 == [3.0, 5.0, 105.0]
