"""``RouterReplay``: record the experts a router picked and make later forwards pick the same.

One ``RouterReplay`` per router (``attach_router_replay`` puts one on every ``TopKRouter`` of a
model). Its ``action`` says where a forward's top-k expert ids come from:

- ``RECORD``: computed as usual and appended to ``recorded``;
- ``REPLAY_FORWARD``: taken from the front of ``recorded`` (what an earlier ``RECORD`` left there,
  or what ``push`` put there, e.g. the routing an inference engine used), not computed;
- ``REPLAY_BACKWARD``: computed as usual; only the recompute below applies;
- ``None``: computed as usual.

Under every action the recompute of a checkpointed forward (activation recompute, during backward)
reuses the routing of that forward instead of routing again, so backward sees the forward's
experts even where recomputed scores would tie-break differently. Both queues are first in, first
out per router: a pipeline schedule (1F1B, interleaved with virtual stages) runs each chunk's
micro-batches forward, and backward, in micro-batch order, and each router belongs to one chunk,
so the n-th forward of a router is replayed by its n-th replayed forward and recomputed by its
n-th recompute.

Replayed probabilities are the router's own scores at the replayed experts, so with the same
weights and inputs a replayed forward is bitwise the recorded one.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable

import torch
from mcore_api import experimental_api

from ..recompute_phase import activation_recompute_phase


@experimental_api
class RouterReplayAction(enum.Enum):
    """What a router's forward does with its ``RouterReplay`` (see the module docstring)."""

    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"
    REPLAY_BACKWARD = "replay_backward"


@experimental_api
class RouterReplay:
    """The recorded routings of one router (``recorded``, oldest first) and its ``action``."""

    def __init__(self, action: RouterReplayAction | None = None):
        self.action = action
        self.recorded: deque[torch.Tensor] = deque()
        self._for_recompute: deque[torch.Tensor] = deque()

    def push(self, indices: torch.Tensor) -> None:
        """Queue a routing ``[tokens, k]`` of expert ids for a ``REPLAY_FORWARD`` forward."""
        self.recorded.append(indices.detach().clone())

    def clear(self) -> None:
        """Forget the recorded routings and any pending recompute."""
        self.recorded.clear()
        self._for_recompute.clear()

    def route(self, compute: Callable[[], torch.Tensor], num_tokens: int, topk: int) -> torch.Tensor:
        """The expert ids ``[num_tokens, topk]`` of this forward; ``compute()`` routes afresh.

        Raises:
            RuntimeError: a replay with nothing recorded left, or a recompute without its forward.
            ValueError: a replayed routing of another shape than this forward's.
        """
        phase = activation_recompute_phase()
        if phase == "recompute":
            if not self._for_recompute:
                raise RuntimeError("RouterReplay: a recompute without a routing kept by its forward")
            return self._for_recompute.popleft()
        if self.action is RouterReplayAction.REPLAY_FORWARD:
            if not self.recorded:
                raise RuntimeError(
                    "RouterReplay: REPLAY_FORWARD with no recorded routing left (record or push one "
                    "per forward of this router)"
                )
            indices = self.recorded.popleft()
            if tuple(indices.shape) != (num_tokens, topk):
                raise ValueError(
                    f"RouterReplay: the replayed routing has shape {tuple(indices.shape)}, this forward "
                    f"routes {num_tokens} tokens to {topk} experts"
                )
        else:
            indices = compute()
            if self.action is RouterReplayAction.RECORD:
                self.recorded.append(indices.detach().clone())
        if phase == "forward":
            self._for_recompute.append(indices)
        return indices


@experimental_api
def attach_router_replay(
    model: torch.nn.Module, action: RouterReplayAction | None = None
) -> list[RouterReplay]:
    """Give every router of ``model`` that supports replay (``TopKRouter``) a new ``RouterReplay``
    with ``action``; returns them in module order."""
    replays = []
    for module in model.modules():
        if hasattr(module, "router_replay"):
            module.router_replay = RouterReplay(action)
            replays.append(module.router_replay)
    return replays


@experimental_api
def set_router_replay_action(model: torch.nn.Module, action: RouterReplayAction | None) -> None:
    """Set ``action`` on every ``RouterReplay`` attached to ``model``'s routers."""
    for module in model.modules():
        replay = getattr(module, "router_replay", None)
        if isinstance(replay, RouterReplay):
            replay.action = action
