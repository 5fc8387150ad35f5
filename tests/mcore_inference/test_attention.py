"""The attention paths of a step (decode rows, prefill chunks with and without a cached prefix,
mixed batches, the padded decode of CUDA graphs) against a naive reference: per query, in float32,
``softmax(q k^T * scale + mask) v`` over the request's cached keys, with windows, sinks and GQA.
Every test runs with every row (decode rows and prefill chunks) on mcore-kernels' native kernel and on the PyTorch path."""

import itertools

import pytest
import torch
from mcore_inference import DynamicInferenceContext, Request, SamplingParams, ScheduledChunk
from mcore_inference.model_runner import DecodeBuffers, ModelRunner
from mcore_kernels import use_backend
from mcore_kernels.native_build import native_library_error

GROUPS, DIM, BLOCK = 2, 8, 4
SCALE = 0.35
_ids = itertools.count()


@pytest.fixture(autouse=True, params=["native", "reference"])
def decode_backend(request):
    """Every row through the native kernel, then through the PyTorch paths."""
    if request.param == "native" and native_library_error() is not None:
        pytest.skip(f"the native CPU kernels do not build here: {native_library_error()}")
    with use_backend(request.param):
        yield request.param


def _context(dtype=torch.float32):
    per_block = 2 * BLOCK * GROUPS * DIM * torch.empty((), dtype=dtype).element_size()
    context = DynamicInferenceContext(
        num_layers=1,
        num_kv_heads=GROUPS,
        head_dim=DIM,
        block_size=BLOCK,
        dtype=dtype,
        kv_cache_memory=40 * per_block,
        max_requests=16,
        max_tokens=256,
    )
    context.kv_cache.copy_(torch.randn(context.kv_cache.shape, generator=torch.Generator().manual_seed(1)))
    return context


def _chunks(context, spans):
    """One chunk per ``(start, length)``: a request of ``start + length`` tokens on shuffled blocks."""
    free = torch.randperm(context.num_blocks, generator=torch.Generator().manual_seed(2)).tolist()
    chunks = []
    for start, length in spans:
        request = Request(next(_ids), list(range(start + length)), SamplingParams())
        request.block_ids = [free.pop() for _ in range(context.blocks_needed(start + length))]
        chunks.append(ScheduledChunk(request, start, length))
    return chunks


