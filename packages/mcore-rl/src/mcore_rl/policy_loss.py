"""GRPO's clipped policy loss over per-token log-probs, with KL penalty, entropy bonus and truncated
importance sampling against the inference engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mcore_api import experimental_api

from ._checks import float_tensor, like, token_mask
from .kl import kl_estimate
from .loss_config import GRPOLossConfig


@experimental_api
@dataclass(frozen=True)
class GRPOLoss:
    """What ``grpo_loss`` returns: ``loss``, the scalar to minimise, and ``metrics``, detached
    0-dim tensors averaged over the unmasked tokens:

    - ``clip_fraction_low``: ratio < 1 - clip_low on a token with negative advantage;
    - ``clip_fraction_high``: ratio > 1 + clip_high on a token with positive advantage;
    - ``ratio_mean``: the mean of ratio = exp(logp - old_logp);
    - ``kl_mean``: the mean KL estimate, when ``ref_logp`` is given;
    - ``entropy_mean``: the mean entropy, when ``entropy`` is given;
    - ``tis_weight_mean``: the mean importance-sampling weight, when the correction is on.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


@experimental_api
def grpo_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    config: GRPOLossConfig | None = None,
    *,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    inference_logp: torch.Tensor | None = None,
) -> GRPOLoss:
    """GRPO's loss of a batch of B completions of T tokens (padded), to minimise.

    ``logp`` ``[B, T]``: the trained policy's log-probs of the completion tokens (with gradient);
    ``advantages`` ``[B]``: one per completion (``group_advantages``); ``completion_mask``
    ``[B, T]`` (bool or 0/1): the tokens that count; values at other positions are ignored, even
    NaN. ``old_logp``: the log-probs, under the trainer, of the policy that generated the rollouts
    (``None``: on policy, ``logp.detach()``). ``ref_logp``: the reference policy's, needed when
    ``config.beta > 0``. ``entropy``: per-token entropies, needed when ``config.entropy_coef > 0``.
    ``inference_logp``: the inference engine's sampling log-probs, needed when ``config.tis_cap``
    is set.

    Per token, with ``ratio = exp(logp - old_logp)`` and ``A`` the completion's advantage::

        w = min(exp(old_logp - inference_logp), tis_cap)          # 1 without tis_cap
        objective = w * min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
                    - beta * KL(logp, ref_logp) + entropy_coef * entropy

    and the loss is minus the objective averaged per ``config.aggregation``: ``"token_mean"`` over
    all unmasked tokens of the batch, ``"sequence_mean"`` over each completion's unmasked tokens,
    then over the completions that have any. A batch without unmasked tokens has loss 0.

    Raises ``TypeError``/``ValueError`` naming the argument: tensors of the wrong type, dtype,
    shape or device; a missing input the config needs.
    """
    config = GRPOLossConfig() if config is None else config
    if not isinstance(config, GRPOLossConfig):
        raise TypeError(f"config: must be a GRPOLossConfig or None, got {type(config).__name__}")
    float_tensor("logp", logp)
    if logp.dim() != 2 or logp.numel() == 0:
        raise ValueError(f"logp: must be a non-empty [B, T] tensor, got shape {tuple(logp.shape)}")
    mask = token_mask("completion_mask", completion_mask, logp, "logp")
    float_tensor("advantages", advantages)
    if advantages.shape != logp.shape[:1] or advantages.device != logp.device:
        raise ValueError(
            f"advantages: must be [B] = {tuple(logp.shape[:1])} on {logp.device} (one per completion), "
            f"got {tuple(advantages.shape)} on {advantages.device}"
        )
    _require("ref_logp", ref_logp, config.beta > 0, "config.beta > 0")
    _require("entropy", entropy, config.entropy_coef > 0, "config.entropy_coef > 0")
    _require("inference_logp", inference_logp, config.tis_cap is not None, "config.tis_cap is set")

    def masked(name: str, value: torch.Tensor | None) -> torch.Tensor | None:
        # Zeros off the mask, before any arithmetic: padding may hold NaN or inf.
        if value is None:
            return None
        like(name, value, logp, "logp")
        return torch.where(mask, value, torch.zeros((), dtype=value.dtype, device=value.device))

    logp = masked("logp", logp)
    old_logp = logp.detach() if old_logp is None else masked("old_logp", old_logp).detach()
    ref_logp = masked("ref_logp", ref_logp)
    entropy = masked("entropy", entropy)
    inference_logp = masked("inference_logp", inference_logp)

    ratio = torch.exp(logp - old_logp)
    adv = advantages.detach().to(logp.dtype)[:, None]
    clipped_ratio = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    objective = torch.minimum(ratio * adv, clipped_ratio * adv)
    tis_weight = None
    if config.tis_cap is not None:
        tis_weight = torch.exp(old_logp - inference_logp.detach()).clamp(max=config.tis_cap)
        objective = objective * tis_weight
    kl = None if ref_logp is None else kl_estimate(logp, ref_logp, config.kl_estimator)
    if config.beta > 0:
        objective = objective - config.beta * kl
    if config.entropy_coef > 0:
        objective = objective + config.entropy_coef * entropy
    loss = _aggregate(-objective, mask, config.aggregation)

    with torch.no_grad():
        metrics = {
            "clip_fraction_low": _token_mean((ratio < 1.0 - config.clip_low) & (adv < 0), mask, ratio),
            "clip_fraction_high": _token_mean((ratio > 1.0 + config.clip_high) & (adv > 0), mask, ratio),
            "ratio_mean": _token_mean(ratio, mask, ratio),
        }
        if kl is not None:
            metrics["kl_mean"] = _token_mean(kl, mask, ratio)
        if entropy is not None:
            metrics["entropy_mean"] = _token_mean(entropy, mask, ratio)
        if tis_weight is not None:
            metrics["tis_weight_mean"] = _token_mean(tis_weight, mask, ratio)
    return GRPOLoss(loss=loss, metrics=metrics)


def _require(name: str, value: object, needed: bool, because: str) -> None:
    if needed and value is None:
        raise ValueError(f"{name}: required when {because}, got None")


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    per_token = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    counts = mask.sum(dim=-1).to(per_token.dtype)
    if aggregation == "token_mean":
        return per_token.sum() / counts.sum().clamp(min=1.0)
    per_sequence = per_token.sum(dim=1) / counts.clamp(min=1.0)
    present = (counts > 0).to(per_token.dtype)
    return (per_sequence * present).sum() / present.sum().clamp(min=1.0)


def _token_mean(values: torch.Tensor, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return _aggregate(values.to(like.dtype), mask, "token_mean")
