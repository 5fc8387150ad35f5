"""KV-cache block bookkeeping: a free list, reference counts and a prefix cache."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from mcore_api import internal_api

from .errors import BlockOverflowError


@internal_api
def block_hash(parent_hash: int | None, tokens: Sequence[int]) -> int:
    """Hash of a full block: its parent block's hash (``None`` for the first) and its tokens."""
    return hash((parent_hash, tuple(tokens)))


@internal_api
class BlockAllocator:
    """Hands out block ids ``0 .. num_blocks - 1``.

    Every block in use has a reference count (requests sharing a cached prefix share its blocks).
    With ``enable_prefix_caching`` a full block can be registered under ``block_hash(parent, tokens)``;
    when its last reference goes it stays cached (evictable, least recently used first) until an
    allocation needs it. A lookup compares the stored parent hash and tokens, so a hash collision
    is a miss, never a wrong hit.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise BlockOverflowError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.reset()

    def reset(self) -> None:
        """Forget every allocation and cached block."""
        self._free: deque[int] = deque(range(self.num_blocks))
        self.ref_counts = [0] * self.num_blocks
        self._key_of: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # block -> (parent, tokens)
        self._hash_of: dict[int, int] = {}  # block -> hash
        self._cached: dict[int, int] = {}  # hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks with reference count 1; free blocks first, then the least recently
        used evictable cached blocks. Raises ``BlockOverflowError`` (allocating none) if too few."""
        if count > self.num_free_blocks:
            raise BlockOverflowError(f"need {count} KV-cache blocks, {self.num_free_blocks} available")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(block)]
                del self._key_of[block]
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced cached blocks become evictable."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise ValueError(f"block {block} released more often than allocated")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def register(self, block: int, parent_hash: int | None, tokens: Sequence[int]) -> int:
        """Record that ``block`` holds the full block ``tokens`` after ``parent_hash``; return its
        hash. A block already cached under that hash keeps the entry (``block`` stays private)."""
        key = (parent_hash, tuple(tokens))
        digest = block_hash(*key)
        if self.enable_prefix_caching and digest not in self._cached and block not in self._hash_of:
            self._cached[digest] = block
            self._hash_of[block] = digest
            self._key_of[block] = key
        return digest

    def match_prefix(self, tokens: Sequence[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """Cached blocks holding the leading full blocks of ``tokens`` (at most ``max_blocks``),
        each now referenced once more, and their hashes."""
        blocks: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return blocks, hashes
        parent = None
        size = self.block_size
        for index in range(min(max_blocks, len(tokens) // size)):
            key = (parent, tuple(tokens[index * size : (index + 1) * size]))
            digest = block_hash(*key)
            block = self._cached.get(digest)
            if block is None or self._key_of[block] != key:
                break
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1
            blocks.append(block)
            hashes.append(digest)
            parent = digest
        return blocks, hashes