def _reference(context, chunks, query, scale, window, sinks):
    """Each query alone, in float32, over its request's keys read slot by slot from the cache."""
    keys, values = context.kv_cache[0, 0].float(), context.kv_cache[0, 1].float()
    heads = query.shape[1]
    per_group = heads // GROUPS
    rows = []
    for chunk in chunks:
        blocks = chunk.request.block_ids
        for position in range(chunk.start, chunk.end):
            slots = torch.tensor([blocks[j // BLOCK] * BLOCK + j % BLOCK for j in range(position + 1)])
            distance = position - torch.arange(position + 1)
            allowed = distance < (window if window is not None else 1 << 30)
            q = query[len(rows)].float()
            out = []
            for head in range(heads):
                k, v = keys[slots, head // per_group], values[slots, head // per_group]
                scores = (k @ q[head]) * scale
                scores = scores.masked_fill(~allowed, float("-inf"))
                if sinks is not None:
                    scores = torch.cat((scores, sinks[head].view(1)))
                probs = torch.softmax(scores, 0)[: position + 1]
                out.append(probs @ v)
            rows.append(torch.cat(out))
    return torch.stack(rows)


def _attend(context, query, window, sinks):
    tokens = query.shape[0]
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(tokens, GROUPS, DIM, generator=gen).to(context.dtype)
    value = torch.randn(tokens, GROUPS, DIM, generator=gen).to(context.dtype)
    return context.attend(1, query, key, value, scale=SCALE, window_size=window, sink_logits=sinks)


SPANS = {
    "decode": [(0, 1), (4, 1), (16, 1), (32, 1), (6, 1)],
    "decode-equal": [(9, 1), (9, 1), (9, 1)],
    "prefill": [(0, 7)],
    "prefill-prefix": [(9, 6)],
    "prefill-aligned-prefix": [(16, 5)],
    "mixed": [(13, 1), (0, 11), (2, 1), (20, 9), (7, 1), (5, 4)],
}


@pytest.mark.parametrize("per_group", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 1, 3, 8])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("layout", sorted(SPANS))
def test_eager_step_matches_reference(layout, with_sinks, window, per_group):
    context = _context()
    chunks = _chunks(context, SPANS[layout])
    heads = GROUPS * per_group
    tokens = sum(c.length for c in chunks)
    query = torch.randn(tokens, heads, DIM, generator=torch.Generator().manual_seed(4))
    sinks = torch.linspace(-1.0, 2.0, heads) if with_sinks else None
    ModelRunner(None, context).prepare_step(chunks)
    out = _attend(context, query, window, sinks)
    expected = _reference(context, chunks, query, SCALE, window, sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_group", [1, 4])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_padded_decode_matches_reference(with_sinks, window, per_group):
    context = _context()
    chunks = _chunks(context, SPANS["decode"])
    heads = GROUPS * per_group
    query = torch.randn(8, heads, DIM, generator=torch.Generator().manual_seed(5))  # 3 padded rows
    sinks = torch.linspace(-1.0, 2.0, heads) if with_sinks else None
    buffers = DecodeBuffers(8, 16, context.device)
    slices = ModelRunner(None, context).prepare_padded_decode(chunks, buffers, rows=8, key_blocks=16)
    assert slices == [slice(i, i + 1) for i in range(5)]
    out = _attend(context, query, window, sinks)
    expected = _reference(context, chunks, query[:5], SCALE, window, sinks)
    torch.testing.assert_close(out[:5], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("with_sinks", [False, True])
def test_bfloat16_step_is_close_to_the_reference(with_sinks):
    context = _context(torch.bfloat16)
    chunks = _chunks(context, SPANS["mixed"])
    query = torch.randn(sum(c.length for c in chunks), 4, DIM, generator=torch.Generator().manual_seed(6))
    sinks = torch.linspace(-1.0, 2.0, 4) if with_sinks else None
    ModelRunner(None, context).prepare_step(chunks)
    out = _attend(context, query.bfloat16(), 3, sinks)
    expected = _reference(context, chunks, query.bfloat16(), SCALE, 3, sinks)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_block_tables_grow_by_appending():
    context = _context()
    tables = context.block_tables
    row = tables.sync(7, [3, 1])
    assert tables.table[row, :3].tolist() == [3, 1, 0]
    assert tables.sync(7, [3, 1, 9]) == row and tables.table[row, :3].tolist() == [3, 1, 9]
    assert tables.sync(7, [5]) == row and tables.table[row, :3].tolist() == [5, 0, 0]  # readmitted
    other = tables.sync(8, [2])
    tables.drop(7)
    assert len(tables) == 1 and tables.sync(9, [4]) == row and other != row
    for request_id in range(100, 200):  # more requests than rows: the table grows
        tables.sync(request_id, [request_id % 40])
    assert tables.table.shape[0] >= 102


@pytest.mark.parametrize("window", [None, 3])
def test_one_padded_batch_and_length_groups_agree(window):
    """Decode rows grouped by length (the default) and as one padded batch give the same output."""
    from mcore_inference.attention import DecodeBatch, StepAttention, attend_step

    context = _context()
    chunks = _chunks(context, SPANS["decode"])
    ModelRunner(None, context).prepare_step(chunks)
    decode = context.step_attention.decode
    # Several groups without a window; with one, every row reads one or two blocks: one group.
    assert len(decode.plan(window, torch.float32)) == (3 if window is None else 1)
    query = torch.randn(len(chunks), 4, DIM, generator=torch.Generator().manual_seed(7))
    blocks = context.kv_cache[0, :, : context.padding_slot].view(2, context.num_blocks, BLOCK, GROUPS, DIM)
    single = DecodeBatch(
        decode.rows,
        decode.positions,
        decode.block_table,
        BLOCK,
        decode.host_positions,
        group_growth=float("inf"),
    )
    assert len(single.plan(window, torch.float32)) == 1
    outputs = [
        attend_step(
            StepAttention(decode=d), query, None, None, blocks[0], blocks[1], scale=SCALE, window_size=window
        )
        for d in (decode, single)
    ]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)
