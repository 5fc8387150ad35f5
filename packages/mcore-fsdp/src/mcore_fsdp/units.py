"""The sharding units of one ``fully_shard`` call: the units of earlier calls on its submodules,
which it adopts as they are, and its new units (the module itself and the instances of
``unit_classes``) with the parameters each owns. Also the checks that keep calls composable:
bottom-up order and every parameter in exactly one unit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mcore_fsdp import ownership
from mcore_fsdp.errors import FSDPConfigError
from mcore_fsdp.flat_param_group import FlatParamGroup, GroupConfig
from mcore_fsdp.settings import ShardSettings
from mcore_fsdp.strategies import ShardingStrategy
from mcore_fsdp.topology import ShardingTopology
from mcore_fsdp.unit_state import ShardingUnit

ExpertPredicate = Callable[[str, nn.Parameter], bool]


@dataclass(frozen=True)
class UnitPlan:
    """What one call shards: ``adopted`` units of earlier calls, keyed by their path under the
    call's module, and ``new_modules`` (the module first) that become units now."""

    adopted: dict[str, ShardingUnit]
    new_modules: list[nn.Module]


def plan_units(module: nn.Module, unit_classes: tuple) -> UnitPlan:
    """Find the units a call on ``module`` adopts and creates; raise ``FSDPConfigError`` if the
    call would shard a parameter that an earlier call already sharded."""
    if ownership.unit_of_module(module) is not None:
        raise FSDPConfigError(
            f"this {type(module).__name__} is already a sharding unit (fully_shard was called on it, or "
            "unit_classes of a call on an enclosing module matched it); call fully_shard once per module"
        )
    adopted = {
        name: unit
        for name, child in module.named_modules()
        if child is not module and (unit := ownership.unit_of_module(child)) is not None
    }
    adopted_modules = {id(unit.module) for unit in adopted.values()}
    _check_no_sharded_params(module, module, "", adopted_modules)
    return UnitPlan(adopted, [module, *_class_units(module, unit_classes, adopted_modules)])


def _check_no_sharded_params(call_module: nn.Module, module: nn.Module, prefix: str, skip: set[int]) -> None:
    for name, param in module._parameters.items():
        if isinstance(param, DTensor):
            raise FSDPConfigError(
                f"parameter {prefix + name!r} is a DTensor, already sharded by another implementation "
                "(e.g. torch.distributed.fsdp.fully_shard): shard the whole model with one of them"
            )
        owner = ownership.owner(param) if param is not None else None
        if owner is None:
            continue
        sharded = owner.module_class.__name__
        if any(each is call_module for each in owner.module.modules()):
            raise FSDPConfigError(
                f"parameter {prefix + name!r} already belongs to the sharded enclosing {sharded}: call "
                "fully_shard bottom-up, on submodules before the modules that contain them"
            )
        raise FSDPConfigError(
            f"parameter {prefix + name!r} is shared with the already sharded {sharded} (tied weights "
            "across units): a parameter must belong to one unit; shard the module that holds all its "
            "uses, or tie it within one unit"
        )
    for child_name, child in module._modules.items():
        if child is not None and id(child) not in skip:
            _check_no_sharded_params(call_module, child, f"{prefix}{child_name}.", skip)


def _class_units(root: nn.Module, unit_classes: tuple, adopted_modules: set[int]) -> list[nn.Module]:
    """Instances of ``unit_classes`` under ``root`` that are not units yet."""
    names = {cls for cls in unit_classes if isinstance(cls, str)}
    types = tuple(cls for cls in unit_classes if isinstance(cls, type))
    inside_adopted = {
        id(inner)
        for module in root.modules()
        if id(module) in adopted_modules
        for inner in module.modules()
        if inner is not module
    }
    found, matched = [], False
    for name, module in root.named_modules():
        cls = _original_class(module)
        if module is root or not (issubclass(cls, types) or cls.__name__ in names):
            continue
        matched = True
        if id(module) in inside_adopted:
            raise FSDPConfigError(
                f"unit_classes matches {name!r} ({cls.__name__}) inside a module that an earlier "
                "fully_shard call sharded: a unit cannot be carved out of an already sharded one"
            )
        if id(module) not in adopted_modules:
            found.append(module)
    if unit_classes and not matched:
        present = sorted({_original_class(module).__name__ for module in root.modules()})
        wanted = [cls if isinstance(cls, str) else cls.__name__ for cls in unit_classes]
        raise FSDPConfigError(
            f"unit_classes {wanted} match no submodule of {type(root).__name__}; "
            f"module classes present: {present[:20]}"
        )
    return found


def _original_class(module: nn.Module) -> type:
    unit = ownership.unit_of_module(module)
    return type(module) if unit is None else unit.module_class


