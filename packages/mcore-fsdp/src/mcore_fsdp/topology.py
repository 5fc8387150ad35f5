"""Data-parallel topology: which process groups a parameter is sharded and replicated over,
resolved from a device mesh, a process group or a mesh shape, and validated before any
collective is issued."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mcore_fsdp.errors import FSDPConfigError

MeshLike = DeviceMesh | ProcessGroup | tuple[int, ...] | None


@dataclass(frozen=True)
class ShardingTopology:
    """The groups one family of parameters (dense or expert) is sharded and replicated over.

    ``mesh`` is the device mesh state-dict DTensors live on: 1-D ``(shard,)`` or 2-D
    ``(replicate, shard)``.
    """

    mesh: DeviceMesh
    shard_group: ProcessGroup
    replicate_group: ProcessGroup | None

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard_group)

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.shard_group)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)

    @property
    def replicate_rank(self) -> int:
        return 0 if self.replicate_group is None else dist.get_rank(self.replicate_group)

    @property
    def device(self) -> torch.device:
        return compute_device(self.mesh.device_type)


def compute_device(device_type: str) -> torch.device:
    """The device buffers of a mesh of ``device_type`` live on (the current one of its kind)."""
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type)
    return torch.device(device_type, module.current_device())


def device_type_of(group: ProcessGroup) -> str:
    """The device type a process group communicates on, from its backend (never assumes CUDA)."""
    backend = str(dist.get_backend(group))
    if backend == "gloo":
        return "cpu"
    if backend == "nccl":
        return "cuda"
    accelerator = torch.accelerator.current_accelerator()
    return "cpu" if accelerator is None else accelerator.type


def check_mesh(mesh: MeshLike, argument: str) -> int:
    """Validate ``mesh`` without communicating and return its number of dimensions; raise
    ``FSDPConfigError`` naming ``argument``."""
    if not dist.is_available() or not dist.is_initialized():
        raise FSDPConfigError(
            f"{argument}: torch.distributed is not initialized; call init_process_group first"
        )
    world = dist.get_world_size()
    if mesh is None or isinstance(mesh, ProcessGroup):
        return 1
    if isinstance(mesh, tuple):
        if len(mesh) not in (1, 2) or not all(isinstance(size, int) and size > 0 for size in mesh):
            raise FSDPConfigError(
                f"{argument} as a shape must be (shard,) or (replicate, shard) of positive ints; got {mesh!r}"
            )
        product = 1
        for size in mesh:
            product *= size
        if product != world:
            raise FSDPConfigError(
                f"{argument} shape {mesh} has {product} ranks but the world size is {world}; "
                "the product of the sizes must equal the world size"
            )
        return len(mesh)
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim not in (1, 2):
            raise FSDPConfigError(
                f"{argument} must be 1-D (shard,) or 2-D (replicate, shard); got a {mesh.ndim}-D mesh"
            )
        if mesh.get_coordinate() is None:
            raise FSDPConfigError(f"{argument} does not contain this rank ({dist.get_rank()})")
        return mesh.ndim
    raise FSDPConfigError(
        f"{argument} must be a DeviceMesh, a ProcessGroup, a shape tuple or None; got {type(mesh).__name__}"
    )


def resolve_topology(mesh: MeshLike) -> ShardingTopology:
    """Build the topology of a mesh already validated by ``check_mesh``."""
    if mesh is None:
        mesh = dist.group.WORLD
    if isinstance(mesh, ProcessGroup):
        mesh = DeviceMesh.from_group(mesh, device_type_of(mesh))
    elif isinstance(mesh, tuple):
        names = ("shard",) if len(mesh) == 1 else ("replicate", "shard")
        mesh = init_device_mesh(device_type_of(dist.group.WORLD), mesh, mesh_dim_names=names)
    if mesh.ndim == 1:
        return ShardingTopology(mesh, mesh.get_group(0), None)
    return ShardingTopology(mesh, mesh.get_group(1), mesh.get_group(0))
