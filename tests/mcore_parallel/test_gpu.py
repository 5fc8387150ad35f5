"""The CUDA paths: NCCL collectives on device tensors, the CUDA generator in the RNG tracker.

Marked ``gpu``: skipped on machines without CUDA. CUDA is touched only inside forked ranks, never
in the test process (the distributed harness refuses to fork once CUDA is initialised there).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_parallel import (
    ColumnParallelLinear,
    RNGStatesTracker,
    RowParallelLinear,
    Timers,
    broadcast_free_port,
    checkpoint,
    get_backend,
    get_rng_tracker,
    model_parallel_manual_seed,
    sharded_frobenius_norm,
)

pytestmark = pytest.mark.gpu


def test_backend_is_nccl_with_cuda():
    assert get_backend() == "nccl"


def _tracker_uses_the_cuda_generator():
    tracker = RNGStatesTracker("cuda:0")
    tracker.add("stream", 5)
    torch.cuda.manual_seed(1)
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(1)
    with tracker.fork("stream"):
        forked = torch.rand(4, device="cuda")
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    assert not torch.equal(forked, expected)


def _checkpoint_replays_cuda_dropout():
    weight = torch.randn(8, 8, device="cuda")

    def block(x, w):
        with get_rng_tracker().fork():
            return F.dropout(x @ w, p=0.5)

    def run(use_checkpoint):
        model_parallel_manual_seed(3, tp_rank=0, device="cuda:0")
        w = weight.clone().requires_grad_()
        x = torch.ones(4, 8, device="cuda", requires_grad=True)
        out = checkpoint(block, x, w) if use_checkpoint else block(x, w)
        out.sum().backward()
        return x.grad, w.grad

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("body", [_tracker_uses_the_cuda_generator, _checkpoint_replays_cuda_dropout])
def test_cuda_random_state(run_distributed, body):
    run_distributed(body, 1, timeout=120)


def _tensor_parallel_on_nccl():
    torch.cuda.set_device(0)
    group = dist.group.WORLD
    torch.manual_seed(0)
    column = ColumnParallelLinear(8, 16, tp_group=group, device="cuda")
    row = RowParallelLinear(16, 8, tp_group=group, device="cuda")
    x = torch.randn(4, 2, 8, device="cuda")
    out, _ = row(F.gelu(column(x)[0]))
    expected = F.linear(F.gelu(F.linear(x, column.weight, column.bias)), row.weight, row.bias)
    assert torch.allclose(out, expected, atol=1e-5)
    timers = Timers()
    timers.set_elapsed("t", 1.0)
    assert timers.min_max_across_ranks(["t"]) == {"t": (1.0, 1.0)}
    assert sharded_frobenius_norm([torch.ones(4, device="cuda")]) == pytest.approx(2.0)
    return broadcast_free_port() > 0


def test_layers_and_collectives_on_nccl(run_distributed):
    assert run_distributed(_tensor_parallel_on_nccl, 1, backend="nccl", timeout=120) == [True]
