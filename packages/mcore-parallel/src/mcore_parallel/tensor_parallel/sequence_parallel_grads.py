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
    Call after backward, before the optimizer step. A parameter's ``main_grad`` (where
    ``DistributedDataParallel`` accumulates it) is reduced if it has one, else its ``.grad``; with
    overlapped DDP reduction, call it only after ``finish_grad_sync``. The gradients are flattened
    into one buffer.
    """
    group = resolve_tp_group(tp_group)
    grads = [
        grad
        for param in module.parameters()
        if getattr(param, "sequence_parallel", False) and (grad := _accumulated_grad(param)) is not None
    ]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(summed.view_as(grad))


def _accumulated_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad
