"""Optional TensorBoard logging (``--tensorboard-dir``), imported only when asked for.

``tensorboard`` comes with the ``mcore-models[tensorboard]`` extra; the writer is
``torch.utils.tensorboard.SummaryWriter``.
"""

from __future__ import annotations

from typing import Any

from mcore_parallel import LoggerConfig

from .extras import import_extra


def import_summary_writer() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``.

    Raises:
        ConfigError: naming ``tensorboard_dir`` and how to install the extra, when tensorboard is missing.
    """
    module = import_extra(
        "torch.utils.tensorboard", "tensorboard_dir", "logging to TensorBoard", "tensorboard", "tensorboard"
    )
    return module.SummaryWriter


def check_tensorboard_available(config: LoggerConfig) -> None:
    """Fail early, on every rank, when ``tensorboard_dir`` is set but tensorboard is not installed.

    Raises:
        ConfigError: as ``import_summary_writer``.
    """
    if config.tensorboard_dir is not None:
        import_summary_writer()


class TensorBoardWriter:
    """Scalars to TensorBoard on the rank that writes; a no-op without ``tensorboard_dir`` or where
    not ``enabled``. Events are flushed after ``tensorboard_queue_size`` of them and on ``close``."""

    def __init__(self, config: LoggerConfig, enabled: bool):
        self.writer = None
        if config.tensorboard_dir is None or not enabled:
            return
        summary_writer = import_summary_writer()
        self.writer = summary_writer(config.tensorboard_dir, max_queue=config.tensorboard_queue_size)

    def scalars(self, iteration: int, values: dict[str, float]) -> None:
        """Write ``values`` at step ``iteration``."""
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, iteration)

    def close(self) -> None:
        """Flush and close the event file (once)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
