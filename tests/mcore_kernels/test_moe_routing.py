"""``moe_topk_routing``: the reference against hand-computed values and a per-row float64 oracle
(softmax after or before top-k, sigmoid, expert bias, replayed indices); the Triton kernels against
the reference, forward and backward, under Triton's interpreter on the CPU (float32: 123 tokens,
7 and 64 experts, k = 1, 2, 4, tied scores) and on a GPU (``gpu``, bfloat16); argument errors."""

import math

import pytest
import torch
from mcore_kernels import moe_topk_routing, use_backend
from mcore_testing.triton_interpreter import interpreted_mismatches


def test_softmax_after_topk_by_hand():
    # logits 0, ln 2, ln 3 (softmax 1/6, 2/6, 3/6); top-2 is experts 2, 1: softmax of (ln 3, ln 2)
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0)]])
    probs, indices, scores = moe_topk_routing(logits, 2)
    assert indices.tolist() == [[2, 1]]
    torch.testing.assert_close(probs, torch.tensor([[0.6, 0.4]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(scores, torch.tensor([[1 / 6, 2 / 6, 3 / 6]]), rtol=0, atol=1e-7)


def test_expert_bias_moves_the_choice_not_the_weights():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0)]])
    bias = torch.tensor([10.0, 0.0, 0.0])
    probs, indices, _ = moe_topk_routing(logits, 2, pre_softmax=True, expert_bias=bias)
    assert indices.tolist() == [[0, 2]]
    torch.testing.assert_close(probs, torch.tensor([[1 / 6, 3 / 6]]), rtol=0, atol=1e-7)


def _oracle(logits, topk, score_function, pre_softmax, bias):
    """Row by row in float64, from the definition (ties to the lowest expert id)."""
    probs, indices, scores = [], [], []
    for row in logits.double().tolist():
        if score_function == "sigmoid":
            s = [1 / (1 + math.exp(-v)) for v in row]
        else:
            top = max(row)
            total = sum(math.exp(v - top) for v in row)
            s = [math.exp(v - top) / total for v in row]
        post = score_function == "softmax" and not pre_softmax
        choice = [
            (row if post else s)[e] + (0.0 if bias is None else bias[e].item()) for e in range(len(row))
        ]
        picked = sorted(range(len(row)), key=lambda e: (-choice[e], e))[:topk]
        if post:
            top = max(row[e] for e in picked)
            total = sum(math.exp(row[e] - top) for e in picked)
            p = [math.exp(row[e] - top) / total for e in picked]
        else:
            p = [s[e] for e in picked]
            if score_function == "sigmoid":
                p = [v / (sum(p) + 1e-20) for v in p] if topk > 1 else p
                s = [v / (sum(s) + 1e-20) for v in s]
        probs.append(p), indices.append(picked), scores.append(s)
    as_tensor = torch.tensor
    return as_tensor(probs, dtype=torch.float64), as_tensor(indices), as_tensor(scores, dtype=torch.float64)


MODES = [("softmax", False), ("softmax", True), ("sigmoid", False)]


