"""The arguments of one ``fully_shard`` call that every call composed into one model must share,
validated without communicating."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from mcore_fsdp.errors import FSDPConfigError
from mcore_fsdp.precision import MixedPrecision
from mcore_fsdp.strategies import OUTER_STRATEGIES, ShardingStrategy
from mcore_fsdp.topology import MeshLike, check_mesh, device_type_of


@dataclass(frozen=True)
class ShardSettings:
    """How a unit shards, computes and overlaps; ``mesh_layout`` is the device type, shape and
    global ranks of its mesh (two meshes with equal layouts shard alike)."""

    mesh_layout: tuple
    strategy: ShardingStrategy
    outer_strategy: ShardingStrategy
    precision: MixedPrecision
    offload_optimizer: bool
    prefetch: bool

    @classmethod
    def parse(
        cls,
        mesh: MeshLike,
        strategy: ShardingStrategy | str,
        outer_strategy: ShardingStrategy | str,
        precision: MixedPrecision | None,
        offload_optimizer: bool,
        prefetch: bool,
    ) -> ShardSettings:
        """Validate the arguments of ``fully_shard``; raise ``FSDPConfigError`` naming the bad one."""
        strategy = ShardingStrategy.parse(strategy, "strategy")
        outer = ShardingStrategy.parse(outer_strategy, "outer_strategy")
        if outer not in OUTER_STRATEGIES:
            raise FSDPConfigError(f"outer_strategy must be 'no_shard' or 'optim'; got {outer.value!r}")
        if outer is ShardingStrategy.OPTIM and strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
            raise FSDPConfigError(
                "outer_strategy='optim' requires strategy='optim_grads_params'; "
                f"got strategy={strategy.value!r}"
            )
        precision = precision or MixedPrecision()
        if not isinstance(precision, MixedPrecision):
            raise FSDPConfigError(
                f"precision must be a MixedPrecision or None; got {type(precision).__name__}"
            )
        layout = _mesh_layout(mesh)
        if outer is ShardingStrategy.OPTIM and len(layout[1]) != 2:
            raise FSDPConfigError(
                f"outer_strategy='optim' needs a 2-D (replicate, shard) mesh; got {len(layout[1])}-D"
            )
        return cls(layout, strategy, outer, precision, bool(offload_optimizer), bool(prefetch))

    def check_same_as(self, other: ShardSettings, where: str) -> None:
        """Raise ``FSDPConfigError`` naming the first argument in which ``other`` (the settings of
        the earlier call ``where``) differs from these."""
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                argument = "mesh" if field.name == "mesh_layout" else field.name
                raise FSDPConfigError(
                    f"{argument} differs from the earlier fully_shard call on {where}: "
                    f"{_describe(theirs)} there, {_describe(mine)} here; pass the same mesh, strategy, "
                    "outer_strategy, precision, offload_optimizer and prefetch to every call of one model"
                )


def _mesh_layout(mesh: MeshLike) -> tuple:
    """``(device type, shape, global ranks)`` of a mesh; checks it first (``check_mesh``)."""
    check_mesh(mesh, "mesh")
    world = dist.get_world_size()
    if isinstance(mesh, DeviceMesh):
        return mesh.device_type, tuple(mesh.shape), tuple(mesh.mesh.flatten().tolist())
    if isinstance(mesh, ProcessGroup):
        ranks = tuple(dist.get_process_group_ranks(mesh))
        return device_type_of(mesh), (len(ranks),), ranks
    shape = (world,) if mesh is None else tuple(mesh)
    return device_type_of(dist.group.WORLD), shape, tuple(range(world))


def _describe(value) -> str:
    if isinstance(value, ShardingStrategy):
        return repr(value.value)
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[1], tuple):
        device_type, shape, ranks = value
        return f"a {device_type} mesh of shape {shape} over ranks {list(ranks)}"
    return repr(value)
