"""Every collective mcore-fsdp issues goes through here: one place to count them, and
device-agnostic fallbacks for backends that lack a fused collective.

``all_gather_into_tensor`` and ``reduce_scatter_tensor`` are native on NCCL and on gloo in recent
PyTorch; where a backend rejects one, the list-based ``all_gather`` or an ``all_reduce`` followed by
a local slice produces the same result.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_active_counters: list[Counter] = []
# (operation, backend) pairs found unsupported: later calls go straight to the fallback.
_unsupported: set[tuple[str, str]] = set()


@contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count the collectives mcore-fsdp issues inside the block, by kind.

    Kinds: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``. A collective that
    runs through a fallback still counts once, under its own kind.
    """
    counter: Counter = Counter()
    _active_counters.append(counter)
    try:
        yield counter
    finally:
        _active_counters.remove(counter)


class Pending:
    """An issued collective: ``wait()`` blocks until it is done and runs the follow-up, if any."""

    def __init__(self, work: dist.Work | None, then: Callable[[], None] | None = None) -> None:
        self._work = work
        self._then = then

    def then(self, follow_up: Callable[[], None]) -> Pending:
        """A ``Pending`` that waits for this one, then runs ``follow_up``."""
        return Pending(None, then=lambda: (self.wait(), follow_up()))

    def wait(self) -> None:
        """Block until the collective has finished and its follow-up has run."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def _count(kind: str) -> None:
    for counter in _active_counters:
        counter[kind] += 1


def _is_unsupported(error: Exception) -> bool:
    if isinstance(error, NotImplementedError):
        return True
    text = str(error).lower()
    return any(marker in text for marker in ("not supported", "unsupported", "does not support"))


def _try_native(operation: str, group: ProcessGroup, native: Callable[[], dist.Work | None]):
    """Run ``native``; return ``(True, work)`` or ``(False, None)`` when the backend lacks it."""
    key = (operation, str(dist.get_backend(group)))
    if key in _unsupported:
        return False, None
    try:
        return True, native()
    except (RuntimeError, NotImplementedError) as error:
        if not _is_unsupported(error):
            raise
        _unsupported.add(key)
        return False, None


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool = False
) -> Pending:
    """Gather equal ``shard``s of every rank of ``group`` into ``output``, in rank order."""
    _count("all_gather")
    ok, work = _try_native(
        "all_gather_into_tensor",
        group,
        lambda: dist.all_gather_into_tensor(output, shard, group=group, async_op=async_op),
    )
    if not ok:
        chunks = list(output.chunk(dist.get_world_size(group)))
        work = dist.all_gather(chunks, shard, group=group, async_op=async_op)
    return Pending(work)


def reduce_scatter(
    output: torch.Tensor, full: torch.Tensor, group: ProcessGroup, async_op: bool = False
) -> Pending:
    """Sum ``full`` over ``group`` and leave this rank's equal slice of the sum in ``output``."""
    _count("reduce_scatter")
    ok, work = _try_native(
        "reduce_scatter_tensor",
        group,
        lambda: dist.reduce_scatter_tensor(output, full, group=group, async_op=async_op),
    )
    if ok:
        return Pending(work)
    work = dist.all_reduce(full, group=group, async_op=async_op)
    rank_slice = full.chunk(dist.get_world_size(group))[dist.get_rank(group)]
    pending = Pending(work, then=lambda: output.copy_(rank_slice))
    if not async_op:
        pending.wait()
    return pending


def all_reduce(
    tensor: torch.Tensor, group: ProcessGroup, async_op: bool = False, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> Pending:
    """Reduce ``tensor`` in place over ``group`` (a sum unless ``op`` says otherwise)."""
    _count("all_reduce")
    return Pending(dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def all_to_all(
    output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup, async_op: bool = False
) -> Pending:
    """Send the i-th equal slice of ``tensor`` to rank i of ``group``; receive into ``output``.

    Where the backend lacks it, every rank gathers all inputs and keeps the slices meant for it.
    """
    _count("all_to_all")
    ok, work = _try_native(
        "all_to_all_single",
        group,
        lambda: dist.all_to_all_single(output, tensor, group=group, async_op=async_op),
    )
    if ok:
        return Pending(work)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gathered = tensor.new_empty((world, *tensor.shape))
    work = dist.all_gather(list(gathered.unbind(0)), tensor, group=group, async_op=async_op)
    pending = Pending(
        work, then=lambda: output.copy_(gathered.view(world, world, -1)[:, rank].reshape(output.shape))
    )
    if not async_op:
        pending.wait()
    return pending
