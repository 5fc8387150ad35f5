"""State dicts whose tensors know their place in the global tensor, so any topology can load them.

A tensor-parallel shard becomes a ``DTensor`` sharded along its ``partition_dim`` over the TP group
(its global shape and offset follow); replicated tensors stay plain, and ranks holding the same one
write it once. Pipeline stages must name their parameters globally (e.g. by global layer index).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..device import get_group_device
from ..optimizer.distributed_optimizer import STATE_KEYS, DistributedOptimizer

OPTIMIZER_PREFIX = "optimizer."
OPTIMIZER_STEP_KEY = "optimizer.step"


def sharded_tensor(
    local: torch.Tensor, tp_group: dist.ProcessGroup | None, partition_dim: int | None
) -> torch.Tensor:
    """``local`` described as slice ``tp_rank`` (equal chunks along ``partition_dim``) of a global tensor.

    Shares storage with ``local``, so loading a checkpoint into it fills ``local`` in place. Returns
    ``local`` itself when it is not partitioned (``partition_dim`` or ``tp_group`` is ``None``).
    """
    if partition_dim is None or tp_group is None:
        return local
    tp = dist.get_world_size(tp_group)
    mesh = DeviceMesh.from_group(tp_group, get_group_device(tp_group).type)
    shape = list(local.shape)
    shape[partition_dim] *= tp
    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh, [Shard(partition_dim)], run_check=False, shape=shape, stride=stride
    )


def _partition_dim(param: torch.Tensor) -> int | None:
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def sharded_model_state_dict(
    module: torch.nn.Module, tp_group: dist.ProcessGroup | None = None, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """``module``'s parameters and buffers by name, TP-partitioned parameters as global-shape DTensors."""
    state = {
        prefix + name: sharded_tensor(param.detach(), tp_group, _partition_dim(param))
        for name, param in module.named_parameters()
    }
    state.update({prefix + name: buffer for name, buffer in module.named_buffers()})
    return state


def sharded_optimizer_state_dict(
    optimizer: DistributedOptimizer,
    module: torch.nn.Module,
    tp_group: dist.ProcessGroup | None = None,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """The optimizer's main parameters and moments per parameter of ``module``, reshardable.

    Keys are ``optimizer.<parameter name>.<main|exp_avg|exp_avg_sq>`` and ``optimizer.step``.
    Collective over the data-parallel group.
    """
    states = optimizer.gather_param_states()
    result: dict[str, torch.Tensor] = {OPTIMIZER_STEP_KEY: torch.tensor(optimizer.step_count)}
    for name, param in module.named_parameters():
        for key, value in states[param].items():
            result[f"{OPTIMIZER_PREFIX}{prefix}{name}.{key}"] = sharded_tensor(
                value, tp_group, _partition_dim(param)
            )
    return result


def load_sharded_optimizer_state_dict(
    optimizer: DistributedOptimizer,
    module: torch.nn.Module,
    state_dict: dict[str, torch.Tensor],
    prefix: str = "",
) -> None:
    """Hand the loaded values of a ``sharded_optimizer_state_dict`` back to ``optimizer``."""

    def local(value: torch.Tensor) -> torch.Tensor:
        return value.to_local() if isinstance(value, DTensor) else value

    states = {
        param: {
            key: local(state_dict[f"{OPTIMIZER_PREFIX}{prefix}{name}.{key}"]) for key in ("main", *STATE_KEYS)
        }
        for name, param in module.named_parameters()
    }
    optimizer.scatter_param_states(states, int(state_dict[OPTIMIZER_STEP_KEY]))
