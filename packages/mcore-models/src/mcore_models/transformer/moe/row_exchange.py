"""Uneven exchange of rows between the ranks of an expert-parallel group, differentiable.

``send[i][j]`` rows go from rank ``i`` to rank ``j``; a rank's input holds its rows for rank 0,
then rank 1, ...; its output holds the rows from rank 0, then rank 1, ... Two transports:
``all_to_all_single`` with split sizes, and a fallback for backends without uneven all-to-all
(some gloo builds) that all-gathers every rank's rows padded to the longest and keeps its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_parallel import all_to_all


def _exchange_by_all_gather(x: torch.Tensor, group: dist.ProcessGroup, send: list[list[int]]) -> torch.Tensor:
    me, size = dist.get_rank(group), dist.get_world_size(group)
    longest = max(sum(row) for row in send)
    padded = x.new_zeros(longest, *x.shape[1:])
    padded[: x.shape[0]] = x
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    pieces = []
    for source in range(size):
        start = sum(send[source][:me])
        pieces.append(gathered[source][start : start + send[source][me]])
    return torch.cat(pieces)


class _AllGatherExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, send):
        ctx.group, ctx.send = group, send
        return _exchange_by_all_gather(x, group, send)

    @staticmethod
    def backward(ctx, grad):
        back = [list(column) for column in zip(*ctx.send, strict=True)]  # the transposed exchange
        return _exchange_by_all_gather(grad, ctx.group, back), None, None


def exchange_rows(
    x: torch.Tensor, group: dist.ProcessGroup, send: list[list[int]], *, via_all_gather: bool = False
) -> torch.Tensor:
    """Rows of ``x`` to their ranks as ``send`` (the full ``[size][size]`` matrix, the same on
    every rank) says; the gradient takes the reverse exchange. ``via_all_gather`` picks the
    fallback transport."""
    if dist.get_world_size(group) == 1:
        return x
    if via_all_gather:
        return _AllGatherExchange.apply(x, group, send)
    me = dist.get_rank(group)
    output_splits = [row[me] for row in send]
    return all_to_all(x, group, output_splits, list(send[me]))


def gather_rows(
    x: torch.Tensor, group: dist.ProcessGroup, counts: list[int], *, via_all_gather: bool = False
) -> torch.Tensor:
    """The rows of every rank of ``group`` (``counts[i]`` rows on rank ``i``), rank 0's first; an
    uneven all-gather whose gradient sums each rank's rows' gradients over the group (a
    reduce-scatter), as expert tensor parallelism needs."""
    size = len(counts)
    if size == 1:
        return x
    send = [[count] * size for count in counts]
    return exchange_rows(x.repeat(size, *([1] * (x.dim() - 1))), group, send, via_all_gather=via_all_gather)


def reduce_scatter_rows(
    x: torch.Tensor, group: dist.ProcessGroup, counts: list[int], *, via_all_gather: bool = False
) -> torch.Tensor:
    """The inverse of ``gather_rows``: ``x`` holds partial rows of every rank (``counts[i]`` for
    rank ``i``, rank 0's first); each rank gets the sum over the group of its own rows."""
    size = len(counts)
    if size == 1:
        return x
    me = dist.get_rank(group)
    send = [list(counts) for _ in range(size)]
    received = exchange_rows(x, group, send, via_all_gather=via_all_gather)
    return received.view(size, counts[me], *x.shape[1:]).sum(0)
