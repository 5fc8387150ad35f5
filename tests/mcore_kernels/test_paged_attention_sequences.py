"""``paged_attention`` (sequences of several queries over a paged cache, causal within them): the
reference against a dense per-sequence oracle (keys gathered position by position, float64
softmax) for prefill chunks with and without a cached prefix, windows at their edges, sinks and
grouped-query ratios; errors for bad arguments."""

import pytest
import torch
from mcore_kernels import paged_attention, use_backend
from mcore_testing.paged_cache import paged_sequences


def _dense_oracle(query, key_blocks, value_blocks, table, starts, seq_lens, scale, window, sinks):
    heads = query.shape[1]
    block_size, groups = key_blocks.shape[1], key_blocks.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    for b, length in enumerate(seq_lens.tolist()):
        rows = range(int(starts[b]), int(starts[b + 1]))
        slots = [(int(table[b, p // block_size]), p % block_size) for p in range(length)]
        keys = torch.stack([key_blocks[i, j] for i, j in slots]).double()  # [L, g, d]
        values = torch.stack([value_blocks[i, j] for i, j in slots]).double()
        query_positions = torch.arange(length - len(rows), length).view(-1, 1)
        distance = query_positions - torch.arange(length)
        allowed = (distance >= 0) & (distance < (window or length + 1))
        for h in range(heads):
            g = h // (heads // groups)
            scores = query[list(rows), h].double() @ keys[:, g].T * scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            if sinks is not None:
                scores = torch.cat([scores, sinks[h].double().expand(len(rows), 1)], dim=1)
            out[list(rows), h] = torch.softmax(scores, dim=1)[:, :length] @ values[:, g]
    return out


SEQUENCES = [  # (heads, groups, dim, block_size, [(seq_len, query_len)], window)
    (4, 4, 64, 16, [(7, 7), (40, 9), (17, 1)], None),  # a whole prompt, a chunk after a prefix, a decode row
    (8, 2, 40, 1, [(5, 5), (12, 3)], None),
    (4, 1, 80, 16, [(33, 33), (50, 18)], 16),  # windows shorter than the chunk
    (2, 2, 16, 4, [(9, 4), (4, 4)], 1),
    (4, 2, 32, 16, [(31, 31), (32, 32), (33, 1)], 32),  # a window at the sequence's edge
]


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize(("heads", "groups", "dim", "block_size", "sequences", "window"), SEQUENCES)
def test_reference_matches_the_dense_oracle(sinks, heads, groups, dim, block_size, sequences, window):
    args = paged_sequences(heads=heads, groups=groups, dim=dim, block_size=block_size, sequences=sequences)
    sink_logits = torch.linspace(-1.0, 2.0, heads) if sinks else None
    with use_backend("reference"):
        out = paged_attention(*args, scale=dim**-0.5, window_size=window, sink_logits=sink_logits)
    expected = _dense_oracle(*args, dim**-0.5, window, sink_logits)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def _valid():
    return paged_sequences(heads=4, groups=2, dim=8, block_size=4, sequences=[(6, 3), (2, 1)])


BAD = {
    "starts not a tensor": (
        lambda a: (*a[:4], [0, 3, 4], a[5]),
        {},
        TypeError,
        "query_starts must be a tensor",
    ),
    "starts length": (
        lambda a: (*a[:4], a[4][:2], a[5]),
        {},
        ValueError,
        r"query_starts must be int64 \[B \+ 1",
    ),
    "int32 seq_lens": (lambda a: (*a[:5], a[5].int()), {}, ValueError, "seq_lens must be int64"),
    "table rows": (lambda a: (*a[:3], a[3][:1], *a[4:]), {}, ValueError, "block_table must be"),
    "dtype mix": (lambda a: (a[0].double(), *a[1:]), {}, TypeError, "share one floating dtype"),
    "window 0": (lambda a: a, {"window_size": 0}, ValueError, "window_size must be"),
    "max_query_len": (lambda a: a, {"max_query_len": -1}, ValueError, "max_query_len must be"),
    "starts past the query": (lambda a: (*a[:4], a[4] + 1, a[5]), {}, ValueError, "query_starts must rise"),
    "sequence shorter than its queries": (lambda a: (*a[:5], a[5] - 3), {}, ValueError, "seq_lens >= query"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_raise_errors_naming_them(case):
    change, keywords, error, message = BAD[case]
    with use_backend("reference"), pytest.raises(error, match=message):
        paged_attention(*change(_valid()), scale=1.0, **keywords)
