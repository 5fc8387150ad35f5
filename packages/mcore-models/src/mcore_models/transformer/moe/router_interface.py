"""What a router gives the MoE layer (``RouterOutput``) and the protocols a router plugs in through."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from mcore_api import experimental_api

from ...config.transformer_config import TransformerConfig


@experimental_api
@dataclass
class RouterOutput:
    """Routing of ``T = s * b`` tokens (sequence-major, as ``hidden.reshape(-1, h)`` orders them).

    ``probs``: ``[T, k]`` weights the experts' outputs are combined with. ``indices``: ``[T, k]``
    expert ids (global). ``aux_loss``: a scalar already scaled by its coefficients, whose gradient
    the MoE layer adds to the backward pass, or ``None``. ``keep``: ``[T, k]`` bool, ``False`` where
    a capacity limit dropped the assignment; ``None`` keeps all.
    """

    probs: torch.Tensor
    indices: torch.Tensor
    aux_loss: torch.Tensor | None = None
    keep: torch.Tensor | None = None


# The two protocols carry no ``experimental_api`` marker although they are experimental: the marker
# is a class attribute, and a runtime-checkable protocol would require it of every implementation.
@runtime_checkable
class RouterInterface(Protocol):
    """A module that routes ``[s, b, h]`` hidden states to experts and round-trips its state
    (experimental)."""

    def __call__(self, hidden_states: torch.Tensor) -> RouterOutput: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any: ...


@runtime_checkable
class RouterBuilder(Protocol):
    """Builds a router from the config: ``TopKRouter`` itself, or any ``(config) -> RouterInterface``
    (experimental)."""

    def __call__(self, config: TransformerConfig) -> RouterInterface: ...
