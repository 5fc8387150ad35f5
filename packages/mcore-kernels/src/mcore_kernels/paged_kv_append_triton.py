"""The paged KV-cache append as a Triton kernel: one program per new token copies its key and
value rows (all key heads, cast to the cache's dtype) into the cache slot ``slot_mapping`` names;
a negative slot writes nothing.

Imported only when the Triton backend is chosen: importing ``mcore_kernels`` never imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 4096  # elements of a token's row (key heads x head dim) copied per loop step


@triton.jit
def _append_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    ROW: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        for block in range(BLOCKS):
            cols = block * BLOCK + tl.arange(0, BLOCK)
            inside = cols < ROW
            k = tl.load(key_ptr + token * ROW + cols, mask=inside)
            v = tl.load(value_ptr + token * ROW + cols, mask=inside)
            tl.store(key_cache_ptr + slot * ROW + cols, k.to(key_cache_ptr.dtype.element_ty), mask=inside)
            tl.store(value_cache_ptr + slot * ROW + cols, v.to(value_cache_ptr.dtype.element_ty), mask=inside)


def paged_kv_append(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See ``mcore_kernels.paged_kv_append``; contiguous caches, key and value."""
    tokens = key.shape[0]
    if tokens == 0:
        return
    row = key.shape[1] * key.shape[2]
    block = min(MAX_BLOCK, triton.next_power_of_2(row))
    _append_kernel[(tokens,)](
        key, value, key_cache, value_cache, slot_mapping, ROW=row, BLOCK=block, BLOCKS=triton.cdiv(row, block)
    )
