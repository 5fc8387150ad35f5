"""Which tokens of which requests the next step computes (``ScheduledChunk``s): decodes first,
then (chunked) prefills, within the context's limits and free blocks."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from mcore_api import internal_api

from .context import DynamicInferenceContext
from .request import Request, RequestEventType, RequestStatus


@internal_api
@dataclass
class ScheduledChunk:
    """Tokens ``start .. start + length - 1`` of ``request.tokens`` computed in this step, and
    which of their logits the step needs (``"none"``, ``"last"`` to sample, ``"all"`` for
    prompt log-probabilities)."""

    request: Request
    start: int
    length: int
    logits: Literal["none", "last", "all"] = "last"

    @property
    def end(self) -> int:
        return self.start + self.length


@internal_api
class Scheduler:
    """Holds the waiting queue and the active requests (those owning cache blocks, in admission order).

    ``schedule()`` fills one step within the context's ``max_requests`` and ``max_tokens``: every
    active request one token at a time if it is decoding, then the rest of partly computed prompts,
    then waiting requests in arrival order, a long prompt cut into chunks across steps. A waiting
    request first takes the cached blocks of its longest cached prefix. When an active request
    needs a block and none is free, the most recently admitted unscheduled request is preempted:
    its blocks are freed and it waits at the front of the queue to be recomputed.
    """

    def __init__(self, context: DynamicInferenceContext):
        self.context = context
        self.allocator = context.allocator
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        self.prefix_cache_hit_tokens = 0  # prompt tokens served from the prefix cache so far
        self.prefix_cache_query_tokens = 0  # prompt tokens looked up in the prefix cache so far

    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.context.max_tokens
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        decoding = [r for r in self.active if len(r.tokens) - r.num_computed_tokens == 1]
        prefilling = [r for r in self.active if len(r.tokens) - r.num_computed_tokens > 1]
        for request in decoding + prefilling:
            if len(chunks) == self.context.max_requests or budget == 0:
                break
            if request.status is not RequestStatus.ACTIVE:  # preempted in this loop
                continue
            length = min(len(request.tokens) - request.num_computed_tokens, budget)
            if not self._reserve_blocks(request, request.num_computed_tokens + length, scheduled):
                continue
            chunks.append(self._chunk(request, length))
            scheduled.add(request.request_id)
            budget -= length
        while self.waiting and len(chunks) < self.context.max_requests and budget > 0:
            request = self.waiting[0]
            if not request.block_ids:
                self._match_prefix(request)
            length = min(len(request.tokens) - request.num_computed_tokens, budget)
            needed = self.context.blocks_needed(request.num_computed_tokens + length) - len(request.block_ids)
            if needed > self.allocator.num_free_blocks:
                self.release(request)  # give the prefix back; try again next step
                break
            request.block_ids += self.allocator.allocate(needed)
            self.waiting.popleft()
            request.status = RequestStatus.ACTIVE
            self.active.append(request)
            chunks.append(self._chunk(request, length))
            budget -= length
        return chunks

    def _chunk(self, request: Request, length: int) -> ScheduledChunk:
        end = request.num_computed_tokens + length
        prompt_length = len(request.prompt_tokens)
        if request.sampling_params.prompt_logprobs and len(request.prompt_logprobs) < prompt_length:
            logits = "all"
        else:
            logits = "last" if end == len(request.tokens) else "none"
        return ScheduledChunk(request, request.num_computed_tokens, length, logits)

    def _match_prefix(self, request: Request) -> None:
        if request.sampling_params.prompt_logprobs:  # needs the logits of every prompt position
            return
        # Keep at least the last token to compute: its logits give the next token.
        max_blocks = (len(request.tokens) - 1) // self.context.block_size
        blocks, hashes = self.allocator.match_prefix(request.tokens, max_blocks)
        request.block_ids, request.block_hashes = blocks, hashes
        request.num_computed_tokens = len(blocks) * self.context.block_size
        self.prefix_cache_hit_tokens += request.num_computed_tokens
        self.prefix_cache_query_tokens += len(request.tokens)

    def _reserve_blocks(self, request: Request, num_tokens: int, scheduled: set[int]) -> bool:
        """Give ``request`` blocks for ``num_tokens``, preempting others; ``False`` if it was preempted itself."""
        needed = self.context.blocks_needed(num_tokens) - len(request.block_ids)
        while needed > self.allocator.num_free_blocks:
            victims = [r for r in self.active if r.request_id not in scheduled and r is not request]
            victim = victims[-1] if victims else request
            self.preempt(victim)
            if victim is request:
                return False
        if needed > 0:
            request.block_ids += self.allocator.allocate(needed)
        return True

    def preempt(self, request: Request) -> None:
        """Free ``request``'s blocks and put it at the front of the queue to be recomputed."""
        self.active.remove(request)
        self.release(request)
        request.status = RequestStatus.WAITING
        request.add_event(RequestEventType.EVICT)
        self.waiting.appendleft(request)

    def release(self, request: Request) -> None:
        """Drop ``request``'s cache blocks; its computed tokens must be recomputed."""
        self.allocator.release(request.block_ids)
        self.context.drop_request(request.request_id)
        request.block_ids, request.block_hashes = [], []
        request.num_computed_tokens = 0

    def finish(self, request: Request) -> None:
        """Remove a completed or failed request, freeing its blocks."""
        if request in self.active:
            self.active.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.release(request)

    def register_full_blocks(self, request: Request) -> None:
        """Offer the request's newly computed full blocks to the prefix cache."""
        size = self.context.block_size
        for index in range(len(request.block_hashes), request.num_computed_tokens // size):
            parent = request.block_hashes[-1] if request.block_hashes else None
            tokens = request.tokens[index * size : (index + 1) * size]
            request.block_hashes.append(self.allocator.register(request.block_ids[index], parent, tokens))

    def requeue_all(self) -> list[Request]:
        """Free every active request's blocks and queue all unfinished requests in arrival order."""
        for request in self.active:
            self.release(request)
            request.status = RequestStatus.WAITING
        requests = sorted([*self.active, *self.waiting], key=lambda r: r.request_id)
        self.active = []
        self.waiting = deque(requests)
        return requests
