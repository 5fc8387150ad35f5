"""Inference-only CPU weight packing for the linear layers.

``F.linear`` on a CPU bfloat16 weight hands oneDNN the plain ``[out, in]`` matrix, which it reorders
into its blocked layout on every call. A layer with packing turned on keeps a copy of the weight
made for the CPU's matmul and multiplies with it directly when a call records no autograd graph.
Two layouts (``set_cpu_weight_packing(..., layout=)``):

- ``"onednn"``, where oneDNN has a bfloat16 matmul (AVX-512 or AMX): the blocked copy, the same
  oneDNN kernel minus the reorder (on a 2-core AVX-512 machine 10-25% on decode-sized batches,
  about 2x for a 32k-row output layer at a handful of rows). The copy doubles the weight memory.
- ``"float32"``, where it has none (AVX2 CPUs): there a bfloat16 or float16 ``F.linear`` runs
  6-8x slower than a float32 one of the same size (measured on a 2-core AMD EPYC with AVX2), so
  the copy is the weight in float32 and the call computes ``F.linear`` in float32 from the input
  widened to float32, rounding the output back to the input's dtype once: the products of the
  16-bit values are exact in float32 and the sums accumulate in float32, as the 16-bit matmul
  does (only the summation order may differ). The copy takes twice the 16-bit weight's memory.

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
limit. So with the oneDNN layout, above 64 rows (decode batches stay exact) the rows are padded
with zeros up to one of 16 sizes per doubling (``padded_rows``, under 1/16 more rows): each output
row depends only on its own input row, the padding rows are dropped, and few kernels are built.
"""

from __future__ import annotations

import functools
import time
from typing import Literal

import torch
import torch.nn.functional as F

PACKED_DTYPES = (torch.bfloat16,)
"""Weight dtypes the oneDNN layout applies to: oneDNN's bf16 matmul gives the same values packed or
not. (float32 would gain too, but oneDNN's packed sgemm rounds differently from ``F.linear``'s.)"""

WIDENED_DTYPES = (torch.bfloat16, torch.float16)
"""Weight dtypes the float32 layout applies to."""

PackingLayout = Literal["auto", "onednn", "float32"]

