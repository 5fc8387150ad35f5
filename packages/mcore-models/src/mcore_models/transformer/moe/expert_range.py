"""The part of an all-experts state dict that one expert-parallel rank holds."""

from __future__ import annotations

import torch


def experts_in_range(state: dict, total: int, first: int, count: int) -> dict:
    """The entries of ``state`` (a state dict of ``total`` experts: ``local_experts.<e>.*`` per
    expert, or tensors stacked along dim 0 by expert) for experts ``first .. first + count - 1``,
    renumbered from 0; entries that are not per expert are kept as they are."""
    result = {}
    for key, value in state.items():
        parts = key.split(".")
        if "local_experts" in parts[:-1]:
            at = parts.index("local_experts") + 1
            index = int(parts[at])
            if first <= index < first + count:
                parts[at] = str(index - first)
                result[".".join(parts)] = value
        elif torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == total:
            result[key] = value[first : first + count]
        else:
            result[key] = value
    return result
