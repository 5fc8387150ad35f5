"""MoE top-k routing in plain PyTorch: the numerical oracle of the Triton kernels and the path every
non-CUDA tensor takes, differentiated by autograd. It is the arithmetic of mcore-models' top-k
router, op for op, so the router's numbers do not change when it calls ``moe_topk_routing``.

Scores are ``softmax(logits)`` or ``sigmoid(logits)`` over the experts. The choice is made on the
logits (softmax after top-k, the default) or on the scores (``pre_softmax``, and sigmoid), plus
``expert_bias`` when given (the bias moves the choice, never the weights); ``torch.topk`` orders the
chosen experts by descending choice. Probabilities: the softmax of the chosen logits (softmax after
top-k), the chosen scores (``pre_softmax``), or the chosen sigmoid scores divided by their sum plus
``1e-20`` (sigmoid, when ``topk > 1``). The returned scores feed the load-balancing loss; sigmoid
scores are divided by their row's sum plus ``1e-20`` for it.
"""

from __future__ import annotations

import torch

EPSILON = 1e-20


def routing_choice(
    logits: torch.Tensor, scores: torch.Tensor, post_softmax: bool, expert_bias: torch.Tensor | None
) -> torch.Tensor:
    """What the top-k picks from (detached): the logits or the scores, plus ``expert_bias``."""
    choice = logits if post_softmax else scores
    if expert_bias is not None:
        choice = choice + expert_bias
    return choice.detach()


def moe_topk_routing(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    pre_softmax: bool,
    expert_bias: torch.Tensor | None,
    indices: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(probs [T, k], indices [T, k], scores [T, E])`` (see the module doc); ``indices``, when
    given, replace the top-k choice (a replayed or group-limited one)."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to(compute)
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1)
    post_softmax = score_function == "softmax" and not pre_softmax
    if indices is None:
        choice = routing_choice(logits, scores, post_softmax, expert_bias)
        indices = choice.topk(topk, dim=-1).indices
    if post_softmax:
        probs = torch.softmax(logits.gather(1, indices), dim=-1)
    else:
        probs = scores.gather(1, indices)
        if score_function == "sigmoid":
            if topk > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + EPSILON)
            scores = scores / (scores.sum(dim=-1, keepdim=True) + EPSILON)
    return probs, indices, scores
