"""The hook through which a serving engine runs a model over its own (paged) key/value cache."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class InferenceContext(Protocol):
    """What ``GPTModel.forward(..., inference_context=ctx)`` asks of an inference engine.

    The engine flattens one step's batch into a single row: ``input_ids`` and ``position_ids``
    ``[1, t]`` hold every request's new tokens back to back. Each attention layer then hands its
    rotated query and key and its value to ``attend`` instead of attending over the row itself;
    the context stores the keys/values in its cache and attends over each request's cached tokens.
    Only the rows ``logits_indices`` (all rows when ``None``) reach the output layer, so
    ``forward`` returns logits ``[1, len(logits_indices), vocab / tp]``.

    mcore-models defines this protocol and never imports an engine; mcore-inference implements it.
    """

    logits_indices: torch.Tensor | None

    def attend(
        self,
        layer_number: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scale: float,
        window_size: int | None,
        sink_logits: torch.Tensor | None,
    ) -> torch.Tensor:
        """Store ``key, value [t, g, d]`` of 1-based global ``layer_number`` in the cache and return
        the attention of ``query [t, n, d]`` (this rank's heads) over the cache, ``[t, n * d]``.

        ``scale`` multiplies the scores, ``window_size`` limits how far back a query sees (``None``:
        no limit), ``sink_logits [n]`` (or ``None``) join each softmax denominator without a value.
        """
        ...
