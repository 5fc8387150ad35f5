"""Token dispatchers: bring each token's copies to the rank that holds its experts, and bring the
expert outputs back, over the expert-parallel group.

Rank ``r`` of an expert-parallel group of size ``P`` holds experts
``r * E / P .. (r + 1) * E / P - 1``. ``dispatch`` returns the rows for this rank's experts,
grouped by expert, and the row count of each; ``combine`` takes the experts' outputs for those
rows and returns ``[T, h]``: each token's outputs weighted by its routing probabilities and summed.
``dispatch_weighted`` also returns each row's probability, for experts that apply it inside their
activation; ``combine`` then sums the outputs unweighted. With an expert-tensor-parallel group
(each expert split over its ranks, see ``expert_sharding``) the rows of all its ranks are gathered
for the experts, and their partial outputs are summed back to the rows' ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_parallel import gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region

from ...config.transformer_config import TransformerConfig
from .capacity import expert_capacity
from .permutation import ExpertRows, permute, permute_probs, plan_expert_rows, unpermute
from .router_interface import RouterOutput
from .row_exchange import exchange_rows, gather_rows, reduce_scatter_rows


def _all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenation along dim 0 of ``x`` from every rank (no gradient; same shape on all ranks)."""
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, x.contiguous(), group=group)
    return torch.cat(gathered)


def _split_probs(rows: torch.Tensor, with_probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(rows, probs)`` from rows carrying their probability as the last column, or ``(rows, None)``."""
    if not with_probs:
        return rows, None
    return rows[:, :-1], rows[:, -1]


def _expert_major_order(counts: list[list[int]], device: torch.device) -> torch.Tensor:
    """Indices that reorder rows grouped by source, then expert (``counts[source][expert]`` rows)
    into rows grouped by expert, then source."""
    starts, offset = [], 0
    for per_expert in counts:
        starts.append([])
        for count in per_expert:
            starts[-1].append(offset)
            offset += count
    pieces = [
        torch.arange(starts[source][e], starts[source][e] + counts[source][e])
        for e in range(len(counts[0]))
        for source in range(len(counts))
    ]
    return torch.cat(pieces).to(device)


class _TokenDispatcher:
    """What both dispatchers share: the groups, this rank's experts and the row padding."""

    def __init__(
        self,
        config: TransformerConfig,
        ep_group: dist.ProcessGroup | None,
        expert_tp_group: dist.ProcessGroup | None = None,
    ):
        self.config = config
        self.ep_group = ep_group
        self.expert_tp_group = expert_tp_group
        self.etp_size = dist.get_world_size(expert_tp_group) if expert_tp_group is not None else 1
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.num_experts = config.num_moe_experts
        self.num_local_experts = self.num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.num_local_experts
        self._plan: ExpertRows | None = None
        self._probs: torch.Tensor | None = None

    def dispatch(self, hidden: torch.Tensor, routing: RouterOutput) -> tuple[torch.Tensor, list[int]]:
        """Rows for the local experts and the rows of each, from ``hidden [T, h]``; ``combine``
        weights the experts' outputs by the routing probabilities."""
        rows, _, tokens_per_expert = self._dispatch(hidden, routing, with_probs=False)
        return rows, tokens_per_expert

    def dispatch_weighted(
        self, hidden: torch.Tensor, routing: RouterOutput
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """As ``dispatch``, plus each row's routing probability ``[rows]`` (zero in padding rows),
        carried with the rows to the experts' ranks; the experts apply it and ``combine`` sums
        their outputs unweighted."""
        rows, probs, tokens_per_expert = self._dispatch(hidden, routing, with_probs=True)
        return rows, probs, tokens_per_expert

    def _dispatch(self, hidden: torch.Tensor, routing: RouterOutput, with_probs: bool):
        raise NotImplementedError

    def _forget(self) -> None:
        """Drop the routing of the finished forward (autograd keeps what backward needs)."""
        self._plan = self._probs = None

    def _capacity_rows(self, num_local_tokens: int) -> int | None:
        """Rows every expert is padded to per source rank, with ``moe_pad_expert_input_to_capacity``."""
        config = self.config
        if not config.moe_pad_expert_input_to_capacity:
            return None
        return expert_capacity(
            num_local_tokens, self.num_experts, config.moe_router_topk, config.moe_expert_capacity_factor
        )


@experimental_api
class AllGatherTokenDispatcher(_TokenDispatcher):
    """Every rank all-gathers all tokens and routing of its expert-tensor-parallel and
    expert-parallel groups, runs its experts on the copies routed to them, and the partial outputs
    are reduce-scattered back to their ranks. Needs the same token count on every rank."""

    def _dispatch(self, hidden: torch.Tensor, routing: RouterOutput, with_probs: bool):
        local_tokens = hidden.shape[0]
        probs, indices, keep = routing.probs, routing.indices, routing.keep
        for group, size in ((self.expert_tp_group, self.etp_size), (self.ep_group, self.ep_size)):
            if size > 1:
                hidden = gather_from_sequence_parallel_region(hidden, group)
                probs = gather_from_sequence_parallel_region(probs, group)
                indices = _all_gather_rows(indices, group)
                if keep is not None:
                    keep = _all_gather_rows(keep.to(torch.uint8), group).bool()
        capacity = self._capacity_rows(local_tokens)
        self._plan = plan_expert_rows(
            indices - self.first_expert,
            keep,
            self.num_local_experts,
            min_rows=None if capacity is None else capacity * self.ep_size * self.etp_size,
            alignment=self.config.moe_router_padding_for_alignment,
        )
        self._probs = None if with_probs else probs
        row_probs = permute_probs(probs, self._plan) if with_probs else None
        return permute(hidden, self._plan), row_probs, self._plan.rows_per_expert.tolist()

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """``[T, h]`` for this rank's tokens from the local experts' output ``rows``."""
        out = unpermute(rows, self._plan, self._probs)
        self._forget()
        if self.ep_size > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, self.ep_group)
        if self.etp_size > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, self.expert_tp_group)
        return out


