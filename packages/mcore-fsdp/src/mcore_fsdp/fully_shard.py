"""``fully_shard``: turn any ``nn.Module`` into a fully sharded data-parallel one, in place."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from mcore_fsdp import grad_norm
from mcore_fsdp import state_dict as checkpointing
from mcore_fsdp.errors import FSDPConfigError
from mcore_fsdp.flat_param_group import FlatParamGroup, GroupConfig
from mcore_fsdp.precision import MixedPrecision
from mcore_fsdp.strategies import OUTER_STRATEGIES, ShardingStrategy
from mcore_fsdp.topology import MeshLike, check_mesh, resolve_topology
from mcore_fsdp.unit_state import ShardingState, ShardingUnit

__all__ = ["FSDPModule", "fully_shard"]

ExpertPredicate = Callable[[str, nn.Parameter], bool]


class FSDPModule:
    """Methods a module gains from ``fully_shard`` (mixed into its class)."""

    _fsdp_state: ShardingState

    def unshard(self) -> None:
        """Gather every unit's full parameters and register them on the modules."""
        for unit in self._fsdp_state.units:
            unit.unshard(async_op=True)
        for unit in self._fsdp_state.units:
            unit.unshard()
            unit.expose(unsharded=True)

    def reshard(self) -> None:
        """Free the gathered parameters (where the strategy shards them); register main shards."""
        for unit in self._fsdp_state.units:
            unit.reshard()

    def set_requires_gradient_sync(self, requires_sync: bool) -> None:
        """Reduce gradients in the coming backwards (``True``), or accumulate them locally."""
        self._fsdp_state.sync_grads = bool(requires_sync)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in the backwards run inside this block (no communication)."""
        previous = self._fsdp_state.sync_grads
        self._fsdp_state.sync_grads = False
        try:
            yield
        finally:
            self._fsdp_state.sync_grads = previous

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale main gradients so their global norm is at most ``max_norm``; return the norm."""
        return grad_norm.clip_grad_norm_(self._fsdp_state.groups, max_norm, norm_type)

    def state_dict(
        self, *, destination=None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, torch.Tensor]:
        """Parameters as DTensors sharded along dim 0 (for ``torch.distributed.checkpoint``),
        buffers as plain tensors; same keys and global shapes as the unsharded model."""
        base = nn.Module.state_dict(self, destination=destination, prefix=prefix, keep_vars=keep_vars)
        return checkpointing.sharded_state_dict(self, base, prefix)

    def full_state_dict(self, cpu: bool = True) -> dict[str, torch.Tensor]:
        """Gathered, unsharded FP32 parameters and buffers, for export (a collective: all ranks call it)."""
        return checkpointing.full_state_dict(self, nn.Module.state_dict(self), cpu=cpu)

    def load_state_dict(self, state_dict, strict: bool = True) -> checkpointing.LoadResult:
        """Load DTensor (any sharding) or full tensors into the main parameters and buffers.

        Keys and global shapes are checked before any communication; a mismatch raises
        ``CheckpointMismatchError``.
        """
        return checkpointing.load_state_dict(self, state_dict, strict=strict)


def _units_of(root: nn.Module, unit_classes: tuple) -> list[nn.Module]:
    names = {cls for cls in unit_classes if isinstance(cls, str)}
    types = tuple(cls for cls in unit_classes if isinstance(cls, type))
    found = [
        module
        for module in root.modules()
        if module is not root and (isinstance(module, types) or type(module).__name__ in names)
    ]
    if unit_classes and not found:
        present = sorted({type(module).__name__ for module in root.modules()})
        wanted = [cls if isinstance(cls, str) else cls.__name__ for cls in unit_classes]
        raise FSDPConfigError(
            f"unit_classes {wanted} match no submodule of {type(root).__name__}; "
            f"module classes present: {present[:20]}"
        )
    return found


def _check_unit_classes(unit_classes) -> tuple:
    if isinstance(unit_classes, (type, str)):
        unit_classes = (unit_classes,)
    unit_classes = tuple(unit_classes)
    for cls in unit_classes:
        if not (isinstance(cls, str) or (isinstance(cls, type) and issubclass(cls, nn.Module))):
            raise FSDPConfigError(f"unit_classes must hold nn.Module subclasses or class names; got {cls!r}")
    return unit_classes


def _owned_params(root: nn.Module, unit_modules: list[nn.Module]) -> dict[int, list]:
    """Map each unit (by module id, root included) to ``[(param, owners, fqns)]`` it owns.

    A parameter registered in several units (tied weights across units) belongs to the root,
    which stays gathered through forward and backward.
    """
    unit_ids = {id(module) for module in unit_modules}
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
            if child is not None:
                visit(child, f"{prefix}{child_name}.", id(child) if id(child) in unit_ids else unit_id)

    visit(root, "", id(root))
    owned: dict[int, list] = {id(module): [] for module in [root, *unit_modules]}
    for param_id, (param, owners, fqns) in entries.items():
        owned[owner_unit[param_id]].append((param, tuple(owners), tuple(fqns)))
    return owned


