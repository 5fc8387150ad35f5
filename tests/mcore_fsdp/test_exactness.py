"""Every strategy trains exactly like one process, and like FSDP2, on the same model and data.

Oracles: the unsharded model on the whole global batch in one process (fp32), and
``torch.distributed.fsdp.fully_shard`` on the same ranks. Three AdamW steps with gradient
clipping (which does clip); losses, gradient norms (against one process) and updated parameters
must agree. The comparison with FSDP2 is a test of its own, skipped where FSDP2 cannot train on
CPU; the one with a single process runs everywhere.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from mcore_fsdp import FSDPModule, fully_shard
from mcore_testing.peers import requires_fsdp2_on_cpu
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

STEPS = 3
MAX_NORM = 0.5
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
HYBRID = [("optim_grads_params", "no_shard"), ("optim_grads_params", "optim"), ("optim_grads", "no_shard")]


def _fsdp2(reference, mesh_shape):
    peer = copy.deepcopy(reference)
    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    peer_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for block in peer.blocks:
        fsdp2_fully_shard(block, mesh=peer_mesh)
    fsdp2_fully_shard(peer, mesh=peer_mesh)
    return peer


def _train_ours_and(peer, tiny, strategy, outer_strategy, mesh_shape):
    """Train ours and ``peer`` ("one process" or "fsdp2") side by side; compare after each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = tiny.Net()
    ours = fully_shard(
        copy.deepcopy(reference),
        mesh=mesh_shape,
        unit_classes=(tiny.Block,),
        strategy=strategy,
        outer_strategy=outer_strategy,
    )
    assert isinstance(ours, FSDPModule)
    models = {"ours": ours, peer: reference if peer == "one process" else _fsdp2(reference, mesh_shape)}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-2) for name, model in models.items()}
    for step in range(STEPS):
        inputs, targets = tiny.batch(step, world)
        losses, norms = {}, {}
        for name, model in models.items():
            if name == "one process":
                loss = tiny.loss(model(inputs), targets)
            else:
                loss = tiny.loss(model(tiny.local(inputs, rank, world)), tiny.local(targets, rank, world))
            loss.backward()
            if name == "ours":
                norms[name] = model.clip_grad_norm_(MAX_NORM)
            else:
                norms[name] = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizers[name].step()
            optimizers[name].zero_grad()
            loss = loss.detach().clone()
            if name != "one process":
                dist.all_reduce(loss)
                loss /= world
            losses[name] = loss
        torch.testing.assert_close(losses["ours"], losses[peer], **TOLERANCE)
        if peer == "one process":
            assert norms[peer] > MAX_NORM  # clipping is exercised
            torch.testing.assert_close(norms["ours"], norms[peer], **TOLERANCE)

    ours_params = ours.full_state_dict()
    peer_params = {
        key: value.full_tensor() if isinstance(value, torch.distributed.tensor.DTensor) else value
        for key, value in models[peer].state_dict().items()
    }
    initial = _initial(tiny)
    for key, expected in peer_params.items():
        torch.testing.assert_close(ours_params[key], expected, **TOLERANCE)
        assert not torch.equal(expected, initial[key])  # parameters really moved
    return True


def _initial(tiny):
    torch.manual_seed(0)
    return tiny.Net().state_dict()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_matches_single_process(run_distributed, tiny, strategy):
    result = run_distributed(_train_ours_and, 2, "one process", tiny, strategy, "no_shard", (2,))
    assert result == [True] * 2


@requires_fsdp2_on_cpu
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_matches_fsdp2(run_distributed, tiny, strategy):
    assert run_distributed(_train_ours_and, 2, "fsdp2", tiny, strategy, "no_shard", (2,)) == [True] * 2


@pytest.mark.parametrize(("strategy", "outer_strategy"), HYBRID)
def test_hybrid_sharding_matches_single_process(run_distributed, tiny, strategy, outer_strategy):
    result = run_distributed(
        _train_ours_and, 4, "one process", tiny, strategy, outer_strategy, (2, 2), timeout=60
    )
    assert result == [True] * 4


@requires_fsdp2_on_cpu
@pytest.mark.parametrize(("strategy", "outer_strategy"), HYBRID)
def test_hybrid_sharding_matches_hsdp(run_distributed, tiny, strategy, outer_strategy):
    result = run_distributed(_train_ours_and, 4, "fsdp2", tiny, strategy, outer_strategy, (2, 2), timeout=60)
    assert result == [True] * 4
