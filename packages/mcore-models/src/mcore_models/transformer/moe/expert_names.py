"""Global names of an expert-parallel rank's expert tensors: how checkpoints and Hugging Face
export see a model whose experts are spread over an expert-parallel group.

Expert rank ``r`` holds experts ``first .. first + local - 1`` (``MoELayer.local_expert_offset``).
Its per-expert tensors (``SequentialExperts``: ``local_experts.<j>``) are expert ``first + j``;
its stacked tensors (``GroupedExperts``: one row per local expert) are its slice, along dim 0, of
the global stack. With expert tensor parallelism each rank holds a slice of every tensor of its
experts (``expert_sharding``); checkpoints gather the slices, so they hold whole experts.
"""

from __future__ import annotations

import torch

from .expert_sharding import EXPERT_TP_DIM
from .moe_layer import MoELayer

_LOCAL_EXPERTS = "local_experts"


def expert_parallel_parameters(module: torch.nn.Module) -> dict[torch.nn.Parameter, MoELayer]:
    """Every expert parameter of ``module``'s MoE layers that have an expert-parallel group, with its layer."""
    return {
        p: layer
        for layer in module.modules()
        if isinstance(layer, MoELayer) and layer.ep_group is not None
        for p in layer.experts.parameters()
    }


def expert_tensor_parallel_parameters(module: torch.nn.Module) -> dict[torch.nn.Parameter, MoELayer]:
    """Every expert parameter of ``module``'s MoE layers split over an expert-tensor-parallel
    group (``expert_tensor_parallel_dim`` set), with its layer."""
    return {
        p: layer
        for layer in module.modules()
        if isinstance(layer, MoELayer) and layer.expert_tp_group is not None
        for p in layer.experts.parameters()
        if getattr(p, EXPERT_TP_DIM, None) is not None
    }


def global_expert_name(name: str, first: int) -> str | None:
    """``name`` with its ``local_experts.<j>`` renumbered to ``local_experts.<first + j>``;
    ``None`` for a tensor stacked by expert (no per-expert index in its name)."""
    parts = name.split(".")
    if _LOCAL_EXPERTS not in parts[:-1]:
        return None
    at = parts.index(_LOCAL_EXPERTS) + 1
    parts[at] = str(int(parts[at]) + first)
    return ".".join(parts)
