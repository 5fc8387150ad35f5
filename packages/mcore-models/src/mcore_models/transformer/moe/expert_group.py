"""Handing a model's expert-parallel group to the MoE layers of its layer spec."""

from __future__ import annotations

import copy

import torch.distributed as dist

from ..spec import ModuleSpec
from .moe_layer import MoELayer


def with_expert_parallel_group(layer_spec: ModuleSpec, ep_group: dist.ProcessGroup | None) -> ModuleSpec:
    """``layer_spec`` with ``ep_group`` in the params of its MoE ``mlp`` (a copy; the spec itself is
    not changed). Specs without an ``MoELayer`` MLP, specs that already name a group, and
    ``ep_group=None`` come back as they are."""
    submodules = layer_spec.submodules if isinstance(layer_spec, ModuleSpec) else None
    mlp = getattr(submodules, "mlp", None)
    if (
        ep_group is None
        or not isinstance(mlp, ModuleSpec)
        or not (isinstance(mlp.module, type) and issubclass(mlp.module, MoELayer))
        or "ep_group" in mlp.params
    ):
        return layer_spec
    spec = copy.copy(layer_spec)
    spec.submodules = copy.copy(submodules)
    spec.submodules.mlp = ModuleSpec(mlp.module, {**mlp.params, "ep_group": ep_group}, mlp.submodules)
    return spec
