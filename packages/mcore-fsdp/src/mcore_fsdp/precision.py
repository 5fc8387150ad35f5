"""Mixed precision: compute dtype of parameters, dtype of gradient communication."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_fsdp.errors import FSDPConfigError

_ALLOWED = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes used by a sharded model. Main parameters and gradients are always FP32.

    Attributes:
        param_dtype: dtype of the gathered parameters the forward and backward run with;
            ``None`` keeps each parameter's own dtype.
        reduce_dtype: dtype gradients are communicated in; ``None`` uses the parameter dtype.
        fp32_accumulate_reduce_scatter: reduce-scatter low-precision gradients with an all-to-all
            and sum the received pieces in FP32, so only the wire format is low precision.
        cast_forward_inputs: cast floating-point inputs of the root forward to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    fp32_accumulate_reduce_scatter: bool = False
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _ALLOWED:
                allowed = ", ".join(str(dtype) for dtype in _ALLOWED)
                raise FSDPConfigError(
                    f"MixedPrecision.{name} must be None or one of {allowed}; got {value!r}"
                )
