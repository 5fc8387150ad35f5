"""Between a full (TP=1) state dict and this rank's tensor-parallel shards of a model.

Parameters tagged ``tensor_model_parallel`` are split along ``partition_dim``; those also tagged
``gated_halves`` (fc1 of gated MLPs) split each half separately so every rank holds
``[its gate rows; its up rows]``, and those tagged ``partition_blocks`` (Mamba's stacked
projections, blocks of unequal sizes along dim 0) split each block separately
(``ssm.blockwise_shard``). Everything else is replicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_api import experimental_api

from ..ssm.block_sharding import blockwise_shard, blockwise_unshard


@experimental_api
def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters (a tied one under each of its names) and persistent buffers, by
    state-dict name: the tensors a full state dict is made of."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    persistent = model.state_dict(keep_vars=True)
    tensors.update({n: b for n, b in model.named_buffers(remove_duplicate=False) if n in persistent})
    return tensors


@experimental_api
def shard_full_tensor(local: torch.Tensor, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This tensor-parallel rank's shard of ``full`` (a whole tensor) for the local parameter
    ``local``, cut as its tags say (``tensor_model_parallel``, ``partition_dim``, gated halves,
    blocks); ``full`` itself where ``local`` is not split or ``world_size`` is 1."""
    if not getattr(local, "tensor_model_parallel", False) or world_size == 1:
        return full
    dim = local.partition_dim
    if getattr(local, "gated_halves", False):
        return torch.cat([half.chunk(world_size, dim)[rank] for half in full.chunk(2, dim)], dim)
    if hasattr(local, "partition_blocks"):
        return blockwise_shard(full, local.partition_blocks, rank, world_size)
    return full.chunk(world_size, dim)[rank]


def load_full_state_dict(
    model: torch.nn.Module, full_state: dict[str, torch.Tensor], tp_group: dist.ProcessGroup
) -> None:
    """Copy this rank's shards of ``full_state`` into ``model``.

    Raises:
        KeyError: ``full_state`` lacks tensors the model has, or has ones it does not.
        ValueError: a shard's shape differs from the parameter's.
    """
    rank, world_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    tensors = state_tensors(model)
    missing = sorted(set(tensors) - set(full_state))
    unexpected = sorted(set(full_state) - set(tensors))
    if missing or unexpected:
        raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, local in tensors.items():
            shard = shard_full_tensor(local, full_state[name], rank, world_size)
            if shard.shape != local.shape:
                raise ValueError(
                    f"{name}: shard shape {tuple(shard.shape)} != parameter shape {tuple(local.shape)}"
                )
            local.copy_(shard)


@experimental_api
def gather_full_tensor(
    local: torch.Tensor, tp_group: dist.ProcessGroup, value: torch.Tensor | None = None
) -> torch.Tensor:
    """The full tensor of the local shard ``local`` (collective over ``tp_group``); with ``value``
    (a tensor of ``local``'s shape, e.g. an optimizer state of it), the full tensor of ``value``."""
    value = (local if value is None else value).detach()
    world_size = dist.get_world_size(tp_group)
    if not getattr(local, "tensor_model_parallel", False) or world_size == 1:
        return value.clone()
    dim = local.partition_dim
    pieces = [torch.empty_like(value) for _ in range(world_size)]
    dist.all_gather(pieces, value.contiguous(), group=tp_group)
    if getattr(local, "gated_halves", False):
        halves = [p.chunk(2, dim) for p in pieces]
        return torch.cat(
            [torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim
        )
    if hasattr(local, "partition_blocks"):
        return blockwise_unshard(pieces, local.partition_blocks)
    return torch.cat(pieces, dim)


def gather_full_state_dict(model: torch.nn.Module, tp_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """The TP=1 state dict of ``model`` on every rank of ``tp_group`` (collective)."""
    return {name: gather_full_tensor(t, tp_group) for name, t in state_tensors(model).items()}
