"""``TopKRouter``: scores every expert for every token and picks the top k."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_api import experimental_api
from mcore_kernels import moe_topk_routing
from mcore_parallel.parallel_state import (
    get_context_parallel_group,
    get_data_parallel_group,
    model_parallel_is_initialized,
)

from ...config.transformer_config import TransformerConfig
from ..init import init_method
from .aux_loss import load_balancing_loss, sequence_load_balancing_loss, z_loss
from .capacity import capacity_keep_mask, expert_capacity
from .router_interface import RouterOutput
from .router_replay import RouterReplay


@experimental_api
def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> torch.Tensor:
    """Top-``topk`` expert ids ``[T, topk]`` drawn only from each token's ``group_topk`` best groups.

    Experts form ``num_groups`` equal consecutive groups; a group's score is the sum of its
    ``topk // group_topk`` highest expert scores (DeepSeek-V3's node-limited routing).
    """
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(group_topk, dim=-1).indices
    group_mask = torch.zeros(tokens, num_groups, dtype=torch.bool, device=scores.device)
    group_mask.scatter_(1, best_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    return scores.masked_fill(~expert_mask, float("-inf")).topk(topk, dim=-1).indices


@experimental_api
class TopKRouter(torch.nn.Module):
    """A linear gate ``[num_moe_experts, hidden]`` and top-k selection, as configured by the
    ``moe_router_*`` fields of ``TransformerConfig``.

    Scores are computed in float32; the returned probabilities have the input's dtype. With
    ``moe_router_linear_bias`` a learned ``bias [num_moe_experts]`` (zeros at init) is added to the
    logits. With
    ``moe_router_enable_expert_bias`` a float32 buffer ``expert_bias`` shifts the top-k choice only
    (not the weights), and training forwards count tokens per expert for ``update_expert_bias``.
    ``last_losses`` holds the detached losses (scalar tensors) of the latest training forward, for
    logging. ``router_replay`` (a ``RouterReplay``, default ``None``) records or replays the top-k
    choice.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        if config.num_moe_experts is None:
            raise ValueError("TopKRouter needs config.num_moe_experts")
        self.config = config
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.weight = torch.nn.Parameter(
            torch.empty(self.num_experts, config.hidden_size, dtype=config.params_dtype)
        )
        init_method(config)(self.weight)
        self.bias = (
            torch.nn.Parameter(torch.zeros(self.num_experts, dtype=config.params_dtype))
            if config.moe_router_linear_bias
            else None
        )
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
            self.register_buffer(
                "local_tokens_per_expert",
                torch.zeros(self.num_experts, dtype=torch.float32),
                persistent=False,
            )
        else:
            self.expert_bias = None
        self.last_losses: dict[str, torch.Tensor] = {}
        # global_aux_loss: expert loads (and token count, last entry) since the last reset, summed
        # over ``data_parallel_group`` (default: the global data x context parallel one of
        # initialize_model_parallel).
        self.register_buffer("global_load", torch.zeros(self.num_experts + 1), persistent=False)
        self.data_parallel_group: dist.ProcessGroup | None = None
        # aux_loss / seq_aux_loss count the experts' loads of whole sequences over the ranks that hold
        # the other parts of them (default: the global context-parallel group)
        self.context_parallel_group: dist.ProcessGroup | None = None
        self.router_replay: RouterReplay | None = None  # see router_replay.attach_router_replay

    def _jitter(self, hidden: torch.Tensor) -> torch.Tensor:
        eps = self.config.moe_input_jitter_eps
        if eps is None or not self.training:
            return hidden
        noise = torch.empty_like(hidden).uniform_(1.0 - eps, 1.0 + eps)
        return hidden * noise

    def _select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs [T, k], indices [T, k], scores [T, E])``; ``scores`` feed the balance loss."""
        config = self.config
        indices = None
        if self.router_replay is not None or config.moe_router_num_groups is not None:
            indices = self._replayed_or_grouped_choice(logits)
        return moe_topk_routing(
            logits,
            self.topk,
            score_function=config.moe_router_score_function,
            pre_softmax=config.moe_router_pre_softmax,
            expert_bias=self.expert_bias,
            indices=indices,
        )

    def _replayed_or_grouped_choice(self, logits: torch.Tensor) -> torch.Tensor:
        """The top-k ids ``[T, k]`` when replayed or group-limited (``moe_topk_routing`` makes the
        plain choice itself): drawn from what it would look at, the logits or the scores plus the
        expert bias."""
        config = self.config
        choice = logits
        if config.moe_router_score_function == "sigmoid":
            choice = torch.sigmoid(logits)
        elif config.moe_router_pre_softmax:
            choice = torch.softmax(logits, dim=-1)
        if self.expert_bias is not None:
            choice = choice + self.expert_bias
        choice = choice.detach()
        if self.router_replay is None:
            return self._top_experts(choice)
        indices = self.router_replay.route(lambda: self._top_experts(choice), logits.shape[0], self.topk)
        return indices.to(logits.device)

    def _top_experts(self, choice: torch.Tensor) -> torch.Tensor:
        config = self.config
        if config.moe_router_num_groups is not None:
            return group_limited_topk(
                choice, self.topk, config.moe_router_num_groups, config.moe_router_group_topk
            )
        return choice.topk(self.topk, dim=-1).indices

    def _aux_loss(
        self, logits: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor, batch: int
    ) -> torch.Tensor | None:
        config = self.config
        losses: dict[str, torch.Tensor] = {}
        if self.training and config.moe_aux_loss_coeff > 0:
            routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, indices, True)
            if config.moe_router_load_balancing_type == "seq_aux_loss":
                losses["load_balancing_loss"] = sequence_load_balancing_loss(
                    scores,
                    routing_map,
                    batch,
                    self.topk,
                    config.moe_aux_loss_coeff,
                    sequence_group=self._context_parallel_group(),
                )
            elif config.moe_router_load_balancing_type == "global_aux_loss":
                losses["load_balancing_loss"] = self._global_load_balancing_loss(scores, routing_map)
            else:
                losses["load_balancing_loss"] = load_balancing_loss(
                    scores,
                    routing_map.sum(dim=0),
                    self.topk,
                    config.moe_aux_loss_coeff,
                    sequence_group=self._context_parallel_group(),
                )
        if self.training and config.moe_z_loss_coeff is not None:
            losses["z_loss"] = z_loss(logits, config.moe_z_loss_coeff)
        self.last_losses = {name: value.detach() for name, value in losses.items()}  # no device sync
        return sum(losses.values()) if losses else None

    def _context_parallel_group(self) -> dist.ProcessGroup | None:
        if self.context_parallel_group is None and model_parallel_is_initialized():
            return get_context_parallel_group()
        return self.context_parallel_group

    def _global_load_balancing_loss(self, scores: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """The balance loss with expert loads counted over the data (x context) parallel ranks and the forwards
        since ``reset_global_load`` (collective over the group); the gradient flows through this
        forward's scores."""
        tokens_here = torch.tensor([routing_map.shape[0]], dtype=torch.float32, device=routing_map.device)
        load = torch.cat((routing_map.sum(dim=0).float(), tokens_here))
        group = self.data_parallel_group
        if group is None and model_parallel_is_initialized():
            group = get_data_parallel_group(with_context_parallel=True)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(load, group=group)
        self.global_load += load
        tokens_per_expert, tokens = self.global_load[:-1], self.global_load[-1]
        fraction = tokens_per_expert / (tokens * self.topk)
        return self.config.moe_aux_loss_coeff * self.num_experts * torch.sum(fraction * scores.mean(dim=0))

    def reset_global_load(self) -> None:
        """Start a new count for ``global_aux_loss`` (after each optimizer step)."""
        self.global_load.zero_()

    def forward(self, hidden_states: torch.Tensor) -> RouterOutput:
        """Route ``[s, b, h]`` hidden states; see ``RouterOutput``."""
        batch = hidden_states.shape[1] if hidden_states.dim() == 3 else 1
        hidden = self._jitter(hidden_states.reshape(-1, hidden_states.shape[-1]))
        bias = None if self.bias is None else self.bias.to(hidden.dtype)
        logits = F.linear(hidden, self.weight.to(hidden.dtype), bias).float()
        probs, indices, scores = self._select(logits)
        aux_loss = self._aux_loss(logits, scores, indices, batch)
        keep = None
        factor = self.config.moe_expert_capacity_factor
        if factor is not None:
            capacity = expert_capacity(logits.shape[0], self.num_experts, self.topk, factor)
            keep = capacity_keep_mask(
                probs, indices, self.num_experts, capacity, self.config.moe_token_drop_policy
            )
            probs = probs * keep
        if self.expert_bias is not None and self.training:
            with torch.no_grad():
                self.local_tokens_per_expert += torch.bincount(
                    indices.flatten(), minlength=self.num_experts
                ).float()
        return RouterOutput(probs.to(hidden_states.dtype), indices, aux_loss, keep)

    def expert_capacity(self, num_tokens: int) -> int | None:
        """Assignments one expert takes from ``num_tokens`` tokens, or ``None`` without a capacity."""
        factor = self.config.moe_expert_capacity_factor
        return None if factor is None else expert_capacity(num_tokens, self.num_experts, self.topk, factor)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing step: ``bias += rate * sign(mean load - load)``, then reset the count.

        ``tokens_per_expert`` defaults to the tokens counted since the last update (sum it over
        data-parallel ranks first when they route different tokens).
        """
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias needs config.moe_router_enable_expert_bias")
        load = self.local_tokens_per_expert if tokens_per_expert is None else tokens_per_expert.float()
        self.expert_bias += self.config.moe_router_bias_update_rate * torch.sign(load.mean() - load)
        self.local_tokens_per_expert.zero_()
