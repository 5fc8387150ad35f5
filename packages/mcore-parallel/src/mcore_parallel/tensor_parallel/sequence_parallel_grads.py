"""Summing the gradients of replicated parameters that only saw this rank's part of the sequence."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import resolve_tp_group


def reduce_sequence_parallel_grads(
    module: torch.nn.Module, tp_group: dist.ProcessGroup | None = None
) -> None:
    """All-reduce, over ``tp_group``, the gradients of parameters tagged ``sequence_parallel = True``.

    Under sequence parallelism such parameters (layer norms, row-parallel biases) are replicated on
    every TP rank but applied to a slice of the tokens, so each rank holds part of their gradient.
    Call after backward, before the optimizer step. The gradients are flattened into one buffer.
    """
    group = resolve_tp_group(tp_group)
    grads = [
        p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None
    ]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(summed.view_as(grad))
