"""Checkpoints move between topologies and strategies, and out to a plain model.

Save model and optimizer with ``torch.distributed.checkpoint`` from 4 ranks
(``optim_grads_params``) after two steps, load on 2 ranks with ``optim_grads`` and take a third
step, and load the model in one process into a plain ``nn.Module``; export a gathered full state
dict into a plain model. Oracles: the gathered parameters of the saving model, and a single
process that trained three steps without interruption.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mcore_fsdp import fully_shard, load_optimizer_state_dict, optimizer_state_dict
from torch.distributed.tensor import DTensor

SAVE_WORLD = 4


def _train_and_save(tiny, path):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = fully_shard(tiny.Net(), unit_classes=(tiny.Block,), strategy="optim_grads_params")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        inputs, targets = tiny.batch(step, world)
        tiny.loss(model(tiny.local(inputs, rank, world)), tiny.local(targets, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    assert all(isinstance(state[name], DTensor) for name, _ in tiny.Net().named_parameters())
    assert state["blocks.0.proj.weight"].shape == (8, 8)
    dcp.save({"model": state, "optim": optimizer_state_dict(model, optimizer)}, checkpoint_id=path)
    full = model.full_state_dict()
    if rank == 0:
        torch.save(full, f"{path}/expected.pt")
    return True


@pytest.mark.filterwarnings("ignore:torch.distributed is .*uninitialized:UserWarning")
def test_save_four_ranks_load_two_ranks_other_strategy_and_plain_model(run_distributed, tiny, tmp_path):
    path = str(tmp_path / "checkpoint")
    assert run_distributed(_train_and_save, SAVE_WORLD, tiny, path, timeout=60) == [True] * SAVE_WORLD
    expected = torch.load(f"{path}/expected.pt")

    def load_on_two_ranks():
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(1)  # different initial weights, all overwritten by the load
        model = fully_shard(tiny.Net(), unit_classes=(tiny.Block,), strategy="optim_grads")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = {"model": model.state_dict(), "optim": optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        load_optimizer_state_dict(model, optimizer, state["optim"])
        loaded = model.full_state_dict()
        for key, value in expected.items():
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)

        # A third step continues exactly where an uninterrupted single process would be.
        torch.manual_seed(0)
        reference = tiny.Net()
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for step in range(3):
            inputs, targets = tiny.batch(step, SAVE_WORLD)
            tiny.loss(reference(inputs), targets).backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        inputs, targets = tiny.batch(2, SAVE_WORLD)
        tiny.loss(model(tiny.local(inputs, rank, world)), tiny.local(targets, rank, world)).backward()
        optimizer.step()
        for key, value in model.full_state_dict().items():
            torch.testing.assert_close(value, reference.state_dict()[key], rtol=1e-5, atol=1e-6)
        return True

    assert run_distributed(load_on_two_ranks, 2) == [True, True]

    plain = tiny.Net()
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=path)  # no process group here: torch loads in this one process
    plain.load_state_dict(state["model"])
    for key, value in expected.items():
        torch.testing.assert_close(plain.state_dict()[key], value, rtol=0, atol=0)


def test_full_state_dict_exports_to_plain_model(run_distributed, tiny):
    def body():
        torch.manual_seed(0)
        reference = tiny.Net()
        model = fully_shard(copy.deepcopy(reference), unit_classes=(tiny.Block,), strategy="optim")
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
        exported = model.full_state_dict()
        plain = tiny.Net()
        plain.load_state_dict(exported)  # strict: same keys and shapes
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(plain.state_dict()[key], value + 1.0, rtol=0, atol=0)
        model.load_state_dict(reference.state_dict())  # full tensors load back in
        for key, value in model.full_state_dict().items():
            torch.testing.assert_close(value, reference.state_dict()[key], rtol=0, atol=0)
        return True

    assert run_distributed(body, 2) == [True, True]


def test_state_dict_of_a_sharded_child_module(run_distributed, tiny):
    """A sharded model inside a plain parent: the parent's state dict holds its DTensors."""

    def body():
        torch.manual_seed(0)
        reference = tiny.Net()
        parent = torch.nn.ModuleDict(
            {"net": fully_shard(copy.deepcopy(reference), unit_classes=(tiny.Block,))}
        )
        state = parent.state_dict()
        assert set(state) == {f"net.{key}" for key in reference.state_dict()}
        for key, value in reference.state_dict().items():
            assert isinstance(state[f"net.{key}"], DTensor)
            torch.testing.assert_close(state[f"net.{key}"].full_tensor(), value, rtol=0, atol=0)
        return True

    assert run_distributed(body, 2) == [True, True]
