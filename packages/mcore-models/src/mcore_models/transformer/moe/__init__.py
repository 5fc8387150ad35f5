"""Mixture of experts: routers, token dispatchers over the expert-parallel group, experts, the layer."""

from .aux_loss import aux_loss_backward_scale
from .grouped_experts import GroupedExperts
from .moe_layer import MoELayer
from .router import TopKRouter, group_limited_topk
from .router_interface import RouterBuilder, RouterInterface, RouterOutput
from .router_replay import RouterReplay, RouterReplayAction, attach_router_replay, set_router_replay_action
from .sequential_experts import SequentialExperts
from .shared_experts import SharedExpertMLP
from .submodules import MoESubmodules
from .token_dispatcher import AllGatherTokenDispatcher, AllToAllTokenDispatcher
from .training_hooks import reset_global_loads, router_loss_metrics, update_expert_biases

__all__ = [
    "AllGatherTokenDispatcher",
    "AllToAllTokenDispatcher",
    "GroupedExperts",
    "MoELayer",
    "MoESubmodules",
    "RouterBuilder",
    "RouterInterface",
    "RouterOutput",
    "RouterReplay",
    "RouterReplayAction",
    "SequentialExperts",
    "SharedExpertMLP",
    "TopKRouter",
    "attach_router_replay",
    "aux_loss_backward_scale",
    "group_limited_topk",
    "reset_global_loads",
    "router_loss_metrics",
    "set_router_replay_action",
    "update_expert_biases",
]
