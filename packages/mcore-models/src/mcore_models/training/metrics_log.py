"""What ``mcore-train`` logs while it trains, as ``LoggerConfig`` asks: to TensorBoard and
Weights & Biases on the rank that writes, timers across every rank."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
from mcore_parallel import LoggerConfig, Timers, get_group_device

from .tensorboard_writer import TensorBoardWriter
from .wandb_writer import WandbWriter

#: The ``timing_log_level`` from which each timer of the loop is recorded.
TIMER_LEVELS = {
    "iteration": 0,
    "forward-backward": 1,
    "optimizer": 1,
    "evaluation": 1,
    "save": 1,
    "batch": 2,
    "sequence-parallel-grads": 2,
}


class MetricsLog:
    """The run's metrics every ``log_interval`` iterations, at evaluations and at the end.

    Every ``log_interval``: training loss, learning rate, gradient norm and tokens/s since the
    previous log, to TensorBoard and W&B; with ``log_memory_to_tensorboard`` this rank's memory,
    and with ``log_timers_to_tensorboard`` the seconds each recorded timer ran since the previous
    log over all ranks (``timing_log_option``: their maximum, minimum and maximum, or every rank),
    to TensorBoard. Held-out loss at evaluations, with the perplexity (TensorBoard: only with
    ``log_validation_ppl_to_tensorboard``). Build it and call ``iteration`` on every rank: the
    timers are gathered by a collective over the default group.
    """

    def __init__(
        self,
        config: LoggerConfig,
        tensorboard: TensorBoardWriter,
        wandb_run: WandbWriter,
        timers: Timers,
        tokens_per_iteration: int,
        device: torch.device,
    ):
        self.config, self.tensorboard, self.wandb_run = config, tensorboard, wandb_run
        self.timers, self.tokens_per_iteration, self.device = timers, tokens_per_iteration, device
        self.timer_names = [name for name, level in TIMER_LEVELS.items() if level <= config.timing_log_level]
        self._seconds, self._iterations = 0.0, 0  # since the previous log

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Time the block on timer ``name`` if ``timing_log_level`` records it."""
        if name not in self.timer_names:
            yield
            return
        timer = self.timers(name)
        timer.start()
        try:
            yield
        finally:
            timer.stop()

    def iteration(
        self,
        iteration: int,
        loss: float,
        lr: float,
        grad_norm: float,
        seconds: float,
        extra: dict[str, float] | None = None,
    ) -> None:
        """Account for one training iteration; log on the log interval (collective there).
        ``extra`` scalars (e.g. MoE router losses) are logged beside the loss."""
        self._seconds, self._iterations = self._seconds + seconds, self._iterations + 1
        if iteration % self.config.log_interval:
            return
        metrics = {
            "train/loss": loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/tokens_per_second": self._iterations
            * self.tokens_per_iteration
            / max(self._seconds, 1e-9),
            **(extra or {}),
        }
        self._seconds, self._iterations = 0.0, 0
        self.tensorboard.scalars(iteration, metrics)
        self.wandb_run.scalars(iteration, metrics)
        if self.config.log_memory_to_tensorboard:
            self.tensorboard.scalars(iteration, memory_scalars(self.device))
        if self.config.log_timers_to_tensorboard:
            self.tensorboard.scalars(iteration, self._timer_scalars())

    def heldout(self, iteration: int, result: dict[str, float]) -> None:
        """Log an evaluation's ``{"loss", "perplexity"}``."""
        values = {"heldout/loss": result["loss"], "heldout/perplexity": result["perplexity"]}
        self.wandb_run.scalars(iteration, values)
        if not self.config.log_validation_ppl_to_tensorboard:
            del values["heldout/perplexity"]
        self.tensorboard.scalars(iteration, values)

    def _timer_scalars(self) -> dict[str, float]:
        """Seconds per timer since the previous log, over the ranks of the default group (collective)."""
        names = self.timer_names
        local = torch.tensor(
            [self.timers(name).elapsed(reset=True) for name in names],
            dtype=torch.float64,
            device=get_group_device(),
        )
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        per_rank = torch.stack(gathered).tolist()  # [rank][timer]
        option = self.config.timing_log_option
        scalars = {}
        for index, name in enumerate(names):
            values = [row[index] for row in per_rank]
            if option == "max":
                scalars[f"timers/{name}"] = max(values)
            elif option == "minmax":
                scalars[f"timers/{name}/min"], scalars[f"timers/{name}/max"] = min(values), max(values)
            else:
                scalars.update({f"timers/{name}/rank{rank}": value for rank, value in enumerate(values)})
        return scalars


def memory_scalars(device: torch.device) -> dict[str, float]:
    """This process's memory in bytes: CUDA's allocator figures on a GPU, else the peak resident set."""
    if device.type == "cuda":
        return {
            "memory/allocated_bytes": torch.cuda.memory_allocated(device),
            "memory/max_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "memory/reserved_bytes": torch.cuda.memory_reserved(device),
        }
    import resource  # POSIX

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"memory/max_rss_bytes": peak if sys.platform == "darwin" else peak * 1024}
