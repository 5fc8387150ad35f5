"""``RunContext``: where this rank trains, shared by every component of a ``Trainer``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from mcore_parallel import ProcessGroupCollection, Timers

from .config import TrainConfigs


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """The resolved configs (and ``given``, as passed to ``pretrain``), process groups, device,
    parameter dtype, this rank and the world size, and the run's timers."""

    configs: TrainConfigs
    given: TrainConfigs
    groups: ProcessGroupCollection
    timers: Timers
    device: torch.device
    dtype: torch.dtype
    rank: int
    world: int

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes the run's files and prints."""
        return self.rank == 0

    @property
    def shows_progress(self) -> bool:
        """Whether this rank shows progress bars."""
        return self.configs.training.progress and self.is_writer

    @property
    def dp_rank(self) -> int:
        """This rank's place in its data-parallel group."""
        return dist.get_rank(self.groups.dp)

    @property
    def dp_size(self) -> int:
        """The data-parallel size."""
        return dist.get_world_size(self.groups.dp)

    @property
    def output_dir(self) -> Path:
        """The run's output directory."""
        return Path(self.configs.training.output_dir)

    @property
    def tokens_per_iteration(self) -> int:
        """Tokens of one global batch."""
        return self.configs.training.global_batch_size * self.configs.data.seq_length