def check_unit_classes(unit_classes) -> tuple:
    """``unit_classes`` as a tuple of module types and class names."""
    if isinstance(unit_classes, (type, str)):
        unit_classes = (unit_classes,)
    unit_classes = tuple(unit_classes)
    for cls in unit_classes:
        if not (isinstance(cls, str) or (isinstance(cls, type) and issubclass(cls, nn.Module))):
            raise FSDPConfigError(f"unit_classes must hold nn.Module subclasses or class names; got {cls!r}")
    return unit_classes


def _owned_params(root: nn.Module, plan: UnitPlan) -> dict[int, list]:
    """Map each new unit (by module id) to ``[(param, owners, fqns)]`` it owns; adopted units'
    subtrees are skipped.

    A parameter registered in several new units (tied weights across units) belongs to the
    root, which stays gathered through forward and backward.
    """
    unit_ids = {id(module) for module in plan.new_modules}
    skip = {id(unit.module) for unit in plan.adopted.values()}
    owner_unit: dict[int, int] = {}
    entries: dict[int, tuple[nn.Parameter, list, list]] = {}

    def visit(module: nn.Module, prefix: str, unit_id: int) -> None:
        for name, param in module._parameters.items():
            if param is None:
                continue
            param_id = id(param)
            if param_id not in entries:
                entries[param_id] = (param, [], [])
                owner_unit[param_id] = unit_id
            elif owner_unit[param_id] != unit_id:
                owner_unit[param_id] = id(root)
            if (module, name) not in entries[param_id][1]:
                entries[param_id][1].append((module, name))
                entries[param_id][2].append(prefix + name)
        for child_name, child in module._modules.items():
            if child is not None and id(child) not in skip:
                visit(child, f"{prefix}{child_name}.", id(child) if id(child) in unit_ids else unit_id)

    visit(root, "", id(root))
    owned: dict[int, list] = {module_id: [] for module_id in unit_ids}
    for param_id, (param, owners, fqns) in entries.items():
        owned[owner_unit[param_id]].append((param, tuple(owners), tuple(fqns)))
    return owned


@dataclass(frozen=True)
class Topologies:
    """Where the new units' parameters shard: ``dense`` for most, ``expert`` for those the
    ``expert_parameters`` predicate (names relative to the call's module) marks, whose gradient
    sum is divided by ``expert_divide_factor`` (``None``: the expert mesh's size)."""

    dense: ShardingTopology
    expert: ShardingTopology | None = None
    expert_parameters: ExpertPredicate | None = None
    expert_divide_factor: float | None = None


def build_units(
    root: nn.Module,
    plan: UnitPlan,
    settings: ShardSettings,
    topologies: Topologies,
    reshard_after_forward: bool | None,
) -> list[ShardingUnit]:
    """Shard the new units' parameters into flat groups and register the main shards on the
    modules; return the new units (root first)."""
    owned = _owned_params(root, plan)
    units = []
    for module in plan.new_modules:
        families: dict[tuple, list] = {}
        for entry in owned[id(module)]:
            param, _, fqns = entry
            is_expert = topologies.expert_parameters is not None and topologies.expert_parameters(
                fqns[0], param
            )
            families.setdefault((param.dtype, is_expert), []).append(entry)
        groups = [
            FlatParamGroup(entries, _group_config(settings, topologies, dtype, is_expert))
            for (dtype, is_expert), entries in families.items()
        ]
        units.append(ShardingUnit(module, groups, settings, reshard_after_forward))
    for unit in units:
        unit.expose(unsharded=False)
        ownership.record(unit)
    return units


def _group_config(
    settings: ShardSettings, topologies: Topologies, dtype: torch.dtype, is_expert: bool
) -> GroupConfig:
    precision = settings.precision
    compute = precision.param_dtype or dtype
    family = topologies.expert if is_expert else topologies.dense
    divisor = family.shard_size * family.replicate_size
    if is_expert and topologies.expert_divide_factor is not None:
        divisor = topologies.expert_divide_factor
    return GroupConfig(
        topology=family,
        strategy=settings.strategy,
        outer_optim=settings.outer_strategy is ShardingStrategy.OPTIM and family.replicate_group is not None,
        compute_dtype=compute,
        reduce_dtype=precision.reduce_dtype or compute,
        fp32_accumulate_reduce_scatter=precision.fp32_accumulate_reduce_scatter,
        offload=settings.offload_optimizer,
        grad_divisor=divisor,
        expert=is_expert,
    )


def in_tree_order(root: nn.Module, units: list[ShardingUnit]) -> list[ShardingUnit]:
    """``units`` ordered as their modules appear in ``root.modules()`` (the root first)."""
    by_module = {id(unit.module): unit for unit in units}
    return [by_module[id(module)] for module in root.modules() if id(module) in by_module]
