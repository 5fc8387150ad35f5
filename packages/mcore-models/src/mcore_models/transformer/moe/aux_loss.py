"""Router losses (load balancing, z-loss) and the autograd hook that adds their gradient to the
backward pass of the MoE layer's output."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from mcore_api import experimental_api


def _summed_over_sequence_group(
    counts: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, int]:
    """``(counts summed over group, group size)``: the counts of whole sequences when ``group``
    (context parallelism) holds the other parts of this rank's sequences (collective there)."""
    size = dist.get_world_size(group) if group is not None else 1
    if size > 1:
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
    return counts, size


def load_balancing_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    topk: int,
    coeff: float,
    *,
    sequence_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Switch-Transformer balance loss ``coeff * E * sum_e f_e * P_e`` over ``T`` tokens.

    ``scores``: ``[T, E]`` router probabilities over all experts; ``tokens_per_expert``: ``[E]``
    routed assignments; ``f_e`` is the fraction of the ``T * k`` assignments expert ``e`` got and
    ``P_e`` its mean score. Balanced routing with uniform scores gives ``coeff``.
    With ``sequence_group`` (the context-parallel ranks, each holding an equal part of the same
    sequences) ``f_e`` counts the whole sequences and ``P_e`` this rank's tokens: the mean of the
    group's losses is the loss of the whole sequences (collective over the group).
    """
    num_tokens, num_experts = scores.shape
    tokens_per_expert, parts = _summed_over_sequence_group(tokens_per_expert, sequence_group)
    fraction = tokens_per_expert.to(scores.dtype) / (num_tokens * parts * topk)
    mean_score = scores.mean(dim=0)
    return coeff * num_experts * torch.sum(fraction * mean_score)


def sequence_load_balancing_loss(
    scores: torch.Tensor,
    routing_map: torch.Tensor,
    batch: int,
    topk: int,
    coeff: float,
    *,
    sequence_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``load_balancing_loss`` of each of ``batch`` sequences, averaged. ``scores`` and the bool
    ``routing_map`` are ``[s * b, E]`` in sequence-major order (token ``i * b + j`` is position
    ``i`` of sequence ``j``). ``sequence_group`` as in ``load_balancing_loss``."""
    tokens, experts = scores.shape
    per_seq_scores = scores.view(tokens // batch, batch, experts).mean(dim=0)  # [b, E]
    per_seq_counts = routing_map.view(tokens // batch, batch, experts).sum(dim=0).to(scores.dtype)
    per_seq_counts, parts = _summed_over_sequence_group(per_seq_counts, sequence_group)
    fraction = per_seq_counts / (tokens // batch * parts * topk)
    return coeff * experts * torch.sum(fraction * per_seq_scores, dim=-1).mean()


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff * mean_t logsumexp(logits_t)^2`` (ST-MoE), which keeps router logits small."""
    return coeff * torch.logsumexp(logits, dim=-1).square().mean()


_backward_scale = 1.0


@experimental_api
@contextlib.contextmanager
def aux_loss_backward_scale(scale: float) -> Iterator[None]:
    """Within the block, router losses attached to outputs are backpropagated with weight
    ``scale`` instead of 1: a loop that divides each micro-batch's loss by the number of
    micro-batches passes ``1 / num_microbatches``, so the losses keep their coefficients."""
    global _backward_scale
    previous, _backward_scale = _backward_scale, scale
    try:
        yield
    finally:
        _backward_scale = previous


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``output``; in backward, ``aux_loss`` receives gradient ``scale``, as if
    ``scale * aux_loss`` had been added to the loss that is backpropagated."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """``output`` unchanged, carrying ``aux_loss``: any ``loss.backward()`` that reaches ``output``
    also backpropagates ``aux_loss``, with weight 1 or the one ``aux_loss_backward_scale`` set
    when this was called."""
    if not aux_loss.requires_grad:
        return output
    return _AttachAuxLoss.apply(output, aux_loss, _backward_scale)
