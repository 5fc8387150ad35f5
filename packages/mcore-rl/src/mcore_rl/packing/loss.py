"""``packed_grpo_loss``: ``grpo_loss`` on one packed bin, normalised over the whole global batch."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from mcore_api import experimental_api

from .._checks import float_tensor
from ..loss_config import GRPOLossConfig
from ..policy_loss import GRPOLoss, grpo_loss
from .pack import PackedBin
from .unpack import CompletionRows


@experimental_api
def packed_grpo_loss(
    logp: torch.Tensor,
    packed_bin: PackedBin | Sequence[PackedBin],
    config: GRPOLossConfig | None = None,
    *,
    num_sequences: int,
    num_tokens: int,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> GRPOLoss:
    """This bin's share of ``grpo_loss`` over the global batch: summed over all its bins (every
    micro-batch and data-parallel rank), the shares equal ``grpo_loss`` of the unpacked batch, for
    ``token_mean`` and ``sequence_mean`` alike; so do their gradients.

    ``logp`` ``[1, L]``: the policy's ``label_logprobs`` of the bin (with gradient).
    ``packed_bin`` may also be several bins of one ``PackedBatch`` and one length ``L`` (a list or
    tuple, e.g. stacked as the rows of one forward): then ``logp`` and the optional tensors are
    ``[k, L]``, one row per bin, and the result is the sum of the bins' shares, in one pass.
    ``num_sequences`` and ``num_tokens``: the global batch's sequences and completion tokens
    (``PackedBatch.num_sequences`` / ``num_tokens``), the ``sequence_mean`` and ``token_mean``
    normalisers. ``old_logp``, ``ref_logp``, ``entropy``: optional packed tensors of ``logp``'s shape
    (e.g. forward passes over the bin); ``old_logp`` defaults to the bin's ``sampling_logprobs``,
    ``ref_logp`` to its ``ref_logprobs``. With ``config.tis_cap``, the sampling log-probs are
    ``grpo_loss``'s ``inference_logp``, and ``old_logp`` is required.

    Schedules that average micro-batch losses (``mcore_parallel``'s) and DDP that averages
    gradients over ranks need the share multiplied by the number of micro-batches and of
    data-parallel ranks. ``metrics`` are this bin's token means; a bin without sequences has loss
    0 (still connected to ``logp``) and no metrics.

    Raises ``TypeError``/``ValueError`` naming the argument (see also ``grpo_loss``).
    """
    config = GRPOLossConfig() if config is None else config
    if not isinstance(config, GRPOLossConfig):
        raise TypeError(f"config: must be a GRPOLossConfig or None, got {type(config).__name__}")
    bins = _bins(packed_bin)
    shape = (len(bins), bins[0].tokens.shape[1])
    for name, value in (("logp", logp), ("old_logp", old_logp), ("ref_logp", ref_logp), ("entropy", entropy)):
        if value is not None and float_tensor(name, value).shape != shape:
            raise ValueError(f"{name}: must be the bins' [k, L] = {shape}, got {tuple(value.shape)}")
    if config.tis_cap is not None and old_logp is None:
        raise ValueError(
            "old_logp: required when config.tis_cap is set (the trainer's log-probs of the rollout "
            "policy, weighed against the bin's sampling log-probs)"
        )
    local_sequences = sum(b.num_sequences for b in bins)
    local_tokens = sum(int(b.loss_mask.sum()) for b in bins)
    _check_count("num_sequences", num_sequences, local_sequences)
    _check_count("num_tokens", num_tokens, local_tokens)
    if local_sequences == 0:
        return GRPOLoss(loss=logp[..., :0].sum(), metrics={})

    def stacked(field: str) -> torch.Tensor | None:
        values = [getattr(b, field) for b in bins]
        return values[0] if len(values) == 1 or values[0] is None else torch.cat(values)

    rows = CompletionRows.of_rows(stacked("loss_mask"), stacked("sequence_index"))
    if len(rows.sequence_index) != local_sequences:
        raise ValueError(
            "packed_bin: the bins hold one sequence index twice: stack only bins of one PackedBatch"
        )
    sampling = stacked("sampling_logprobs")

    def gather(value: torch.Tensor) -> torch.Tensor:  # the bin may live on another device than logp
        return rows.gather(value.to(logp.device))

    def optional(value: torch.Tensor | None) -> torch.Tensor | None:
        return None if value is None else gather(value)

    result = grpo_loss(
        gather(logp),
        gather(stacked("advantages"))[:, 0],
        rows.mask().to(logp.device),
        config,
        old_logp=gather(sampling if old_logp is None else old_logp),
        ref_logp=optional(stacked("ref_logprobs") if ref_logp is None else ref_logp),
        entropy=optional(entropy),
        inference_logp=gather(sampling) if config.tis_cap is not None else None,
    )
    if config.aggregation == "token_mean":
        share = local_tokens / num_tokens
    else:
        share = local_sequences / num_sequences
    return GRPOLoss(loss=result.loss * share, metrics=result.metrics)


def _bins(packed_bin: object) -> tuple[PackedBin, ...]:
    """``packed_bin`` as a non-empty tuple of bins of one length."""
    if isinstance(packed_bin, PackedBin):
        return (packed_bin,)
    if not isinstance(packed_bin, (list, tuple)) or not packed_bin:
        raise TypeError(
            f"packed_bin: must be a PackedBin or a non-empty list of them, got {type(packed_bin).__name__}"
        )
    for b, member in enumerate(packed_bin):
        if not isinstance(member, PackedBin):
            raise TypeError(f"packed_bin[{b}]: must be a PackedBin, got {type(member).__name__}")
        if member.tokens.shape != packed_bin[0].tokens.shape:
            raise ValueError(
                f"packed_bin[{b}]: {tuple(member.tokens.shape)} tokens, but packed_bin[0] has "
                f"{tuple(packed_bin[0].tokens.shape)}: stacked bins must have one length"
            )
    return tuple(packed_bin)


def _check_count(name: str, value: object, local: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name}: must be an int, got {type(value).__name__} {value!r}")
    if value < max(local, 1):
        raise ValueError(
            f"{name}: must be >= this bin's {local} (and >= 1): the global batch's count, got {value}"
        )
