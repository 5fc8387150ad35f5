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
    *,
    stride: int = 1,
) -> torch.nn.Parameter:
    """This rank's slice along ``partition_dim`` of a full ``shape`` tensor initialised by ``init_method``.

    The full tensor is drawn on the CPU from the default generator, so every rank seeded alike gets
    slices of one master tensor and the model matches a single-process one for any TP size.
    With ``stride`` > 1 the master is ``stride`` equal blocks along ``partition_dim`` (a gated
    fc1's ``[gate; up]``: 2) and the rank holds its slice of each block, in block order.
    The parameter is tagged ``tensor_model_parallel = True``, ``partition_dim`` and
    ``partition_stride``.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride must be a positive int, got {stride!r}")
    if shape[partition_dim] % (stride * world_size):
        raise ValueError(
            f"dimension {partition_dim} of {tuple(shape)} must be divisible by stride ({stride}) x the "
            f"tensor-parallel size ({world_size})"
        )
    master = torch.empty(shape, dtype=torch.float32)
    init_method(master)
    blocks = master.chunk(stride, dim=partition_dim)
    shard = torch.cat([block.chunk(world_size, dim=partition_dim)[rank] for block in blocks], partition_dim)
    param = torch.nn.Parameter(shard.to(device=device, dtype=dtype).contiguous())
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride
    return param


def check_divisible(name: str, value: int, world_size: int) -> int:
    """``value // world_size``; raises ``ValueError`` naming ``name`` when it does not divide."""
    if value % world_size:
        raise ValueError(f"{name} ({value}) must be divisible by the tensor-parallel size ({world_size})")
    return value // world_size
