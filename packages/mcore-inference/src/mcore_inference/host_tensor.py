"""Small CPU tensors from Python numbers, without ``torch.tensor``'s per-element cost.

``torch.tensor(list)`` inspects every element of the list (about 0.3-0.5 us each): a step's lists
of 64 to 500 ids, positions, slots and sampling parameters cost more to build than the ops that
read them. ``array.array`` converts the numbers in one C loop and ``torch.frombuffer`` wraps its
memory, 4-7x faster for those sizes, with the same values bit for bit.
"""

from __future__ import annotations

import array
from collections.abc import Iterable

import torch

_TYPECODES = {torch.long: "q", torch.float64: "d"}


def host_tensor(values: Iterable[int] | Iterable[float], dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``torch.tensor(list(values), dtype=dtype)`` (1-D, CPU) for ``dtype`` ``torch.long`` (ints)
    or ``torch.float64`` (floats). The tensor owns a reference to its buffer; it may be written."""
    buffer = array.array(_TYPECODES[dtype], values)
    if not buffer:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype)
