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


def _random_state_devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def _build_local_experts(spec, config: TransformerConfig, local: int, first: int) -> torch.nn.Module:
    """The experts ``first .. first + local - 1`` with the initial weights they have at any EP size.

    With expert parallelism every rank draws the initial weights of all ``num_moe_experts`` experts,
    in the order one process would, keeps its own and drops the rest: the random stream then moves
    on exactly as without expert parallelism (so later layers match too), and the experts of
    different ranks differ. Costs one layer's full expert weights for the time of the copy.
    """
    total = config.num_moe_experts
    if local == total:
        return build_module(spec, config, num_local_experts=local)
    everything = build_module(spec, config, num_local_experts=total)
    with torch.random.fork_rng(devices=_random_state_devices()):  # the stream moved on already
        experts = build_module(spec, config, num_local_experts=local)
    experts.load_state_dict(_local_expert_state(everything.state_dict(), total, first, local))
    return experts


def _local_expert_state(state: dict, total: int, first: int, local: int) -> dict:
    """The part of an all-experts state dict (``local_experts.<e>.*`` per expert, or tensors stacked
    along dim 0 by expert) that holds experts ``first .. first + local - 1``, renumbered from 0."""
    result = {}
    for key, value in state.items():
        parts = key.split(".")
        if "local_experts" in parts[:-1]:
            at = parts.index("local_experts") + 1
            index = int(parts[at])
            if first <= index < first + local:
                parts[at] = str(index - first)
                result[".".join(parts)] = value
        elif torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == total:
            result[key] = value[first : first + local]
        else:
            result[key] = value
    return result


@experimental_api
class MoELayer(torch.nn.Module):
    """Mixture of experts on ``[s, b, h]``, called and returning like ``MLP``.

    Built from ``MoESubmodules``: ``router`` (any ``RouterBuilder``) picks experts per token, a
    dispatcher (``config.moe_token_dispatcher_type``) moves token copies over the expert-parallel
    group ``ep_group`` (default: the global one of ``initialize_model_parallel``, or none on a
    single process), this rank's ``num_moe_experts / ep_size`` experts run, and the weighted
    outputs come back; the shared expert's output is added. The router's aux loss rides on the
    output: its gradient joins any ``backward`` through this layer. With
    ``config.moe_weighted_activation`` each row's probability travels with it and the experts apply
    it inside their activation (``experts(rows, tokens_per_expert, probs)``), not to their output.
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
        self.experts = _build_local_experts(
            submodules.experts, config, self.num_local_experts, self.local_expert_offset
        )
        for param in self.experts.parameters():
            param.expert_parallel = True  # reduced over the expert-data-parallel group, see DDP
        self.shared_experts = (
            build_module(submodules.shared_experts, config, tp_group=tp_group)
            if submodules.shared_experts is not None
            else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        routing = self.router(hidden_states)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.config.moe_weighted_activation:
            rows, probs, tokens_per_expert = self.dispatcher.dispatch_weighted(tokens, routing)
            expert_output = self.experts(rows, tokens_per_expert, probs)
        else:
            rows, tokens_per_expert = self.dispatcher.dispatch(tokens, routing)
            expert_output = self.experts(rows, tokens_per_expert)
        output = self.dispatcher.combine(expert_output).view_as(hidden_states)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        if routing.aux_loss is not None:
            output = attach_aux_loss(output, routing.aux_loss)
        return output
