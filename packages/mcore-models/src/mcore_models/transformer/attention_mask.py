"""Which keys each query may see: causal, optionally windowed, optionally within one document."""

from __future__ import annotations

import torch


def allowed_by_position(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window_size: int | None = None
) -> torch.Tensor:
    """Boolean ``[q, k]``: ``True`` where a query at ``query_positions[i]`` may attend to a key at
    ``key_positions[j]``: causal, and with ``window_size`` at most ``window_size - 1`` positions back."""
    distance = query_positions[:, None] - key_positions[None, :]
    allowed = distance >= 0
    if window_size is not None:
        allowed = allowed & (distance < window_size)
    return allowed


def allowed_keys(
    seq_length: int,
    *,
    window_size: int | None = None,
    segment_ids: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Boolean ``[b or 1, 1, s, s]``: ``True`` where query ``i`` may attend to key ``j``.

    Causal (``j <= i``); with ``window_size`` also ``i - j < window_size``; with ``segment_ids``
    ``[b, s]`` only keys of the query's own document.
    """
    if segment_ids is not None:
        device = segment_ids.device
    index = torch.arange(seq_length, device=device)
    allowed = allowed_by_position(index, index, window_size)[None, None]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return allowed
