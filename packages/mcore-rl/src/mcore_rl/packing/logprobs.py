"""Per-token log-probs of the labels from (vocab-parallel) logits, without gathering the vocabulary."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_parallel import vocab_parallel_cross_entropy

from .._checks import float_tensor, is_real
from .pack import IGNORE_INDEX


@experimental_api
def label_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``log softmax(logits / temperature)[label]`` per token, ``[b, s]`` float32, differentiable in
    ``logits``; 0 where the label is ``IGNORE_INDEX`` (-100).

    ``logits`` ``[b, s, V / tp]``: this tensor-parallel rank's vocabulary shard, as ``GPTModel``
    returns them with ``parallel_output=True``, the softmax's normaliser reduced over ``tp_group``
    (``mcore_parallel``'s ``vocab_parallel_cross_entropy``, full logits are never gathered);
    ``tp_group=None``: the logits hold the whole vocabulary. ``temperature``: the sampling
    temperature, so that the log-probs are those the tokens were sampled with.

    Raises ``TypeError``/``ValueError`` naming the argument for wrong types, shapes or temperature.
    """
    float_tensor("logits", logits)
    if logits.dim() != 3:
        raise ValueError(f"logits: must be [b, s, vocab], got shape {tuple(logits.shape)}")
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.long:
        raise TypeError(
            f"labels: must be a long tensor, got {getattr(labels, 'dtype', type(labels).__name__)}"
        )
    if labels.shape != logits.shape[:2]:
        raise ValueError(
            f"labels: must have the shape of logits' first two dimensions {tuple(logits.shape[:2])}, "
            f"got {tuple(labels.shape)}"
        )
    if not is_real(temperature) or temperature <= 0:
        raise ValueError(f"temperature: must be a finite number > 0, got {temperature!r}")
    scaled = logits if temperature == 1.0 else logits / temperature
    ignored = labels == IGNORE_INDEX
    targets = labels.masked_fill(ignored, 0)
    if tp_group is None:
        negative = torch.nn.functional.cross_entropy(
            scaled.float().transpose(1, 2), targets, reduction="none"
        )
    else:
        negative = vocab_parallel_cross_entropy(scaled, targets, tp_group)
    return torch.where(ignored, torch.zeros((), dtype=negative.dtype, device=negative.device), -negative)