def fully_shard(
    module: nn.Module,
    *,
    mesh: MeshLike = None,
    unit_classes: Iterable[type[nn.Module] | str] | type[nn.Module] | str = (),
    strategy: ShardingStrategy | str = ShardingStrategy.OPTIM_GRADS_PARAMS,
    outer_strategy: ShardingStrategy | str = ShardingStrategy.NO_SHARD,
    precision: MixedPrecision | None = None,
    expert_parameters: ExpertPredicate | None = None,
    expert_mesh: MeshLike = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    offload_optimizer: bool = False,
    prefetch: bool = True,
) -> nn.Module:
    """Shard ``module`` in place for data parallelism and return it.

    Each instance of ``unit_classes`` (types or class names) becomes a sharding unit whose
    parameters are gathered together; the remaining parameters form the root unit. Afterwards
    ``module.parameters()`` are the FP32 main-parameter shards: build any ``torch.optim``
    optimizer on them, and call ``loss.backward()``/``optimizer.step()`` as usual.

    Args:
        mesh: ``None`` (the default group), a ``ProcessGroup``, a 1-D ``DeviceMesh`` to shard
            over, a 2-D ``(replicate, shard)`` mesh for hybrid sharding, or a shape tuple whose
            product is the world size.
        strategy: what is sharded across the shard dimension, see ``ShardingStrategy``.
        outer_strategy: across the replicate dimension of a 2-D mesh, ``"no_shard"`` or
            ``"optim"`` (the latter only with ``strategy="optim_grads_params"``).
        precision: compute and gradient-communication dtypes; main parameters are FP32.
        expert_parameters: ``(name, param) -> bool`` marking expert parameters; they shard over
            ``expert_mesh`` (the expert-data-parallel group), the rest over ``mesh``.
        init_fn: materializes parameters created on the ``meta`` device, called with ``module``.
        offload_optimizer: keep main parameters, main gradients (and so optimizer state) on CPU.
        prefetch: issue the next unit's all-gather early, in forward and in backward.

    Raises:
        FSDPConfigError: bad arguments, detected before any collective is issued.
    """
    strategy = ShardingStrategy.parse(strategy, "strategy")
    outer = ShardingStrategy.parse(outer_strategy, "outer_strategy")
    if outer not in OUTER_STRATEGIES:
        raise FSDPConfigError(f"outer_strategy must be 'no_shard' or 'optim'; got {outer.value!r}")
    if outer is ShardingStrategy.OPTIM and strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise FSDPConfigError(
            f"outer_strategy='optim' requires strategy='optim_grads_params'; got strategy={strategy.value!r}"
        )
    precision = precision or MixedPrecision()
    if not isinstance(precision, MixedPrecision):
        raise FSDPConfigError(f"precision must be a MixedPrecision or None; got {type(precision).__name__}")
    if isinstance(module, FSDPModule):
        raise FSDPConfigError("module is already sharded by fully_shard")
    if (expert_parameters is None) != (expert_mesh is None):
        raise FSDPConfigError("expert_parameters and expert_mesh must be given together")
    unit_modules = _units_of(module, _check_unit_classes(unit_classes))
    if init_fn is None:
        meta = [name for name, param in module.named_parameters() if param.is_meta]
        if meta:
            raise FSDPConfigError(
                f"{len(meta)} parameters are on the meta device (first: {meta[0]!r}); pass init_fn "
                "to materialize them, e.g. init_fn=lambda m: (m.to_empty(device=...), m.reset_parameters())"
            )
    mesh_dims = check_mesh(mesh, "mesh")
    if outer is ShardingStrategy.OPTIM and mesh_dims != 2:
        raise FSDPConfigError(
            f"outer_strategy='optim' needs a 2-D (replicate, shard) mesh; got {mesh_dims}-D"
        )
    if expert_mesh is not None and check_mesh(expert_mesh, "expert_mesh") != 1:
        raise FSDPConfigError("expert_mesh must be 1-D: the expert-data-parallel group")
    topology = resolve_topology(mesh)
    expert_topology = resolve_topology(expert_mesh) if expert_mesh is not None else None

    if init_fn is not None:
        init_fn(module)
        meta = [name for name, param in module.named_parameters() if param.is_meta]
        if meta:
            raise FSDPConfigError(
                f"init_fn left {len(meta)} parameters on the meta device (first: {meta[0]!r})"
            )

    def group_config(dtype: torch.dtype, is_expert: bool) -> GroupConfig:
        compute = precision.param_dtype or dtype
        family = expert_topology if is_expert else topology
        return GroupConfig(
            topology=family,
            strategy=strategy,
            outer_optim=outer is ShardingStrategy.OPTIM and family.replicate_group is not None,
            compute_dtype=compute,
            reduce_dtype=precision.reduce_dtype or compute,
            fp32_accumulate_reduce_scatter=precision.fp32_accumulate_reduce_scatter,
            offload=offload_optimizer,
            grad_divisor=family.shard_size * family.replicate_size,
            expert=is_expert,
        )

    owned = _owned_params(module, unit_modules)
    units = []
    for unit_module in [module, *unit_modules]:
        families: dict[tuple, list] = {}
        for entry in owned[id(unit_module)]:
            param, _, fqns = entry
            is_expert = expert_parameters is not None and expert_parameters(fqns[0], param)
            families.setdefault((param.dtype, is_expert), []).append(entry)
        groups = [
            FlatParamGroup(entries, group_config(dtype, is_expert))
            for (dtype, is_expert), entries in families.items()
        ]
        units.append(ShardingUnit(unit_module, groups, is_root=unit_module is module))
    for unit in units:
        unit.expose(unsharded=False)
    for name, buffer in list(module.named_buffers()):
        if buffer.device != topology.device and not buffer.is_meta:
            owner, _, attribute = name.rpartition(".")
            module.get_submodule(owner)._buffers[attribute] = buffer.to(topology.device)

    state = ShardingState(units, precision.param_dtype if precision.cast_forward_inputs else None, prefetch)
    module.__class__ = _sharded_class(type(module))
    module._fsdp_state = state
    return module


_SHARDED_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    return _SHARDED_CLASSES[cls]
