"""``MoELayer``: router -> token dispatcher -> experts -> combine (+ shared expert), a drop-in
replacement for ``MLP`` in a layer spec."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_parallel import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from mcore_parallel.parallel_state import get_process_group_collection, model_parallel_is_initialized

from ...config.transformer_config import TransformerConfig
from ..spec import build_module
from .aux_loss import attach_aux_loss
from .expert_range import experts_in_range
from .expert_sharding import expert_tp_size, shard_expert_state
from .router_interface import RouterBuilder, RouterInterface, RouterOutput
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


def _resolve_expert_tp_group(
    group: dist.ProcessGroup | None, config: TransformerConfig
) -> dist.ProcessGroup | None:
    """The group each expert is split over, or ``None``: with ``expert_tensor_parallel_size``
    unset the experts are whole on every rank (and replicated over tensor-parallel ranks)."""
    if config.expert_tensor_parallel_size is None:
        return None
    if group is None and model_parallel_is_initialized():
        group = get_process_group_collection().expert_tp
    size = expert_tp_size(group)
    if size != config.expert_tensor_parallel_size:
        raise ValueError(
            f"config.expert_tensor_parallel_size ({config.expert_tensor_parallel_size}) differs from the "
            f"size of the expert-tensor-parallel group ({size}); pass expert_tp_group or "
            "initialize_model_parallel with it"
        )
    return group if size > 1 else None


def _token_split_group(
    tp_group: dist.ProcessGroup | None, config: TransformerConfig
) -> dist.ProcessGroup | None:
    """The tensor-parallel group whose ranks split the (replicated) tokens among them for the
    routed experts, as Megatron's sequence parallelism does: only with expert tensor parallelism
    configured (then every rank must bring different tokens to the expert groups)."""
    if config.expert_tensor_parallel_size is None:
        return None
    if tp_group is None and model_parallel_is_initialized():
        tp_group = get_process_group_collection().tp
    return tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None


def _random_state_devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def _build_local_experts(
    spec, config: TransformerConfig, local: int, first: int, expert_tp_group: dist.ProcessGroup | None
) -> torch.nn.Module:
    """The experts ``first .. first + local - 1`` (this rank's slices of them with an
    ``expert_tp_group``) with the initial weights they have at any EP and expert-TP size.

    With expert parallelism every rank draws the initial weights of all ``num_moe_experts`` whole
    experts, in the order one process would, keeps its own (slices) and drops the rest: the random
    stream then moves on exactly as without expert parallelism (so later layers match too), and the
    experts of different ranks differ. Costs one layer's full expert weights for the time of the copy.
    """
    total = config.num_moe_experts
    if local == total and expert_tp_group is None:
        return build_module(spec, config, num_local_experts=local)
    everything = build_module(spec, config, num_local_experts=total)
    extra = {} if expert_tp_group is None else {"expert_tp_group": expert_tp_group}
    with torch.random.fork_rng(devices=_random_state_devices()):  # the stream moved on already
        experts = build_module(spec, config, num_local_experts=local, **extra)
    state = experts_in_range(everything.state_dict(), total, first, local)
    experts.load_state_dict(shard_expert_state(state, experts, expert_tp_group))
    return experts


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

    With ``config.expert_tensor_parallel_size`` set, each expert is split over ``expert_tp_group``
    (default: the global expert-tensor-parallel group; see ``expert_sharding``), the ranks of
    ``tp_group`` split the tokens among them for the routed experts and gather the output back,
    and the dispatchers gather rows over the expert-TP group. Unset, experts are whole on every rank.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MoESubmodules,
        *,
        tp_group: dist.ProcessGroup | None = None,
        ep_group: dist.ProcessGroup | None = None,
        expert_tp_group: dist.ProcessGroup | None = None,
        exchange_via_all_gather: bool = False,
    ):
        super().__init__()
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs config.num_moe_experts")
        if not isinstance(submodules.router, RouterBuilder):
            raise TypeError(f"MoESubmodules.router must be a RouterBuilder, got {submodules.router!r}")
        self.config = config
        self.ep_group = _resolve_ep_group(ep_group, config)
        self.expert_tp_group = _resolve_expert_tp_group(expert_tp_group, config)
        self.token_split_group = _token_split_group(tp_group, config)
        self.router = submodules.router(config)
        if not isinstance(self.router, RouterInterface):
            raise TypeError(
                f"the router builder returned {type(self.router).__name__}, not a RouterInterface"
            )
        if config.moe_token_dispatcher_type == "allgather":
            self.dispatcher = AllGatherTokenDispatcher(config, self.ep_group, self.expert_tp_group)
        else:
            self.dispatcher = AllToAllTokenDispatcher(
                config, self.ep_group, self.expert_tp_group, via_all_gather=exchange_via_all_gather
            )
        self.num_local_experts = self.dispatcher.num_local_experts
        self.local_expert_offset = self.dispatcher.first_expert
        self.experts = _build_local_experts(
            submodules.experts, config, self.num_local_experts, self.local_expert_offset, self.expert_tp_group
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
        split = self.token_split_group
        if split is not None:
            tokens, routing = _split_tokens(tokens, routing, split)
        if self.config.moe_weighted_activation:
            rows, probs, tokens_per_expert = self.dispatcher.dispatch_weighted(tokens, routing)
            expert_output = self.experts(rows, tokens_per_expert, probs)
        else:
            rows, tokens_per_expert = self.dispatcher.dispatch(tokens, routing)
            expert_output = self.experts(rows, tokens_per_expert)
        output = self.dispatcher.combine(expert_output)
        if split is not None:
            output = gather_from_sequence_parallel_region(output, split, tensor_parallel_output_grad=False)
        output = output.view_as(hidden_states)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        if routing.aux_loss is not None:
            output = attach_aux_loss(output, routing.aux_loss)
        return output


def _split_tokens(
    tokens: torch.Tensor, routing: RouterOutput, group: dist.ProcessGroup
) -> tuple[torch.Tensor, RouterOutput]:
    """This rank's equal share of the replicated ``tokens [T, h]`` and their routing; the
    gradients of the shares are gathered back over ``group``."""
    size = dist.get_world_size(group)
    if tokens.shape[0] % size:
        raise ValueError(
            f"with expert tensor parallelism the tensor-parallel ranks split the tokens of an MoE layer: "
            f"its {tokens.shape[0]} tokens (sequence x micro-batch) must be a multiple of the "
            f"tensor-parallel size ({size})"
        )
    count, start = tokens.shape[0] // size, dist.get_rank(group) * tokens.shape[0] // size

    def mine(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[start : start + count]

    share = RouterOutput(
        probs=scatter_to_sequence_parallel_region(routing.probs, group),
        indices=mine(routing.indices),
        aux_loss=routing.aux_loss,
        keep=mine(routing.keep),
    )
    return scatter_to_sequence_parallel_region(tokens, group), share
