"""``LoggerConfig``: what training logs, and where."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .fields import ConfigError, config_field, validate_fields

_TENSORBOARD_SWITCHES = (
    "log_timers_to_tensorboard",
    "log_validation_ppl_to_tensorboard",
    "log_memory_to_tensorboard",
)


@dataclass
class LoggerConfig:
    """Logging: interval, TensorBoard and Weights & Biases destinations, timers and memory."""

    log_interval: int = config_field(100, minimum=1, help="Log training metrics every this many iterations.")
    tensorboard_dir: str | None = config_field(None, help="Directory to write TensorBoard events to.")
    tensorboard_queue_size: int = config_field(
        1000, minimum=1, help="Events TensorBoard may queue before it flushes to disk."
    )
    log_timers_to_tensorboard: bool = config_field(False, help="Write timer values to TensorBoard.")
    log_validation_ppl_to_tensorboard: bool = config_field(
        False, help="Write validation perplexity to TensorBoard."
    )
    log_memory_to_tensorboard: bool = config_field(False, help="Write memory usage to TensorBoard.")
    timing_log_level: Literal[0, 1, 2] = config_field(
        0, help="Timers to record: 0 only the iteration, 1 coarse phases, 2 everything."
    )
    timing_log_option: Literal["max", "minmax", "all"] = config_field(
        "minmax", help="How to report timers across ranks: the maximum, min and max, or every rank."
    )
    wandb_project: str | None = config_field(None, help="Weights & Biases project to log to.")
    wandb_exp_name: str | None = config_field(None, help="Weights & Biases run name.")
    wandb_save_dir: str | None = config_field(None, help="Directory for the local Weights & Biases files.")

    def __post_init__(self) -> None:
        validate_fields(self)
        for switch in _TENSORBOARD_SWITCHES:
            if getattr(self, switch) and self.tensorboard_dir is None:
                raise ConfigError(
                    [switch, "tensorboard_dir"], "logging to TensorBoard needs a TensorBoard directory"
                )
        if (
            self.wandb_exp_name is not None or self.wandb_save_dir is not None
        ) and self.wandb_project is None:
            raise ConfigError(
                ["wandb_exp_name", "wandb_save_dir", "wandb_project"],
                "Weights & Biases settings need a project",
            )
