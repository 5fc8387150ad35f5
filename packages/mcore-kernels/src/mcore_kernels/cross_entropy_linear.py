"""``linear_cross_entropy``: an output layer and its cross entropy in one pass over chunks of rows,
without the full ``[tokens, vocabulary]`` logits kept for backward.

The logits exist one chunk of rows at a time, in a float32 buffer reused from chunk to chunk
(about 16 MiB by default). Each chunk's loss and its gradient with respect to the logits (as if
each counted token's upstream gradient were 1) are computed by the dispatched backend
(``cross_entropy_reference`` or ``cross_entropy_triton``), and ``grad_hidden`` and
``grad_weight`` from it with the matmuls autograd would run. Backward scales them by the real
upstream gradient ``g``: ``grad_hidden`` row by row (exact), ``grad_weight`` by the value ``c``
most counted tokens share (a mean or a masked mean gives each the same). Rows whose ``g`` differs
from ``c`` get their logits recomputed and ``(g - c) dlogits`` added, so the result is exact for
any ``g``, at a cost in proportion to those rows; when they are most rows, ``c`` is 0 and all
are recomputed. Kept for backward: the inputs, ``grad_hidden``, ``grad_weight`` (float32) and
one log-sum-exp per row.
"""

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


def _logits_into(out: torch.Tensor, low: torch.Tensor | None, hidden: torch.Tensor, weight: torch.Tensor):
    """``hidden @ weight.T`` into float32 ``out``, rounded to ``hidden``'s dtype first (in ``low``)."""
    if low is None:
        return torch.mm(hidden, weight.t(), out=out)
    torch.mm(hidden, weight.t(), out=low)
    return out.copy_(low)


