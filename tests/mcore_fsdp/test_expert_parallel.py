"""Expert parameters shard over the expert-data-parallel group, the rest over all ranks.

4 ranks, expert parallelism 2: ranks {0, 2} hold expert set 0 and ranks {1, 3} expert set 1.
Oracle (one SGD step): dense gradients averaged over all 4 ranks, expert gradients over the 2
ranks holding the same experts, each computed with a plain model per rank.
"""

import torch
import torch.distributed as dist
from mcore_fsdp import count_collectives, fully_shard
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

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


def _body(tiny):
    rank, world = dist.get_rank(), dist.get_world_size()
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("expert_dp", "ep"))
    expert_index = grid.get_local_rank("ep")
    inputs, targets = tiny.batch(0, world)

    grads = []
    for source in range(world):
        plain = _plain_model(source % 2)
        tiny.loss(plain(tiny.local(inputs, source, world)), tiny.local(targets, source, world)).backward()
        grads.append({name: param.grad for name, param in plain.named_parameters()})
    expected = {}
    for name, param in _plain_model(expert_index).named_parameters():
        peers = [
            source for source in range(world) if not name.startswith("expert.") or source % 2 == expert_index
        ]
        expected[name] = param.detach() - LR * sum(grads[source][name] for source in peers) / len(peers)

    model = fully_shard(
        _plain_model(expert_index),
        expert_parameters=lambda name, param: name.startswith("expert."),
        expert_mesh=grid["expert_dp"],
    )
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
