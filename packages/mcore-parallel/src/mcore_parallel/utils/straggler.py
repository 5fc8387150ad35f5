"""Detecting ranks whose steps take longer than their peers'."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config.straggler import StragglerDetectionConfig
from ..device import get_group_device, synchronize_device


@dataclass(frozen=True)
class StragglerReport:
    """Mean step time per rank (index = rank in the group), their spread, and the ranks flagged slow.

    ``slow_ranks`` is empty unless ``relative_stddev`` exceeds ``threshold``; then it holds the ranks
    whose time exceeds the mean by more than ``threshold`` times the mean.
    """

    step_times: list[float]
    mean: float
    relative_stddev: float
    threshold: float
    slow_ranks: list[int]

    @property
    def straggling(self) -> bool:
        """Whether any rank was flagged."""
        return bool(self.slow_ranks)

    def __str__(self) -> str:
        times = ", ".join(f"{t:.4f}" for t in self.step_times)
        verdict = f"slow ranks: {self.slow_ranks}" if self.slow_ranks else "no stragglers"
        return (
            f"step time per rank [s]: [{times}]; mean {self.mean:.4f}, relative stddev "
            f"{self.relative_stddev:.3f} (threshold {self.threshold}); {verdict}"
        )


class StragglerDetector:
    """Records this rank's step times and compares their means across ``group`` when asked.

    Time steps with ``with detector.step():`` (or ``record``); call ``report`` (collective) to compare
    and start a new window, or ``maybe_report`` every step to report every ``report_time_interval``
    seconds as measured by the group's first rank.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        threshold_relative_stddev: float = 0.1,
        report_time_interval: float = 300.0,
        calc_relative_stddev: bool = True,
    ):
        self.config = StragglerDetectionConfig(
            enabled=True,
            report_time_interval=report_time_interval,
            calc_relative_stddev=calc_relative_stddev,
            threshold_relative_stddev=threshold_relative_stddev,
        )
        self.group = group
        self._times: list[float] = []
        self._last_report = time.monotonic()

    @classmethod
    def from_config(cls, config: StragglerDetectionConfig, group: dist.ProcessGroup | None = None):
        """A detector with the thresholds of ``config`` (whether to use it is ``config.enabled``)."""
        return cls(
            group, config.threshold_relative_stddev, config.report_time_interval, config.calc_relative_stddev
        )

    def record(self, seconds: float) -> None:
        """Add one step's duration."""
        if seconds < 0:
            raise ValueError(f"step time must be >= 0 seconds, got {seconds}")
        self._times.append(seconds)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time the block as one step."""
        synchronize_device()
        began = time.perf_counter()
        yield
        synchronize_device()
        self.record(time.perf_counter() - began)

    def report(self) -> StragglerReport:
        """Gather every rank's mean step time since the last report and flag the slow ranks (collective)."""
        mean_here = sum(self._times) / len(self._times) if self._times else 0.0
        self._times.clear()
        self._last_report = time.monotonic()
        world_size = dist.get_world_size(self.group)
        gathered = torch.zeros(world_size, dtype=torch.float64, device=get_group_device(self.group))
        local = torch.tensor([mean_here], dtype=torch.float64, device=gathered.device)
        dist.all_gather_into_tensor(gathered, local, group=self.group)
        times = gathered.tolist()
        mean = sum(times) / world_size
        stddev = math.sqrt(sum((t - mean) ** 2 for t in times) / world_size)
        relative = stddev / mean if mean > 0 else 0.0
        threshold = self.config.threshold_relative_stddev
        slow = []
        if self.config.calc_relative_stddev and relative > threshold:
            slow = [rank for rank, t in enumerate(times) if t > mean * (1.0 + threshold)]
        return StragglerReport(times, mean, relative, threshold, slow)

    def maybe_report(self) -> StragglerReport | None:
        """``report()`` once ``report_time_interval`` has passed on the group's first rank, else ``None``.

        Collective (a one-element broadcast) so that every rank decides alike; call it on every rank.
        """
        due = torch.tensor(
            [time.monotonic() - self._last_report >= self.config.report_time_interval],
            dtype=torch.int32,
            device=get_group_device(self.group),
        )
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast(due, src=source, group=self.group)
        return self.report() if due.item() else None
