"""``paged_kv_append``: writes a step's new keys and values into a paged KV cache at the slots a
slot mapping names (a Triton kernel on CUDA, the PyTorch reference elsewhere; ``dispatch``)."""

from __future__ import annotations

import importlib

import torch

from . import paged_kv_append_reference
from .dispatch import select_backend

_OP = "paged_kv_append"


def paged_kv_append(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key, value [t, g, d]`` into ``key_cache, value_cache`` in place: token ``i``'s rows
    go to cache slot ``slot_mapping[i]`` (int32/int64 ``[t]``; slot ``s`` is row ``s`` of the cache
    flattened over its leading dimensions, so ``[num_blocks, block_size, g, d]`` or ``[slots, g,
    d]``), cast to the cache's dtype; a negative slot writes nothing (padding). Slots must be
    distinct; the reference refuses one past the cache (the Triton kernel does not check, which
    would wait on the device)."""
    _check(key_cache, value_cache, key, value, slot_mapping)
    if select_backend(_OP, key_cache) == "reference":
        paged_kv_append_reference.paged_kv_append(key_cache, value_cache, key, value, slot_mapping)
        return
    kernels = importlib.import_module("mcore_kernels.paged_kv_append_triton")
    kernels.paged_kv_append(
        key_cache, value_cache, key.contiguous(), value.contiguous(), slot_mapping.contiguous()
    )


def _check(key_cache, value_cache, key, value, slot_mapping) -> None:
    tensors = {"key_cache": key_cache, "value_cache": value_cache, "key": key, "value": value}
    for name, tensor in {**tensors, "slot_mapping": slot_mapping}.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a tensor, got {type(tensor).__name__}")
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise TypeError(f"{_OP}: {name} must be floating point, got {tensor.dtype}")
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"{_OP}: key and value must be [t, g, d] alike, got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key_cache.dim() < 3 or key_cache.shape[-2:] != key.shape[1:] or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"{_OP}: key_cache and value_cache must be [..., g={key.shape[1]}, d={key.shape[2]}] alike, got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError(f"{_OP}: key_cache and value_cache must be contiguous (they are written in place)")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{_OP}: slot_mapping must be int32/int64 [t={key.shape[0]}], got "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    devices = {t.device for t in (*tensors.values(), slot_mapping)}
    if len(devices) > 1:
        raise ValueError(f"{_OP}: all tensors must be on one device, got {sorted(map(str, devices))}")
