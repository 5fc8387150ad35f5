"""Grouping token copies by expert (permute) and summing weighted expert outputs back per token
(unpermute), with optional zero-row padding of each expert's group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mcore_kernels import moe_padded_counts, moe_permute, moe_unpermute


@dataclass
class ExpertRows:
    """Where each kept assignment sits in the expert-sorted rows.

    ``assignment``: ``[A]`` flat assignment index (``t * k + j``) of each kept assignment;
    ``row``: ``[A]`` its row in the permuted tensor; ``row_map``: ``[T, k]`` the row of every
    assignment, ``-1`` where not kept; ``rows_per_expert``: ``[E]`` rows of each expert, padding
    included; ``num_rows``: their sum.
    """

    assignment: torch.Tensor
    row_map: torch.Tensor
    row: torch.Tensor
    rows_per_expert: torch.Tensor
    num_rows: int


def plan_expert_rows(
    indices: torch.Tensor,
    keep: torch.Tensor | None,
    num_experts: int,
    *,
    min_rows: int | None = None,
    alignment: int | None = None,
) -> ExpertRows:
    """Sort the kept assignments of ``indices [T, k]`` (ids in ``[0, num_experts)``; others are
    ignored) by expert, stably in token order. Each expert's group is padded with zero rows up to
    ``min_rows`` and then to a multiple of ``alignment``."""
    flat = indices.flatten()
    valid = (flat >= 0) & (flat < num_experts)
    if keep is not None:
        valid &= keep.flatten()
    assignment = valid.nonzero().squeeze(1)
    experts = flat[assignment]
    order = torch.argsort(experts, stable=True)
    assignment, experts = assignment[order], experts[order]
    counts = torch.bincount(experts, minlength=num_experts)
    rows = moe_padded_counts(counts, min_rows=min_rows, alignment=alignment)
    row_start = torch.cumsum(rows, 0) - rows
    count_start = torch.cumsum(counts, 0) - counts
    position = torch.arange(len(assignment), device=indices.device) - count_start[experts]
    row = row_start[experts] + position
    row_map = torch.full_like(flat, -1).index_copy(0, assignment, row).view(indices.shape)
    return ExpertRows(
        assignment=assignment,
        row_map=row_map,
        row=row,
        rows_per_expert=rows,
        num_rows=int(rows.sum()),
    )


def permute(hidden: torch.Tensor, plan: ExpertRows) -> torch.Tensor:
    """``[num_rows, h]``: a copy of its token's hidden state in each assignment's row, zeros in padding."""
    return moe_permute(hidden, plan.row_map, plan.num_rows)


def permute_probs(probs: torch.Tensor, plan: ExpertRows) -> torch.Tensor:
    """``[num_rows]``: each assignment's probability from ``probs [T, k]`` in its row, zeros in padding."""
    out = probs.new_zeros(plan.num_rows)
    return out.index_copy(0, plan.row, probs.flatten().index_select(0, plan.assignment))


def unpermute(rows: torch.Tensor, plan: ExpertRows, probs: torch.Tensor | None) -> torch.Tensor:
    """``[T, h]``: each token's sum of its assignments' rows weighted by ``probs [T, k]``
    (unweighted with ``None``: the experts applied the probabilities already)."""
    return moe_unpermute(rows, plan.row_map, probs)
