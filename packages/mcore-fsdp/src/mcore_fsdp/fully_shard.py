"""``fully_shard``: turn any ``nn.Module`` into a fully sharded data-parallel one, in place."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from mcore_fsdp import grad_norm, ownership, units
from mcore_fsdp import state_dict as checkpointing
from mcore_fsdp.errors import FSDPConfigError
from mcore_fsdp.precision import MixedPrecision
from mcore_fsdp.settings import ShardSettings
from mcore_fsdp.strategies import ShardingStrategy
from mcore_fsdp.topology import MeshLike, check_mesh, resolve_topology
from mcore_fsdp.unit_state import ShardingState, ShardingUnit
from mcore_fsdp.units import ExpertPredicate

__all__ = ["FSDPModule", "fully_shard"]


class FSDPModule:
    """Methods a module gains from ``fully_shard`` (mixed into its class).

    Every module ``fully_shard`` made a sharding unit has them. Methods with ``recurse`` act on
    this module's unit and, with ``recurse=True``, on the units below it; the others act on the
    units below it as well (the whole model when called on the root).
    """

    _fsdp_unit: ShardingUnit

    @property
    def _fsdp_state(self) -> ShardingState:
        return self._fsdp_unit.state

    def _fsdp_units(self, recurse: bool = True) -> list[ShardingUnit]:
        if not recurse:
            return [self._fsdp_unit]
        return [unit for module in self.modules() if (unit := ownership.unit_of_module(module)) is not None]

    def unshard(self, *, recurse: bool = True) -> None:
        """Gather the units' full parameters and register them on the modules."""
        chosen = self._fsdp_units(recurse)
        for unit in chosen:
            unit.unshard(async_op=True)
        for unit in chosen:
            unit.unshard()
            unit.expose(unsharded=True)

    def reshard(self, *, recurse: bool = True) -> None:
        """Free the gathered parameters (where the strategy shards them); register main shards."""
        for unit in self._fsdp_units(recurse):
            unit.reshard()

    def set_requires_gradient_sync(self, requires_sync: bool, *, recurse: bool = True) -> None:
        """Reduce the units' gradients in the coming backwards (``True``), or accumulate them locally."""
        for unit in self._fsdp_units(recurse):
            unit.sync_grads = bool(requires_sync)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in the backwards run inside this block (no communication)."""
        chosen = self._fsdp_units()
        previous = [unit.sync_grads for unit in chosen]
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for unit, value in zip(chosen, previous, strict=True):
                unit.sync_grads = value

    def set_is_last_backward(self, is_last: bool) -> None:
        """Whether the next backward is the last before the optimizer step (default ``True``).

        After a backward that is not the last, its final gradient reduction stays in flight,
        overlapping what comes next; the next forward or backward, ``clip_grad_norm_`` and any
        optimizer's ``step()`` complete it. Read ``.grad`` only after a last backward.
        """
        self._fsdp_state.is_last_backward = bool(is_last)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Free the units' gathered parameters after forward (``True``) or keep them for backward."""
        if not isinstance(reshard_after_forward, bool):
            raise FSDPConfigError(f"reshard_after_forward must be a bool; got {reshard_after_forward!r}")
        for unit in self._fsdp_units(recurse):
            unit.requested_reshard_after_forward = unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Free the units' gathered parameters after backward (``True``, default) or keep them, so
        the next forward (e.g. of the next micro-batch) gathers nothing until parameters change."""
        for unit in self._fsdp_units(recurse):
            unit.reshard_after_backward = bool(reshard_after_backward)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, copies_outside: Callable | None = None
    ) -> torch.Tensor:
        """Scale main gradients so their global norm is at most ``max_norm``; return the norm.
        ``copies_outside(param)``: how many ranks outside its mesh hold the same gradient (default 1)."""
        self._fsdp_state.finish_reductions()
        groups = [group for unit in self._fsdp_units() for group in unit.groups]
        return grad_norm.clip_grad_norm_(groups, max_norm, norm_type, copies_outside)

    def state_dict(
        self, *, destination=None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, torch.Tensor]:
        """Parameters as DTensors sharded along dim 0 (for ``torch.distributed.checkpoint``),
        buffers as plain tensors; same keys and global shapes as the unsharded model."""
        if self._fsdp_state.collecting_state_dict:  # inside an enclosing unit's state_dict
            return nn.Module.state_dict(self, destination=destination, prefix=prefix, keep_vars=keep_vars)
        base = checkpointing.plain_state_dict(
            self, destination=destination, prefix=prefix, keep_vars=keep_vars
        )
        return checkpointing.sharded_state_dict(self, base, prefix)

    def full_state_dict(self, cpu: bool = True) -> dict[str, torch.Tensor]:
        """Gathered, unsharded FP32 parameters and buffers, for export (a collective: all ranks call it)."""
        return checkpointing.full_state_dict(self, checkpointing.plain_state_dict(self), cpu=cpu)

    def load_state_dict(self, state_dict, strict: bool = True) -> checkpointing.LoadResult:
        """Load DTensor (any sharding) or full tensors into the main parameters and buffers.

        Keys and global shapes are checked before any communication; a mismatch raises
        ``CheckpointMismatchError``.
        """
        return checkpointing.load_state_dict(self, state_dict, strict=strict)


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
    expert_gradient_divide_factor: float | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    offload_optimizer: bool = False,
    prefetch: bool = True,
    reshard_after_forward: bool | None = None,
) -> nn.Module:
    """Shard ``module`` in place for data parallelism and return it.

    Like PyTorch's FSDP2, calls compose bottom-up: ``fully_shard(layer)`` for each layer, then
    ``fully_shard(model)``. Each call makes its module a sharding unit whose parameters (those
    not in a unit already) are gathered together, and adopts the units of earlier calls on its
    submodules; the last call, on the root, drives them all. ``unit_classes`` (types or class
    names) makes each matching submodule a unit in the same call. Afterwards
    ``module.parameters()`` are the FP32 main-parameter shards (the same parameter objects as
    before): build any ``torch.optim`` optimizer on them, and call ``loss.backward()`` and
    ``optimizer.step()`` as usual.

    Args:
        mesh: ``None`` (the default group), a ``ProcessGroup``, a 1-D ``DeviceMesh`` to shard
            over, a 2-D ``(replicate, shard)`` mesh for hybrid sharding, or a shape tuple whose
            product is the world size.
        strategy: what is sharded across the shard dimension, see ``ShardingStrategy``.
        outer_strategy: across the replicate dimension of a 2-D mesh, ``"no_shard"`` or
            ``"optim"`` (the latter only with ``strategy="optim_grads_params"``).
        precision: compute and gradient-communication dtypes; main parameters are FP32.
        expert_parameters: ``(name, param) -> bool`` marking expert parameters (names relative to
            ``module``); they shard over ``expert_mesh`` (the expert-data-parallel group), the
            rest over ``mesh``. Their state-dict entries are DTensors over ``expert_mesh`` under
            the model's own names: where expert-parallel ranks hold different experts under one
            name, rename them (e.g. by global expert index) before ``torch.distributed.checkpoint``.
        expert_gradient_divide_factor: what the expert gradients' sum over ``expert_mesh`` is
            divided by; ``None``: its size (an average over the ranks holding the same experts).
            With expert parallelism, whose token exchange brings every data-parallel rank's tokens
            to the experts, pass the data-parallel size (dense and expert gradients then share one
            scale, as Megatron's DDP and torchtitan's FSDP2 set it).
        init_fn: materializes parameters created on the ``meta`` device, called with ``module``.
        offload_optimizer: keep main parameters, main gradients (and so optimizer state) on CPU.
        prefetch: issue the next unit's all-gather early, in forward and in backward.
        reshard_after_forward: for the units this call creates, ``True`` frees gathered
            parameters after forward (gathered again for backward), ``False`` keeps them until
            backward ends; ``None``: ``False`` for the root, ``True`` for the others.

    Every call of one model must pass the same ``mesh`` (layout), ``strategy``,
    ``outer_strategy``, ``precision``, ``offload_optimizer`` and ``prefetch``.

    Raises:
        FSDPConfigError: bad arguments or an impossible composition (a module sharded twice, a
            submodule sharded after an enclosing module, a parameter shared across units of
            separate calls, arguments that differ from an adopted call's, parameters that are
            DTensors already), detected before any collective is issued. A forward of sharded
            layers inside a module with trainable parameters no call manages (a forgotten
            root call) raises it too.
    """
    if not isinstance(module, nn.Module):
        raise FSDPConfigError(f"module must be an nn.Module; got {type(module).__name__}")
    settings = ShardSettings.parse(mesh, strategy, outer_strategy, precision, offload_optimizer, prefetch)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise FSDPConfigError(
            f"reshard_after_forward must be True, False or None; got {reshard_after_forward!r} (an int, "
            "FSDP2's resharding to a smaller group after forward, is not supported)"
        )
    if (expert_parameters is None) != (expert_mesh is None):
        raise FSDPConfigError("expert_parameters and expert_mesh must be given together")
    _check_divide_factor(expert_gradient_divide_factor, expert_mesh)
    plan = units.plan_units(module, units.check_unit_classes(unit_classes))
    for name, unit in plan.adopted.items():
        settings.check_same_as(unit.settings, f"{name!r} ({unit.module_class.__name__})")
    _check_meta(module, init_fn, plan)
    if expert_mesh is not None and check_mesh(expert_mesh, "expert_mesh") != 1:
        raise FSDPConfigError("expert_mesh must be 1-D: the expert-data-parallel group")
    topologies = units.Topologies(
        resolve_topology(mesh),
        resolve_topology(expert_mesh) if expert_mesh is not None else None,
        expert_parameters,
        expert_gradient_divide_factor,
    )
    if init_fn is not None:
        init_fn(module)
        meta = [name for name, param in module.named_parameters() if param.is_meta]
        if meta:
            raise FSDPConfigError(
                f"init_fn left {len(meta)} parameters on the meta device (first: {meta[0]!r})"
            )

    new_units = units.build_units(module, plan, settings, topologies, reshard_after_forward)
    _move_buffers(module, topologies.dense.device)
    ShardingState(units.in_tree_order(module, [*new_units, *plan.adopted.values()]))
    for unit in new_units:
        unit.module.__class__ = _sharded_class(unit.module_class)
        unit.module._fsdp_unit = unit
    return module


def _check_meta(module: nn.Module, init_fn, plan: units.UnitPlan) -> None:
    if init_fn is not None and plan.adopted:
        raise FSDPConfigError(
            f"init_fn cannot be combined with already sharded submodules ({list(plan.adopted)[:3]}): it "
            "would reach their shards. Materialize the remaining meta parameters before this call, or "
            "use unit_classes with init_fn in a single call"
        )
    if init_fn is None:
        meta = [name for name, param in module.named_parameters() if param.is_meta]
        if meta:
            raise FSDPConfigError(
                f"{len(meta)} parameters are on the meta device (first: {meta[0]!r}); pass init_fn "
                "to materialize them, e.g. init_fn=lambda m: (m.to_empty(device=...), m.reset_parameters())"
            )


def _check_divide_factor(factor, expert_mesh: MeshLike) -> None:
    if factor is None:
        return
    if expert_mesh is None:
        raise FSDPConfigError("expert_gradient_divide_factor needs expert_parameters and expert_mesh")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise FSDPConfigError(
            f"expert_gradient_divide_factor must be a positive number or None; got {factor!r}"
        )


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for name, buffer in list(module.named_buffers()):
        if buffer.device != device and not buffer.is_meta:
            owner, _, attribute = name.rpartition(".")
            module.get_submodule(owner)._buffers[attribute] = buffer.to(device)


_SHARDED_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    return _SHARDED_CLASSES[cls]
