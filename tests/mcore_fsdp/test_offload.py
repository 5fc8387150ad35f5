"""Optimizer CPU offload: main parameters, gradients and optimizer state on the CPU, results
unchanged (oracle: a single process). On a GPU the compute parameters stay on the device."""

import copy

import pytest
import torch
import torch.distributed as dist
from mcore_fsdp import MixedPrecision, fully_shard


def _offloaded_training(tiny, device_type: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = tiny.Net()
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    model = fully_shard(
        copy.deepcopy(reference),
        unit_classes=(tiny.Block,),
        offload_optimizer=True,
        precision=MixedPrecision(param_dtype=torch.float32),
    )
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    seen_devices = set()
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen_devices.add(m.proj.weight.device.type))
    for step in range(2):
        inputs, targets = tiny.batch(step, world)
        output = model(tiny.local(inputs, rank, world).to(device_type))
        tiny.loss(output.cpu(), tiny.local(targets, rank, world)).backward()
        tiny.loss(reference(inputs), targets).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    assert seen_devices == {device_type}
    assert {param.device.type for param in model.parameters()} == {"cpu"}
    assert {param.grad.device.type for param in model.parameters()} == {"cpu"}
    states = optimizers[1].state.values()
    assert {state["exp_avg"].device.type for state in states} == {"cpu"}
    full = model.full_state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6)
    return True


def test_optimizer_offload_matches_single_process(run_distributed, tiny):
    assert run_distributed(_offloaded_training, 2, tiny, "cpu") == [True, True]


@pytest.mark.gpu
def test_optimizer_offload_on_gpu(run_distributed, tiny):
    world = min(torch.cuda.device_count(), 2)
    assert (
        run_distributed(_offloaded_training, world, tiny, "cuda", backend="nccl", timeout=120)
        == [True] * world
    )
