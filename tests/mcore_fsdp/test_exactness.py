"""Every strategy trains exactly like one process and like FSDP2 on the same model and data.

Oracle: the unsharded model on the whole global batch in one process (fp32), and
``torch.distributed.fsdp.fully_shard`` on the same ranks. Three AdamW steps with gradient
clipping (which does clip); losses, gradient norms and updated parameters must agree.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from mcore_fsdp import FSDPModule, fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

STEPS = 3
MAX_NORM = 0.5
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _train_three_ways(tiny, strategy, outer_strategy, mesh_shape):
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
    peer = copy.deepcopy(reference)
    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    peer_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for block in peer.blocks:
        fsdp2_fully_shard(block, mesh=peer_mesh)
    fsdp2_fully_shard(peer, mesh=peer_mesh)

    models = {"reference": reference, "ours": ours, "fsdp2": peer}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-2) for name, model in models.items()}
    for step in range(STEPS):
        inputs, targets = tiny.batch(step, world)
        losses, norms = {}, {}
        for name, model in models.items():
            if name == "reference":
                loss = tiny.loss(model(inputs), targets)
            else:
                loss = tiny.loss(model(tiny.local(inputs, rank, world)), tiny.local(targets, rank, world))
            loss.backward()
            if name == "ours":
                norms[name] = model.clip_grad_norm_(MAX_NORM)
            else:
                norms[name] = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                if isinstance(norms[name], torch.distributed.tensor.DTensor):
                    norms[name] = norms[name].full_tensor()
            optimizers[name].step()
            optimizers[name].zero_grad()
            loss = loss.detach().clone()
            if name != "reference":
                dist.all_reduce(loss)
                loss /= world
            losses[name] = loss
        assert norms["reference"] > MAX_NORM  # clipping is exercised
        torch.testing.assert_close(losses["ours"], losses["reference"], **TOLERANCE)
        torch.testing.assert_close(norms["ours"], norms["reference"], **TOLERANCE)
        torch.testing.assert_close(losses["ours"], losses["fsdp2"], **TOLERANCE)

    ours_params = ours.full_state_dict()
    peer_params = {key: value.full_tensor() for key, value in peer.state_dict().items()}
    for key, expected in reference.state_dict().items():
        torch.testing.assert_close(ours_params[key], expected, **TOLERANCE)
        torch.testing.assert_close(ours_params[key], peer_params[key], **TOLERANCE)
        assert not torch.equal(expected, _initial(tiny)[key])  # parameters really moved
    return True


def _initial(tiny):
    torch.manual_seed(0)
    return tiny.Net().state_dict()


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_each_strategy_matches_single_process_and_fsdp2(run_distributed, tiny, strategy):
    assert run_distributed(_train_three_ways, 2, tiny, strategy, "no_shard", (2,)) == [True] * 2


@pytest.mark.parametrize(
    ("strategy", "outer_strategy"),
    [("optim_grads_params", "no_shard"), ("optim_grads_params", "optim"), ("optim_grads", "no_shard")],
)
def test_hybrid_sharding_matches_single_process_and_hsdp(run_distributed, tiny, strategy, outer_strategy):
    assert (
        run_distributed(_train_three_ways, 4, tiny, strategy, outer_strategy, (2, 2), timeout=60)
        == [True] * 4
    )