@pytest.mark.parametrize(("score_function", "pre_softmax"), MODES)
@pytest.mark.parametrize("topk", [1, 2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_matches_the_oracle(score_function, pre_softmax, topk, with_bias):
    generator = torch.Generator().manual_seed(topk)
    logits = 2 * torch.randn(9, 7, generator=generator, dtype=torch.float64)
    bias = torch.randn(7, generator=generator, dtype=torch.float64) if with_bias else None
    kwargs = dict(score_function=score_function, pre_softmax=pre_softmax, expert_bias=bias)
    got = moe_topk_routing(logits, topk, **kwargs)
    for a, b in zip(got, _oracle(logits, topk, score_function, pre_softmax, bias), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_given_indices_replace_the_choice():
    logits = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    given = torch.tensor([[5, 0]] * 5)
    probs, indices, _ = moe_topk_routing(logits, 2, indices=given)
    assert torch.equal(indices, given)
    torch.testing.assert_close(probs, torch.softmax(logits[:, [5, 0]], dim=-1))
    assert torch.autograd.gradcheck(lambda x: moe_topk_routing(x, 2, indices=given)[0], (logits,))


CASES = [
    (tokens, experts, topk, mode, bias, ties)
    for experts in (7, 64)
    for topk in (1, 2, 4)
    for mode in MODES
    for tokens, bias, ties in ((123, False, False), (123, True, False), (123, False, True))
]


def _case_id(case):
    tokens, experts, topk, (function, pre), bias, ties = case
    return f"{tokens}x{experts}-k{topk}-{function}{'-pre' if pre else ''}{'-bias' if bias else ''}{'-ties' if ties else ''}"


def _run(case, backend, *, dtype=torch.float32, device="cpu", indices=None, use_scores=True):
    """``(probs, indices, scores, dlogits)`` of one case on ``backend``; ties: integer logits;
    without ``use_scores`` the loss takes the probabilities only."""
    tokens, experts, topk, (function, pre), with_bias, ties = case
    generator = torch.Generator().manual_seed(tokens * experts + topk)
    logits = (
        torch.randint(-2, 3, (tokens, experts), generator=generator).float()
        if ties
        else 2 * torch.randn(tokens, experts, generator=generator)
    )
    bias = torch.randn(experts, generator=generator).to(device) if with_bias else None
    weights = torch.randn(tokens, topk, generator=generator).to(device, dtype)
    score_weights = torch.randn(tokens, experts, generator=generator).to(device, dtype)
    logits = logits.to(device, dtype).requires_grad_(True)
    with use_backend(backend):
        probs, chosen, scores = moe_topk_routing(
            logits, topk, score_function=function, pre_softmax=pre, expert_bias=bias, indices=indices
        )
    loss = (probs * weights).sum()
    if use_scores:
        loss = loss + (scores * score_weights).sum()
    loss.backward()
    return probs.detach(), chosen, scores.detach(), logits.grad


def _interpreted_mismatches() -> list:
    """Run in a fresh process with ``TRITON_INTERPRET=1``: the (case, tensor) pairs where the Triton
    kernels and the reference disagree. With tied scores the kernel's choice must be the lowest
    ids among equals (a stable sort's), and the reference is given that choice to compare the rest."""
    mismatches = []
    for case in CASES:
        triton = _run(case, "triton")
        reference = _run(case, "reference", indices=triton[1] if case[-1] else None)
        if case[-1]:
            expected = _stable_choice(case)
            if not torch.equal(triton[1], expected):
                mismatches.append([_case_id(case), "stable indices"])
        for name, a, b in zip(("probs", "indices", "scores", "dlogits"), triton, reference, strict=True):
            if not torch.allclose(a.double(), b.double(), 1e-5, 1e-6):
                mismatches.append([_case_id(case), name])
    for case in CASES[:9]:  # no gradient into the scores (the loss does not use them)
        triton = _run(case, "triton", use_scores=False)
        reference = _run(case, "reference", indices=triton[1] if case[-1] else None, use_scores=False)
        if not torch.allclose(triton[3], reference[3], 1e-5, 1e-6):
            mismatches.append([_case_id(case), "dlogits from probs only"])
    return mismatches


def _stable_choice(case):
    """The top-k of the case's (integer) choice by a stable descending sort."""
    tokens, experts, topk, (function, pre), with_bias, _ = case
    generator = torch.Generator().manual_seed(tokens * experts + topk)
    logits = torch.randint(-2, 3, (tokens, experts), generator=generator).float()
    bias = torch.randn(experts, generator=generator) if with_bias else torch.zeros(experts)
    scores = torch.sigmoid(logits) if function == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = (logits if function == "softmax" and not pre else scores) + bias
    return torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :topk]


def test_triton_kernels_match_the_reference_under_the_interpreter():
    assert interpreted_mismatches(__file__) == []


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_kernels_match_the_reference_on_a_gpu(case):
    triton = _run(case, "triton", dtype=torch.bfloat16, device="cuda")
    reference = _run(case, "reference", dtype=torch.bfloat16, device="cuda", indices=triton[1])
    for a, b in zip(triton, reference, strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (dict(logits=torch.ones(3, 4, dtype=torch.int64)), TypeError, "logits must be a floating-point"),
        (dict(logits=torch.ones(4)), TypeError, r"logits must be a floating-point \[T, E\]"),
        (dict(topk=0), ValueError, r"topk must be an int in \[1, 4\]"),
        (dict(topk=5), ValueError, r"topk must be an int in \[1, 4\]"),
        (dict(score_function="relu"), ValueError, "score_function must be one of"),
        (dict(score_function="sigmoid", pre_softmax=True), ValueError, "pre_softmax needs score_function"),
        (dict(expert_bias=torch.zeros(3)), ValueError, r"expert_bias must be a floating-point \(4,\)"),
        (dict(indices=torch.zeros(3, 2)), ValueError, r"indices must be an int64 \(3, 2\)"),
        (
            dict(indices=torch.zeros(3, 1, dtype=torch.int64)),
            ValueError,
            r"indices must be an int64 \(3, 2\)",
        ),
    ],
)
def test_bad_arguments_are_named(arguments, error, match):
    call = dict(logits=torch.randn(3, 4), topk=2) | arguments
    with pytest.raises(error, match=match):
        moe_topk_routing(call.pop("logits"), call.pop("topk"), **call)


def test_forcing_triton_for_float64_is_refused():
    from mcore_kernels import KernelBackendError

    with use_backend("triton"), pytest.raises(KernelBackendError, match="float32, not float64"):
        moe_topk_routing(torch.randn(3, 4, dtype=torch.float64), 2)
