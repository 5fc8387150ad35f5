"""Expert parameters shard over the expert-data-parallel group, the rest over all ranks.

4 ranks, expert parallelism 2: ranks {0, 2} hold expert set 0 and ranks {1, 3} expert set 1.
Oracle (one SGD step): dense gradients averaged over all 4 ranks, expert gradients summed over the
2 ranks holding the same experts and divided by 2 (the default) or by the given factor, each
computed with a plain model per rank. The global gradient norm and the expert state dict (DTensors
on the expert mesh) are checked against the same plain models.
"""

import math

import pytest
import torch
import torch.distributed as dist
from mcore_fsdp import count_collectives, fully_shard
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

LR = 0.1


class ExpertNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(5, 8)
        self.expert = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.expert(self.dense(x))))


def _plain_model(expert_index: int) -> ExpertNet:
    torch.manual_seed(0)
    model = ExpertNet()
    torch.manual_seed(100 + expert_index)
    model.expert.reset_parameters()
    return model


def _reference_grads(tiny, expert_index: int, expert_divisor: float) -> dict[str, torch.Tensor]:
    """The reduced gradients of expert set ``expert_index``'s ranks, from one plain model per rank."""
    world = dist.get_world_size()
    inputs, targets = tiny.batch(0, world)
    grads = []
    for source in range(world):
        plain = _plain_model(source % 2)
        tiny.loss(plain(tiny.local(inputs, source, world)), tiny.local(targets, source, world)).backward()
        grads.append({name: param.grad for name, param in plain.named_parameters()})
    reduced = {}
    for name, _ in _plain_model(expert_index).named_parameters():
        if name.startswith("expert."):
            peers = [source for source in range(world) if source % 2 == expert_index]
            reduced[name] = sum(grads[source][name] for source in peers) / expert_divisor
        else:
            reduced[name] = sum(grads[source][name] for source in range(world)) / world
    return reduced


def _sharded(expert_index: int, grid, **kwargs) -> nn.Module:
    return fully_shard(
        _plain_model(expert_index),
        expert_parameters=lambda name, param: name.startswith("expert."),
        expert_mesh=grid["expert_dp"],
        **kwargs,
    )


def _body(tiny):
    rank, world = dist.get_rank(), dist.get_world_size()
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("expert_dp", "ep"))
    expert_index = grid.get_local_rank("ep")
    inputs, targets = tiny.batch(0, world)
    grads = _reference_grads(tiny, expert_index, expert_divisor=2)
    expected = {
        name: param.detach() - LR * grads[name]
        for name, param in _plain_model(expert_index).named_parameters()
    }

    model = _sharded(expert_index, grid)
    shard_sizes = {
        family: sum(
            p.numel() for n, p in model.named_parameters() if n.startswith("expert.") == (family == "expert")
        )
        for family in ("expert", "dense")
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with count_collectives() as counter:
        tiny.loss(model(tiny.local(inputs, rank, world)), tiny.local(targets, rank, world)).backward()
    optimizer.step()
    model.unshard()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], rtol=1e-6, atol=1e-7)
    return shard_sizes, dict(counter)


def test_expert_parameters_shard_over_expert_data_parallel_group(run_distributed, tiny):
    results = run_distributed(_body, 4, tiny, timeout=60)
    # Every dense element is owned by exactly one of the 4 ranks, every expert element by one of
    # the 2 ranks of its expert-data-parallel group (ranks 0 and 2 hold the same experts).
    assert sum(sizes["dense"] for sizes, _ in results) == 5 * 8 + 8 + 8 * 3 + 3
    assert results[0][0]["expert"] + results[2][0]["expert"] == 8 * 8 + 8
    assert results[1][0]["expert"] + results[3][0]["expert"] == 8 * 8 + 8
    for _, counts in results:
        assert counts["reduce_scatter"] == 2  # one per family


def _divided_and_clipped_body(tiny):
    """Experts divided by the data-parallel size (4), clipped by the global norm; the state dict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("expert_dp", "ep"))
    expert_index = grid.get_local_rank("ep")
    inputs, targets = tiny.batch(0, world)
    grads = [_reference_grads(tiny, index, expert_divisor=world) for index in (0, 1)]
    squares = sum(g.pow(2).sum() for name, g in grads[0].items()) + sum(
        g.pow(2).sum() for name, g in grads[1].items() if name.startswith("expert.")
    )
    norm, max_norm = math.sqrt(float(squares)), 0.01
    expected = {
        name: param.detach() - LR * grads[expert_index][name] * max_norm / (norm + 1e-6)
        for name, param in _plain_model(expert_index).named_parameters()
    }

    model = _sharded(expert_index, grid, expert_gradient_divide_factor=world)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    tiny.loss(model(tiny.local(inputs, rank, world)), tiny.local(targets, rank, world)).backward()
    total = model.clip_grad_norm_(max_norm)
    optimizer.step()
    state = model.state_dict()
    for name, value in state.items():
        assert isinstance(value, DTensor)
        torch.testing.assert_close(value.full_tensor(), expected[name], rtol=1e-6, atol=1e-7)
    weight = state["expert.weight"]
    # the expert weight's rows are split over its 2 expert-data-parallel ranks, not over all 4
    assert weight.device_mesh.mesh.tolist() == grid["expert_dp"].mesh.tolist()
    assert weight.placements == (Shard(0),) and weight.to_local().shape == (4, 8)
    assert state["dense.weight"].to_local().shape == (2, 5)
    reloaded = _sharded(expert_index, grid)
    reloaded.load_state_dict(state)
    reloaded.unshard()
    loaded = {name: param.detach().clone() for name, param in reloaded.named_parameters()}
    return float(total), norm, loaded, expected


def test_expert_gradient_divide_factor_clipping_and_state_dict(run_distributed, tiny):
    for total, norm, loaded, expected in run_distributed(_divided_and_clipped_body, 4, tiny, timeout=60):
        assert total == pytest.approx(norm, rel=1e-5) and norm > 0.1  # 0.01 clips
        assert loaded.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(loaded[name], expected[name], rtol=1e-6, atol=1e-7)


def _copies_outside_body(tiny):
    """The expert gradients taken as held by 2 ranks outside their mesh each (``copies_outside``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("expert_dp", "ep"))
    inputs, targets = tiny.batch(0, world)
    grads = [_reference_grads(tiny, index, expert_divisor=world) for index in (0, 1)]
    dense = sum(g.pow(2).sum() for name, g in grads[0].items() if not name.startswith("expert."))
    experts = sum(g.pow(2).sum() for each in grads for name, g in each.items() if name.startswith("expert."))
    model = _sharded(grid.get_local_rank("ep"), grid, expert_gradient_divide_factor=world)
    tiny.loss(model(tiny.local(inputs, rank, world)), tiny.local(targets, rank, world)).backward()
    expert_params = {id(param) for name, param in model.named_parameters() if name.startswith("expert.")}
    total = model.clip_grad_norm_(
        math.inf, copies_outside=lambda param: 2 if id(param) in expert_params else 1
    )
    return float(total), math.sqrt(float(dense + experts / 2))


def test_copies_outside_the_mesh_count_once_in_the_norm(run_distributed, tiny):
    for total, norm in run_distributed(_copies_outside_body, 4, tiny, timeout=60):
        assert total == pytest.approx(norm, rel=1e-5)
