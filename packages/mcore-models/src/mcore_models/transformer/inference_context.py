"""The hook through which a serving engine runs a model over its own (paged) key/value cache."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class MambaStepLayout:
    """Which request's Mamba state each part of a step's flattened row continues.

    ``decode_rows [d]`` are rows that each advance their own request by one token, reading and
    writing the state slots ``decode_slots [d]``; ``prefills`` holds, per segment of several
    tokens of one request, its rows (a ``slice`` of the row) and its slot. A request's slot holds
    the state after its tokens computed so far (zeros before its first token).
    """

    decode_rows: torch.Tensor
    decode_slots: torch.Tensor
    prefills: tuple[tuple[slice, int], ...] = ()


@runtime_checkable
class MambaInferenceContext(InferenceContext, Protocol):
    """An ``InferenceContext`` that also keeps per-request Mamba states: what the Mamba layers of
    a hybrid model (``MambaInferenceStateConfig``) ask of an engine.

    Each Mamba layer reads ``mamba_layout`` and the states of its ``layer_number`` and writes the
    states after this step's tokens back into the same tensors, in place.
    """

    mamba_layout: MambaStepLayout

    def mamba_states(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv ``[slots, *conv_state_shape]`` and SSM ``[slots, *ssm_state_shape]`` states of
        Mamba layer ``layer_number`` (1-based, global), one row per slot."""
        ...
