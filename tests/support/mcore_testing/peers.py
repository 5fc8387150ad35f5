"""Torch features that some tests take as their oracle, and whether the torch installed here has them.

A test compares with such a peer where the peer can run, and skips that comparison, saying why,
where it cannot. Each check looks for the feature the peer needs, not at torch's version number.
Importing this module imports torch (the ``mcore-api`` tests, which run without torch, never do).
"""

import pytest
import torch
import torch.nn.functional as F


def fsdp2_runs_on_cpu() -> bool:
    """Whether ``torch.distributed.fsdp.fully_shard`` (FSDP2) can train on CPU ranks here.

    FSDP2 orders its collectives with device streams and events, and on CPU calls
    ``record_event``/``wait_event`` on ``torch.cpu.Stream``, which has them only from torch 2.7
    (pytorch/pytorch#145935, added so that FSDP2 runs on CPU).
    """
    return all(hasattr(torch.cpu.Stream, name) for name in ("record_event", "wait_event"))


requires_fsdp2_on_cpu = pytest.mark.skipif(
    not fsdp2_runs_on_cpu(),
    reason=f"the peer, FSDP2 (torch.distributed.fsdp.fully_shard), cannot train on CPU in torch "
    f"{torch.__version__}: torch.cpu.Stream has no record_event/wait_event",
)


def rms_norm_rounds_once() -> bool:
    """Whether ``torch.nn.functional.rms_norm`` on bfloat16 applies the weight in float32 and rounds
    once, as its fused kernel does; before that kernel, torch rounded the normalized input to
    bfloat16 and multiplied it by the weight in bfloat16 (a second rounding)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=generator).bfloat16()
    weight = torch.randn(16, generator=generator).bfloat16()
    x32 = x.float()
    once = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).bfloat16()
    return torch.equal(F.rms_norm(x, (16,), weight, 1e-5), once)
