"""The global gradient norm of a model split over tensor-, pipeline- and data-parallel ranks.

Every gradient element of the whole model is counted exactly once: a tensor-parallel shard on each
tensor-parallel rank, a parameter replicated across the tensor-parallel group (layer norms, row
biases) on tensor-parallel rank 0 only, each pipeline stage's own parameters on that stage. The
local sums of squares are then added up over the model-parallel group (tensor x pipeline) and,
where gradients are sharded (distributed optimizer), over the data-parallel group.

Expert-parallel parameters (``param.expert_parallel``, MoE experts: each expert-parallel rank holds
other experts) are summed over the expert-parallel group first (and over the expert-data-parallel
group where sharded), so each expert counts once too. Where the groups have an expert-tensor x
expert group (``tp_ep``, made by ``initialize_model_parallel``) the experts are counted apart from
the dense parameters: a slice split over the expert-tensor-parallel group
(``param.expert_tensor_parallel_dim`` set) on each of its ranks, an expert tensor replicated over
it on its rank 0 only, summed over ``tp_ep`` and the pipeline group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ..device import get_group_device
from ..process_groups.collection import ProcessGroupCollection


def counts_toward_grad_norm(param: torch.Tensor, tp_group: dist.ProcessGroup | None) -> bool:
    """Whether this rank counts ``param`` in the global norm (see the module docstring)."""
    if getattr(param, "tensor_model_parallel", False) or tp_group is None:
        return True
    return dist.get_rank(tp_group) == 0


def is_expert_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert's, different on each expert-parallel rank (``expert_parallel``)."""
    return getattr(param, "expert_parallel", False)


def is_expert_tensor_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is a slice of an expert tensor split over the expert-tensor-parallel group."""
    return getattr(param, "expert_tensor_parallel_dim", None) is not None


def counts_toward_expert_grad_norm(param: torch.Tensor, expert_tp_group: dist.ProcessGroup | None) -> bool:
    """Whether this rank counts the expert parameter ``param`` in the global norm (see the module docstring)."""
    if is_expert_tensor_parallel(param) or expert_tp_group is None:
        return True
    return dist.get_rank(expert_tp_group) == 0


def experts_counted_apart(process_groups: ProcessGroupCollection | None) -> bool:
    """Whether expert parameters' squares are added up over ``tp_ep`` and ``pp``, apart from the rest."""
    return process_groups is not None and process_groups.tp_ep is not None


def sum_of_squares(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Float64 sum of squares of ``tensors``, added up on the device of the first (no host sync)."""
    sums = [tensor.detach().double().square().sum() for tensor in tensors]
    if not sums:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([part.to(sums[0].device) for part in sums]).sum()


def all_reduce_grad_norm(
    local_sum_of_squares: torch.Tensor, groups: Iterable[dist.ProcessGroup | None]
) -> float:
    """Add ``local_sum_of_squares`` over each distinct group given and return the square root."""
    return math.sqrt(all_reduce_sum(local_sum_of_squares, groups).item())


def all_reduce_sum(local: torch.Tensor, groups: Iterable[dist.ProcessGroup | None]) -> torch.Tensor:
    """``local`` (float64) added up over each distinct group given, in turn."""
    total = local.double()
    for group in dict.fromkeys(group for group in groups if group is not None):
        total = total.to(get_group_device(group))
        dist.all_reduce(total, group=group)
    return total


def clip_grad_norm(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    process_groups: ProcessGroupCollection | None = None,
) -> float:
    """Clip the gradients of a data-parallel replica of a model split by ``process_groups``.

    Uses ``param.main_grad`` where ``DistributedDataParallel`` put it, else ``param.grad``;
    gradients must already be reduced over the data-parallel group. Scales them in place so the
    global norm is at most ``max_norm`` (``max_norm <= 0``: no clipping) and returns the global norm
    before clipping. Without ``process_groups`` the model is taken to be unsplit. With an
    expert-parallel group of more than one rank, expert parameters' squares are first added up over it.
    """
    tp_group = process_groups.tp if process_groups is not None else None
    grads = []
    for param in parameters:
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is not None:
            grads.append((param, grad))
    if experts_counted_apart(process_groups):
        norm = _norm_with_experts_apart(grads, process_groups)
    else:
        norm = _norm(grads, process_groups, tp_group)
    if max_norm > 0 and norm > max_norm:
        for _, grad in grads:
            grad.mul_(max_norm / (norm + 1e-6))
    return norm


def _norm_with_experts_apart(grads: list, groups: ProcessGroupCollection) -> float:
    dense = [g for p, g in grads if not is_expert_parallel(p) and counts_toward_grad_norm(p, groups.tp)]
    experts = [
        g for p, g in grads if is_expert_parallel(p) and counts_toward_expert_grad_norm(p, groups.expert_tp)
    ]
    total = all_reduce_sum(sum_of_squares(dense), [groups.mp])
    experts_total = all_reduce_sum(sum_of_squares(experts), [groups.tp_ep, groups.pp])
    return math.sqrt((total + experts_total.to(total.device)).item())


def _norm(grads: list, process_groups: ProcessGroupCollection | None, tp_group) -> float:
    ep_group = process_groups.ep if process_groups is not None else None
    split = ep_group is not None and dist.get_world_size(ep_group) > 1
    counted = [(param, grad) for param, grad in grads if counts_toward_grad_norm(param, tp_group)]
    local = sum_of_squares(grad for param, grad in counted if not (split and is_expert_parallel(param)))
    if split:
        experts = sum_of_squares(grad for param, grad in counted if is_expert_parallel(param))
        experts = all_reduce_sum(experts, [ep_group])
        local = local.to(experts.device) + experts
    return all_reduce_grad_norm(local, [process_groups.mp if process_groups is not None else None])
