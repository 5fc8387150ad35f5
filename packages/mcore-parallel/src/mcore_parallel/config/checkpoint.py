"""``CheckpointConfig``: where and how training state is saved and loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .fields import ConfigError, config_field, validate_fields


@dataclass
class CheckpointConfig:
    """Checkpointing: save and load directories, interval, format and what to include.

    ``ckpt_format``: ``torch_dist`` (``torch.distributed.checkpoint``) is the one format
    implemented; ``fsdp_dtensor`` is reserved for a later release and ``DistributedCheckpointer``
    refuses it.
    """

    save: str | None = config_field(None, help="Directory to save checkpoints to.")
    load: str | None = config_field(None, help="Directory to load a checkpoint from.")
    save_interval: int | None = config_field(
        None, minimum=1, help="Save a checkpoint every this many iterations."
    )
    no_save_optim: bool = config_field(False, help="Leave the optimizer state out of saved checkpoints.")
    no_save_rng: bool = config_field(False, help="Leave the random-number states out of saved checkpoints.")
    no_load_optim: bool = config_field(False, help="Do not restore the optimizer state when loading.")
    no_load_rng: bool = config_field(False, help="Do not restore the random-number states when loading.")
    ckpt_format: Literal["torch_dist", "fsdp_dtensor"] = config_field(
        "torch_dist",
        help="On-disk format: torch_dist (torch.distributed.checkpoint); fsdp_dtensor is reserved for a "
        "later release and refused.",
    )
    async_save: bool = config_field(
        False, help="Write checkpoints in the background while training continues."
    )

    def __post_init__(self) -> None:
        if self.ckpt_format == "zarr":
            raise ConfigError(
                ["ckpt_format"],
                "the 'zarr' format is not supported; use 'torch_dist' (torch.distributed.checkpoint), "
                "which saves and loads across topologies",
            )
        validate_fields(self)
        if self.save_interval is not None and self.save is None:
            raise ConfigError(["save_interval", "save"], "a save interval needs a save directory")
        if self.async_save and self.save is None:
            raise ConfigError(["async_save", "save"], "asynchronous saving needs a save directory")
        if self.async_save and self.ckpt_format != "torch_dist":
            raise ConfigError(
                ["async_save", "ckpt_format"],
                f"asynchronous saving needs ckpt_format 'torch_dist', got {self.ckpt_format!r}",
            )
