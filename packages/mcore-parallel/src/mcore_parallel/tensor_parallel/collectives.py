"""Plain (non-autograd) collectives along a tensor dimension, shared by the autograd mappings.

They use ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and ``all_to_all_single``, which
gloo implements for every supported torch (>= 2.6) as NCCL does, so one code path serves both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import parallel_state


def resolve_tp_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group`` itself, or the global tensor-parallel group when it is ``None``."""
    return group if group is not None else parallel_state.get_tensor_model_parallel_group()


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of ``tensor`` over ``group``, in a new tensor."""
    if dist.get_world_size(group) == 1:
        return tensor
    summed = tensor.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(summed, group=group)
    return summed


def split_along_dim(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's equal slice of ``tensor`` along ``dim``."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return tensor
    if tensor.shape[dim] % world_size:
        raise ValueError(
            f"dimension {dim} of size {tensor.shape[dim]} does not split evenly over {world_size} ranks"
        )
    chunk = tensor.shape[dim] // world_size
    return tensor.narrow(dim, dist.get_rank(group) * chunk, chunk).contiguous()


def gather_along_dim(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The slices of all ranks concatenated along ``dim``, in rank order."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return tensor
    leading = tensor.movedim(dim, 0).contiguous()
    gathered = leading.new_empty((world_size * leading.shape[0], *leading.shape[1:]))
    dist.all_gather_into_tensor(gathered, leading, group=group)
    return gathered.movedim(0, dim)


def reduce_scatter_along_first_dim(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ``group`` of ``tensor``, of which this rank keeps its equal slice along dim 0."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return tensor
    if tensor.shape[0] % world_size:
        raise ValueError(
            f"dimension 0 of size {tensor.shape[0]} does not split evenly over {world_size} ranks"
        )
    out = tensor.new_empty((tensor.shape[0] // world_size, *tensor.shape[1:]))
    dist.reduce_scatter_tensor(out, tensor.contiguous(), group=group)
    return out


def all_to_all_first_dim(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
) -> torch.Tensor:
    """Exchange slices along dim 0: slice ``i`` of the input goes to rank ``i``; equal slices by default."""
    if dist.get_world_size(group) == 1:
        return tensor
    rows = tensor.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    out = tensor.new_empty((rows, *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes, input_split_sizes, group=group)
    return out
