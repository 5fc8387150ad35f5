"""The paged KV cache: sizing from a memory budget, step limits and layout, block count agreed
over ranks, and paged attention against dense attention."""

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from mcore_inference import (
    DynamicInferenceContext,
    MaxSequenceLengthOverflowError,
    Request,
    RequestOverflowError,
    SamplingParams,
    ScheduledChunk,
    TokenOverflowError,
    paged_attention,
)
from mcore_inference.model_runner import ModelRunner

_ids = itertools.count()

SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
PER_BLOCK = 2 * 2 * 4 * 2 * 8 * 4  # k+v, layers, block, heads, dim, fp32


def test_budget_in_bytes_and_as_fraction():
    context = DynamicInferenceContext(**SHAPE, kv_cache_memory=10 * PER_BLOCK + PER_BLOCK // 2)
    assert context.bytes_per_block == PER_BLOCK and context.num_blocks == 10
    assert context.memory_bytes == 10 * PER_BLOCK and context.max_sequence_length == 40
    assert context.kv_cache.shape == (2, 2, 40 + 1, 2, 8)  # and the padding slot
    assert context.padding_slot == 40
    assert DynamicInferenceContext(**SHAPE, kv_cache_memory=1e-6).num_blocks >= 1
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            DynamicInferenceContext(**SHAPE, kv_cache_memory=bad)
    assert context.deallocate() == 10 * PER_BLOCK and context.kv_cache is None
    assert context.deallocate() == 0
    context.allocate()
    assert context.is_allocated


def _chunk(tokens, blocks, start, length):
    request = Request(next(_ids), tokens, SamplingParams())
    request.block_ids = blocks
    return ScheduledChunk(request, start, length)


def test_step_limits_raise_typed_errors():
    context = DynamicInferenceContext(
        **SHAPE, kv_cache_memory=8 * PER_BLOCK, max_requests=2, max_tokens=5, max_sequence_length=20
    )
    chunk = _chunk([1, 2, 3], [0], 0, 3)
    runner = ModelRunner(None, context)
    with pytest.raises(RequestOverflowError, match="max_requests is 2"):
        runner.prepare_step([chunk, chunk, chunk])
    with pytest.raises(TokenOverflowError, match="6 tokens in one step, max_tokens is 5"):
        runner.prepare_step([chunk, chunk])
    with pytest.raises(MaxSequenceLengthOverflowError, match="max_sequence_length 20"):
        context.check_sequence_length(21)
    ids, positions, slices = runner.prepare_step([chunk, _chunk([4, 5, 6, 7, 8, 9], [1, 2], 5, 1)])
    assert ids.tolist() == [[1, 2, 3, 9]] and positions.tolist() == [[0, 1, 2, 5]]
    assert context.logits_indices.tolist() == [2, 3] and slices == [slice(0, 1), slice(1, 2)]
    assert context.token_slots.tolist() == [0, 1, 2, 2 * 4 + 1]  # position 5 -> block 2, offset 1


def test_block_count_is_the_minimum_over_ranks(run_distributed):
    def body():
        budget = (10 + 5 * dist.get_rank()) * PER_BLOCK
        return DynamicInferenceContext(
            **SHAPE, kv_cache_memory=budget, block_count_group=dist.group.WORLD
        ).num_blocks

    assert run_distributed(body, 2) == [10, 10]


def _dense(q, k, v, scale, window, sinks):
    """Plain causal attention of one sequence: q [Q, n, d] at the last Q positions of k, v [L, g, d]."""
    n, g = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(n // g, 1), v.repeat_interleave(n // g, 1)
    scores = torch.einsum("qnd,lnd->nql", q, k) * scale
    qpos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])[:, None]
    distance = qpos - torch.arange(k.shape[0])
    allowed = (distance >= 0) & (distance < (window or math.inf))
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.view(n, 1, 1).expand(n, q.shape[0], 1)), -1)
    probs = scores.softmax(-1)[..., : k.shape[0]]
    return torch.einsum("nql,lnd->qnd", probs, v).reshape(q.shape[0], -1)


@pytest.mark.parametrize(
    "window, sinks", [(None, None), (3, None), (None, torch.tensor([0.5, -1.0, 0.0, 2.0]))]
)
def test_paged_attention_matches_dense(window, sinks):
    gen = torch.Generator().manual_seed(0)
    block_size, lengths, queries = 4, [9, 3, 13], [4, 1, 13]
    cache_k = torch.randn(40, 2, 8, generator=gen)
    cache_v = torch.randn(40, 2, 8, generator=gen)
    tables = [[7, 2, 5], [0], [9, 1, 4, 3]]
    for length, count, table in zip(lengths, queries, tables, strict=True):
        q = torch.randn(1, count, 4, 8, generator=gen)
        positions = torch.arange(length)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        out = paged_attention(
            q,
            cache_k,
            cache_v,
            slots[None],
            positions[None, length - count :],
            scale=0.3,
            window_size=window,
            sink_logits=sinks,
        )
        expected = _dense(q[0], cache_k[slots], cache_v[slots], 0.3, window, sinks)
        torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)
