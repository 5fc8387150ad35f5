"""Tensor-parallel sharding of a tensor made of unequal blocks stacked along dim 0.

Mamba's ``in_proj`` rows are ``[z; x; B; C; dt]`` and its conv channels ``[x; B; C]``: blocks of
different sizes, each split over the tensor-parallel ranks. Rank ``r`` holds
``[its slice of block 0; its slice of block 1; ...]``. Such parameters are tagged
``partition_blocks`` (the full block sizes) besides ``tensor_model_parallel`` and ``partition_dim``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from mcore_api import experimental_api

InitMethod = Callable[[torch.Tensor], object]


@experimental_api
def blockwise_shard(
    full: torch.Tensor, block_sizes: Sequence[int], rank: int, world_size: int
) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full``: its ``1 / world_size`` slice of each block, in block order."""
    _check_blocks(full, block_sizes, world_size)
    blocks = full.split(list(block_sizes), dim=0)
    return torch.cat([block.chunk(world_size, dim=0)[rank] for block in blocks], dim=0)


@experimental_api
def blockwise_unshard(shards: Sequence[torch.Tensor], block_sizes: Sequence[int]) -> torch.Tensor:
    """The full tensor from every rank's shard (rank order); the inverse of :func:`blockwise_shard`."""
    world_size = len(shards)
    local_sizes = [size // world_size for size in block_sizes]
    pieces = [shard.split(local_sizes, dim=0) for shard in shards]
    return torch.cat([pieces[rank][i] for i in range(len(block_sizes)) for rank in range(world_size)], dim=0)


def blockwise_init(init_method: InitMethod, block_sizes: Sequence[int], world_size: int) -> InitMethod:
    """An init method for a layer that splits its master contiguously over ``world_size`` ranks
    (``sharded_parameter``, ``ColumnParallelLinear``): it draws the master with ``init_method`` in
    block order, then arranges it rank by rank, so that rank ``r``'s contiguous slice is its
    :func:`blockwise_shard`. The draw does not depend on ``world_size``."""

    def init(master: torch.Tensor) -> None:
        drawn = torch.empty_like(master)
        init_method(drawn)
        with torch.no_grad():
            master.copy_(
                torch.cat([blockwise_shard(drawn, block_sizes, r, world_size) for r in range(world_size)])
            )

    return init


def _check_blocks(full: torch.Tensor, block_sizes: Sequence[int], world_size: int) -> None:
    if sum(block_sizes) != full.shape[0] or any(size % world_size for size in block_sizes):
        raise ValueError(
            f"block sizes {list(block_sizes)} must add up to dim 0 of the tensor ({full.shape[0]}) and "
            f"each be divisible by the tensor-parallel size ({world_size})"
        )
