"""The PyTorch reference of the paged KV-cache append: the Triton kernel's oracle and the path
wherever it cannot run."""

from __future__ import annotations

import torch


def paged_kv_append(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See ``mcore_kernels.paged_kv_append``: ``index_copy_`` of the rows with a slot."""
    groups, dim = key_cache.shape[-2:]
    keys, values = key_cache.view(-1, groups, dim), value_cache.view(-1, groups, dim)
    slots = slot_mapping.long()
    if len(slots) and int(slots.max()) >= len(keys):
        raise ValueError(
            f"paged_kv_append: slot_mapping names slot {int(slots.max())} of a cache of {len(keys)} slots"
        )
    if len(slots) and int(slots.min()) < 0:  # rows without a slot (padding) write nothing
        kept = slots >= 0
        slots, key, value = slots[kept], key[kept], value[kept]
    keys.index_copy_(0, slots, key.to(keys.dtype))
    values.index_copy_(0, slots, value.to(values.dtype))
