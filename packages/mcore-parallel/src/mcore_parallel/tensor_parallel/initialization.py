"""Parameters of tensor-parallel layers: initialised as a full master tensor, then sharded."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from mcore_api import internal_api

InitMethod = Callable[[torch.Tensor], object]

default_init_method: InitMethod = partial(torch.nn.init.normal_, mean=0.0, std=0.02)
"""Normal(0, 0.02), the usual transformer initialisation."""


@internal_api
def sharded_parameter(
    shape: tuple[int, ...],
    partition_dim: int,
    group: dist.ProcessGroup,
    init_method: InitMethod,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> torch.nn.Parameter:
    """This rank's slice along ``partition_dim`` of a full ``shape`` tensor initialised by ``init_method``.

    The full tensor is drawn on the CPU from the default generator, so every rank seeded alike gets
    slices of one master tensor and the model matches a single-process one for any TP size.
    The parameter is tagged ``tensor_model_parallel = True`` and ``partition_dim``.
    """
    master = torch.empty(shape, dtype=torch.float32)
    init_method(master)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = master.chunk(world_size, dim=partition_dim)[rank]
    param = torch.nn.Parameter(shard.to(device=device, dtype=dtype).contiguous())
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    return param


def check_divisible(name: str, value: int, world_size: int) -> int:
    """``value // world_size``; raises ``ValueError`` naming ``name`` when it does not divide."""
    if value % world_size:
        raise ValueError(f"{name} ({value}) must be divisible by the tensor-parallel size ({world_size})")
    return value // world_size
