"""Checkpoints move between mcore-fsdp and PyTorch FSDP2 through ``torch.distributed.checkpoint``.

A Hugging Face Llama sharded layer by layer (tied embedding and head) trains two steps under one
implementation, which saves model and optimizer state; the other loads them at another world
size (4 ranks to 2, 2 ranks to 3: uneven rows). Oracle: the saver's gathered parameters and
optimizer state, which the loader's must equal exactly.
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mcore_fsdp import fully_shard, load_optimizer_state_dict, optimizer_state_dict
from mcore_testing.peers import requires_fsdp2_on_cpu
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor


def _ours(model):
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _fsdp2(model):
    for layer in model.model.layers:
        fsdp2_fully_shard(layer)
    fsdp2_fully_shard(model)
    return model


def _ours_state(model, optimizer):
    return {"model": model.state_dict(), "optim": optimizer_state_dict(model, optimizer)}


def _fsdp2_state(model, optimizer):
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optimizer_state}


def _load_ours(model, optimizer, state):
    model.load_state_dict(state["model"])
    load_optimizer_state_dict(model, optimizer, state["optim"])


def _load_fsdp2(model, optimizer, state):
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


SIDES = {"mcore-fsdp": (_ours, _ours_state, _load_ours), "fsdp2": (_fsdp2, _fsdp2_state, _load_fsdp2)}


def _gathered(value):
    """``value`` with every DTensor replaced by its full tensor (a collective)."""
    if isinstance(value, dict):
        return {key: _gathered(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_gathered(item) for item in value]
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value.clone() if isinstance(value, torch.Tensor) else value


def _train_and_save(example, side, path):
    rank, world = dist.get_rank(), dist.get_world_size()
    shard, state_of, _ = SIDES[side]
    model = shard(example.build_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        tokens = example.token_batch(step, 2 * world).chunk(world)[rank]
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = state_of(model, optimizer)
    dcp.save(state, checkpoint_id=path)
    saved = _gathered(state)  # every rank takes part
    return saved if rank == 0 else None


def _load(example, side, path):
    shard, state_of, load = SIDES[side]
    model = shard(example.build_model(seed=1))  # other weights, all overwritten by the load
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = state_of(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    load(model, optimizer, state)
    loaded = _gathered(state_of(model, optimizer))
    return loaded if dist.get_rank() == 0 else None


@pytest.mark.parametrize(
    ("saver", "save_world", "loader", "load_world"),
    [
        ("mcore-fsdp", 4, "fsdp2", 2),
        pytest.param("fsdp2", 2, "mcore-fsdp", 3, marks=requires_fsdp2_on_cpu),  # FSDP2 trains before saving
    ],
)
def test_checkpoint_loads_into_the_other_implementation(
    run_distributed, hf_llama_example, tmp_path, saver, save_world, loader, load_world
):
    path = str(tmp_path / "checkpoint")
    saved = run_distributed(_train_and_save, save_world, hf_llama_example, saver, path, timeout=60)[0]
    loaded = run_distributed(_load, load_world, hf_llama_example, loader, path, timeout=60)[0]
    assert loaded["model"].keys() == saved["model"].keys()
    for key, value in saved["model"].items():
        torch.testing.assert_close(
            loaded["model"][key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}"
        )
    assert loaded["optim"]["state"].keys() == saved["optim"]["state"].keys()
    for name, entries in saved["optim"]["state"].items():
        assert loaded["optim"]["state"][name].keys() == entries.keys()
        for key, value in entries.items():
            torch.testing.assert_close(
                loaded["optim"]["state"][name][key],
                value,
                rtol=0,
                atol=0,
                msg=lambda m, k=f"{name} {key}": m + k,
            )
    assert loaded["optim"]["param_groups"] == saved["optim"]["param_groups"]
