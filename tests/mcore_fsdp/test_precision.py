"""Mixed precision: bf16 compute with FP32 main parameters, a separate gradient-communication
dtype, and the FP32-accumulating reduce-scatter."""

import copy

import torch
import torch.distributed as dist
from mcore_fsdp import MixedPrecision, fully_shard
from mcore_testing.peers import requires_fsdp2_on_cpu
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard


@requires_fsdp2_on_cpu
def test_bf16_params_fp32_reduce_match_fsdp2(run_distributed, tiny):
    """Oracle: FSDP2 with the same policy (bf16 parameters, fp32 gradient reduction)."""

    def body():
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        base = tiny.Net()
        ours = fully_shard(
            copy.deepcopy(base),
            unit_classes=(tiny.Block,),
            precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
        peer = copy.deepcopy(base)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world,))
        for block in peer.blocks:
            fsdp2_fully_shard(block, mesh=mesh, mp_policy=policy)
        fsdp2_fully_shard(peer, mesh=mesh, mp_policy=policy)
        seen = []
        ours.blocks[0].proj.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
        assert all(param.dtype == torch.float32 for param in ours.parameters())  # FP32 main params
        optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in (ours, peer)]
        for step in range(3):
            inputs, targets = tiny.batch(step, world)
            losses = []
            for model, optimizer in zip((ours, peer), optimizers, strict=True):
                output = model(tiny.local(inputs, rank, world))
                assert output.dtype == torch.bfloat16
                loss = tiny.loss(output, tiny.local(targets, rank, world))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
        assert seen == [torch.bfloat16] * 3
        full = ours.full_state_dict()
        for key, value in peer.state_dict().items():
            torch.testing.assert_close(full[key], value.full_tensor(), rtol=1e-6, atol=1e-6)
            assert full[key].dtype == torch.float32
        return True

    assert run_distributed(body, 2) == [True, True]


def test_fp32_accumulating_reduce_scatter(run_distributed, tiny):
    """bf16 on the wire, FP32 sum: the main gradient equals the FP32 sum of each rank's
    bf16-rounded contribution, which plain bf16 summation does not reproduce."""

    def body():
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        base = tiny.Net()
        inputs, targets = tiny.batch(0, world)
        contributions = []
        for source in range(world):
            model = copy.deepcopy(base)
            tiny.loss(model(tiny.local(inputs, source, world)), tiny.local(targets, source, world)).backward()
            contributions.append({name: param.grad / world for name, param in model.named_parameters()})
        expected = {
            name: sum(grads[name].bfloat16().float() for grads in contributions) for name in contributions[0]
        }
        assert any(not torch.equal(value, value.bfloat16().float()) for value in expected.values())

        model = fully_shard(
            copy.deepcopy(base),
            unit_classes=(tiny.Block,),
            precision=MixedPrecision(reduce_dtype=torch.bfloat16, fp32_accumulate_reduce_scatter=True),
        )
        tiny.loss(model(tiny.local(inputs, rank, world)), tiny.local(targets, rank, world)).backward()
        with torch.no_grad():  # read the gradient shards back as a full state dict
            for param in model.parameters():
                param.copy_(param.grad)
        gathered = model.full_state_dict()
        for name, value in expected.items():
            torch.testing.assert_close(gathered[name], value, rtol=0, atol=0)
        return True

    assert run_distributed(body, 2) == [True, True]
