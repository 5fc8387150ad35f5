"""``host_tensor`` builds the tensor ``torch.tensor`` would, bit for bit, from lists and iterables."""

import gc
import math

import pytest
import torch
from mcore_inference.host_tensor import host_tensor


@pytest.mark.parametrize(
    "values",
    [[0, 1, -1, 2**63 - 1, -(2**63), 12345678901234], list(range(500)), [7]],
)
def test_ints_are_torch_tensor_of_the_list(values):
    built = host_tensor(iter(values))
    expected = torch.tensor(values, dtype=torch.long)
    assert built.dtype == torch.long and built.device.type == "cpu"
    assert torch.equal(built, expected)


def test_floats_keep_every_bit():
    values = [0.1, -0.0, 1e-310, 2.0**-1074, math.pi, math.inf, -math.inf, math.nan, 3]  # 3: an int
    built = host_tensor(values, torch.float64)
    expected = torch.tensor(values, dtype=torch.float64)
    assert built.dtype == torch.float64
    assert torch.equal(built.view(torch.int64), expected.view(torch.int64))  # NaN and -0.0 too


def test_empty_and_out_of_range():
    for dtype in (torch.long, torch.float64):
        empty = host_tensor([], dtype)
        assert empty.shape == (0,) and empty.dtype == dtype
    with pytest.raises(OverflowError):
        host_tensor([2**63])


def test_the_tensor_outlives_its_list_and_may_be_written():
    built = host_tensor([5, 6, 7])
    gc.collect()
    built += 1
    assert built.tolist() == [6, 7, 8]
