"""Handing a model's expert-parallel and expert-tensor-parallel groups to the MoE layers of its layer spec."""

from __future__ import annotations

import copy

import torch.distributed as dist

from ..spec import ModuleSpec
from .moe_layer import MoELayer


def with_expert_parallel_group(
    layer_spec: ModuleSpec,
    ep_group: dist.ProcessGroup | None,
    expert_tp_group: dist.ProcessGroup | None = None,
    *,
    field: str = "mlp",
) -> ModuleSpec:
    """``layer_spec`` with ``ep_group`` (and ``expert_tp_group``, the expert-tensor-parallel group)
    in the params of its MoE submodule ``field`` (a copy; the spec itself is not changed). Specs
    without an ``MoELayer`` there, groups the spec already names, and ``None`` groups are left as
    they are."""
    submodules = layer_spec.submodules if isinstance(layer_spec, ModuleSpec) else None
    mlp = getattr(submodules, field, None)
    if not isinstance(mlp, ModuleSpec) or not (
        isinstance(mlp.module, type) and issubclass(mlp.module, MoELayer)
    ):
        return layer_spec
    given = {"ep_group": ep_group, "expert_tp_group": expert_tp_group}
    added = {name: group for name, group in given.items() if group is not None and name not in mlp.params}
    if not added:
        return layer_spec
    spec = copy.copy(layer_spec)
    spec.submodules = copy.copy(submodules)
    setattr(spec.submodules, field, ModuleSpec(mlp.module, {**mlp.params, **added}, mlp.submodules))
    return spec
