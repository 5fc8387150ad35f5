"""Named wall-clock timers for training loops and start-up phases."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from ..device import get_group_device, synchronize_device


class Timer:
    """Accumulates the durations of start/stop intervals (device work is waited for at each end).

    ``elapsed`` is the total since the last reset; ``average`` the mean interval, leaving out the first
    interval ever measured (warm-up: compilation, allocation) once there are others.
    """

    def __init__(self, name: str):
        self.name = name
        self._started_at: float | None = None
        self._total = 0.0
        self._intervals: list[float] = []

    @property
    def running(self) -> bool:
        """Whether the timer has been started and not stopped."""
        return self._started_at is not None

    def start(self) -> None:
        """Begin an interval."""
        if self.running:
            raise RuntimeError(f"timer {self.name!r} is already running")
        synchronize_device()
        self._started_at = time.perf_counter()

    def stop(self) -> float:
        """End the interval and return its duration in seconds."""
        if not self.running:
            raise RuntimeError(f"timer {self.name!r} is not running")
        synchronize_device()
        duration = time.perf_counter() - self._started_at
        self._started_at = None
        self._record(duration)
        return duration

    def set_elapsed(self, seconds: float) -> None:
        """Record an interval measured elsewhere (for example with device events)."""
        if seconds < 0:
            raise ValueError(f"elapsed time must be >= 0 seconds, got {seconds}")
        self._record(seconds)

    def elapsed(self, reset: bool = True) -> float:
        """Total seconds of the intervals since the last reset (a running interval counts up to now)."""
        total = self._total
        if self.running:
            total += time.perf_counter() - self._started_at
        if reset:
            self._total = 0.0
        return total

    @property
    def count(self) -> int:
        """Intervals measured so far."""
        return len(self._intervals)

    def average(self) -> float:
        """Mean interval in seconds, without the first one when there are at least two."""
        if not self._intervals:
            raise RuntimeError(f"timer {self.name!r} has measured nothing")
        steady = self._intervals[1:] or self._intervals
        return sum(steady) / len(steady)

    def _record(self, seconds: float) -> None:
        self._total += seconds
        self._intervals.append(seconds)


class Timers:
    """A registry of ``Timer`` objects by name, plus the start-up phases of a run.

    ``timers("forward").start()`` creates a timer on first use.
    """

    def __init__(self) -> None:
        self._timers: dict[str, Timer] = {}
        self._startup: dict[str, float] = {}

    def __call__(self, name: str) -> Timer:
        if name not in self._timers:
            self._timers[name] = Timer(name)
        return self._timers[name]

    def names(self) -> list[str]:
        """Names of the timers created so far."""
        return list(self._timers)

    def set_elapsed(self, name: str, seconds: float) -> None:
        """Record an externally measured interval on timer ``name``."""
        self(name).set_elapsed(seconds)

    @contextlib.contextmanager
    def startup_phase(self, name: str) -> Iterator[None]:
        """Time one phase of start-up (imports, process groups, model build, checkpoint load)."""
        if name in self._startup:
            raise ValueError(f"start-up phase {name!r} was already recorded")
        synchronize_device()
        began = time.perf_counter()
        try:
            yield
        finally:
            synchronize_device()
            self._startup[name] = time.perf_counter() - began

    def startup_phases(self) -> dict[str, float]:
        """Seconds per start-up phase, in the order they ran."""
        return dict(self._startup)

    def min_max_across_ranks(
        self, names: Sequence[str], group: dist.ProcessGroup | None = None, reset: bool = True
    ) -> dict[str, tuple[float, float]]:
        """``(min, max)`` over the ranks of ``group`` of each timer's ``elapsed`` (collective).

        A timer a rank never used counts as 0 there.
        """
        device = get_group_device(group)
        local = torch.tensor(
            [self._timers[n].elapsed(reset) if n in self._timers else 0.0 for n in names],
            dtype=torch.float64,
            device=device,
        )
        low, high = local.clone(), local.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        return {n: (lo, hi) for n, lo, hi in zip(names, low.tolist(), high.tolist(), strict=True)}
