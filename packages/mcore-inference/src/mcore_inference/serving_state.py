"""The serving state of a coordinator and its engines, and which control signal leads where."""

from __future__ import annotations

import enum

from .errors import IllegalControlSignalError


class ServingState(enum.Enum):
    """What the engines behind a coordinator do: ``running`` (stepping), ``paused`` (not stepping;
    requests are kept and new ones queue), ``suspended`` (paused with the KV cache freed) or
    ``stopped`` (the engines were shut down; nothing more is served)."""

    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"
    STOPPED = "stopped"


_TRANSITIONS: dict[tuple[ServingState, str], ServingState] = {
    (ServingState.RUNNING, "pause"): ServingState.PAUSED,
    (ServingState.PAUSED, "unpause"): ServingState.RUNNING,
    (ServingState.PAUSED, "suspend"): ServingState.SUSPENDED,
    (ServingState.SUSPENDED, "resume"): ServingState.PAUSED,
    (ServingState.PAUSED, "stop"): ServingState.STOPPED,
}
SIGNALS = ("pause", "unpause", "suspend", "resume", "stop")
"""The control signals, by name."""


def next_state(state: ServingState, signal: str) -> ServingState:
    """The state ``signal`` leads to from ``state``: ``pause`` only from running, ``unpause``
    and ``suspend`` and ``stop`` only from paused, ``resume`` only from suspended (back to paused).
    Anything else raises ``IllegalControlSignalError`` saying which signals ``state`` allows."""
    if signal not in SIGNALS:
        raise ValueError(f"unknown control signal {signal!r}; one of {', '.join(SIGNALS)}")
    target = _TRANSITIONS.get((state, signal))
    if target is None:
        allowed = [s for (origin, s) in _TRANSITIONS if origin is state]
        hint = f"allowed: {', '.join(allowed)}" if allowed else "nothing is allowed after stop"
        raise IllegalControlSignalError(signal, state.value, f"cannot {signal} while {state.value} ({hint})")
    return target
