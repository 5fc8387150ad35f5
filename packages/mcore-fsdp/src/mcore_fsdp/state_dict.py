"""State dicts of a sharded model: DTensors for ``torch.distributed.checkpoint`` (any topology
can load what any other saved), gathered full tensors for export, and loading of either.

The flat buffers shard the concatenation of a unit's parameters, which no DTensor placement
describes; a state dict therefore re-lays each parameter out as ``Shard(0)`` over the shard mesh
dimension (``torch.chunk`` rows), with one all-gather per flat group. Expert parameters' DTensors
live on the expert mesh.
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


def named_slots(module: nn.Module) -> dict[str, tuple[FlatParamGroup, ParamSlot]]:
    """Every name a sharded parameter is registered under in ``module`` (relative to it, in
    ``state_dict`` order), with its flat group and slot."""
    owned: dict[int, list] = {}
    for group in module._fsdp_state.groups:
        for slot in group.slots:
            for owner, attribute in slot.owners:
                owned.setdefault(id(owner), []).append((attribute, group, slot))
    named = {}
    for path, submodule in module.named_modules(remove_duplicate=False):
        for attribute, group, slot in owned.get(id(submodule), ()):
            named[f"{path}.{attribute}" if path else attribute] = (group, slot)
    return named


def names_by_slot(named: dict[str, tuple[FlatParamGroup, ParamSlot]]) -> dict[int, list[str]]:
    """The names of each slot (by ``id``), in ``named``'s order."""
    names: dict[int, list[str]] = {}
    for name, (_, slot) in named.items():
        names.setdefault(id(slot), []).append(name)
    return names


def model_groups(named: dict[str, tuple[FlatParamGroup, ParamSlot]]) -> list[FlatParamGroup]:
    """The flat groups with a parameter in ``named``, each once, in order."""
    return list({id(group): group for group, _ in named.values()}.values())


def plain_state_dict(module: nn.Module, **kwargs) -> dict[str, torch.Tensor]:
    """``nn.Module.state_dict`` of a sharded module: main shards as registered (units below it
    leave theirs alone too)."""
    state = module._fsdp_state
    previous, state.collecting_state_dict = state.collecting_state_dict, True
    try:
        return nn.Module.state_dict(module, **kwargs)
    finally:
        state.collecting_state_dict = previous


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


def _replace_params(module: nn.Module, base: dict, prefix: str, convert) -> dict[str, torch.Tensor]:
    """Set every parameter entry of ``base`` to ``convert(group, slot, gathered parameter)``."""
    named = named_slots(module)
    names = names_by_slot(named)
    for group in model_groups(named):
        for slot, full_param in _full_params(group, group.main):
            value = convert(group, slot, full_param)
            for name in names.get(id(slot), ()):
                if prefix + name in base:
                    base[prefix + name] = value
    return base


def sharded_state_dict(
    module: nn.Module, base: dict[str, torch.Tensor], prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Replace the parameter entries of ``base`` (``plain_state_dict``) with DTensors."""
    return _replace_params(module, base, prefix, to_dtensor)


def full_state_dict(
    module: nn.Module, base: dict[str, torch.Tensor], cpu: bool = True
) -> dict[str, torch.Tensor]:
    """Replace the parameter entries of ``base`` with gathered full FP32 tensors."""
    _replace_params(module, base, "", lambda group, slot, full_param: full_param.clone())
    return {key: value.detach().cpu() if cpu else value.detach() for key, value in base.items()}


def load_state_dict(
    module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True
) -> LoadResult:
    """Load DTensors of any sharding, or full tensors, into main parameters; buffers as usual.

    Every key and global shape is checked before any communication.
    """
    named = named_slots(module)
    names = names_by_slot(named)
    slots = {name: slot for name, (_, slot) in named.items()}
    buffer_keys = set(plain_state_dict(module)) - set(slots)
    expected = set(slots) | buffer_keys
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    # A tied parameter is loaded from whichever of its names is present.
    missing_params = [
        name for name in missing if name in slots and not any(n in state_dict for n in names[id(slots[name])])
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
        for group in model_groups(named):
            for slot in group.slots:
                if id(slot) not in names:  # tied to a parameter registered outside ``module``
                    continue
                value = next(state_dict[name] for name in names[id(slot)] if name in state_dict)
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                piece = value.reshape(-1)[slot.local_start : slot.local_stop]
                group.main[group.main_range(slot)].copy_(piece)
    buffers = {key: state_dict[key] for key in buffer_keys if key in state_dict}
    nn.Module.load_state_dict(module, buffers, strict=False)
    return LoadResult(missing, unexpected)
