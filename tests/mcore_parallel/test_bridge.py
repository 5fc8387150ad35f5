"""BridgeCommunicator and per-module groups == one process.

Encoder on grid A (TP=2, DP=1: ranks 0-1), decoder on grid B (TP=1, DP=2: ranks 2-3). The encoder
sends its full-batch activation across the bridge; each decoder replica gets its half of the
batch, computes its share of the mean loss, and sends the gradient back. Loss, encoder (TP shard)
and decoder (DDP over B's data-parallel group) gradients equal the single-process run; fp32,
rtol 1e-5, atol 1e-6.
"""

import pytest
import torch
import torch.distributed as dist
from mcore_parallel import (
    BridgeCommunicator,
    ColumnParallelLinear,
    DistributedDataParallelConfig,
    HyperCommGrid,
    MultiModuleProcessGroups,
    RowParallelLinear,
)
from torch import nn

SEQ, BATCH, HIDDEN, FFN = 3, 4, 4, 8
RTOL, ATOL = 1e-5, 1e-6


def _bridge_matches_reference():
    rank = dist.get_rank()
    grids = {
        "encoder": HyperCommGrid([2, 1], ["tp", "dp"], rank_offset=0),
        "decoder": HyperCommGrid([1, 2], ["tp", "dp"], rank_offset=2),
    }
    groups = MultiModuleProcessGroups.from_grids(grids)
    bridge = BridgeCommunicator(grids["encoder"], grids["decoder"])
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.Tanh(), nn.Linear(FFN, HIDDEN))
    decoder = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
    x, target = torch.randn(SEQ, BATCH, HIDDEN), torch.randn(SEQ, BATCH, HIDDEN)
    reference_loss = (decoder(encoder(x)) - target).square().mean()
    reference_loss.backward()

    if groups.local_modules() == ["encoder"]:
        tp, tp_rank = groups["encoder"].tp, dist.get_rank(groups["encoder"].tp)
        fc1, fc2 = ColumnParallelLinear(HIDDEN, FFN, tp_group=tp), RowParallelLinear(FFN, HIDDEN, tp_group=tp)
        with torch.no_grad():
            for mine, full in ((fc1, encoder[0]), (fc2, encoder[2])):
                mine.weight.copy_(full.weight.chunk(2, dim=mine.weight.partition_dim)[tp_rank])
                mine.bias.copy_(full.bias.chunk(2)[tp_rank] if mine is fc1 else full.bias)
        activation = fc2(torch.tanh(fc1(x)[0]))[0]
        grad = bridge.send_forward_recv_backward(activation)
        activation.backward(grad)
        for mine, full in ((fc1, encoder[0]), (fc2, encoder[2])):
            dim = mine.weight.partition_dim
            torch.testing.assert_close(
                mine.weight.grad,
                full.weight.grad.chunk(2, dim=dim)[tp_rank],
                rtol=RTOL,
                atol=ATOL,
                msg=f"encoder weight {dim}",
            )
        return None

    assert groups.local_modules() == ["decoder"]
    dp = dist.get_world_size(groups["decoder"].dp)
    model = groups.wrap_ddp(
        "decoder",
        nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()),
        DistributedDataParallelConfig(grad_reduce_op="sum"),
    )
    model.module.load_state_dict(decoder.state_dict())
    activation = bridge.recv_forward().requires_grad_()
    half = dist.get_rank(groups["decoder"].dp)
    local_target = target.chunk(dp, dim=1)[half]
    loss = (model(activation) - local_target).square().mean() / dp
    loss.backward()
    bridge.send_backward(activation.grad)
    model.finish_grad_sync()
    for param, full in zip(model.module.parameters(), decoder.parameters(), strict=True):
        torch.testing.assert_close(param.main_grad, full.grad, rtol=RTOL, atol=ATOL, msg="decoder")
    total = loss.detach().clone()
    dist.all_reduce(total, group=groups["decoder"].dp)
    torch.testing.assert_close(total, reference_loss.detach(), rtol=RTOL, atol=ATOL, msg="loss")
    return rank


def test_bridge_between_grids_matches_single_process(run_distributed):
    assert run_distributed(_bridge_matches_reference, 4) == [None, None, 2, 3]


def test_bridge_rejects_grids_without_tp_and_dp():
    with pytest.raises(ValueError, match="src_grid"):
        BridgeCommunicator(HyperCommGrid([2], ["pp"]), HyperCommGrid([2], ["tp"]))
