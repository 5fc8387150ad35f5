"""``MoELayer``: router -> token dispatcher -> experts -> combine (+ shared expert), a drop-in
replacement for ``MLP`` in a layer spec."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_parallel.parallel_state import get_process_group_collection, model_parallel_is_initialized

from ...config.transformer_config import TransformerConfig
from ..spec import build_module
from .aux_loss import attach_aux_loss
from .router_interface import RouterBuilder, RouterInterface
from .submodules import MoESubmodules
from .token_dispatcher import AllGatherTokenDispatcher, AllToAllTokenDispatcher


def _resolve_ep_group(
    ep_group: dist.ProcessGroup | None, config: TransformerConfig
) -> dist.ProcessGroup | None:
    if ep_group is None and model_parallel_is_initialized():
        ep_group = get_process_group_collection().ep
    size = dist.get_world_size(ep_group) if ep_group is not None else 1
    if size != config.expert_model_parallel_size:
        raise ValueError(
            f"config.expert_model_parallel_size ({config.expert_model_parallel_size}) differs from the size "
            f"of the expert-parallel group ({size}); pass ep_group or initialize_model_parallel with it"
        )
    return ep_group


@experimental_api
class MoELayer(torch.nn.Module):
    """Mixture of experts on ``[s, b, h]``, called and returning like ``MLP``.

    Built from ``MoESubmodules``: ``router`` (any ``RouterBuilder``) picks experts per token, a
    dispatcher (``config.moe_token_dispatcher_type``) moves token copies over the expert-parallel
    group ``ep_group`` (default: the global one of ``initialize_model_parallel``, or none on a
    single process), this rank's ``num_moe_experts / ep_size`` experts run, and the weighted
    outputs come back; the shared expert's output is added. The router's aux loss rides on the
    output: its gradient joins any ``backward`` through this layer.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MoESubmodules,
        *,
        tp_group: dist.ProcessGroup | None = None,
        ep_group: dist.ProcessGroup | None = None,
        exchange_via_all_gather: bool = False,
    ):
        super().__init__()
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs config.num_moe_experts")
        if not isinstance(submodules.router, RouterBuilder):
            raise TypeError(f"MoESubmodules.router must be a RouterBuilder, got {submodules.router!r}")
        self.config = config
        self.ep_group = _resolve_ep_group(ep_group, config)
        self.router = submodules.router(config)
        if not isinstance(self.router, RouterInterface):
            raise TypeError(
                f"the router builder returned {type(self.router).__name__}, not a RouterInterface"
            )
        if config.moe_token_dispatcher_type == "allgather":
            self.dispatcher = AllGatherTokenDispatcher(config, self.ep_group)
        else:
            self.dispatcher = AllToAllTokenDispatcher(
                config, self.ep_group, via_all_gather=exchange_via_all_gather
            )
        self.num_local_experts = self.dispatcher.num_local_experts
        self.local_expert_offset = self.dispatcher.first_expert
        self.experts = build_module(submodules.experts, config, num_local_experts=self.num_local_experts)
        self.shared_experts = (
            build_module(submodules.shared_experts, config, tp_group=tp_group)
            if submodules.shared_experts is not None
            else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        routing = self.router(hidden_states)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        rows, tokens_per_expert = self.dispatcher.dispatch(tokens, routing)
        output = self.dispatcher.combine(self.experts(rows, tokens_per_expert)).view_as(hidden_states)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        if routing.aux_loss is not None:
            output = attach_aux_loss(output, routing.aux_loss)
        return output
