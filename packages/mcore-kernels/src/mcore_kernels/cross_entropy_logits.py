"""``cross_entropy``: the loss of given logits, chunk by chunk, optionally over a vocabulary split
across a tensor-parallel group. It keeps for backward only the logits (the caller's tensor) and
one log-sum-exp per row: the backward recomputes the softmax a chunk of rows at a time, in
float32, by the dispatched backend (``cross_entropy_reference`` or ``cross_entropy_triton``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .cross_entropy_arguments import (
    check_options,
    check_target_tensor,
    check_targets,
    chunk_kernels,
    counted_targets,
    default_chunk_rows,
    reduce,
    shard_group,
    smoothing_over,
)
from .cross_entropy_reference import ChunkTargets
from .dispatch import select_backend


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, ignore_index, chunk_rows, smoothing, backend):
        kernels = chunk_kernels(backend)
        n, vocab = logits.shape
        targets = counted_targets(target, ignore_index, vocab_start, vocab)
        loss, lse, found = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
        for first in range(0, n, chunk_rows):
            chunk = slice(first, min(n, first + chunk_rows))
            scratch = logits[chunk].to(torch.float32, copy=True)
            loss[chunk], lse[chunk], found[chunk] = kernels.chunk_forward_(
                scratch, targets.rows(chunk), group, smoothing, False
            )
        check_targets("cross_entropy", target, targets.valid, found, group)
        ctx.save_for_backward(logits, targets.local, targets.here, targets.valid, lse)
        ctx.options = (chunk_rows, smoothing, backend)
        return loss.masked_fill_(~targets.valid, 0.0)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local, here, valid, lse = ctx.saved_tensors
        chunk_rows, smoothing, backend = ctx.options
        kernels = chunk_kernels(backend)
        targets = ChunkTargets(local, here, valid)
        g = grad_loss.float().masked_fill(~valid, 0.0)
        grad = torch.empty_like(logits)
        for first in range(0, logits.shape[0], chunk_rows):
            chunk = slice(first, min(logits.shape[0], first + chunk_rows))
            scratch = logits[chunk].to(torch.float32, copy=True)
            grad[chunk] = kernels.chunk_gradient_(
                scratch, lse[chunk], targets.rows(chunk), g[chunk], smoothing
            )
        return grad, None, None, None, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross entropy of ``logits [..., v]`` against ``target [...]`` (class ids; ``ignore_index``:
    not counted), as ``F.cross_entropy`` of the float32 logits with ``reduction`` and
    ``label_smoothing``; float32 out. With ``group`` (vocabulary parallel) ``logits`` are the
    classes ``vocab_start ..`` of the vocabulary, the other ranks holding the rest."""
    check_options("cross_entropy", reduction, label_smoothing, chunk_size, vocab_start)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        kind = str(logits.dtype) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"cross_entropy: logits must be a floating-point [..., v] tensor, got {kind}")
    check_target_tensor("cross_entropy", target, logits.shape[:-1], logits.device)
    group = shard_group(group)
    vocab = logits.shape[-1]
    smoothing = smoothing_over(label_smoothing, vocab, group, logits.device)
    rows = chunk_size if chunk_size is not None else default_chunk_rows(vocab)
    backend = select_backend("cross_entropy", logits)
    flat_target = target.reshape(-1)
    loss = _CrossEntropy.apply(
        logits.reshape(-1, vocab), flat_target, group, vocab_start, ignore_index, rows, smoothing, backend
    )
    return reduce(loss, flat_target != ignore_index, reduction).view(
        target.shape if reduction == "none" else ()
    )
