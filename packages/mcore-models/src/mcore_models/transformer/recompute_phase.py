"""Which run of a checkpointed forward is executing: the first (activations dropped) or the
recompute during backward. Modules whose forward must not change between the two (an MoE router
under ``RouterReplay``) ask ``activation_recompute_phase()``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Literal

import torch

_state = threading.local()  # the phase is set and read by the same call, whatever thread runs backward


def activation_recompute_phase() -> Literal["forward", "recompute"] | None:
    """``"forward"`` inside the first run of a checkpointed function, ``"recompute"`` inside its rerun
    during backward, ``None`` outside activation recompute."""
    return getattr(_state, "phase", None)


def recomputable(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` for ``mcore_parallel.checkpoint``: its first call runs in phase ``"forward"``,
    every later one (the recompute) in phase ``"recompute"``. Wrapped where gradients are off (no
    backward, so no recompute will follow), the first call runs outside any phase."""
    calls, backward_follows = 0, torch.is_grad_enabled()

    def run(*args: Any) -> Any:
        nonlocal calls
        phase = ("forward" if backward_follows else None) if calls == 0 else "recompute"
        calls += 1
        previous, _state.phase = activation_recompute_phase(), phase
        try:
            return function(*args)
        finally:
            _state.phase = previous

    return run