@experimental_api
class AllToAllTokenDispatcher(_TokenDispatcher):
    """Each rank sorts its token copies by expert and sends every rank exactly the copies routed
    to that rank's experts (an uneven all-to-all); the outputs travel back the same way.
    ``via_all_gather`` exchanges rows through padded all-gathers instead, for backends without
    uneven all-to-all. Ranks may receive zero rows. With an expert-tensor-parallel group the
    received rows are then gathered over it (an uneven all-gather) and the partial outputs summed
    back over it before their return trip."""

    def __init__(
        self,
        config: TransformerConfig,
        ep_group: dist.ProcessGroup | None,
        expert_tp_group: dist.ProcessGroup | None = None,
        *,
        via_all_gather: bool = False,
    ):
        super().__init__(config, ep_group, expert_tp_group)
        self.via_all_gather = via_all_gather
        self._send: list[list[int]] = []
        self._order: torch.Tensor | None = None
        self._etp_counts: list[int] = []
        self._etp_order: torch.Tensor | None = None

    def _dispatch(self, hidden: torch.Tensor, routing: RouterOutput, with_probs: bool):
        self._plan = plan_expert_rows(
            routing.indices,
            routing.keep,
            self.num_experts,
            min_rows=self._capacity_rows(hidden.shape[0]),
            alignment=self.config.moe_router_padding_for_alignment,
        )
        self._probs = None if with_probs else routing.probs
        rows = permute(hidden, self._plan)
        if with_probs:  # the probabilities travel as one more column of the rows
            rows = torch.cat(
                (rows, permute_probs(routing.probs, self._plan).unsqueeze(-1).to(rows.dtype)), -1
            )
        if self.ep_size > 1:
            rows, tokens_per_expert = self._exchange_over_ep(rows)
        else:
            tokens_per_expert = self._plan.rows_per_expert.tolist()
        if self.etp_size > 1:
            rows, tokens_per_expert = self._gather_over_expert_tp(rows, tokens_per_expert)
        return (*_split_probs(rows, with_probs), tokens_per_expert)

    def _exchange_over_ep(self, rows: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Rows routed to this rank's experts from every expert-parallel rank, expert-major."""
        local = self.num_local_experts
        counts = _all_gather_rows(self._plan.rows_per_expert.unsqueeze(0), self.ep_group).tolist()  # [P][E]
        self._send = [[sum(row[j * local : (j + 1) * local]) for j in range(self.ep_size)] for row in counts]
        received = exchange_rows(rows, self.ep_group, self._send, via_all_gather=self.via_all_gather)
        # Received rows are ordered by source rank, then local expert; the experts want expert-major.
        mine = [row[self.first_expert : self.first_expert + local] for row in counts]
        self._order = _expert_major_order(mine, rows.device)
        tokens_per_expert = [sum(mine[source][e] for source in range(self.ep_size)) for e in range(local)]
        return received.index_select(0, self._order), tokens_per_expert

    def _gather_over_expert_tp(
        self, rows: torch.Tensor, tokens_per_expert: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """The rows of every expert-tensor-parallel rank for the (shared) local experts, expert-major."""
        mine = torch.tensor([tokens_per_expert], device=rows.device)
        counts = _all_gather_rows(mine, self.expert_tp_group).tolist()  # [P][local]
        self._etp_counts = [sum(row) for row in counts]
        gathered = gather_rows(
            rows, self.expert_tp_group, self._etp_counts, via_all_gather=self.via_all_gather
        )
        self._etp_order = _expert_major_order(counts, rows.device)
        tokens_per_expert = [sum(row[e] for row in counts) for e in range(self.num_local_experts)]
        return gathered.index_select(0, self._etp_order), tokens_per_expert

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """``[T, h]`` for this rank's tokens from the local experts' output ``rows``."""
        if self.etp_size > 1:
            source_major = torch.zeros_like(rows).index_copy(0, self._etp_order, rows)
            rows = reduce_scatter_rows(
                source_major, self.expert_tp_group, self._etp_counts, via_all_gather=self.via_all_gather
            )
            self._etp_order = None
        if self.ep_size > 1:
            source_major = torch.zeros_like(rows).index_copy(0, self._order, rows)
            back = [list(column) for column in zip(*self._send, strict=True)]
            rows = exchange_rows(source_major, self.ep_group, back, via_all_gather=self.via_all_gather)
            self._order = None
        out = unpermute(rows, self._plan, self._probs)
        self._forget()
        return out
