"""Hugging Face's ``time_step_limit = [min, max]`` (Mamba2, Bamba: transformers clamps the time
steps ``softplus(dt + dt_bias)`` to it; ``(0, inf)`` by default) as ``MambaConfig``'s
``mamba_dt_clamp_min`` and ``mamba_dt_clamp_max``, and back."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ...ssm import MambaConfig


def time_step_limit_from_hf(limit: Sequence[float] | None) -> tuple[float, float | None]:
    """``(mamba_dt_clamp_min, mamba_dt_clamp_max)`` of a ``time_step_limit`` (``None``: no limit);
    an infinite upper end is no upper clamp (``None``). ``MambaConfig`` validates the values."""
    low, high = limit or (0.0, math.inf)
    return low, None if high == math.inf else high


def time_step_limit_to_hf(mamba: MambaConfig) -> list[float]:
    """The ``time_step_limit`` of ``mamba``'s clamps: ``[mamba_dt_clamp_min, mamba_dt_clamp_max]``,
    with ``inf`` for no upper clamp."""
    high = mamba.mamba_dt_clamp_max
    return [mamba.mamba_dt_clamp_min, math.inf if high is None else high]
