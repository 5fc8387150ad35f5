"""Per-token estimators of the KL divergence from the policy to a reference policy."""

from __future__ import annotations

from typing import Literal

import torch
from mcore_api import experimental_api

from ._checks import float_tensor, like

_ESTIMATORS = ("k1", "k2", "k3")


@experimental_api
def kl_estimate(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: Literal["k1", "k2", "k3"] = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the log-probs, under both, of tokens the
    policy sampled (J. Schulman, "Approximating KL Divergence", 2020). With
    ``d = ref_logp - logp``:

    - ``k1 = -d``: unbiased, high variance, can be negative;
    - ``k2 = d ** 2 / 2``: biased, low variance, >= 0;
    - ``k3 = exp(d) - d - 1``: unbiased, low variance, >= 0; TRL's GRPO KL term.

    Same shape as ``logp``; differentiable in ``logp`` (and ``ref_logp``). Raises ``TypeError`` or
    ``ValueError`` naming the argument for tensors that are not floating point or of different
    shapes, or an unknown ``estimator``.
    """
    float_tensor("logp", logp)
    like("ref_logp", ref_logp, logp, "logp")
    if estimator not in _ESTIMATORS:
        raise ValueError(f"estimator: must be one of {_ESTIMATORS}, got {estimator!r}")
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d * d / 2
    return torch.exp(d) - d - 1