_LAYOUT_DTYPES = {"onednn": PACKED_DTYPES, "float32": WIDENED_DTYPES}

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
    """A layer's linear weight copied into ``layout`` (``"onednn"``: oneDNN's blocked layout;
    ``"float32"``: widened to float32), rebuilt whenever that weight changes."""

    def __init__(self, layout: Literal["onednn", "float32"] = "onednn"):
        if layout not in ("onednn", "float32"):
            raise ValueError(f"layout must be 'onednn' or 'float32', got {layout!r}")
        self.layout = layout
        self._weight: torch.Tensor | None = None
        self._packed: torch.Tensor | None = None
        self._key: tuple | None = None

    def applies_to(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``F.linear(x, weight)`` may be computed from a packed copy."""
        return (
            not torch.compiler.is_compiling()  # traced: the compiler packs weights its own way
            and x.device.type == "cpu"
            and weight.device.type == "cpu"
            and x.dtype == weight.dtype
            and weight.dtype in _LAYOUT_DTYPES[self.layout]
            and not weight.is_inference()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        )

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` from the packed copy of ``weight``, packed first if this is
        a different weight or it changed since."""
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if weight is not self._weight or key != self._key:
            with torch.no_grad():
                self._packed = self._pack(weight.detach())
            self._weight, self._key = weight, key
        if bias is not None and bias.dtype != x.dtype:
            return F.linear(x, weight, bias)
        if self.layout == "float32":
            wide_bias = None if bias is None else bias.float()
            return F.linear(x.float(), self._packed, wide_bias).to(x.dtype)
        count = x.numel() // x.shape[-1]
        padded = padded_rows(count)
        if padded == count:  # oneDNN takes the leading dimensions as they are: no reshaping around it
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        rows = x.reshape(count, x.shape[-1])
        rows = torch.cat([rows, rows.new_zeros(padded - count, rows.shape[1])])
        output = torch.ops.mkldnn._linear_pointwise(rows, self._packed, bias, "none", [], "")
        return output[:count].view(*x.shape[:-1], output.shape[-1])

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        if self.layout == "float32":
            return weight.float()
        return torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_SIZE_HINT)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedLinearWeight | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, from ``packed`` where it applies."""
    if packed is not None and packed.applies_to(x, weight):
        return packed.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def set_cpu_weight_packing(
    module: torch.nn.Module, enabled: bool, *, warm_up_rows: int = 0, layout: PackingLayout = "auto"
) -> int:
    """Turn inference-only CPU weight packing on or off for every layer in ``module`` that supports
    it (``ColumnParallelLinear`` and ``RowParallelLinear``); returns how many layers now pack.

    ``layout`` (see the module docstring): ``"onednn"`` keeps bfloat16 weights in oneDNN's blocked
    layout, ``"float32"`` keeps bfloat16 and float16 weights widened to float32, ``"auto"`` takes
    ``"onednn"`` where ``cpu_weight_packing_available()`` and ``"float32"`` elsewhere. Each call
    drops the copies made so far (they are rebuilt at the next forward, or now with
    ``warm_up_rows``). Only forward calls that autograd does not record use the copy, so
    training through the same layers is unaffected.

    ``warm_up_rows`` > 0 (an engine's token limit per step) makes every copy now; with the
    oneDNN layout it also runs each distinct weight shape once at every row count up to it (as
    ``padded_rows`` pads them), so that oneDNN builds its kernels here rather than during the
    first requests (about a millisecond each). A shape's larger row counts are skipped once one
    call takes over 20 ms: there the build is small beside the product. Raises ``ValueError`` for
    a negative ``warm_up_rows`` or an unknown ``layout``, and ``RuntimeError`` for
    ``layout="onednn"`` where oneDNN has no bfloat16 matmul.
    """
    if isinstance(warm_up_rows, bool) or not isinstance(warm_up_rows, int) or warm_up_rows < 0:
        raise ValueError(f"warm_up_rows must be an int >= 0, got {warm_up_rows!r}")
    chosen = _chosen_layout(layout)
    count = 0
    for layer in module.modules():
        if hasattr(layer, "packed_weight"):
            layer.packed_weight = PackedLinearWeight(chosen) if enabled else None
            count += enabled
    if enabled and warm_up_rows:
        _warm_up(module, warm_up_rows)
    return count


def _chosen_layout(layout: PackingLayout) -> Literal["onednn", "float32"]:
    if layout not in ("auto", "onednn", "float32"):
        raise ValueError(f"layout must be 'auto', 'onednn' or 'float32', got {layout!r}")
    if layout == "onednn" and not cpu_weight_packing_available():
        raise RuntimeError("layout='onednn': this CPU or torch build has no oneDNN bfloat16 matmul")
    if layout == "auto":
        return "onednn" if cpu_weight_packing_available() else "float32"
    return layout


def _warm_up(module: torch.nn.Module, max_rows: int) -> None:
    """Each packing layer's first call at every padded row count up to ``max_rows`` (up to the
    first that takes over ``_WARM_UP_CALL_SECONDS``), once per (weight shape, dtype, bias) kind:
    oneDNN's kernels do not depend on the weight's values. Float32 copies are made by one call."""
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
            # a kind already warmed needs one call only, which packs this layer's weight; the
            # float32 layout has no kernels to build
            one_call = kind in done or packed.layout == "float32"
            for rows in sizes[:1] if one_call else sizes:
                started = time.perf_counter()
                packed.linear(weight.new_zeros(rows, weight.shape[1]), weight, bias)
                if time.perf_counter() - started > _WARM_UP_CALL_SECONDS:
                    break
            done.add(kind)
