"""Device and backend selection: the one place that decides between CUDA/NCCL and CPU/gloo."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def get_backend() -> str:
    """The collective backend for this machine: ``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def get_device(local_rank: int | None = None) -> torch.device:
    """The device this process computes on: ``cuda:<local_rank>`` when CUDA is available, else CPU.

    ``local_rank`` defaults to the ``LOCAL_RANK`` environment variable (0 when unset).
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank)


def get_group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a tensor must live on to take part in a collective over ``group``.

    NCCL groups communicate CUDA tensors (on the current CUDA device); every other backend CPU tensors.
    """
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize_device() -> None:
    """Wait for queued device work (a no-op unless CUDA is in use), so host timers measure it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
