"""A tensor-parallel engine served through its first rank.

At TP > 1 every rank runs its own ``DynamicInferenceEngine`` with the same requests added in the
same order and the same steps (see ``DynamicInferenceEngine``). ``TensorParallelLeader`` wraps the
engine of TP rank 0, the one an ``EngineEndpoint`` serves: every call that changes the engine is
queued and broadcast over a control group (with the next step, suspend, resume or shutdown), and
``follow_leader`` repeats them, in order, on each other rank's engine. Requests get the same ids
on every rank, since every add (a refused one too) is repeated."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from .errors import EngineGroupError
from .request import Request
from .sampling_params import SamplingParams

_logger = logging.getLogger(__name__)

_ADD, _ABORT, _STEP, _SUSPEND, _RESUME, _SHUTDOWN = range(6)


def _broadcast(ops: list[tuple] | None, group: dist.ProcessGroup) -> list[tuple]:
    """``ops`` from the group's first rank to the others (what it sent, on every rank);
    ``EngineGroupError`` when a rank is gone."""
    holder = [ops]
    try:
        dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    except Exception as error:  # a peer's closed connection, or a timeout
        raise EngineGroupError(f"the tensor-parallel control channel failed: {error}") from error
    return holder[0]


class TensorParallelLeader:
    """``engine`` (TP rank 0's) for an ``EngineEndpoint``, mirrored to the ranks of ``group``
    (a gloo group of the engine's TP ranks, this rank first) that run ``follow_leader``."""

    def __init__(self, engine: Any, group: dist.ProcessGroup):
        self.engine = engine
        self.group = group
        self._pending: list[tuple] = []

    def add_request(
        self, prompt: Sequence[int] | str, sampling_params: SamplingParams | None = None, *, on_output=None
    ) -> Request:
        """``engine.add_request``, repeated on the other ranks before the next step."""
        request = self.engine.add_request(prompt, sampling_params, on_output=on_output)
        self._pending.append((_ADD, prompt, sampling_params))
        return request

    def abort(self, request_id: int) -> bool:
        """``engine.abort``, repeated on the other ranks before the next step."""
        unfinished = self.engine.abort(request_id)
        self._pending.append((_ABORT, request_id))
        return unfinished

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[Request]:
        """Send the queued calls and the step to the other ranks, then step."""
        self._send(_STEP)
        return self.engine.step()

    def suspend(self) -> int:
        self._send(_SUSPEND)
        return self.engine.suspend()

    def resume(self) -> None:
        self._send(_RESUME)
        self.engine.resume()

    def shutdown(self) -> None:
        """Shut this engine down and end the other ranks' ``follow_leader``."""
        self.engine.shutdown()
        self._send(_SHUTDOWN)

    def cache_stats(self) -> dict[str, float]:
        return self.engine.cache_stats()

    def _send(self, op: int) -> None:
        ops, self._pending = [*self._pending, (op,)], []
        _broadcast(ops, self.group)


def follow_leader(engine: Any, group: dist.ProcessGroup) -> None:
    """Repeat on ``engine`` what ``TensorParallelLeader`` on the first rank of ``group`` does to
    its engine, until it shuts down; ``EngineGroupError`` when the leader is gone."""
    while True:
        for op, *args in _broadcast(None, group):
            if op == _ADD:
                engine.add_request(*args)
            elif op == _ABORT:
                engine.abort(*args)
            elif op == _STEP:
                try:
                    engine.step()
                except Exception:  # the leader's step raised alike: its requests failed, go on
                    _logger.exception("engine step raised; its requests failed, following goes on")
            elif op == _SUSPEND:
                engine.suspend()
            elif op == _RESUME:
                engine.resume()
            elif op == _SHUTDOWN:
                engine.shutdown()
                return
