"""Autograd-aware communication between tensor- and sequence-parallel regions.

Each function's backward is the communication that makes gradients exact: a copy into a parallel
region all-reduces its gradient, a reduction out of one passes it through, a scatter gathers it, and
so on. The hidden dimension is the last one; the sequence dimension is the first (``[s, b, h]``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import (
    all_reduce,
    all_to_all_first_dim,
    gather_along_dim,
    reduce_scatter_along_first_dim,
    resolve_tp_group,
    split_along_dim,
)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, -1, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along_dim(grad, -1, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, 0, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return gather_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_along_first_dim(grad, ctx.group), None, None
        return split_along_dim(grad, 0, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, 0, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        return all_to_all_first_dim(x, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad):
        # The reverse exchange: what this rank received goes back where it came from.
        back = all_to_all_first_dim(grad, ctx.group, ctx.input_split_sizes, ctx.output_split_sizes)
        return back, None, None, None


def _apply(
    mapping: type[torch.autograd.Function], x: torch.Tensor, group: dist.ProcessGroup, *args
) -> torch.Tensor:
    """``mapping`` over ``group``; on one rank every mapping is the identity, so ``x`` itself comes back
    (no autograd node, whose Python forward and backward would only cost time)."""
    if dist.get_world_size(group) == 1:
        return x
    return mapping.apply(x, group, *args)


def copy_to_tensor_model_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Identity forward; all-reduces the gradient over ``group`` (default: the global TP group)."""
    return _apply(_CopyToRegion, x, resolve_tp_group(group))


def reduce_from_tensor_model_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduces (sums) partial results over ``group``; the gradient passes through."""
    return _apply(_ReduceFromRegion, x, resolve_tp_group(group))


def scatter_to_tensor_model_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Keeps this rank's slice of the last dimension; the gradient is all-gathered."""
    return _apply(_ScatterToRegion, x, resolve_tp_group(group))


def gather_from_tensor_model_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-gathers slices along the last dimension; the gradient is split back."""
    return _apply(_GatherFromRegion, x, resolve_tp_group(group))


def scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Keeps this rank's slice of the sequence (first) dimension; the gradient is all-gathered."""
    return _apply(_ScatterToSequenceRegion, x, resolve_tp_group(group))


def gather_from_sequence_parallel_region(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    tensor_parallel_output_grad: bool = True,
) -> torch.Tensor:
    """All-gathers sequence slices along the first dimension.

    With ``tensor_parallel_output_grad`` (the output feeds a tensor-parallel op, so each rank's
    gradient is partial) the gradient is reduce-scattered; otherwise it is only split.
    """
    return _apply(_GatherFromSequenceRegion, x, resolve_tp_group(group), tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Sums partial results over ``group`` and keeps this rank's sequence slice; the gradient is all-gathered."""
    return _apply(_ReduceScatterToSequenceRegion, x, resolve_tp_group(group))


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """Sends slice ``i`` of the first dimension to rank ``i`` (equal slices unless split sizes are given).

    The gradient takes the reverse exchange.
    """
    return _apply(_AllToAll, x, group, output_split_sizes, input_split_sizes)
