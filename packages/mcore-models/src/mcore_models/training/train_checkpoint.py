"""``TrainCheckpoint``: a run's checkpoints: resume from ``--load``, save with the files that
describe the run, wait for an asynchronous save."""

from __future__ import annotations

import functools
from pathlib import Path

from mcore_parallel import DistributedCheckpointer, latest_iteration

from ..checkpoints.metadata import write_checkpoint_metadata
from .checkpointing import load_training_checkpoint, save_training_checkpoint
from .model_setup import TrainModel
from .optimizer_protocol import TrainOptimizer
from .run_context import RunContext


class TrainCheckpoint:
    """Checkpoints of ``model`` and ``optimizer`` (see ``checkpointing``). Beside each checkpoint's
    tensors: the model config, the tokenizer and the run's configs as given to ``pretrain``."""

    def __init__(self, context: RunContext, model: TrainModel, optimizer: TrainOptimizer, tokenizer):
        self.context, self.model, self.optimizer = context, model, optimizer
        self.checkpointer = DistributedCheckpointer(context.configs.checkpoint)
        self.write_files = functools.partial(
            write_checkpoint_metadata,
            model_config=context.configs.model,
            vocab_size=tokenizer.vocab_size,
            tokenizer=tokenizer,
            train_configs=context.given,
        )

    def resume(self) -> tuple[int, dict]:
        """The iteration and loss history of ``--load``'s latest checkpoint, loaded into model and
        optimizer; ``(0, {})`` without one (collective)."""
        context, load_dir = self.context, self.context.configs.checkpoint.load
        if load_dir is not None and latest_iteration(load_dir) is not None:
            with context.timers.startup_phase("checkpoint load"):
                groups = context.groups
                return load_training_checkpoint(
                    self.checkpointer, self.model, self.optimizer, groups.tp, groups
                )
        if load_dir is not None and context.is_writer:
            print(f"no checkpoint in {load_dir}; starting from scratch")
        return 0, {}

    def save(self, iteration: int, history: dict) -> Path:
        """Save the checkpoint of ``iteration`` (collective); returns its directory."""
        groups = self.context.groups
        return save_training_checkpoint(
            self.checkpointer,
            self.model,
            self.optimizer,
            groups.tp,
            iteration,
            history,
            groups,
            self.write_files,
        )

    def wait(self) -> None:
        """Complete an asynchronous save (and mark it latest)."""
        self.checkpointer.wait()
