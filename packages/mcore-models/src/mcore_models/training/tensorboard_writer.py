"""Optional TensorBoard logging (``--tensorboard-dir``), imported only when asked for."""

from __future__ import annotations

from mcore_parallel import ConfigError, LoggerConfig


class TensorBoardWriter:
    """Scalars to TensorBoard on the rank that writes; a no-op without ``tensorboard_dir``."""

    def __init__(self, config: LoggerConfig, enabled: bool):
        self.config = config
        self.writer = None
        if config.tensorboard_dir is None or not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:  # tensorboard is not a dependency
            raise ConfigError(
                ["tensorboard_dir"],
                "TensorBoard logging needs the 'tensorboard' package: pip install tensorboard",
            ) from error
        self.writer = SummaryWriter(config.tensorboard_dir, max_queue=config.tensorboard_queue_size)

    def scalars(self, iteration: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
