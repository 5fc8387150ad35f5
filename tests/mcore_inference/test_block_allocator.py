"""Block allocator: free list, reference counts, prefix cache with collision check and LRU eviction."""

import pytest
from mcore_inference import BlockAllocator, BlockOverflowError, block_allocator


def test_allocate_release_and_overflow():
    allocator = BlockAllocator(4, 2)
    blocks = allocator.allocate(3)
    assert sorted(blocks) == [0, 1, 2] and allocator.num_free_blocks == 1
    with pytest.raises(BlockOverflowError, match="need 2 KV-cache blocks, 1 available"):
        allocator.allocate(2)
    assert allocator.num_free_blocks == 1  # a refused allocation takes nothing
    allocator.release(blocks)
    assert allocator.num_free_blocks == 4
    with pytest.raises(ValueError, match="released more often"):
        allocator.release([blocks[0]])


def test_prefix_match_shares_blocks_and_counts_references():
    allocator = BlockAllocator(8, 2)
    tokens = [1, 2, 3, 4, 5]
    first = allocator.allocate(3)
    parent = allocator.register(first[0], None, tokens[0:2])
    allocator.register(first[1], parent, tokens[2:4])
    blocks, hashes = allocator.match_prefix(tokens, max_blocks=10)
    assert blocks == first[:2] and len(hashes) == 2
    assert allocator.ref_counts[first[0]] == 2
    # a different first block changes every later hash: no match
    assert allocator.match_prefix([9, 2, 3, 4], max_blocks=10) == ([], [])
    assert allocator.match_prefix(tokens, max_blocks=1)[0] == first[:1]


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first():
    allocator = BlockAllocator(3, 1)
    a, b, c = allocator.allocate(3)
    ha = allocator.register(a, None, [10])
    allocator.register(b, None, [20])
    allocator.release([b])
    allocator.release([a])  # a is now the most recently released
    allocator.release([c])  # uncached: straight to the free list
    assert allocator.num_free_blocks == 3 and allocator.num_cached_blocks == 2
    assert allocator.allocate(1) == [c]  # free blocks before cached ones
    assert allocator.allocate(1) == [b]  # then the least recently used cached block
    assert allocator.num_cached_blocks == 1
    assert allocator.match_prefix([20], 1) == ([], [])  # b's content is gone
    assert allocator.match_prefix([10], 1) == ([a], [ha])  # a survived, referenced again
    assert allocator.num_free_blocks == 0


def test_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(block_allocator, "block_hash", lambda parent, tokens: 42)
    allocator = BlockAllocator(4, 2)
    (block,) = allocator.allocate(1)
    allocator.register(block, None, [1, 2])
    assert allocator.match_prefix([3, 4], 1) == ([], [])  # same hash, other tokens
    assert allocator.match_prefix([1, 2], 1)[0] == [block]


def test_prefix_caching_off_registers_nothing():
    allocator = BlockAllocator(2, 1, enable_prefix_caching=False)
    (block,) = allocator.allocate(1)
    allocator.register(block, None, [1])
    allocator.release([block])
    assert allocator.num_cached_blocks == 0 and allocator.match_prefix([1], 1) == ([], [])