def _forward_chunks(kernels, hidden, weight, targets, group, smoothing, chunk_rows, need_hidden, need_weight):
    """``(loss, lse, found, unit grad_hidden or None, unit grad_weight or None)`` over all rows."""
    n, vocab = hidden.shape[0], weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    rows = min(chunk_rows, n)
    buffer = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    low = None if dtype == torch.float32 else torch.empty(rows, vocab, dtype=dtype, device=device)
    loss, lse, found = (torch.empty(n, dtype=torch.float32, device=device) for _ in range(3))
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = None
    if need_weight:
        # float32 matmuls write the first chunk's product over it (beta=0); others accumulate.
        fresh = torch.empty if low is None and n else torch.zeros
        grad_weight = fresh(weight.shape, dtype=torch.float32, device=device)
    for first in range(0, n, chunk_rows):
        chunk = slice(first, min(n, first + chunk_rows))
        h = hidden[chunk]
        size = h.shape[0]
        logits = _logits_into(buffer[:size], None if low is None else low[:size], h, weight)
        want_grad = need_hidden or need_weight
        loss[chunk], lse[chunk], found[chunk] = kernels.chunk_forward_(
            logits, targets.rows(chunk), group, smoothing, want_grad
        )
        if not want_grad:
            continue
        grad_logits = logits if low is None else low[:size].copy_(logits)
        if need_hidden:
            torch.mm(grad_logits, weight, out=grad_hidden[chunk])
        if need_weight:
            if low is None:
                grad_weight.addmm_(grad_logits.t(), h, beta=0.0 if first == 0 else 1.0)
            else:
                grad_weight.add_(torch.mm(grad_logits.t(), h))
    return loss, lse, found, grad_hidden, grad_weight


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        target,
        group,
        vocab_start,
        ignore_index,
        chunk_rows,
        smoothing,
        backend,
        recorded,
    ):
        kernels = chunk_kernels(backend)
        targets = counted_targets(target, ignore_index, vocab_start, weight.shape[0])
        # needs_input_grad is set under no_grad too, where no backward follows: ``recorded`` says
        need_hidden, need_weight = (recorded and ctx.needs_input_grad[i] for i in (0, 1))
        loss, lse, found, grad_hidden, grad_weight = _forward_chunks(
            kernels, hidden, weight, targets, group, smoothing, chunk_rows, need_hidden, need_weight
        )
        check_targets("linear_cross_entropy", target, targets.valid, found, group)
        ctx.save_for_backward(
            hidden, weight, targets.local, targets.here, targets.valid, lse, grad_hidden, grad_weight
        )
        ctx.options = (chunk_rows, smoothing, backend)
        return loss.masked_fill_(~targets.valid, 0.0)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local, here, valid, lse, unit_grad_hidden, unit_grad_weight = ctx.saved_tensors
        chunk_rows, smoothing, backend = ctx.options
        g = grad_loss.float().masked_fill(~valid, 0.0)
        grad_hidden = grad_weight = None
        if unit_grad_hidden is not None:
            grad_hidden = (unit_grad_hidden * g.unsqueeze(1)).to(hidden.dtype)
        if unit_grad_weight is not None:
            counted = g[valid]
            common = torch.mode(counted).values if counted.numel() else g.new_zeros(())
            rows = (valid & (g != common)).nonzero().squeeze(1)
            if 2 * rows.numel() > counted.numel():  # mostly distinct weights: recompute them all
                common = g.new_zeros(())
                rows = (g != 0).nonzero().squeeze(1)
            grad_weight = unit_grad_weight * common
            if rows.numel():
                targets = ChunkTargets(local, here, valid)
                recompute = (chunk_kernels(backend), hidden, weight, targets, lse, smoothing, chunk_rows)
                _add_recomputed(grad_weight, rows, g - common, *recompute)
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def _add_recomputed(grad_weight, rows, scale, kernels, hidden, weight, targets, lse, smoothing, chunk_rows):
    """``grad_weight += sum over rows of scale[row] * dlogits[row] (x) hidden[row]``, logits recomputed."""
    for first in range(0, rows.numel(), chunk_rows):
        index = rows[first : first + chunk_rows]
        h = hidden[index]
        logits = torch.mm(h, weight.t()).float()
        grad_logits = kernels.chunk_gradient_(
            logits, lse[index], targets.rows(index), scale[index], smoothing
        )
        grad_weight.add_(torch.mm(grad_logits.to(h.dtype).t(), h))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross entropy of the logits ``hidden [..., h] @ weight [v, h].T`` against ``target [...]``
    (class ids; ``ignore_index``: not counted), as ``F.cross_entropy`` of the float32 logits
    (rounded to ``hidden``'s dtype first) with ``reduction`` and ``label_smoothing``, computed
    ``chunk_size`` tokens at a time; float32 out. With ``group`` (vocabulary parallel) ``weight``
    is the classes ``vocab_start ..`` and the gradient of ``hidden`` this rank's partial sum."""
    check_options("linear_cross_entropy", reduction, label_smoothing, chunk_size, vocab_start)
    _check_tensors(hidden, weight, target)
    group = shard_group(group)
    vocab = weight.shape[0]
    smoothing = smoothing_over(label_smoothing, vocab, group, hidden.device)
    rows = chunk_size if chunk_size is not None else default_chunk_rows(vocab)
    backend = select_backend("linear_cross_entropy", hidden)
    flat_target = target.reshape(-1)
    loss = _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        flat_target,
        group,
        vocab_start,
        ignore_index,
        rows,
        smoothing,
        backend,
        torch.is_grad_enabled(),
    )
    return reduce(loss, flat_target != ignore_index, reduction).view(
        target.shape if reduction == "none" else ()
    )


def _check_tensors(hidden, weight, target) -> None:
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise TypeError(
                f"linear_cross_entropy: {name} must be a floating-point tensor, got {_kind(tensor)}"
            )
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            "linear_cross_entropy: hidden [..., h] and weight [v, h] expected, got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"linear_cross_entropy: weight must be {hidden.dtype} on {hidden.device} like hidden, got "
            f"{weight.dtype} on {weight.device}"
        )
    check_target_tensor("linear_cross_entropy", target, hidden.shape[:-1], hidden.device)


def _kind(value) -> str:
    return str(value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
