"""The random stream for dropout inside tensor-parallel regions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from mcore_parallel import MODEL_PARALLEL_RNG, get_rng_tracker


@contextlib.contextmanager
def tensor_parallel_rng(tp_group: dist.ProcessGroup) -> Iterator[None]:
    """Draw from mcore-parallel's per-TP-rank stream (``model_parallel_manual_seed``).

    Without tensor parallelism and without that stream, the default generator is used.

    Raises:
        RuntimeError: TP > 1 and the stream was never seeded (TP ranks would share dropout masks).
    """
    tracker = get_rng_tracker()
    if MODEL_PARALLEL_RNG not in tracker.get_states():
        if dist.get_world_size(tp_group) > 1:
            raise RuntimeError(
                "dropout under tensor parallelism needs mcore_parallel.model_parallel_manual_seed(seed, tp_rank)"
            )
        yield
        return
    with tracker.fork():
        yield
