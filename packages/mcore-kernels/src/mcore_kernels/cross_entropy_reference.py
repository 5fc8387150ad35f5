"""Cross entropy of one chunk of float32 logits in plain PyTorch: the numerical oracle of the Triton
kernels and the path every non-CUDA tensor takes.

A chunk is ``logits [r, v]``, the rows of ``r`` tokens over this rank's ``v`` vocabulary columns
(all of them without a tensor-parallel group). With a group the row maxima are all-reduced (max)
before the exponentials, then the sums of exponentials, the target logits, the count of ranks
holding each target and, with label smoothing, the sums of logits (sum). ``chunk_forward_`` leaves
in the chunk the loss's gradient with respect to the logits for an upstream gradient of 1 per
counted token, ``chunk_gradient_`` recomputes it from the row's log-sum-exp, scaled per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ChunkTargets:
    """The targets of a chunk's rows as this rank sees them."""

    local: torch.Tensor  # [r, 1] int64: the target's column in this shard (0 where not here)
    here: torch.Tensor  # [r] bool: counted and in this shard
    valid: torch.Tensor  # [r] bool: counted (not ignore_index)

    def rows(self, index: slice | torch.Tensor) -> ChunkTargets:
        """The targets of the rows ``index``."""
        return ChunkTargets(self.local[index], self.here[index], self.valid[index])


@dataclass(frozen=True)
class Smoothing:
    """Label smoothing ``a`` over ``vocab`` classes: the target is ``(1 - a)`` on the label plus
    ``a / vocab`` on every class, as ``torch.nn.functional.cross_entropy`` defines it."""

    a: float
    vocab: int


def chunk_forward_(
    logits: torch.Tensor,
    targets: ChunkTargets,
    group: dist.ProcessGroup | None,
    smoothing: Smoothing,
    want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, lse, found)`` of the chunk's rows (float32 ``[r]`` each; ``found``: how many shards
    hold the row's target). With ``want_grad`` the chunk is overwritten with ``dloss / dlogits``
    (zero on rows not counted); otherwise with scratch."""
    rows, vocab = logits.shape
    if vocab:
        picked = logits.gather(1, targets.local).squeeze(1).masked_fill_(~targets.here, 0.0)
        row_max = logits.amax(1)
    else:  # a rank holding only padded ids: nothing to add
        picked = logits.new_zeros(rows)
        row_max = torch.full_like(picked, float("-inf"))
    parts = [picked, targets.here.to(torch.float32)]
    if smoothing.a:
        parts.append(logits.sum(1))
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    probs = logits.sub_(row_max.unsqueeze(1)).exp_()  # in place: unnormalised softmax
    sums = torch.stack([probs.sum(1), *parts])
    if group is not None:
        dist.all_reduce(sums, group=group)
    sum_exp, target_logit, found = sums[0], sums[1], sums[2]
    lse = sum_exp.log().add_(row_max)
    if smoothing.a:
        loss = lse - (1.0 - smoothing.a) * target_logit - (smoothing.a / smoothing.vocab) * sums[3]
    else:
        loss = lse - target_logit
    if want_grad:
        probs.mul_((targets.valid / sum_exp).unsqueeze(1))
        _subtract_targets_(probs, targets, targets.valid.to(torch.float32), smoothing)
    return loss, lse, found


def chunk_gradient_(
    logits: torch.Tensor, lse: torch.Tensor, targets: ChunkTargets, scale: torch.Tensor, smoothing: Smoothing
) -> torch.Tensor:
    """Overwrite the chunk with ``scale [r]`` times ``dloss / dlogits``, recomputed from each
    row's global log-sum-exp ``lse [r]``; returns the chunk."""
    probs = logits.sub_(lse.unsqueeze(1)).exp_()
    _subtract_targets_(probs, targets, torch.ones_like(scale), smoothing)
    return probs.mul_(scale.unsqueeze(1))


def _subtract_targets_(
    probs: torch.Tensor, targets: ChunkTargets, weight: torch.Tensor, smoothing: Smoothing
) -> None:
    """``probs -= weight * target distribution`` in place (rows' weights ``weight [r]``)."""
    if not probs.shape[1]:
        return
    if smoothing.a:
        probs.sub_((weight * (smoothing.a / smoothing.vocab)).unsqueeze(1))
        on_target = targets.here.to(probs.dtype) * (weight * (smoothing.a - 1.0))
    else:
        on_target = targets.here.to(probs.dtype).neg_()
    probs.scatter_add_(1, targets.local, on_target.unsqueeze(1))
