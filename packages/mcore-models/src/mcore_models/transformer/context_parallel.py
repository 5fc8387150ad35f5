"""Context parallelism: a sequence split over the ranks of a context-parallel (CP) group, and
attention of each rank's queries over the keys and values of every rank.

Causal load balancing: the sequence is cut into ``2 * cp`` equal chunks and rank ``r`` holds chunks
``r`` and ``2 * cp - 1 - r`` (an early and a late one), so every rank has about the same causal
work. Each rank's tokens keep their true positions (for RoPE, learned positions and the mask).

Keys and values travel either by one all-gather (``"all_gather"``) or around a ring (``"p2p"``):
``cp`` steps, each sending the current key/value block to the next rank and receiving the previous
rank's block while attending over the current one; partial results are merged by log-sum-exp
rescaling (a running maximum and sum of exponentials), with the sink logit, if any, joining at the
end. Both are exact: the same numbers as attention over the whole sequence, up to summation order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_parallel import gather_from_sequence_parallel_region

from .attention_mask import allowed_by_position
from .masked_attention import masked_attention

CPCommType = Literal["p2p", "all_gather"]


def _check_divisible(seq_length: int, cp_size: int) -> None:
    if seq_length % (2 * cp_size):
        raise ValueError(
            f"sequence length ({seq_length}) must be divisible by 2 x context_parallel_size "
            f"({2 * cp_size}) for load-balanced context parallelism"
        )


@experimental_api
def context_parallel_positions(
    seq_length: int, cp_rank: int, cp_size: int, device: torch.device | None = None
) -> torch.Tensor:
    """The positions ``[seq_length / cp_size]`` (int64) of the tokens rank ``cp_rank`` holds:
    chunk ``cp_rank`` then chunk ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size`` chunks.

    Raises:
        ValueError: ``seq_length`` is not divisible by ``2 * cp_size``, or ``cp_rank`` is out of range.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    _check_divisible(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat(
        (
            torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
            torch.arange(late * chunk, (late + 1) * chunk, device=device),
        )
    )


@experimental_api
def split_sequence(tensor: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> torch.Tensor:
    """The tokens of ``tensor`` (sequence along ``seq_dim``) that CP rank ``cp_rank`` holds."""
    positions = context_parallel_positions(tensor.shape[seq_dim], cp_rank, cp_size, tensor.device)
    return tensor.index_select(seq_dim, positions)


@experimental_api
def split_batch(batch: Mapping[str, Any], cp_rank: int, cp_size: int, seq_dim: int = 1) -> dict[str, Any]:
    """``split_sequence`` of every tensor of a batch (``tokens``, ``labels``, ``loss_mask``,
    ``position_ids``, ... each ``[b, s, ...]`` with ``seq_dim=1``); other values are kept as they
    are. Position ids are split like the rest, so each rank keeps its tokens' true positions."""
    return {
        name: split_sequence(value, cp_rank, cp_size, seq_dim) if isinstance(value, torch.Tensor) else value
        for name, value in batch.items()
    }


@experimental_api
def restore_sequence_order(pieces: Sequence[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """The whole sequence from the pieces of every CP rank (``pieces[r]`` from rank ``r``); the
    inverse of ``split_sequence``."""
    cp_size = len(pieces)
    seq_length = pieces[0].shape[seq_dim] * cp_size
    stacked = torch.cat(list(pieces), dim=seq_dim)
    positions = torch.cat(
        [context_parallel_positions(seq_length, r, cp_size, stacked.device) for r in range(cp_size)]
    )
    return stacked.index_select(seq_dim, torch.argsort(positions))


class _GatherSequence(torch.autograd.Function):
    """All-gather over the CP group in natural order; backward keeps this rank's tokens' gradient."""

    @staticmethod
    def forward(ctx, local, cp_group, seq_dim):
        ctx.cp_group, ctx.seq_dim = cp_group, seq_dim
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(cp_group))]
        dist.all_gather(pieces, local.contiguous(), group=cp_group)
        return restore_sequence_order(pieces, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        cp_rank, cp_size = dist.get_rank(ctx.cp_group), dist.get_world_size(ctx.cp_group)
        return split_sequence(grad, cp_rank, cp_size, ctx.seq_dim), None, None


@experimental_api
def gather_sequence(local: torch.Tensor, cp_group: dist.ProcessGroup, seq_dim: int = 1) -> torch.Tensor:
    """The whole sequence in natural order from every CP rank's ``local`` piece (collective).

    Differentiable: the gradient that reaches ``local`` is that of this rank's own tokens, so
    gradients summed over the CP group are those of the whole sequence."""
    return _GatherSequence.apply(local, cp_group, seq_dim)


@experimental_api
def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cp_group: dist.ProcessGroup,
    comm_type: CPCommType = "p2p",
    scale: float,
    window_size: int | None = None,
    sink_logits: torch.Tensor | None = None,
    dropout: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the keys of the whole split sequence.

    ``query [s, b, n, d]``, ``key, value [s, b, g, d]`` hold this rank's ``s`` tokens (as
    ``split_sequence`` cut them); returns ``[s, b, n, d]``. ``window_size`` limits how far back a
    query sees (by true position), ``sink_logits [n]`` add a sink to every softmax, ``dropout`` is
    applied to the attention probabilities.

    Raises:
        ValueError: an unknown ``comm_type``.
    """
    cp_rank, cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    seq_length = query.shape[0] * cp_size
    positions = [context_parallel_positions(seq_length, r, cp_size, query.device) for r in range(cp_size)]
    q = query.permute(1, 2, 0, 3)  # [b, n, s, d]
    if comm_type == "all_gather":
        # one collective for both; its backward reduce-scatters the partial key/value gradients
        kv = gather_from_sequence_parallel_region(torch.cat((key, value), dim=-1), cp_group)
        k, v = kv.permute(1, 2, 0, 3).chunk(2, dim=-1)  # rank-major order; the mask follows positions
        allowed = allowed_by_position(positions[cp_rank], torch.cat(positions), window_size)
        context = masked_attention(q, k, v, allowed, scale=scale, sink_logits=sink_logits, dropout=dropout)
    elif comm_type == "p2p":
        context = _ring_attention(
            q, key, value, positions, cp_group, scale, window_size, sink_logits, dropout
        )
    else:
        raise ValueError(f"comm_type must be 'p2p' or 'all_gather', got {comm_type!r}")
    return context.permute(2, 0, 1, 3)


def _ring_attention(q, key, value, positions, cp_group, scale, window_size, sink_logits, dropout):
    """Attention of ``q [b, n, s, d]`` over the key/value blocks of all ranks, passed around the ring."""
    cp_rank, cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    following = dist.get_global_rank(cp_group, (cp_rank + 1) % cp_size)
    preceding = dist.get_global_rank(cp_group, (cp_rank - 1) % cp_size)
    repeats = q.shape[1] // key.shape[2]
    block = torch.cat((key, value), dim=-1).contiguous()  # [s, b, g, 2d]: one message per step
    running_max = numerator = denominator = None
    for step in range(cp_size):
        pending = []
        if step + 1 < cp_size:  # the next block is on its way while this one is computed
            incoming = torch.empty_like(block)
            pending = _exchange(block.detach(), following, incoming, preceding, cp_group)
        source = (cp_rank - step) % cp_size
        k, v = block.permute(1, 2, 0, 3).repeat_interleave(repeats, dim=1).chunk(2, dim=-1)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        allowed = allowed_by_position(positions[cp_rank], positions[source], window_size)
        scores = scores.masked_fill(~allowed, float("-inf"))
        # Step 0 is this rank's own block: every query sees itself, so the maximum is finite from here.
        block_max = scores.amax(dim=-1, keepdim=True).detach()
        new_max = block_max if running_max is None else torch.maximum(running_max, block_max)
        weights = torch.exp(scores - new_max)  # 0 where masked
        block_sum = weights.sum(dim=-1, keepdim=True)
        if dropout is not None:
            weights = dropout(weights)
        block_out = torch.matmul(weights.to(v.dtype), v).float()
        if running_max is None:
            numerator, denominator = block_out, block_sum
        else:
            rescale = torch.exp(running_max - new_max)
            numerator = numerator * rescale + block_out
            denominator = denominator * rescale + block_sum
        running_max = new_max
        for request in pending:
            request.wait()
        if pending:
            block = _RingShift.apply(block, (incoming,), cp_group, following, preceding)
    if sink_logits is not None:
        sink = sink_logits.float().view(1, -1, 1, 1)
        final_max = torch.maximum(running_max, sink.detach())
        rescale = torch.exp(running_max - final_max)
        numerator = numerator * rescale
        denominator = denominator * rescale + torch.exp(sink - final_max)
    return (numerator / denominator).to(q.dtype)


class _RingShift(torch.autograd.Function):
    """The block received from the preceding rank, already in ``holder[0]``; backward sends its
    gradient back there and receives, from the following rank, the gradient of the block sent."""

    @staticmethod
    def forward(ctx, sent, holder, cp_group, following, preceding):
        ctx.cp_group, ctx.following, ctx.preceding = cp_group, following, preceding
        return holder[0]

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # empty_like keeps the strides it is given
        grad_of_sent = torch.empty_like(grad)
        for request in _exchange(grad, ctx.preceding, grad_of_sent, ctx.following, ctx.cp_group):
            request.wait()
        return grad_of_sent, None, None, None, None


def _exchange(send: torch.Tensor, to: int, receive: torch.Tensor, source: int, group: dist.ProcessGroup):
    """Start sending ``send`` to global rank ``to`` and receiving ``receive`` from ``source``, as one
    batch (NCCL needs the pair batched when both peers are the same rank); returns the requests."""
    return dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, receive, source, group)]
    )
