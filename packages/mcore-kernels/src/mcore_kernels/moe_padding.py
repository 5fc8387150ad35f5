"""``moe_padded_counts``: per-expert token counts padded up to a minimum and to an alignment, the
rows each expert's group takes in a permuted (expert-sorted) batch. A few integer ops on ``[E]``:
PyTorch on every device, no kernel."""

from __future__ import annotations

import torch


def _check_size(name: str, value, least: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
        kind = "a positive" if least == 1 else "a non-negative"
        raise ValueError(f"moe_padded_counts: {name} must be {kind} int or None, got {value!r}")


def moe_padded_counts(
    counts: torch.Tensor, *, min_rows: int | None = None, alignment: int | None = None
) -> torch.Tensor:
    """``counts [E]`` (integer) raised to at least ``min_rows``, then rounded up to a multiple of
    ``alignment``; an expert with no tokens gets ``min_rows`` rounded up (zero without ``min_rows``)."""
    if (
        not isinstance(counts, torch.Tensor)
        or counts.is_floating_point()
        or counts.is_complex()
        or counts.dim() != 1
    ):
        kind = (
            f"{counts.dtype} {tuple(counts.shape)}"
            if isinstance(counts, torch.Tensor)
            else type(counts).__name__
        )
        raise TypeError(f"moe_padded_counts: counts must be an integer [E] tensor, got {kind}")
    _check_size("min_rows", min_rows, 0)
    _check_size("alignment", alignment, 1)
    rows = counts
    if min_rows is not None:
        rows = rows.clamp(min=min_rows)
    if alignment is not None:
        rows = (rows + alignment - 1) // alignment * alignment
    return rows
