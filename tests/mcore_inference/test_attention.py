"""The attention paths of a step (decode rows, prefill chunks with and without a cached prefix,
mixed batches, the padded decode of CUDA graphs) against a naive reference: per query, in float32,
``softmax(q k^T * scale + mask) v`` over the request's cached keys, with windows, sinks and GQA.
Every test runs with every row (decode rows and prefill chunks) on mcore-kernels' native kernel and on the PyTorch path."""

import pytest
import torch
from mcore_inference.model_runner import DecodeBuffers, ModelRunner
from mcore_kernels import use_backend
from mcore_kernels.native_build import native_library_error
from mcore_testing.paged_steps import (
    BLOCK,
    DIM,
    GROUPS,
    SCALE,
    STEP_SPANS,
    attend_one_layer,
    attention_oracle,
    paged_context,
    step_chunks,
)


@pytest.fixture(autouse=True, params=["native", "reference"])
def decode_backend(request):
    """Every row through the native kernel, then through the PyTorch paths."""
    if request.param == "native" and native_library_error() is not None:
        pytest.skip(f"the native CPU kernels do not build here: {native_library_error()}")
    with use_backend(request.param):
        yield request.param


@pytest.mark.parametrize("per_group", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 1, 3, 8])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("layout", sorted(STEP_SPANS))
def test_eager_step_matches_reference(layout, with_sinks, window, per_group):
    context = paged_context()
    chunks = step_chunks(context, STEP_SPANS[layout])
    heads = GROUPS * per_group
    tokens = sum(c.length for c in chunks)
    query = torch.randn(tokens, heads, DIM, generator=torch.Generator().manual_seed(4))
    sinks = torch.linspace(-1.0, 2.0, heads) if with_sinks else None
    ModelRunner(None, context).prepare_step(chunks)
    out = attend_one_layer(context, query, window, sinks)
    expected = attention_oracle(context, chunks, query, SCALE, window, sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_group", [1, 4])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_padded_decode_matches_reference(with_sinks, window, per_group):
    context = paged_context()
    chunks = step_chunks(context, STEP_SPANS["decode"])
    heads = GROUPS * per_group
    query = torch.randn(8, heads, DIM, generator=torch.Generator().manual_seed(5))  # 3 padded rows
    sinks = torch.linspace(-1.0, 2.0, heads) if with_sinks else None
    buffers = DecodeBuffers(8, 16, context.device)
    slices = ModelRunner(None, context).prepare_padded_decode(chunks, buffers, rows=8, key_blocks=16)
    assert slices == [slice(i, i + 1) for i in range(5)]
    out = attend_one_layer(context, query, window, sinks)
    expected = attention_oracle(context, chunks, query[:5], SCALE, window, sinks)
    torch.testing.assert_close(out[:5], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("with_sinks", [False, True])
def test_bfloat16_step_is_close_to_the_reference(with_sinks):
    context = paged_context(torch.bfloat16)
    chunks = step_chunks(context, STEP_SPANS["mixed"])
    query = torch.randn(sum(c.length for c in chunks), 4, DIM, generator=torch.Generator().manual_seed(6))
    sinks = torch.linspace(-1.0, 2.0, 4) if with_sinks else None
    ModelRunner(None, context).prepare_step(chunks)
    out = attend_one_layer(context, query.bfloat16(), 3, sinks)
    expected = attention_oracle(context, chunks, query.bfloat16(), SCALE, 3, sinks)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_block_tables_grow_by_appending():
    context = paged_context()
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

    context = paged_context()
    chunks = step_chunks(context, STEP_SPANS["decode"])
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
