"""Which engine a new request goes to: round-robin, least-loaded, or by prompt-prefix affinity."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

from .block_allocator import block_hash


class RoutingPolicy(enum.StrEnum):
    """How the coordinator picks an engine for a request.

    ``round_robin``: the live engines in turn. ``least_loaded``: the engine with the fewest
    unfinished requests (ties in turn). ``prefix_affinity``: the engine that last served the
    longest prefix of the prompt, in whole blocks of ``prefix_block_size`` tokens (the unit of the
    engines' prefix cache), so that prompts sharing a prefix meet the cache that holds it; a
    prompt with no known prefix goes to the least-loaded engine."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX_AFFINITY = "prefix_affinity"


class Router:
    """Routing state over the live engines (any hashable ids), for one coordinator thread."""

    def __init__(self, policy: RoutingPolicy | str, prefix_block_size: int = 16, max_prefixes: int = 1 << 16):
        self.policy = RoutingPolicy(policy)
        if not (isinstance(prefix_block_size, int) and prefix_block_size >= 1):
            raise ValueError(f"prefix_block_size must be an int >= 1, got {prefix_block_size!r}")
        self.prefix_block_size = prefix_block_size
        self.max_prefixes = max_prefixes
        self._engines: list[Hashable] = []
        self._turn = 0
        self._prefixes: OrderedDict[int, Hashable] = OrderedDict()  # block-chain hash -> engine

    @property
    def engines(self) -> list[Hashable]:
        """The engines requests can go to, in the order they joined."""
        return list(self._engines)

    def add_engine(self, engine: Hashable) -> None:
        """Make ``engine`` a target (again)."""
        if engine not in self._engines:
            self._engines.append(engine)

    def remove_engine(self, engine: Hashable) -> None:
        """No request goes to ``engine`` any more; prefixes it served are forgotten."""
        if engine in self._engines:
            self._engines.remove(engine)
        for key in [k for k, e in self._prefixes.items() if e == engine]:
            del self._prefixes[key]

    def choose(self, prompt_tokens: Sequence[int], loads: Mapping[Hashable, int]) -> Hashable:
        """The engine for a request of ``prompt_tokens``; ``loads`` holds each engine's unfinished
        requests. ``LookupError`` when there is no engine."""
        if not self._engines:
            raise LookupError("no engine to route to")
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            return self._next_in_turn(self._engines)
        if self.policy is RoutingPolicy.PREFIX_AFFINITY:
            hashes = self._block_hashes(prompt_tokens)
            engine = next((self._prefixes[h] for h in reversed(hashes) if h in self._prefixes), None)
            if engine is None:
                engine = self._least_loaded(loads)
            for h in hashes:  # this engine now holds every block of the prompt
                self._prefixes[h] = engine
                self._prefixes.move_to_end(h)
            while len(self._prefixes) > self.max_prefixes:
                self._prefixes.popitem(last=False)
            return engine
        return self._least_loaded(loads)

    def _next_in_turn(self, candidates: Sequence[Hashable]) -> Hashable:
        """The first of ``candidates`` at or after the turn (in join order); the turn moves past it."""
        n = len(self._engines)
        for offset in range(n):
            engine = self._engines[(self._turn + offset) % n]
            if engine in candidates:
                self._turn = (self._turn + offset + 1) % n
                return engine
        raise LookupError("no candidate engine is live")

    def _least_loaded(self, loads: Mapping[Hashable, int]) -> Hashable:
        lowest = min(loads.get(e, 0) for e in self._engines)
        return self._next_in_turn([e for e in self._engines if loads.get(e, 0) == lowest])

    def _block_hashes(self, tokens: Sequence[int]) -> list[int]:
        """Chained hashes of the prompt's whole blocks (as the engine's prefix cache keys them)."""
        size, parent, hashes = self.prefix_block_size, None, []
        for start in range(0, len(tokens) - size + 1, size):
            parent = block_hash(parent, tokens[start : start + size])
            hashes.append(parent)
        return hashes
