"""``rms_norm_rows``, ``rotary_rows``, ``swiglu_rows`` and ``paged_decode_attention_rows``: the C++ CPU kernels called without the
public ops' checks and autograd give exactly the public ops' native-backend values, and what the
kernels are given wrong still raises."""

import pytest
import torch
from mcore_kernels import (
    apply_rotary,
    native_rows_available,
    paged_decode_attention,
    paged_decode_attention_rows,
    rms_norm,
    rms_norm_rows,
    rope_cos_sin,
    rope_inverse_frequencies,
    rotary_rows,
    swiglu,
    swiglu_rows,
    use_backend,
)
from mcore_kernels.native_build import native_library_error

pytestmark = pytest.mark.skipif(
    native_library_error() is not None,
    reason=f"the native CPU kernels do not build here: {native_library_error()}",
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_available_where_the_kernels_build():
    assert native_rows_available()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_rms_norm_rows_equals_the_public_op(dtype, rows):
    torch.manual_seed(0)
    x, weight = torch.randn(rows, 96, dtype=dtype), torch.randn(96, dtype=dtype)
    with torch.no_grad(), use_backend("native"):
        expected = rms_norm(x, weight, 1e-5)
    assert torch.equal(rms_norm_rows(x, weight, 1e-5), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("rotary", [64, 32])  # full and partial rotary
def test_rotary_rows_of_heads_side_by_side_equal_the_public_op(dtype, tokens, rotary):
    torch.manual_seed(0)
    heads = torch.randn(tokens, 6, 64, dtype=dtype)  # a token's heads share its table row
    cos, sin = rope_cos_sin(torch.arange(tokens) + 3, rope_inverse_frequencies(rotary, 10000.0))
    with torch.no_grad(), use_backend("native"):
        expected = apply_rotary(heads, cos.unsqueeze(1), sin.unsqueeze(1))
    assert torch.equal(rotary_rows(heads.reshape(-1, 64), cos, sin).view(tokens, 6, 64), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_swiglu_rows_equals_the_public_op(dtype, rows):
    torch.manual_seed(0)
    x = torch.randn(rows, 2 * 80, dtype=dtype)
    with torch.no_grad(), use_backend("native"):
        expected = swiglu(x)
    assert torch.equal(swiglu_rows(x), expected)


def test_what_the_kernels_cannot_take_raises():
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="rms_norm: weight must be"):
        rms_norm_rows(x, torch.ones(15), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        rms_norm_rows(torch.randn(16, 4).t(), torch.ones(16), 1e-5)
    with pytest.raises(RuntimeError, match="multiple of the table rows"):
        rotary_rows(torch.randn(5, 16), torch.ones(2, 16), torch.ones(2, 16))
    with pytest.raises(RuntimeError, match="swiglu"):
        swiglu_rows(torch.randn(4, 15))
    with pytest.raises(RuntimeError, match="swiglu"):
        swiglu_rows(torch.randn(2, 4, 16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 5])
def test_paged_decode_attention_rows_equals_the_public_op(dtype, window):
    torch.manual_seed(0)
    blocks, block_size, groups, heads, dim = 12, 4, 2, 4, 32
    key_blocks = torch.randn(blocks, block_size, groups, dim, dtype=dtype)
    value_blocks = torch.randn(blocks, block_size, groups, dim, dtype=dtype)
    table = torch.randperm(blocks)[:9].view(3, 3).to(torch.int32)
    positions = torch.tensor([0, 6, 11])
    query, sinks = torch.randn(3, heads, dim, dtype=dtype), torch.linspace(-1, 1, heads)
    for sink in (None, sinks):
        with torch.no_grad(), use_backend("native"):
            expected = paged_decode_attention(
                query,
                key_blocks,
                value_blocks,
                table,
                positions,
                scale=0.3,
                window_size=window or None,
                sink_logits=sink,
            )
        rows = paged_decode_attention_rows(
            query, key_blocks, value_blocks, table, positions, 0.3, window, sink
        )
        assert torch.equal(rows, expected)


def test_paged_decode_attention_rows_checks_what_it_reads():
    key_blocks = value_blocks = torch.randn(4, 4, 1, 16)
    query, positions = torch.randn(1, 2, 16), torch.tensor([5])
    with pytest.raises(RuntimeError, match="block_table names block 9"):
        paged_decode_attention_rows(
            query, key_blocks, value_blocks, torch.tensor([[0, 9]]), positions, 1.0, 0, None
        )
    with pytest.raises(RuntimeError, match="outside the 2 blocks"):
        paged_decode_attention_rows(
            query, key_blocks, value_blocks, torch.tensor([[0, 1]]), torch.tensor([8]), 1.0, 0, None
        )
    with pytest.raises(RuntimeError, match="share one dtype"):
        paged_decode_attention_rows(
            query.double(), key_blocks, value_blocks, torch.tensor([[0, 1]]), positions, 1.0, 0, None
        )
