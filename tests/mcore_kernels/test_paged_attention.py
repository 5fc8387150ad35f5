"""``paged_decode_attention``: the native C++ kernel and the PyTorch reference against a naive
per-sequence oracle (keys gathered position by position, float64 softmax), for odd lengths,
windows at their edges, sinks, grouped-query ratios, block sizes and dtypes; the native kernel's
tiles of consecutive rows of one sequence (prefill chunks) against the reference; errors for bad
arguments; and the dispatch between the two."""

import subprocess
import sys
import textwrap

import pytest
import torch
from mcore_kernels import (
    KernelBackendError,
    layer_norm,
    paged_attention_reference,
    paged_decode_attention,
    use_backend,
)
from mcore_kernels.native_build import native_library_error

NATIVE = native_library_error() is None
needs_native = pytest.mark.skipif(
    not NATIVE, reason=f"the native CPU kernels do not build here: {native_library_error()}"
)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _case(*, batch, heads, groups, dim, block_size, positions, dtype, table_dtype=torch.int64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = max(positions) // block_size + 1
    num_blocks = batch * width + 3
    blocks = [
        torch.randn(num_blocks, block_size, groups, dim, generator=generator).to(dtype) for _ in range(2)
    ]
    table = (
        torch.randperm(num_blocks, generator=generator)[: batch * width].view(batch, width).to(table_dtype)
    )
    query = torch.randn(batch, heads, dim, generator=generator).to(dtype)
    return query, *blocks, table, torch.tensor(positions, dtype=torch.int64)


def _oracle(query, key_blocks, value_blocks, table, positions, scale, window, sinks):
    batch, heads, dim = query.shape
    block_size, groups = key_blocks.shape[1], key_blocks.shape[2]
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    for b in range(batch):
        last = int(positions[b])
        first = 0 if window is None else max(0, last - window + 1)
        rows = [(int(table[b, p // block_size]), p % block_size) for p in range(first, last + 1)]
        keys = torch.stack([key_blocks[block, offset] for block, offset in rows]).double()  # [L, g, d]
        values = torch.stack([value_blocks[block, offset] for block, offset in rows]).double()
        for h in range(heads):
            g = h // (heads // groups)
            scores = keys[:, g] @ query[b, h].double() * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks[h : h + 1].double()])
            probs = torch.softmax(scores, 0)[: len(rows)]
            out[b, h] = probs @ values[:, g]
    return out


CASES = [  # (heads, groups, dim, block_size, positions, window)
    (4, 4, 64, 16, [0, 15, 16, 17, 130], None),
    (8, 2, 40, 16, [5, 31, 32, 99], None),
    (6, 3, 80, 1, [0, 1, 7, 12], None),
    (8, 8, 64, 16, [40, 41, 200], 32),
    (4, 1, 64, 16, [0, 30, 31, 32, 33], 32),  # windows at their edges
    (2, 2, 16, 4, [3, 4, 5], 1),
    (4, 2, 128, 16, [0, 17, 63], None),  # bf16 dot products over 4 pairs of 32 lanes
    (2, 1, 32, 8, [3, 9, 40], 16),  # over 1
]


@pytest.mark.parametrize("backend", ["reference", pytest.param("native", marks=needs_native)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize(("heads", "groups", "dim", "block_size", "positions", "window"), CASES)
def test_matches_the_naive_oracle(backend, dtype, sinks, heads, groups, dim, block_size, positions, window):
    query, keys, values, table, pos = _case(
        batch=len(positions),
        heads=heads,
        groups=groups,
        dim=dim,
        block_size=block_size,
        positions=positions,
        dtype=dtype,
    )
    sink_logits = torch.linspace(-1.0, 2.0, heads) if sinks else None
    scale = dim**-0.5
    with use_backend(backend):
        out = paged_decode_attention(
            query, keys, values, table, pos, scale=scale, window_size=window, sink_logits=sink_logits
        )
    expected = _oracle(query, keys, values, table, pos, scale, window, sink_logits)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_native
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_native_equals_the_reference_on_a_large_batch(table_dtype):
    positions = torch.randint(0, 300, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    args = _case(
        batch=37,
        heads=8,
        groups=4,
        dim=64,
        block_size=16,
        positions=positions,
        dtype=torch.bfloat16,
        table_dtype=table_dtype,
    )
    with use_backend("native"):
        native = paged_decode_attention(*args, scale=0.125)
    with use_backend("reference"):
        reference = paged_decode_attention(*args, scale=0.125)
    torch.testing.assert_close(native.float(), reference.float(), atol=1e-2, rtol=1e-2)


RUNS = [  # (heads, groups, dim, block_size, rows as (sequence, first position, count), window)
    (8, 4, 64, 16, [(0, 0, 37), (1, 200, 1), (2, 5, 20), (3, 90, 1)], None),  # 16 queries a group
    (8, 2, 64, 16, [(0, 10, 40), (1, 77, 3), (0, 50, 1)], 24),  # windows inside a tile
    (4, 4, 32, 8, [(0, 0, 19), (1, 3, 1), (2, 30, 5)], None),  # a head a group: row by row
    (16, 2, 128, 16, [(0, 100, 9), (1, 0, 2)], 7),
    (6, 3, 48, 24, [(0, 17, 33), (1, 60, 1)], None),  # blocks not a multiple of 16 positions
]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize(("heads", "groups", "dim", "block_size", "runs", "window"), RUNS)
def test_native_tiles_of_consecutive_rows_match_the_reference(
    dtype, sinks, interleave, heads, groups, dim, block_size, runs, window
):
    """Rows of one sequence at consecutive positions (prefill chunks, computed as tiles) among decode
    rows of other sequences; interleaved, no two consecutive rows form a run."""
    generator = torch.Generator().manual_seed(2)
    sequences = 1 + max(s for s, _, _ in runs)
    width = max(first + count for _, first, count in runs) // block_size + 1
    num_blocks = sequences * width + 3
    keys, values = (
        torch.randn(num_blocks, block_size, groups, dim, generator=generator).to(dtype) for _ in range(2)
    )
    tables = torch.randperm(num_blocks, generator=generator)[: sequences * width].view(sequences, width)
    rows = [(s, p) for s, first, count in runs for p in range(first, first + count)]
    if interleave:
        rows = rows[::2] + rows[1::2]
    table = tables[[s for s, _ in rows]].to(torch.int32)
    positions = torch.tensor([p for _, p in rows])
    query = torch.randn(len(rows), heads, dim, generator=generator).to(dtype)
    sink_logits = torch.linspace(-1.0, 2.0, heads) if sinks else None
    args = (query, keys, values, table, positions)
    with use_backend("native"):
        out = paged_decode_attention(*args, scale=dim**-0.5, window_size=window, sink_logits=sink_logits)
    expected = paged_attention_reference.paged_decode_attention(*args, dim**-0.5, window, sink_logits)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_native
def test_native_refuses_blocks_and_positions_outside_the_cache():
    query, keys, values, table, pos = _case(
        batch=2, heads=2, groups=1, dim=16, block_size=4, positions=[3, 6], dtype=torch.float32
    )
    with use_backend("native"):
        bad_table = table.clone()
        bad_table[1, 1] = keys.shape[0]
        with pytest.raises(RuntimeError, match="names block"):
            paged_decode_attention(query, keys, values, bad_table, pos, scale=1.0)
        with pytest.raises(RuntimeError, match="outside the 2 blocks"):
            paged_decode_attention(query, keys, values, table, torch.tensor([3, 8]), scale=1.0)


def test_reference_refuses_positions_outside_the_table():
    args = _case(batch=2, heads=2, groups=1, dim=16, block_size=4, positions=[3, 6], dtype=torch.float32)
    with use_backend("reference"), pytest.raises(ValueError, match="positions must lie"):
        paged_decode_attention(*args[:4], torch.tensor([3, 8]), scale=1.0)


def _valid():
    return _case(batch=2, heads=4, groups=2, dim=8, block_size=4, positions=[2, 5], dtype=torch.float32)


BAD = {
    "query not a tensor": (lambda a: ([[1.0]], *a[1:]), {}, TypeError, "query must be a tensor"),
    "query 2-D": (lambda a: (a[0][0], *a[1:]), {}, ValueError, r"query must be \[B, n, d\]"),
    "value shape": (lambda a: (a[0], a[1], a[2][:-1], *a[3:]), {}, ValueError, "value_blocks"),
    "heads not a multiple": (lambda a: (a[0][:, :3], *a[1:]), {}, ValueError, "do not fit"),
    "dtype mix": (lambda a: (a[0].double(), *a[1:]), {}, TypeError, "share one floating dtype"),
    "float table": (lambda a: (*a[:3], a[3].float(), a[4]), {}, ValueError, "block_table must be"),
    "int32 positions": (lambda a: (*a[:4], a[4].int()), {}, ValueError, "positions must be int64"),
    "zero scale": (lambda a: a, {"scale": 0.0}, ValueError, "scale must be positive"),
    "window 0": (lambda a: a, {"window_size": 0}, ValueError, "window_size must be"),
    "window float": (lambda a: a, {"window_size": 2.5}, ValueError, "window_size must be"),
    "sinks shape": (lambda a: a, {"sink_logits": torch.zeros(3)}, ValueError, "sink_logits"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_raise_errors_naming_them(case):
    change, keywords, error, message = BAD[case]
    options = {"scale": 1.0, **keywords}
    with pytest.raises(error, match=message):
        paged_decode_attention(*change(_valid()), **options)


def test_forcing_a_kernel_an_op_does_not_have_is_refused():
    with use_backend("native"), pytest.raises(KernelBackendError, match="layer_norm has no native kernel"):
        layer_norm(torch.ones(2, 4), torch.ones(4))


def test_without_a_compiler_auto_takes_the_reference_and_forcing_native_says_why(tmp_path):
    script = textwrap.dedent(
        """
        import torch
        from mcore_kernels import KernelBackendError, select_backend, use_backend
        assert select_backend("paged_decode_attention", torch.ones(1), kernels=("native",)) == "reference"
        try:
            with use_backend("native"):
                select_backend("paged_decode_attention", torch.ones(1), kernels=("native",))
        except KernelBackendError as error:
            print(error)
        """
    )
    environment = {"CXX": "no-such-compiler", "MCORE_KERNELS_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "no C++ compiler: 'no-such-compiler' is not on PATH" in result.stdout
