"""Inference-only CPU weight packing for the linear layers.

``F.linear`` on a CPU bfloat16 weight hands oneDNN the plain ``[out, in]`` matrix, which it reorders
into its blocked layout on every call. A layer with packing turned on keeps that blocked copy and
multiplies with it directly when a call records no autograd graph: the same oneDNN kernel, minus the
reorder (on a 2-core AVX-512 machine 10-25% on decode-sized batches, about 2x for a 32k-row output
layer at a handful of rows). The copy doubles the layer's weight memory.

The copy is tied to the weight it was made from: an update autograd's version counter sees
(optimizer step, ``load_state_dict``, ``copy_`` under ``no_grad``) or a swapped ``.data`` is noticed
on the next call, which repacks. Writes the counter cannot see (in place through ``.data``,
collectives such as ``broadcast`` into a parameter) must be followed by ``set_cpu_weight_packing``
again, which drops every copy. Calls that autograd records, other devices and dtypes, and weights
whose changes cannot be tracked (inference-mode tensors) take ``F.linear`` unchanged, and so do
calls that ``torch.compile`` traces (inductor cannot lower a packed copy that is not a graph
constant; it packs linear weights itself when freezing).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.bfloat16,)
"""Weight dtypes packing applies to: oneDNN's bf16 matmul gives the same values packed or not.
(float32 would gain too, but oneDNN's packed sgemm rounds differently from ``F.linear``'s.)"""

_BATCH_SIZE_HINT = 32  # the row count oneDNN tunes its blocked layout for; decode batches are near it


@functools.cache
def cpu_weight_packing_available() -> bool:
    """Whether this torch build and CPU can run oneDNN's packed bf16 linear."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinearWeight:
    """oneDNN's blocked copy of a layer's linear weight, rebuilt whenever that weight changes."""

    def __init__(self):
        self._weight: torch.Tensor | None = None
        self._packed: torch.Tensor | None = None
        self._key: tuple | None = None

    @staticmethod
    def applies_to(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``F.linear(x, weight)`` may be computed from a packed copy."""
        return (
            not torch.compiler.is_compiling()  # traced: the compiler packs weights its own way
            and x.device.type == "cpu"
            and weight.device.type == "cpu"
            and x.dtype == weight.dtype
            and weight.dtype in PACKED_DTYPES
            and not weight.is_inference()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        )

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` from the packed copy of ``weight``, packed first if this is
        a different weight or it changed since."""
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if weight is not self._weight or key != self._key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_SIZE_HINT)
            self._weight, self._key = weight, key
        if bias is not None and bias.dtype != x.dtype:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedLinearWeight | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, from ``packed`` where it applies."""
    if packed is not None and packed.applies_to(x, weight):
        return packed.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def set_cpu_weight_packing(module: torch.nn.Module, enabled: bool) -> int:
    """Turn inference-only CPU weight packing on or off for every layer in ``module`` that supports
    it (``ColumnParallelLinear`` and ``RowParallelLinear``); returns how many layers now pack.

    Turning it on where ``cpu_weight_packing_available()`` is false packs nothing and returns 0.
    Each call drops the copies made so far (they are rebuilt at the next forward).
    Only forward calls that autograd does not record use the packed copy (see the module docstring),
    so training through the same layers is unaffected.
    """
    packing = enabled and cpu_weight_packing_available()
    count = 0
    for layer in module.modules():
        if hasattr(layer, "packed_weight"):
            layer.packed_weight = PackedLinearWeight() if packing else None
            count += packing
    return count
