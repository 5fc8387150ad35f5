"""Optional Weights & Biases logging (``--wandb-project``), imported only when asked for.

``wandb`` comes with the ``mcore-models[wandb]`` extra. ``WANDB_MODE=offline`` (wandb's own
setting) writes the run under the save directory only, without network; ``wandb sync`` uploads it
later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mcore_parallel import LoggerConfig

from .extras import import_extra


def import_wandb() -> Any:
    """The ``wandb`` module.

    Raises:
        ConfigError: naming ``wandb_project`` and how to install the extra, when it is missing.
    """
    return import_extra("wandb", "wandb_project", "logging to Weights & Biases", "wandb", "wandb")


def check_wandb_available(config: LoggerConfig) -> None:
    """Fail early, on every rank, when ``wandb_project`` is set but wandb is not installed.

    Raises:
        ConfigError: as ``import_wandb``.
    """
    if config.wandb_project is not None:
        import_wandb()


class WandbWriter:
    """Scalars and a final summary to one Weights & Biases run; a no-op without ``wandb_project``
    or where not ``enabled`` (every rank but the one that writes).

    The run is named ``wandb_exp_name`` and keeps its files under ``wandb_save_dir`` (default:
    ``default_dir``), in wandb's ``wandb/`` folder there; ``run_config`` is recorded as its config.
    Used as a context manager, the run is finished on exit, marked failed if an exception left
    the block.
    """

    def __init__(self, config: LoggerConfig, enabled: bool, default_dir: str, run_config: dict):
        self.run = None
        if config.wandb_project is None or not enabled:
            return
        wandb = import_wandb()
        directory = Path(config.wandb_save_dir or default_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=config.wandb_project, name=config.wandb_exp_name, dir=str(directory), config=run_config
        )

    def scalars(self, iteration: int, values: dict[str, float]) -> None:
        """Log ``values`` at step ``iteration``."""
        if self.run is not None:
            self.run.log(values, step=iteration)

    def summary(self, values: dict[str, Any]) -> None:
        """Set the run's summary values (its final figures)."""
        if self.run is not None:
            self.run.summary.update(values)

    def close(self, failed: bool = False) -> None:
        """Finish the run (once)."""
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None

    def __enter__(self) -> WandbWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        self.close(failed=exc_type is not None)
        return False
