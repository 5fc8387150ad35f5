"""``DistributedCheckpointer``: save and load sharded state dicts; a crashed save never hides the last one.

Layout under the save directory: ``iter_0000010/`` per checkpoint and ``latest_checkpointed_iteration.txt``.
A save writes into ``iter_0000010.inprogress/``; only when every rank has written does rank 0
rename it to ``iter_0000010/`` and then replace the ``latest`` marker (write to a temporary file,
then an atomic rename). A save that dies on the way leaves the previous checkpoint marked latest.
Files a caller writes beside the tensors (``save(..., write_files=)``) go into the staging
directory too, so they appear with the checkpoint or not at all.

``torch.distributed.checkpoint`` is imported when first used, not with this module: on torch 2.6 its
import loads ``torch._dynamo`` and with it Triton, which ``import mcore_parallel`` must not do.
"""

from __future__ import annotations

import functools
import inspect
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config.checkpoint import CheckpointConfig
from ..config.fields import ConfigError

LATEST_FILE = "latest_checkpointed_iteration.txt"
IN_PROGRESS_SUFFIX = ".inprogress"


@functools.cache
def _async_save_copies_cpu_tensors() -> bool:
    """Whether ``torch.distributed.checkpoint.async_save`` writes a copy of CPU tensors taken when it
    is called. Its stagers (the ``async_stager`` keyword) copy them; before those, torch staged the
    state dict with ``tensor.to("cpu")``, which returns a CPU tensor itself, so the background
    write would see what training changes meanwhile (torch 2.6)."""
    import torch.distributed.checkpoint as dcp

    return "async_stager" in inspect.signature(dcp.async_save).parameters


def _copy_cpu_tensors(value: Any) -> Any:
    """``value`` (nested dicts, lists, tuples) with its CPU tensors, DTensor shards included, copied;
    tensors on a device are left as they are, since staging to the CPU copies them anyway."""
    from torch.distributed.checkpoint.stateful import Stateful

    if isinstance(value, Stateful):
        value = value.state_dict()
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if value.device.type == "cpu" else value
    if isinstance(value, dict):
        return {key: _copy_cpu_tensors(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_copy_cpu_tensors(item) for item in value)
    return value


def checkpoint_dir(directory: str | os.PathLike, iteration: int) -> Path:
    """The directory of the checkpoint of ``iteration``."""
    return Path(directory) / f"iter_{iteration:07d}"


def latest_iteration(directory: str | os.PathLike) -> int | None:
    """The iteration of the last complete checkpoint under ``directory``, or ``None``."""
    marker = Path(directory) / LATEST_FILE
    return int(marker.read_text().strip()) if marker.exists() else None


class DistributedCheckpointer:
    """Save and load state dicts (``sharded_model_state_dict`` & co.) with ``torch.distributed.checkpoint``.

    ``config.save`` / ``config.load`` are the directories; ``config.async_save`` writes in a background
    thread over a process group of its own (``wait()`` completes it; the next ``save`` waits for the
    previous one). Collective: every rank of ``process_group`` (default: all) calls the same methods.
    Works without an initialized process group (one process).

    Raises:
        ConfigError: ``config.ckpt_format`` is not ``torch_dist``.
    """

    def __init__(self, config: CheckpointConfig, process_group: dist.ProcessGroup | None = None):
        if config.ckpt_format != "torch_dist":
            raise ConfigError(
                ["ckpt_format"],
                f"DistributedCheckpointer writes ckpt_format 'torch_dist', got {config.ckpt_format!r}",
            )
        self.config = config
        self.distributed = dist.is_initialized()
        self.process_group = process_group
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self._async_group = dist.new_group(backend="gloo") if config.async_save and self.distributed else None
        self._pending: tuple[Future, int] | None = None

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.process_group)

    def save(
        self,
        state_dict: dict[str, Any],
        iteration: int,
        write_files: Callable[[Path], None] | None = None,
    ) -> None:
        """Save ``state_dict`` as the checkpoint of ``iteration`` in ``config.save``.

        ``write_files(directory)``, called on rank 0 only, writes further files (e.g. the model's
        config) into the checkpoint's directory before the tensors; they are published with them.
        """
        if self.config.save is None:
            raise ConfigError(["save"], "saving needs a save directory")
        self.wait()
        staging = Path(str(checkpoint_dir(self.config.save, iteration)) + IN_PROGRESS_SUFFIX)
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # left behind by a crashed save
            staging.mkdir(parents=True)
            if write_files is not None:
                write_files(staging)
        self._barrier()
        import torch.distributed.checkpoint as dcp

        # Without an initialized process group torch.distributed.checkpoint saves and loads in one
        # process by itself; no ``no_dist=``, which older torch does not accept.
        if self.config.async_save:
            if not _async_save_copies_cpu_tensors():
                state_dict = _copy_cpu_tensors(state_dict)
            future = dcp.async_save(state_dict, checkpoint_id=staging, process_group=self._async_group)
            self._pending = (future, iteration)
        else:
            dcp.save(state_dict, checkpoint_id=staging, process_group=self.process_group)
            self._publish(iteration)
            self._barrier()

    def wait(self) -> None:
        """Finish a pending asynchronous save and mark it latest."""
        if self._pending is None:
            return
        future, iteration = self._pending
        self._pending = None
        future.result()
        self._publish(iteration)
        self._barrier()

    def _publish(self, iteration: int) -> None:
        """Rank 0: move the finished checkpoint into place, then point the latest marker at it."""
        if self.rank != 0:
            return
        final = checkpoint_dir(self.config.save, iteration)
        if final.exists():
            shutil.rmtree(final)
        os.replace(str(final) + IN_PROGRESS_SUFFIX, final)
        marker = Path(self.config.save) / LATEST_FILE
        temporary = marker.with_suffix(".tmp")
        with open(temporary, "w") as handle:
            handle.write(str(iteration))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, marker)

    def load(self, state_dict: dict[str, Any], iteration: int | None = None) -> int:
        """Fill ``state_dict`` in place from ``config.load`` (the latest checkpoint by default).

        Tensors may be sharded differently from when they were saved. Returns the iteration loaded.

        Raises:
            FileNotFoundError: there is no complete checkpoint to load.
        """
        import torch.distributed.checkpoint as dcp

        iteration, directory = self._load_directory(iteration)
        dcp.load(state_dict, checkpoint_id=directory, process_group=self.process_group)
        return iteration

    def saved_keys(self, iteration: int | None = None) -> set[str]:
        """The keys the checkpoint of ``iteration`` in ``config.load`` (the latest by default) holds,
        nested dicts flattened to dotted keys as ``load`` matches them (not collective).

        A caller loads optional entries (left out of some checkpoints) only when they are here.

        Raises:
            FileNotFoundError: there is no complete checkpoint to look at.
        """
        import torch.distributed.checkpoint as dcp

        directory = self._load_directory(iteration)[1]
        return set(dcp.FileSystemReader(directory).read_metadata().state_dict_metadata)

    def _load_directory(self, iteration: int | None) -> tuple[int, Path]:
        """``iteration`` (the latest one when ``None``) and its checkpoint directory under ``config.load``."""
        if self.config.load is None:
            raise ConfigError(["load"], "loading needs a load directory")
        if iteration is None:
            iteration = latest_iteration(self.config.load)
            if iteration is None:
                raise FileNotFoundError(
                    f"no {LATEST_FILE} in {self.config.load}: nothing has been saved there"
                )
        directory = checkpoint_dir(self.config.load, iteration)
        if not directory.is_dir():
            raise FileNotFoundError(f"no checkpoint of iteration {iteration} at {directory}")
        return iteration, directory
