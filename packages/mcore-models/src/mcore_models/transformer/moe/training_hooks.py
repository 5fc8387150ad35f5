"""What a training loop calls on a model with MoE layers after each optimizer step: the
aux-loss-free expert-bias update, the reset of the global load counts, and the router losses to log."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_api import experimental_api

from .router import TopKRouter


def _biased_routers(model: torch.nn.Module) -> list[TopKRouter]:
    return [m for m in model.modules() if isinstance(m, TopKRouter) and m.expert_bias is not None]


@experimental_api
@torch.no_grad()
def update_expert_biases(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """``update_expert_bias`` on every ``TopKRouter`` of ``model`` that has an expert bias, with its
    token counts first summed over ``group`` (the data x context parallel group, so that every
    replica moves its biases identically; collective there). Returns how many routers were updated."""
    routers = _biased_routers(model)
    for router in routers:
        counts = router.local_tokens_per_expert.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        router.update_expert_bias(counts)
    return len(routers)


@experimental_api
def reset_global_loads(model: torch.nn.Module) -> None:
    """``reset_global_load`` on every ``TopKRouter`` of ``model``: ``global_aux_loss`` counts the
    expert loads of one optimizer step."""
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.reset_global_load()


@experimental_api
def router_loss_metrics(model: torch.nn.Module) -> dict[str, float]:
    """``{"moe/<loss name>": value}``: each router loss of the latest training forward (this rank's
    last micro-batch), summed over the MoE layers of ``model``; empty without such losses."""
    totals: dict[str, float] = {}
    for module in model.modules():
        for name, value in (
            getattr(module, "last_losses", {}).items() if isinstance(module, TopKRouter) else ()
        ):
            totals[f"moe/{name}"] = totals.get(f"moe/{name}", 0.0) + float(value)
    return totals
