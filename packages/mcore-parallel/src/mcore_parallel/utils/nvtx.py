"""NVTX ranges for GPU profilers; no-ops where CUDA is unavailable."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """Mark the block as range ``name`` in Nsight timelines. Usable as a decorator too.

    On a machine without CUDA it does nothing (and never initialises CUDA).
    """
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
