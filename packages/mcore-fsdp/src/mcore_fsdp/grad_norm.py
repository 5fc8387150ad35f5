"""Global gradient-norm clipping over main-gradient shards."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from mcore_fsdp import collectives
from mcore_fsdp.flat_param_group import FlatParamGroup


def clip_grad_norm_(
    groups: list[FlatParamGroup],
    max_norm: float,
    norm_type: float = 2.0,
    copies_outside: Callable[[torch.nn.Parameter], int] | None = None,
) -> torch.Tensor:
    """Clip the main gradients of ``groups`` to a global ``norm_type`` norm of ``max_norm``.

    Each rank holds a slice of every gradient, replicated over some ranks of its mesh; a slice's
    contribution is divided by its number of copies, then summed over the default process group.
    Ranks outside a mesh (tensor-, pipeline- or expert-parallel peers) are taken to hold distinct
    parameters, unless ``copies_outside(param)`` says how many of them hold the same gradient (e.g.
    expert-tensor-parallel peers of an expert tensor they do not split). Returns the total norm
    (before clipping), the same on every rank.
    """
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"norm_type must be positive or inf; got {norm_type}")
    grads = [
        (group, param.grad, copies_outside(param) if copies_outside is not None else 1)
        for group in groups
        for param in group.main_params
        if param.grad is not None and param.grad.numel() > 0
    ]
    device = groups[0].device if groups else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group, grad, outside in grads:
        grad = grad.to(device, torch.float32)
        if math.isinf(norm_type):
            total = torch.maximum(total, grad.abs().max())
        else:
            topology = group.config.topology
            holders = topology.shard_size * topology.replicate_size
            copies = holders // (group.layout_shards * group.outer_shards) * outside
            total += grad.abs().pow(norm_type).sum() / copies
    if math.isinf(norm_type):
        collectives.all_reduce(total, dist.group.WORLD, op=dist.ReduceOp.MAX)
        norm = total
    else:
        collectives.all_reduce(total, dist.group.WORLD)
        norm = total.pow(1.0 / norm_type)
    coefficient = max_norm / (norm.item() + 1e-6)
    if coefficient < 1.0:
        with torch.no_grad():
            for _, grad, _ in grads:
                grad.mul_(coefficient)
    return norm.float()
