"""Cross entropy over logits whose vocabulary dimension is split across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import resolve_tp_group
from .embedding import vocab_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing):
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        local_vocab = logits.shape[-1]
        vocab_size = local_vocab * world_size
        start, end = vocab_range(vocab_size, rank, world_size)

        ctx.input_dtype = logits.dtype
        logits = logits.float()
        global_max = logits.max(dim=-1).values
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - global_max.unsqueeze(-1)

        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sums = torch.stack([target_logit, exp.sum(dim=-1), shifted.sum(dim=-1)])
        dist.all_reduce(sums, group=group)
        target_logit, sum_exp, sum_shifted = sums
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit
        if label_smoothing > 0.0:
            # Smoothed target: (1 - a) on the label plus a / V on every class (as torch defines it).
            mean_neg_log_prob = log_sum_exp - sum_shifted / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * mean_neg_log_prob

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing = label_smoothing
        ctx.vocab_size = vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        a = ctx.label_smoothing
        grad = softmax.clone()
        if a > 0.0:
            grad.sub_(a / ctx.vocab_size)
        on_target = (~outside).to(grad.dtype) * (1.0 - a)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -on_target.unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)).to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross entropy (no reduction) from this rank's vocabulary slice of the logits.

    ``vocab_parallel_logits`` is ``[..., V / tp]`` (rank ``r`` holding classes ``r*V/tp`` up to the
    next rank's), ``target`` is ``[...]`` of global class ids. Matches
    ``torch.nn.functional.cross_entropy(logits, target, reduction="none", label_smoothing=...)`` on
    the full logits. Computed in float32.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    group = resolve_tp_group(tp_group)
    if dist.get_world_size(group) == 1:  # the whole vocabulary is here: PyTorch's fused kernel
        loss = torch.nn.functional.cross_entropy(
            vocab_parallel_logits.float().flatten(0, -2),
            target.flatten(),
            reduction="none",
            label_smoothing=label_smoothing,
        )
        return loss.view(target.shape)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group, label_smoothing)
