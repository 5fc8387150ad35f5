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

oneDNN builds a kernel for every new row count it sees (about a millisecond each, then kept in a
cache of bounded size), and an engine's prefill steps have row counts anywhere up to its token
limit. So above 64 rows (decode batches stay exact) the rows are padded with zeros up to one of
16 sizes per doubling (``padded_rows``, under 1/16 more rows): each output row depends only on
its own input row, the padding rows are dropped, and few kernels are built.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.bfloat16,)
"""Weight dtypes packing applies to: oneDNN's bf16 matmul gives the same values packed or not.
(float32 would gain too, but oneDNN's packed sgemm rounds differently from ``F.linear``'s.)"""

_BATCH_SIZE_HINT = 32  # the row count oneDNN tunes its blocked layout for; decode batches are near it
_EXACT_ROWS = 64  # row counts up to this one (decode batches) run unpadded
_STEPS_PER_POWER_OF_TWO = 32  # a padded count is a multiple of this fraction of the power of two above it
_WARM_UP_CALL_SECONDS = 0.02  # calls this long are not warmed up: the kernel's build is small beside them


def padded_rows(rows: int) -> int:
    """The row count a call of ``rows`` rows runs at: ``rows`` itself up to 64, else ``rows``
    rounded up to a multiple of 1/32 of the power of two at or above it (65..128 -> multiples
    of 4, 129..256 -> of 8, 257..512 -> of 16): 16 sizes per doubling, under 1/16 more rows."""
    if rows <= _EXACT_ROWS:
        return rows
    step = (1 << (rows - 1).bit_length()) // _STEPS_PER_POWER_OF_TWO
    return -(-rows // step) * step


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
        count = x.numel() // x.shape[-1]
        padded = padded_rows(count)
        if padded == count:  # oneDNN takes the leading dimensions as they are: no reshaping around it
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        rows = x.reshape(count, x.shape[-1])
        rows = torch.cat([rows, rows.new_zeros(padded - count, rows.shape[1])])
        output = torch.ops.mkldnn._linear_pointwise(rows, self._packed, bias, "none", [], "")
        return output[:count].view(*x.shape[:-1], output.shape[-1])


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedLinearWeight | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, from ``packed`` where it applies."""
    if packed is not None and packed.applies_to(x, weight):
        return packed.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def set_cpu_weight_packing(module: torch.nn.Module, enabled: bool, *, warm_up_rows: int = 0) -> int:
    """Turn inference-only CPU weight packing on or off for every layer in ``module`` that supports
    it (``ColumnParallelLinear`` and ``RowParallelLinear``); returns how many layers now pack.

    Turning it on where ``cpu_weight_packing_available()`` is false packs nothing and returns 0.
    Each call drops the copies made so far (they are rebuilt at the next forward, or now with
    ``warm_up_rows``). Only forward calls that autograd does not record use the packed copy (see
    the module docstring), so training through the same layers is unaffected.

    ``warm_up_rows`` > 0 (an engine's token limit per step) packs every weight now and runs each
    distinct weight shape once at every row count up to it (as ``padded_rows`` pads them), so
    that oneDNN builds its kernels here rather than during the first requests (about a
    millisecond each). A shape's larger row counts are skipped once one call takes over 20 ms:
    there the build is small beside the product. Raises ``ValueError`` for a negative
    ``warm_up_rows``.
    """
    if isinstance(warm_up_rows, bool) or not isinstance(warm_up_rows, int) or warm_up_rows < 0:
        raise ValueError(f"warm_up_rows must be an int >= 0, got {warm_up_rows!r}")
    packing = enabled and cpu_weight_packing_available()
    count = 0
    for layer in module.modules():
        if hasattr(layer, "packed_weight"):
            layer.packed_weight = PackedLinearWeight() if packing else None
            count += packing
    if packing and warm_up_rows:
        _warm_up(module, warm_up_rows)
    return count


def _warm_up(module: torch.nn.Module, max_rows: int) -> None:
    """Each packing layer's first call at every padded row count up to ``max_rows`` (up to the
    first that takes over ``_WARM_UP_CALL_SECONDS``), once per (weight shape, dtype, bias) kind:
    oneDNN's kernels do not depend on the weight's values."""
    sizes = sorted({padded_rows(rows) for rows in range(1, max_rows + 1)})
    done = set()
    with torch.no_grad():
        for layer in module.modules():
            packed = getattr(layer, "packed_weight", None)
            if packed is None:
                continue
            weight, bias = layer.weight, layer._matmul_bias()
            if not packed.applies_to(weight.new_zeros(1, weight.shape[1]), weight):
                continue
            kind = (tuple(weight.shape), weight.dtype, None if bias is None else bias.dtype)
            # a kind already warmed needs one call only, which packs this layer's weight
            for rows in sizes[:1] if kind in done else sizes:
                started = time.perf_counter()
                packed.linear(weight.new_zeros(rows, weight.shape[1]), weight, bias)
                if time.perf_counter() - started > _WARM_UP_CALL_SECONDS:
                    break
            done.add(kind)
