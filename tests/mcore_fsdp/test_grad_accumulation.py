"""``no_sync`` accumulates gradients locally: no communication, and two micro-batches then
equal one step on their concatenation (single-process oracle)."""

import copy

import pytest
import torch
import torch.distributed as dist
from mcore_fsdp import count_collectives, fully_shard


def _accumulate(tiny, strategy):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = tiny.Net()
    model = fully_shard(copy.deepcopy(reference), unit_classes=(tiny.Block,), strategy=strategy)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    for step in range(2):
        inputs, targets = tiny.batch(step, world, per_rank=4)
        local_x, local_y = tiny.local(inputs, rank, world), tiny.local(targets, rank, world)
        with model.no_sync(), count_collectives() as counter:
            tiny.loss(model(local_x[:2]), local_y[:2]).div(2).backward()
        assert counter["reduce_scatter"] == counter["all_reduce"] == 0
        tiny.loss(model(local_x[2:]), local_y[2:]).div(2).backward()
        # The reference sees the same micro-batches of every rank, i.e. the whole batch.
        tiny.loss(reference(inputs), targets).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    full = model.full_state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_no_sync_accumulation_matches_full_batch(run_distributed, tiny, strategy):
    assert run_distributed(_accumulate, 2, tiny, strategy) == [True, True]
