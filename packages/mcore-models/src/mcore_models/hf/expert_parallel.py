"""The experts of a model spread over an expert-parallel group, gathered into the state dict a
model with every expert on one rank (EP = 1) has: per-expert tensors under their global index,
stacked tensors concatenated in expert order (``transformer.moe.expert_names`` names them, as
checkpoints do)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..transformer.moe import MoELayer
from ..transformer.moe.expert_names import global_expert_name


def _spread_layers(model: torch.nn.Module) -> list[tuple[str, MoELayer]]:
    """``(name, layer)`` of each MoE layer whose experts are spread over more than one rank."""
    return [
        (name, layer)
        for name, layer in model.named_modules()
        if isinstance(layer, MoELayer)
        and layer.ep_group is not None
        and dist.get_world_size(layer.ep_group) > 1
    ]


def expert_parallel_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The expert-parallel group over which ``model``'s experts are spread (``None``: all on this rank).

    Raises:
        ValueError: the MoE layers use different groups.
    """
    groups = {layer.ep_group for _, layer in _spread_layers(model)}
    if len(groups) > 1:
        raise ValueError("the model's MoE layers spread their experts over different expert-parallel groups")
    return next(iter(groups), None)


def _first_experts(layer: MoELayer) -> list[int]:
    """Each expert-parallel rank's ``local_expert_offset`` (collective over the layer's group)."""
    firsts: list = [None] * dist.get_world_size(layer.ep_group)
    dist.all_gather_object(firsts, layer.local_expert_offset, group=layer.ep_group)
    return firsts


def gather_expert_parallel_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Replace, in ``state`` (``model``'s state dict on this rank, tensor-parallel shards already
    gathered), each spread MoE layer's local expert tensors by all experts of the layer (collective
    over each layer's expert-parallel group, one tensor at a time)."""
    for name, layer in _spread_layers(model):
        prefix, ranks = f"{name}.experts.", dist.get_world_size(layer.ep_group)
        firsts = _first_experts(layer)
        for key in [k for k in state if k.startswith(prefix)]:
            local = state.pop(key).contiguous()
            pieces = [torch.empty_like(local) for _ in range(ranks)]
            dist.all_gather(pieces, local, group=layer.ep_group)
            if global_expert_name(key, 0) is None:  # stacked by expert: the ranks' slices in order
                order = sorted(range(ranks), key=firsts.__getitem__)
                state[key] = torch.cat([pieces[r] for r in order])
            else:
                state.update(
                    {global_expert_name(key, first): p for first, p in zip(firsts, pieces, strict=True)}
                )
