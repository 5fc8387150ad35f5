"""``moe_padded_counts``: hand-computed counts with a minimum, an alignment and both; argument errors."""

import pytest
import torch
from mcore_kernels import moe_padded_counts


@pytest.mark.parametrize(
    ("min_rows", "alignment", "expected"),
    [
        (None, None, [0, 1, 7, 8, 9]),
        (None, 4, [0, 4, 8, 8, 12]),
        (3, None, [3, 3, 7, 8, 9]),
        (3, 4, [4, 4, 8, 8, 12]),
        (None, 1, [0, 1, 7, 8, 9]),
        (0, 2, [0, 2, 8, 8, 10]),
    ],
)
def test_counts_padded_by_hand(min_rows, alignment, expected):
    counts = torch.tensor([0, 1, 7, 8, 9])
    assert moe_padded_counts(counts, min_rows=min_rows, alignment=alignment).tolist() == expected


@pytest.mark.parametrize(
    ("counts", "options", "error", "match"),
    [
        (torch.ones(3), {}, TypeError, "counts must be an integer"),
        (torch.ones(2, 3, dtype=torch.int64), {}, TypeError, r"counts must be an integer \[E\]"),
        (torch.ones(3, dtype=torch.int64), dict(alignment=0), ValueError, "alignment must be a positive int"),
        (
            torch.ones(3, dtype=torch.int64),
            dict(min_rows=-1),
            ValueError,
            "min_rows must be a non-negative int",
        ),
    ],
)
def test_bad_arguments_are_named(counts, options, error, match):
    with pytest.raises(error, match=match):
        moe_padded_counts(counts, **options)
