"""Pipeline schedules == one process: loss and every gradient, for 1F1B and interleaved 1F1B.

The model is a stack of residual MLP blocks (column- then row-parallel linear with TP); virtual
stage ``c * pp + s`` (chunk ``c`` of stage ``s``) holds an equal run of blocks. Micro-batches have
different sequence lengths, so activations travel with the shape handshake. fp32, only summation
order differs: rtol 1e-5, atol 1e-6.
"""

import pytest
import torch
import torch.distributed as dist
from mcore_parallel import (
    ColumnParallelLinear,
    P2PCommunicator,
    PipelineAction,
    RowParallelLinear,
    forward_backward_no_pipelining,
    forward_backward_pipelining,
    initialize_model_parallel,
    schedule_actions,
)
from torch import nn

HIDDEN, FFN, BATCH, LAYERS, MICRO = 4, 8, 2, 8, 4
RTOL, ATOL = 1e-5, 1e-6


class Block(nn.Module):
    def __init__(self, tp_group=None):
        super().__init__()
        if tp_group is None:
            self.fc1, self.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
        else:
            self.fc1 = ColumnParallelLinear(HIDDEN, FFN, tp_group=tp_group)
            self.fc2 = RowParallelLinear(FFN, HIDDEN, tp_group=tp_group)

    def forward(self, x):
        hidden = self.fc1(x)
        hidden = torch.tanh(hidden[0] if isinstance(hidden, tuple) else hidden)
        out = self.fc2(hidden)
        return x + (out[0] if isinstance(out, tuple) else out)


def _data():
    generator = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(2 + i, BATCH, HIDDEN, generator=generator),
            torch.randn(2 + i, BATCH, HIDDEN, generator=generator),
        )
        for i in range(MICRO)
    ]


def _pipeline_matches_reference(tp, pp, vpp, forward_only):
    groups = initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    stage, tp_rank = dist.get_rank(groups.pp), dist.get_rank(groups.tp)
    torch.manual_seed(0)
    reference = nn.ModuleList(Block() for _ in range(LAYERS))
    data = _data()
    reference_losses = []
    for x, target in data:
        for block in reference:
            x = block(x)
        loss = (x - target).square().mean()
        reference_losses.append(loss.detach())
        (loss / MICRO).backward()

    per_chunk = LAYERS // (pp * vpp)
    chunks, layer_ids = [], []
    for chunk in range(vpp):
        first = (chunk * pp + stage) * per_chunk
        ids = list(range(first, first + per_chunk))
        module = nn.Sequential(*(Block(groups.tp) for _ in ids))
        with torch.no_grad():
            for block, layer in zip(module, ids, strict=True):
                for name, param in block.named_parameters():
                    full = reference[layer].get_parameter(name)
                    dim = getattr(param, "partition_dim", None)
                    param.copy_(full if dim is None else full.chunk(tp, dim=dim)[tp_rank])
        chunks.append(module)
        layer_ids.append(ids)

    def forward_step(iterator, module, input_tensor):
        x, target = next(iterator)
        output = module(x if input_tensor is None else input_tensor)
        return (output - target).square().mean() if module is chunks[-1] and stage == pp - 1 else output

    losses = forward_backward_pipelining(
        forward_step_func=forward_step,
        data_iterator=[iter(data) for _ in chunks],
        model=chunks if vpp > 1 else chunks[0],
        num_microbatches=MICRO,
        pp_group=groups.pp,
        forward_only=forward_only,
    )
    if stage == pp - 1:
        for loss, expected in zip(losses, reference_losses, strict=True):
            torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL, msg="loss")
    else:
        assert losses == []
    for module, ids in zip(chunks, layer_ids, strict=True):
        for block, layer in zip(module, ids, strict=True):
            for name, param in block.named_parameters():
                if forward_only:
                    assert param.grad is None
                    continue
                full = reference[layer].get_parameter(name).grad
                dim = getattr(param, "partition_dim", None)
                expected = full if dim is None else full.chunk(tp, dim=dim)[tp_rank]
                torch.testing.assert_close(
                    param.grad, expected, rtol=RTOL, atol=ATOL, msg=f"layer {layer} {name}"
                )
    return len(losses)


@pytest.mark.parametrize(
    ("tp", "pp", "vpp"),
    [(1, 2, 1), (1, 4, 1), (1, 2, 2), (1, 4, 2), (2, 2, 1), (2, 2, 2)],
    ids=["pp2", "pp4", "pp2-vpp2", "pp4-vpp2", "tp2-pp2", "tp2-pp2-vpp2"],
)
def test_pipeline_matches_single_process(run_distributed, tp, pp, vpp):
    run_distributed(_pipeline_matches_reference, tp * pp, tp, pp, vpp, False)


@pytest.mark.parametrize("vpp", [1, 2])
def test_forward_only(run_distributed, vpp):
    run_distributed(_pipeline_matches_reference, 2, 1, 2, vpp, True)


def test_no_pipelining_accumulates_mean_gradient():
    torch.manual_seed(0)
    model = Block()
    data = _data()
    losses = forward_backward_no_pipelining(
        forward_step_func=lambda it, m, _: (lambda x, t: (m(x) - t).square().mean())(*next(it)),
        data_iterator=iter(data),
        model=model,
        num_microbatches=MICRO,
    )
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sum((model(x) - t).square().mean() for x, t in data).div(MICRO).backward()
    assert len(losses) == MICRO
    for actual, reference in zip(expected, model.parameters(), strict=True):
        torch.testing.assert_close(actual, reference.grad, rtol=RTOL, atol=ATOL, msg="gradient")


def test_schedule_orders():
    assert schedule_actions(0, 2, 3) == [
        PipelineAction("F", 0, 0),
        PipelineAction("F", 0, 1),
        PipelineAction("B", 0, 0),
        PipelineAction("F", 0, 2),
        PipelineAction("B", 0, 1),
        PipelineAction("B", 0, 2),
    ]
    interleaved = schedule_actions(1, 2, 4, num_chunks=2)
    assert sorted(interleaved) == sorted(
        PipelineAction(k, c, m) for k in "FB" for c in range(2) for m in range(4)
    )
    assert interleaved[:3] == [
        PipelineAction("F", 0, 0),
        PipelineAction("F", 0, 1),
        PipelineAction("F", 1, 0),
    ]
    with pytest.raises(ValueError, match="num_microbatches"):
        schedule_actions(0, 2, 3, num_chunks=2)


def _combined_p2p():
    p2p = P2PCommunicator(dist.group.WORLD)
    if p2p.stage == 0:
        activation = torch.arange(6.0).view(2, 3)  # shape travels with it
        grad = p2p.send_forward_recv_backward(activation)
        p2p.send_forward(activation + 1)
        return grad.tolist(), p2p.recv_backward(torch.Size([2, 3])).tolist()
    first = p2p.recv_forward()
    second = p2p.send_backward_recv_forward(-first)
    p2p.send_backward(-second)
    return first.tolist(), second.tolist()


def test_combined_p2p_operations(run_distributed):
    (grad, second_grad), (first, second) = run_distributed(_combined_p2p, 2)
    expected = torch.arange(6.0).view(2, 3)
    assert first == expected.tolist() and second == (expected + 1).tolist()
    assert grad == (-expected).tolist() and second_grad == (-expected - 1).tolist()
