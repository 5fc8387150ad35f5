"""``RunLogging``: where a training run reports while it trains.

Metrics to TensorBoard and Weights & Biases (``MetricsLog``), the progress bar on rank 0, the
straggler detector's reports and the gradient logger (``--save-grads-interval``).
"""

from __future__ import annotations

import contextlib
import dataclasses

from mcore_parallel import StragglerDetector

from ..debug.grad_logger import DataGradientLogger
from .metrics_log import MetricsLog
from .model_setup import TrainModel
from .progress import TrainingProgress
from .run_context import RunContext
from .tensorboard_writer import TensorBoardWriter
from .wandb_writer import WandbWriter


class RunLogging:
    """The run's loggers; ``open_progress(start)`` starts the progress bar once the start is known."""

    def __init__(self, context: RunContext, model: TrainModel, wandb_run: WandbWriter):
        configs, training = context.configs, context.configs.training
        self.context, self.wandb_run = context, wandb_run
        self.tensorboard = TensorBoardWriter(configs.logger, context.is_writer)
        self.log = MetricsLog(
            configs.logger,
            self.tensorboard,
            wandb_run,
            context.timers,
            context.tokens_per_iteration,
            context.device,
        )
        self.straggler = (
            StragglerDetector.from_config(configs.straggler) if configs.straggler.enabled else None
        )
        self.straggler_reports: list[dict] = []
        self.grad_logger = (
            DataGradientLogger(
                model.container, context.output_dir / "grads", every=training.save_grads_interval
            )
            if training.save_grads_interval
            else None
        )
        self.progress: TrainingProgress | None = None

    def open_progress(self, start: int) -> TrainingProgress:
        """The progress bar from iteration ``start`` (shown on rank 0 with ``progress``)."""
        training = self.context.configs.training
        self.progress = TrainingProgress(
            training.train_iters, start, self.context.tokens_per_iteration, self.context.shows_progress
        )
        return self.progress

    def step(self):
        """A context timing one step for the straggler detector (a no-op without one)."""
        return self.straggler.step() if self.straggler is not None else contextlib.nullcontext()

    def begin_gradients(self, iteration: int) -> None:
        """Start the gradient logger's record of ``iteration`` (if it logs)."""
        if self.grad_logger is not None:
            self.grad_logger.begin(iteration)

    def end_gradients(self, model: TrainModel) -> None:
        """Hand DDP's accumulated gradients to the gradient logger as ``.grad`` (if it logs)."""
        if self.grad_logger is None:
            return
        params = list(model.container.parameters())
        for p in params:
            p.grad = p.main_grad
        self.grad_logger.end()
        for p in params:
            p.grad = None

    def check_stragglers(self, iteration: int) -> None:
        """Record (and show) the straggler detector's report when one is due (collective then)."""
        if self.straggler is None:
            return
        report = self.straggler.maybe_report()
        if report is not None:
            self.straggler_reports.append({"iteration": iteration, **dataclasses.asdict(report)})
            self.progress.write(f"straggler report at iteration {iteration}: {report}")

    def close(self) -> None:
        """Close TensorBoard and remove the gradient logger's hooks."""
        self.tensorboard.close()
        if self.grad_logger is not None:
            self.grad_logger.remove()
