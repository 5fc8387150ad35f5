"""Checkpoint entries of experts split over expert-tensor-parallel ranks: saved whole (the slices
gathered over the group), so a checkpoint holds the same tensors at any expert-TP size; loading
reads the whole tensors and cuts each rank's slice back into the parameters and optimizer states."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..transformer.moe.expert_sharding import EXPERT_TP_DIM, gather_slices, shard


@dataclass
class SliceBack:
    """A whole tensor a load fills, and the slice of it that goes back into ``target``."""

    whole: torch.Tensor
    target: torch.Tensor
    param: torch.Tensor
    group: dist.ProcessGroup


def whole_expert_tensor(
    tensor: torch.Tensor, param: torch.Tensor, group: dist.ProcessGroup, slice_back: list[SliceBack] | None
) -> torch.Tensor:
    """``tensor`` (``param``'s slice, or a state of it) gathered whole over ``group`` (collective);
    with ``slice_back``, a load into the result is remembered for ``copy_slices_back``."""
    whole = gather_slices(tensor, param, group)
    if slice_back is not None:
        slice_back.append(SliceBack(whole, tensor, param, group))
    return whole


def copy_slices_back(slice_back: list[SliceBack]) -> None:
    """Each rank's slice of the loaded whole tensors into the parameters and states they came from."""
    with torch.no_grad():
        for entry in slice_back:
            dim, gated = getattr(entry.param, EXPERT_TP_DIM), getattr(entry.param, "gated_halves", False)
            rank, size = dist.get_rank(entry.group), dist.get_world_size(entry.group)
            entry.target.copy_(shard(entry.whole, dim, rank, size, gated))
