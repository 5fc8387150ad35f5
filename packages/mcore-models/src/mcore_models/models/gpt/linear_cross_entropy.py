"""The output layer and the per-token cross entropy in one pass over chunks of rows.

``linear_cross_entropy(hidden, weight, target)`` equals
``F.cross_entropy(F.linear(hidden, weight).float(), target, reduction="none")`` (logits rounded to
``hidden``'s dtype, then the loss in float32), but the logits exist only one chunk of rows at a
time, in a buffer reused from chunk to chunk (about 16 MiB of float32), and are never kept for
backward.

The gradients are computed in the forward pass, chunk by chunk, as if each token's upstream
gradient were 1: ``dlogits = softmax - onehot(target)``, then ``grad_hidden`` and ``grad_weight``
from it with the same matmuls autograd would run. Backward scales them by the real upstream
gradient ``g``: ``grad_hidden`` row by row (exact), ``grad_weight`` by the value ``c`` most tokens
share (a mean or a masked mean gives every counted token the same one). The rows whose ``g``
differs from ``c`` (tokens a loss mask drops, or any other weighting) get their logits recomputed
and their ``(g - c) dlogits`` added, so the result is exact for any ``g``; it costs time only in
proportion to those rows. When they are most rows, ``c`` is 0 and all rows are recomputed.

Ignored tokens (``target == ignore_index``) have loss 0 and no gradient. With a tensor-parallel
group the weight is this rank's vocabulary shard starting at ``vocab_start``: row maxima and
sums are all-reduced per chunk, and ``grad_hidden`` is this rank's partial sum (the caller's copy
into the tensor-parallel region all-reduces it in backward, as for ``ColumnParallelLinear``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Rows per chunk: enough for an efficient matmul, and about 16 MiB of float32 logits when the
# vocabulary is small enough for that to hold more rows (on a 2-core CPU, 1024 rows of 4096 ran
# a training step 2-5% faster than 256: fewer passes of the weight-gradient accumulation).
_MIN_CHUNK_ROWS = 256
_CHUNK_ELEMENTS = 1 << 22


def chunk_rows_for(vocab: int) -> int:
    """Rows per chunk for a (local) vocabulary of ``vocab`` columns."""
    return max(_MIN_CHUNK_ROWS, _CHUNK_ELEMENTS // max(vocab, 1))


def _logits_into(out: torch.Tensor, low: torch.Tensor | None, hidden: torch.Tensor, weight: torch.Tensor):
    """``hidden @ weight.T`` into float32 ``out``, rounded to ``hidden``'s dtype first (in ``low``)."""
    if low is None:
        torch.mm(hidden, weight.t(), out=out)
    else:
        torch.mm(hidden, weight.t(), out=low)
        out.copy_(low)
    return out


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, group, vocab_start, ignore_index, chunk_rows):
        n, vocab = hidden.shape[0], weight.shape[0]
        device, dtype = hidden.device, hidden.dtype
        parallel = group is not None
        valid = target != ignore_index
        local = target - vocab_start
        here = valid & (local >= 0) & (local < vocab)  # the target's logit is on this rank
        local = local.masked_fill(~here, 0).unsqueeze(1)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]

        rows = min(chunk_rows, n)
        buffer = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        low = None if dtype == torch.float32 else torch.empty(rows, vocab, dtype=dtype, device=device)
        lse = torch.empty(n, dtype=torch.float32, device=device)
        target_logit = torch.empty(n, dtype=torch.float32, device=device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = None
        if need_weight:
            # float32 matmuls write the first chunk's product over it (beta=0); others accumulate.
            fresh = torch.empty if low is None and n else torch.zeros
            grad_weight = fresh(weight.shape, dtype=torch.float32, device=device)
        for first in range(0, n, chunk_rows):
            last = min(n, first + chunk_rows)
            chunk = slice(first, last)
            h = hidden[chunk]
            logits = _logits_into(
                buffer[: last - first], None if low is None else low[: last - first], h, weight
            )
            if vocab:
                picked = logits.gather(1, local[chunk]).squeeze(1).masked_fill_(~here[chunk], 0.0)
                row_max = logits.amax(1)
            else:  # a rank holding only padded ids: nothing to add
                picked = logits.new_zeros(last - first)
                row_max = torch.full_like(picked, float("-inf"))
            if parallel:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            probs = logits.sub_(row_max.unsqueeze(1)).exp_()  # in place: unnormalised softmax
            sums = torch.stack([probs.sum(1), picked])
            if parallel:
                dist.all_reduce(sums, group=group)
            sum_exp, target_logit[chunk] = sums
            lse[chunk] = sum_exp.log().add_(row_max)
            if not (need_hidden or need_weight):
                continue
            # dloss / dlogits = softmax - onehot(target), zero on ignored rows.
            probs.mul_((valid[chunk] / sum_exp).unsqueeze(1))
            if vocab:
                probs.scatter_add_(1, local[chunk], here[chunk].to(probs.dtype).neg_().unsqueeze(1))
            grad_logits = probs if low is None else low[: last - first].copy_(probs)
            if need_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[chunk])
            if need_weight:
                if low is None:
                    grad_weight.addmm_(grad_logits.t(), h, beta=0.0 if first == 0 else 1.0)
                else:
                    grad_weight.add_(torch.mm(grad_logits.t(), h))
        loss = (lse - target_logit).masked_fill_(~valid, 0.0)
        ctx.save_for_backward(hidden, weight, local, here, valid, lse, grad_hidden, grad_weight)
        ctx.chunk_rows = chunk_rows
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local, here, valid, lse, unit_grad_hidden, unit_grad_weight = ctx.saved_tensors
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
                _add_recomputed(
                    grad_weight, hidden, weight, rows, g - common, local, here, lse, ctx.chunk_rows
                )
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _add_recomputed(grad_weight, hidden, weight, rows, scale, local, here, lse, chunk_rows):
    """``grad_weight += sum over rows of scale[row] * dlogits[row] (x) hidden[row]``, logits recomputed."""
    for first in range(0, rows.numel(), chunk_rows):
        index = rows[first : first + chunk_rows]
        h = hidden[index]
        logits = torch.mm(h, weight.t()).float()
        probs = logits.sub_(lse[index].unsqueeze(1)).exp_()
        if weight.shape[0]:
            probs.scatter_add_(1, local[index], here[index].to(probs.dtype).neg_().unsqueeze(1))
        probs.mul_(scale[index].unsqueeze(1))
        grad_weight.add_(torch.mm(probs.to(h.dtype).t(), h))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Per-token cross entropy ``[n]`` (float32) of the logits ``hidden [n, h] @ weight[v, h].T``.

    ``target [n]`` holds global class ids (``ignore_index``: loss 0, no gradient). With ``group``
    (more than one rank) ``weight`` is the rows ``vocab_start ..`` of the vocabulary; the other
    ranks hold the rest. ``chunk_rows`` defaults to ``chunk_rows_for(v)``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [n, h] and weight [v, h] expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"target must be [{hidden.shape[0]}], got {tuple(target.shape)}")
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    rows = chunk_rows if chunk_rows is not None else chunk_rows_for(weight.shape[0])
    if rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {rows}")
    return _LinearCrossEntropy.apply(hidden, weight, target, group, vocab_start, ignore_index, rows)
