"""Which sharding unit owns each parameter object ``fully_shard`` manages (its main and its
gathered form), so a later call can tell parameters that are already sharded from new ones."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from mcore_fsdp.unit_state import ShardingUnit

_UNIT_OF_PARAM = WeakIdKeyDictionary()


def record(unit: ShardingUnit) -> None:
    """Mark the main and gathered parameters of ``unit``'s groups as owned by it."""
    for group in unit.groups:
        for param in [*group.main_params, *group.unsharded_params]:
            _UNIT_OF_PARAM[param] = unit


def owner(param: nn.Parameter) -> ShardingUnit | None:
    """The unit that owns ``param``, or ``None`` if no ``fully_shard`` call sharded it."""
    return _UNIT_OF_PARAM.get(param)


def unit_of_module(module: nn.Module) -> ShardingUnit | None:
    """The unit ``module`` is, if ``fully_shard`` made it one."""
    return module.__dict__.get("_fsdp_unit")
