"""Knowledge-distillation losses: the KL divergence between a student's and a teacher's
temperature-softened next-token distributions, and distances between chosen layers' hidden states.

Logits may be vocab-parallel (each tensor-parallel rank holds a slice of the vocabulary, padded ids
at ``-inf``): the softmax is then computed across the group (maximum and sum all-reduced), never
gathered, and every rank of the group gets the same loss.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_parallel import reduce_from_tensor_model_parallel_region
from torch.distributed.nn.functional import all_reduce as all_reduce_with_summed_grad

from .schedule import masked_mean_loss


def _sum_over_group(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` summed over the ranks of ``tp_group``, for a result every rank holds alike (its gradient
    passes through, as to each rank's own terms); ``x`` without a group."""
    return x if tp_group is None else reduce_from_tensor_model_parallel_region(x, tp_group)


def vocab_parallel_log_softmax(logits: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``log_softmax`` over the last dimension, split over ``tp_group`` (whole without one), in float32."""
    logits = logits.float()
    maximum = logits.detach().amax(dim=-1, keepdim=True)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - maximum
    total = shifted.exp().sum(dim=-1, keepdim=True)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        # every rank's terms depend on the normalizer: its gradient is summed over the group
        total = all_reduce_with_summed_grad(total, group=tp_group)
    return shifted - total.log()


@experimental_api
def logit_kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    temperature: float = 1.0,
    direction: Literal["forward", "reverse"] = "forward",
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Masked mean over tokens of ``T² · KL`` between the distributions ``softmax(logits / T)``.

    ``direction="forward"``: ``KL(teacher ‖ student)`` (mean-seeking, Hinton et al.);
    ``"reverse"``: ``KL(student ‖ teacher)`` (mode-seeking). The ``T²`` keeps gradient magnitudes
    independent of the temperature. Logits ``[..., vocab]`` (``[..., vocab / tp]``, each rank its
    slice, with ``tp_group``), ``loss_mask`` of the leading shape, 1 where a token counts. Float32
    throughout; the teacher gets no gradient. Ids at ``-inf`` in both (padding) contribute nothing.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction must be 'forward' or 'reverse', got {direction!r}")
    log_student = vocab_parallel_log_softmax(student_logits.float() / temperature, tp_group)
    log_teacher = vocab_parallel_log_softmax(teacher_logits.detach().float() / temperature, tp_group)
    log_p, log_q = (log_teacher, log_student) if direction == "forward" else (log_student, log_teacher)
    p = log_p.exp()
    terms = p * torch.where(p > 0, log_p - log_q, 0.0)  # padded ids: 0, not 0 * (-inf + inf)
    per_token = _sum_over_group(terms.sum(dim=-1), tp_group)
    return masked_mean_loss(per_token, loss_mask) * temperature**2


@experimental_api
def hidden_state_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    kind: Literal["cosine", "mse"] = "cosine",
    projection: torch.nn.Module | None = None,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Distance between hidden states ``[..., hidden]`` of one (student layer, teacher layer) pair,
    averaged over tokens (where ``loss_mask`` of the leading shape is 1; all tokens without it).

    ``kind="cosine"``: ``1 - cos(student, teacher)`` per token; ``"mse"``: the mean squared
    difference over the hidden dimension per token. ``projection`` (e.g. a ``Linear`` from the
    student's width to the teacher's) maps the student's states first; without it the widths must
    match. Float32; the teacher gets no gradient.
    """
    student = student_hidden if projection is None else projection(student_hidden)
    student, teacher = student.float(), teacher_hidden.detach().float()
    if student.shape != teacher.shape:
        raise ValueError(
            f"hidden states of shape {tuple(student.shape)} (student, after any projection) and "
            f"{tuple(teacher.shape)} (teacher) cannot be compared: project the student's to the teacher's width"
        )
    if kind == "cosine":
        per_token = 1.0 - torch.nn.functional.cosine_similarity(student, teacher, dim=-1)
    elif kind == "mse":
        per_token = (student - teacher).square().mean(dim=-1)
    else:
        raise ValueError(f"kind must be 'cosine' or 'mse', got {kind!r}")
    mask = torch.ones_like(per_token) if loss_mask is None else loss_mask
    return masked_mean_loss(per_token, mask)
