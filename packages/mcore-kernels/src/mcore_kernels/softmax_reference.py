"""Attention softmax in plain PyTorch: the numerical oracle of the Triton kernel and the path every
non-CUDA tensor takes, differentiated by autograd (in float32, bit for bit the plain
``softmax(masked_fill(scores * scale))`` with the sink column appended).

``scores [..., n, q, k]``: the last ``q`` queries of ``k`` keys (query ``i`` is at position
``i + k - q``), ``n`` heads. Scores are scaled and the softmax taken in float32 (float64 for float64
scores); the result is rounded once to the scores' dtype. A sink logit per head joins the
denominator and takes probability mass but has no column of its own. A row with no allowed key and
no sink is all zeros (and passes no gradient).
"""

from __future__ import annotations

import torch


def allowed_keys(
    q: int,
    k: int,
    causal: bool,
    window_size: int | None,
    allowed: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean mask, ``True`` where a query may attend to a key: ``allowed`` (or everything), and with
    ``causal`` keys at or before the query, with ``window_size`` fewer than ``window_size`` back."""
    if not causal:
        return allowed
    distance = (torch.arange(q, device=device) + (k - q))[:, None] - torch.arange(k, device=device)[None, :]
    band = distance >= 0
    if window_size is not None:
        band = band & (distance < window_size)
    return band if allowed is None else allowed & band


def attention_softmax(
    scores: torch.Tensor,
    scale: float,
    causal: bool,
    window_size: int | None,
    sink_logits: torch.Tensor | None,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """The probabilities ``[..., n, q, k]`` in ``scores``' dtype (see the module doc)."""
    compute = torch.promote_types(scores.dtype, torch.float32)
    s = scores.to(compute) * scale
    q, k = s.shape[-2], s.shape[-1]
    mask = allowed_keys(q, k, causal, window_size, allowed, s.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    empty = None
    if mask is not None and sink_logits is None:
        empty = ~mask.any(-1, keepdim=True)
        s = s.masked_fill(empty, 0.0)  # not a row of -inf: its softmax would be NaN, forward and back
    if sink_logits is None:
        probs = torch.softmax(s, dim=-1)
    else:
        sink = sink_logits.to(compute).view(-1, 1, 1).expand(*s.shape[:-1], 1)
        probs = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
    if empty is not None:
        probs = probs.masked_fill(empty, 0.0)
    return probs.to(scores.dtype)
