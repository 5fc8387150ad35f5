"""State dicts of a sharded model: DTensors for ``torch.distributed.checkpoint`` (any topology
can load what any other saved), gathered full tensors for export, and loading of either.

The flat buffers shard the concatenation of a unit's parameters, which no DTensor placement
describes; a state dict therefore re-lays each parameter out as ``Shard(0)`` over the shard mesh
dimension (``torch.chunk`` rows), with one all-gather per flat group.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from mcore_fsdp.errors import CheckpointMismatchError
from mcore_fsdp.flat_param_group import FlatParamGroup, ParamSlot


class LoadResult(NamedTuple):
    """Keys ignored by a non-strict ``load_state_dict``."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def model_groups(module: nn.Module) -> list[FlatParamGroup]:
    """The flat groups of a sharded model; expert groups are refused (not checkpointable yet)."""
    groups = module._fsdp_state.groups
    experts = [slot.fqns[0] for group in groups if group.config.expert for slot in group.slots]
    if experts:
        raise NotImplementedError(
            f"state dicts of expert parameters (e.g. {experts[0]!r}) are not supported yet: expert-parallel "
            "ranks hold different experts under the same name"
        )
    return groups


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


def to_dtensor(group: FlatParamGroup, slot: ParamSlot, full_param: torch.Tensor) -> DTensor:
    """This rank's ``Shard(0)`` rows (or a replica) of a gathered parameter, as a DTensor."""
    topology = group.config.topology
    sharded = group.config.strategy.shards_main_params and len(slot.shape) > 0
    if sharded:
        rows, shards = slot.shape[0], topology.shard_size
        per_rank = -(-rows // shards)
        start = min(topology.shard_rank * per_rank, rows)
        local = full_param[start : min(start + per_rank, rows)]
    else:
        local = full_param
    placement = Shard(0) if sharded else Replicate()
    placements = [Replicate(), placement] if topology.mesh.ndim == 2 else [placement]
    return DTensor.from_local(
        local.clone(), topology.mesh, placements, shape=slot.shape, stride=_contiguous_stride(slot.shape)
    )


def _full_params(group: FlatParamGroup, owned: torch.Tensor):
    full = group.gather_full(owned)
    for slot in group.slots:
        yield slot, full[slot.offset : slot.offset + slot.numel].view(slot.shape)


def sharded_state_dict(
    module: nn.Module, base: dict[str, torch.Tensor], prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Replace the parameter entries of ``base`` (``nn.Module.state_dict``) with DTensors."""
    for group in model_groups(module):
        for slot, full_param in _full_params(group, group.main):
            value = to_dtensor(group, slot, full_param)
            for fqn in slot.fqns:
                if prefix + fqn in base:
                    base[prefix + fqn] = value
    return base


def full_state_dict(
    module: nn.Module, base: dict[str, torch.Tensor], cpu: bool = True
) -> dict[str, torch.Tensor]:
    """Replace the parameter entries of ``base`` with gathered full FP32 tensors."""
    for group in model_groups(module):
        for slot, full_param in _full_params(group, group.main):
            value = full_param.clone()
            for fqn in slot.fqns:
                if fqn in base:
                    base[fqn] = value
    return {key: value.detach().cpu() if cpu else value.detach() for key, value in base.items()}


def load_state_dict(
    module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True
) -> LoadResult:
    """Load DTensors of any sharding, or full tensors, into main parameters; buffers as usual.

    Every key and global shape is checked before any communication.
    """
    groups = model_groups(module)
    slots = {fqn: slot for group in groups for slot in group.slots for fqn in slot.fqns}
    buffer_keys = set(nn.Module.state_dict(module)) - set(slots)
    expected = set(slots) | buffer_keys
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    # A tied parameter is loaded from whichever of its names is present.
    missing_params = [
        fqn for fqn in missing if fqn in slots and not any(n in state_dict for n in slots[fqn].fqns)
    ]
    if strict and (unexpected or missing_params or [key for key in missing if key in buffer_keys]):
        raise CheckpointMismatchError(
            f"state dict does not match the model: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}"
        )
    if missing_params:
        raise CheckpointMismatchError(f"state dict lacks parameters {missing_params[:10]}")
    wrong = [
        f"{fqn}: checkpoint {tuple(state_dict[fqn].shape)} vs model {tuple(slot.shape)}"
        for fqn, slot in slots.items()
        if fqn in state_dict and tuple(state_dict[fqn].shape) != tuple(slot.shape)
    ]
    if wrong:
        raise CheckpointMismatchError(f"state dict shapes do not match the model: {wrong[:10]}")

    with torch.no_grad():
        for group in groups:
            for slot in group.slots:
                value = next(state_dict[fqn] for fqn in slot.fqns if fqn in state_dict)
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                piece = value.reshape(-1)[slot.local_start : slot.local_stop]
                group.main[group.main_range(slot)].copy_(piece)
    buffers = {key: state_dict[key] for key in buffer_keys if key in state_dict}
    nn.Module.load_state_dict(module, buffers, strict=False)
    return LoadResult(missing, unexpected)
