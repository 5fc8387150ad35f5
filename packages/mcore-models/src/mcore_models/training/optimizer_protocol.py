"""The interface every optimizer of ``mcore-train`` implements, written down as two protocols.

``TrainOptimizer`` is what the training loop uses: parameter groups (the loop sets ``lr`` in them),
``zero_grad()`` and ``step()``, which returns the gradient norm before clipping. ``LocalOptimizer``,
mcore-parallel's ``DistributedOptimizer`` and ``FSDPOptimizer`` implement it.

``ParamStatesOptimizer`` adds the per-parameter checkpoint interface of the first two
(``gather_param_states`` / ``scatter_param_states`` / ``step_count``): their checkpoints hold
float32 main values and Adam moments named by global parameter name, so one loads into the other.
``FSDPOptimizer``'s state is a DTensor state dict instead; which layout a checkpoint uses is decided
by the model (``TrainModel.checkpoint_state``), whose sharding it follows.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class TrainOptimizer(Protocol):
    """What the training loop asks of an optimizer."""

    @property
    def param_groups(self) -> list[dict]:
        """The parameter groups; the loop sets each group's ``lr`` before every step."""
        ...

    def zero_grad(self) -> None:
        """Clear the gradients before an iteration's forward and backward passes."""
        ...

    def step(self) -> float:
        """Clip by the global gradient norm and update; returns the norm before clipping."""
        ...


@runtime_checkable
class ParamStatesOptimizer(TrainOptimizer, Protocol):
    """A ``TrainOptimizer`` whose checkpoint state is per model parameter: float32 ``main`` value,
    ``exp_avg`` and ``exp_avg_sq`` (``LocalOptimizer`` and ``DistributedOptimizer``)."""

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        ...

    def gather_param_states(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Per model parameter: its whole ``main``, ``exp_avg`` and ``exp_avg_sq`` tensors."""
        ...

    def scatter_param_states(
        self, states: dict[torch.nn.Parameter, dict[str, torch.Tensor]], step: int
    ) -> None:
        """Take per-parameter states in ``gather_param_states``' layout and the step count."""
        ...
