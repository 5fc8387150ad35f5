"""Between the state dict a model with every expert whole on one rank (EP = 1, no expert tensor
parallelism) has and this rank's experts: per-expert tensors under their global index, stacked
tensors concatenated in expert order (``transformer.moe.expert_names`` names them, as checkpoints
do), each expert whole or, split over an expert-tensor-parallel group, this rank's slices of it
(``transformer.moe.expert_sharding``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..transformer.moe import MoELayer
from ..transformer.moe.expert_names import expert_tensor_parallel_parameters, global_expert_name
from ..transformer.moe.expert_range import experts_in_range
from ..transformer.moe.expert_sharding import gather_slices, shard_expert_state


def _moe_layers(model: torch.nn.Module) -> list[tuple[str, MoELayer]]:
    return [(name, layer) for name, layer in model.named_modules() if isinstance(layer, MoELayer)]


def _spread_layers(model: torch.nn.Module) -> list[tuple[str, MoELayer]]:
    """``(name, layer)`` of each MoE layer whose experts are spread over more than one rank."""
    return [
        (name, layer)
        for name, layer in _moe_layers(model)
        if layer.ep_group is not None and dist.get_world_size(layer.ep_group) > 1
    ]


def _only_group(groups: set[dist.ProcessGroup], kind: str) -> dist.ProcessGroup | None:
    if len(groups) > 1:
        raise ValueError(f"the model's MoE layers spread their experts over different {kind} groups")
    return next(iter(groups), None)


def expert_parallel_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The expert-parallel group over which ``model``'s experts are spread (``None``: all on this rank).

    Raises:
        ValueError: the MoE layers use different groups.
    """
    return _only_group({layer.ep_group for _, layer in _spread_layers(model)}, "expert-parallel")


def expert_tensor_parallel_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The expert-tensor-parallel group over which each of ``model``'s experts is split
    (``None``: whole on this rank).

    Raises:
        ValueError: the MoE layers use different groups.
    """
    groups = {layer.expert_tp_group for _, layer in _moe_layers(model) if layer.expert_tp_group is not None}
    return _only_group(groups, "expert-tensor-parallel")


def local_expert_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Cut, in ``state`` (a state dict of ``model``'s shape at EP = 1 without expert tensor
    parallelism), each MoE layer's expert tensors to this rank's experts and, with an
    expert-tensor-parallel group, to this rank's slices of them (as the layer's parameters are tagged)."""
    for name, layer in _moe_layers(model):
        prefix = f"{name}.experts."
        experts = {key[len(prefix) :]: state.pop(key) for key in [k for k in state if k.startswith(prefix)]}
        experts = experts_in_range(
            experts, layer.config.num_moe_experts, layer.local_expert_offset, layer.num_local_experts
        )
        experts = shard_expert_state(experts, layer.experts, layer.expert_tp_group)
        state.update({prefix + key: value for key, value in experts.items()})


def gather_expert_tensor_parallel_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Replace, in ``state`` (``model``'s state dict on this rank), each expert tensor split over an
    expert-tensor-parallel group by the whole tensor (collective over each layer's group, one
    tensor at a time)."""
    split = expert_tensor_parallel_parameters(model)
    for key, param in model.named_parameters():
        layer = split.get(param)
        if layer is not None:
            state[key] = gather_slices(state[key], param, layer.expert_tp_group)


def _first_experts(layer: MoELayer) -> list[int]:
    """Each expert-parallel rank's ``local_expert_offset`` (collective over the layer's group)."""
    firsts: list = [None] * dist.get_world_size(layer.ep_group)
    dist.all_gather_object(firsts, layer.local_expert_offset, group=layer.ep_group)
    return firsts


def gather_expert_parallel_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Replace, in ``state`` (``model``'s state dict on this rank, tensor-parallel shards and
    expert-tensor-parallel slices already gathered), each spread MoE layer's local expert tensors
    by all experts of the layer (collective over each layer's expert-parallel group, one tensor at a time)."""
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
