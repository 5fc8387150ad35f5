"""MoE token permutation in plain PyTorch: the numerical oracle of the Triton kernels and the path
every non-CUDA tensor takes, differentiated by autograd. The arithmetic of mcore-models'
``permutation`` module, op for op: copies gathered with ``index_select`` and placed with
``index_copy``; on the way back weighted in the rows' dtype and summed with ``index_add`` in row
order.

``row_map [T, k]`` (int64) holds the row of each token's ``j``-th assignment in the permuted
(expert-sorted) tensor, ``-1`` for an assignment that is dropped.
"""

from __future__ import annotations

import torch


def assignments(row_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(assignment, row)``: the flat indices (``t * k + j``) of the kept assignments in row order,
    and their rows."""
    flat = row_map.flatten()
    kept = (flat >= 0).nonzero().squeeze(1)
    kept = kept[torch.argsort(flat[kept])]
    return kept, flat[kept]


def check_rows(op: str, row: torch.Tensor, limit: int, *, distinct: bool) -> None:
    """On the CPU, a ``ValueError`` unless the sorted kept ``row`` lie below ``limit`` (and, if
    ``distinct``, none repeats), as the native kernels check; elsewhere that would wait on the device."""
    if row.device.type != "cpu" or not len(row):
        return
    if int(row[-1]) >= limit:
        raise ValueError(f"{op}: row_map names row {int(row[-1])} of {limit}")
    repeated = (row[1:] == row[:-1]).nonzero()
    if distinct and len(repeated):
        raise ValueError(f"{op}: row_map names row {int(row[repeated[0, 0]])} twice")


def moe_permute(hidden: torch.Tensor, row_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[num_rows, h]``: token ``t``'s hidden state in row ``row_map[t, j]`` for each kept ``j``,
    zeros in the other rows."""
    assignment, row = assignments(row_map)
    check_rows("moe_permute", row, num_rows, distinct=True)
    out = hidden.new_zeros(num_rows, hidden.shape[-1])
    return out.index_copy(0, row, hidden.index_select(0, assignment // row_map.shape[1]))


def moe_unpermute(rows: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """``[T, h]``: each token's sum of its kept assignments' rows, weighted by ``probs [T, k]``
    (unweighted with ``None``)."""
    assignment, row = assignments(row_map)
    check_rows("moe_unpermute", row, rows.shape[0], distinct=False)
    weighted = rows.index_select(0, row)
    if probs is not None:
        weights = probs.flatten().index_select(0, assignment).unsqueeze(-1)
        weighted = weighted * weights.to(rows.dtype)
    out = rows.new_zeros(row_map.shape[0], rows.shape[-1])
    return out.index_add(0, assignment // row_map.shape[1], weighted)
