"""Named random-number streams for tensor-parallel regions, on any device.

Dropout inside a tensor-parallel region (on a slice of the hidden dimension) must differ between
TP ranks, while dropout on replicated activations must agree across them; data-parallel replicas
must see identical streams. ``RNGStatesTracker`` keeps named generator states and swaps one in for
the duration of ``fork``; ``model_parallel_manual_seed`` sets the usual two streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..device import get_device

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""Name of the stream that differs per tensor-parallel rank."""

_TP_SEED_OFFSET = 2718


def get_device_rng_state(device: torch.device) -> torch.Tensor:
    """The default generator state of ``device`` (the CPU generator for ``cpu``)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Restore a state taken by ``get_device_rng_state``."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states for one device (default: ``get_device()``, looked up on first use)."""

    def __init__(self, device: torch.device | str | None = None):
        self._device = torch.device(device) if device is not None else None
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    @property
    def device(self) -> torch.device:
        """The device whose default generator the streams replace."""
        if self._device is None:
            self._device = get_device()
        return self._device

    @device.setter
    def device(self, device: torch.device | str) -> None:
        self._device = torch.device(device)

    def reset(self) -> None:
        """Forget every stream."""
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (for checkpoints and recomputation)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the streams with ``states`` (from ``get_states``)."""
        self._states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; names and seeds must be new."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        saved = get_device_rng_state(self.device)
        try:
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self._states[name] = get_device_rng_state(self.device)
        finally:
            set_device_rng_state(saved, self.device)
        self._seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw random numbers from stream ``name`` inside the block; the default stream is untouched."""
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} does not exist; known: {sorted(self._states)}")
        saved = get_device_rng_state(self.device)
        set_device_rng_state(self._states[name], self.device)
        try:
            yield
        finally:
            self._states[name] = get_device_rng_state(self.device)
            set_device_rng_state(saved, self.device)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker used by ``model_parallel_manual_seed`` and ``checkpoint``."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, tp_rank: int, device: torch.device | str | None = None) -> None:
    """Seed the default stream with ``seed`` and ``MODEL_PARALLEL_RNG`` with ``seed + 2718 + tp_rank``.

    Call with the same ``seed`` on all ranks that should agree (typically every rank of a pipeline
    stage): TP ranks then differ inside ``fork()`` and agree outside it; DP ranks, having the same
    ``tp_rank``, agree everywhere. Resets the global tracker, which then works on ``device``.
    """
    device = torch.device(device) if device is not None else get_device()
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    _TRACKER.device = device
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)
