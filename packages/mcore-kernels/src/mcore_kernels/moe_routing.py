"""``moe_topk_routing``: the public entry point, an autograd function over the Triton kernels
(``dispatch``; the reference is differentiated by autograd), and the checks that turn bad arguments
into errors naming them."""

from __future__ import annotations

import importlib

import torch

from . import moe_routing_reference
from .dispatch import KernelBackendError, requested_backend, select_backend

SCORE_FUNCTIONS = ("softmax", "sigmoid")


class _TritonRoutingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, sigmoid, post_softmax, expert_bias, indices):
        kernels = importlib.import_module("mcore_kernels.moe_routing_triton")
        logits = logits.contiguous()
        bias = None if expert_bias is None else expert_bias.float().contiguous()
        given = None if indices is None else indices.contiguous()
        probs, indices, scores = kernels.routing_forward(logits, topk, sigmoid, post_softmax, bias, given)
        ctx.save_for_backward(logits, indices)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        ctx.options = (sigmoid, post_softmax)
        ctx.mark_non_differentiable(indices)
        return probs, indices, scores

    @staticmethod
    def backward(ctx, dprobs, _dindices, dscores):
        logits, indices = ctx.saved_tensors
        kernels = importlib.import_module("mcore_kernels.moe_routing_triton")
        dprobs = torch.zeros(indices.shape, device=logits.device) if dprobs is None else dprobs
        dscores = None if dscores is None else dscores.float().contiguous()
        dlogits = kernels.routing_backward(
            logits, indices, dprobs.float().contiguous(), dscores, *ctx.options
        )
        return dlogits.to(logits.dtype), None, None, None, None, None


def _check(logits, topk, score_function, pre_softmax, expert_bias, indices) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 2:
        raise TypeError(
            f"moe_topk_routing: logits must be a floating-point [T, E] tensor, got {_kind(logits)}"
        )
    experts = logits.shape[1]
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= experts:
        raise ValueError(f"moe_topk_routing: topk must be an int in [1, {experts}], got {topk!r}")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(
            f"moe_topk_routing: score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}"
        )
    if pre_softmax and score_function != "softmax":
        raise ValueError("moe_topk_routing: pre_softmax needs score_function 'softmax'")
    if expert_bias is not None and (
        not isinstance(expert_bias, torch.Tensor)
        or not expert_bias.is_floating_point()
        or tuple(expert_bias.shape) != (experts,)
        or expert_bias.device != logits.device
    ):
        raise ValueError(
            f"moe_topk_routing: expert_bias must be a floating-point ({experts},) tensor on "
            f"{logits.device}, got {_kind(expert_bias)}"
        )
    if indices is not None and (
        not isinstance(indices, torch.Tensor)
        or indices.dtype != torch.int64
        or tuple(indices.shape) != (logits.shape[0], topk)
        or indices.device != logits.device
    ):
        raise ValueError(
            f"moe_topk_routing: indices must be an int64 ({logits.shape[0]}, {topk}) tensor on "
            f"{logits.device}, got {_kind(indices)}"
        )


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)} on {value.device}"
    return type(value).__name__


def moe_topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    expert_bias: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route ``logits [T, E]`` to ``topk`` experts each: ``(probs [T, k], indices [T, k], scores
    [T, E])``, the scores being what the load-balancing loss takes. ``score_function`` is
    ``"softmax"`` (top-k on the logits, then a softmax over the chosen ones; with ``pre_softmax``
    top-k on the softmax) or ``"sigmoid"`` (top-k on the sigmoid scores, the chosen ones
    renormalised to sum to one when ``topk > 1``). ``expert_bias [E]`` shifts the choice only;
    ``indices`` given (int64 ``[T, k]``, e.g. replayed) replace the choice. Computed and returned in
    float32 (float64 logits: float64, on the reference); differentiable in ``logits``. See
    ``moe_routing_reference``."""
    _check(logits, topk, score_function, pre_softmax, expert_bias, indices)
    if logits.dtype == torch.float64 and requested_backend() == "triton":
        raise KernelBackendError("moe_topk_routing: the Triton kernel computes in float32, not float64")
    backend = select_backend("moe_topk_routing", logits)
    if backend == "reference" or logits.numel() == 0 or logits.dtype == torch.float64:
        return moe_routing_reference.moe_topk_routing(
            logits, topk, score_function, bool(pre_softmax), expert_bias, indices
        )
    post_softmax = score_function == "softmax" and not pre_softmax
    return _TritonRoutingFunction.apply(
        logits, topk, score_function == "sigmoid", post_softmax, expert_bias, indices
    )
