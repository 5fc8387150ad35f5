"""The MLP activations: the reference against torch formulas (autograd for the gradients; bit for
bit in float32) and Hugging Face's GPT-OSS gate; the Triton kernels against the reference, forward and
backward, under Triton's interpreter on the CPU (float32) and on a GPU (``gpu``); argument errors."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from mcore_kernels import (
    clamped_swiglu,
    geglu,
    quick_geglu,
    quick_gelu,
    squared_relu,
    swiglu,
    use_backend,
)
from mcore_testing.triton_interpreter import interpreted_mismatches


def _split(x, interleaved):
    return (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)


def _formula(name, x, probs, options):
    """The activation written with torch ops, differentiable by autograd."""
    alpha = options.get("alpha", 1.702)
    if name in ("quick_gelu", "squared_relu"):
        out = x * torch.sigmoid(alpha * x) if name == "quick_gelu" else F.relu(x) ** 2
    else:
        gate, up = _split(x, options.get("interleaved", False))
        clamp = options.get("limit", 7.0) if name == "clamped_swiglu" else options.get("clamp")
        offset = 1.0 if name == "clamped_swiglu" else options.get("offset", 0.0)
        if clamp is not None:
            gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
        act = {
            "swiglu": F.silu,
            "geglu": F.gelu,
            "quick_geglu": lambda g: g * torch.sigmoid(alpha * g),
            "clamped_swiglu": lambda g: g * torch.sigmoid(alpha * g),
        }[name]
        out = act(gate) * (up + offset)
    return out if probs is None else out * probs.reshape(*x.shape[:-1], 1)


FUNCTIONS = {
    "swiglu": swiglu,
    "geglu": geglu,
    "quick_geglu": quick_geglu,
    "clamped_swiglu": clamped_swiglu,
    "quick_gelu": quick_gelu,
    "squared_relu": squared_relu,
}

# (name, keyword options, weighted by probs)
CASES = [
    ("swiglu", {}, False),
    ("swiglu", {}, True),
    ("swiglu", {"offset": 0.5, "clamp": 2.0, "interleaved": True}, True),
    ("geglu", {}, False),
    ("geglu", {"offset": -1.0, "clamp": 1.5}, True),
    ("quick_geglu", {}, False),
    ("quick_geglu", {"alpha": 1.3, "offset": 1.0, "interleaved": True}, True),
    ("clamped_swiglu", {}, False),
    ("clamped_swiglu", {"limit": 1.0}, True),
    ("clamped_swiglu", {"alpha": 2.0, "limit": 0.75, "interleaved": True}, True),
    ("quick_gelu", {}, False),
    ("quick_gelu", {"alpha": 1.1}, True),
    ("squared_relu", {}, False),
    ("squared_relu", {}, True),
]


def _case_id(case):
    name, options, weighted = case
    parts = [name, *(f"{k}={v}" for k, v in options.items())]
    return "-".join(parts + (["weighted"] if weighted else []))


def _gated(name):
    return name not in ("quick_gelu", "squared_relu")


def _limit(name, options):
    return options.get("limit", 7.0) if name == "clamped_swiglu" else options.get("clamp")


def _inputs(name, options, weighted, shape, *, dtype=torch.float32, seed=0, device="cpu", edges=True):
    """``x`` spread over the clamp range, with some entries exactly at its edges (unless not
    ``edges``), and ``probs``."""
    gen = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(*shape, generator=gen)
    limit = _limit(name, options)
    if limit is not None and edges:
        flat = x.view(-1)
        flat[0::7] = limit
        flat[3::11] = -limit
    probs = torch.rand(*shape[:-1], generator=gen) if weighted else None
    return (x.to(device, dtype), None if probs is None else probs.to(device, dtype))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reference_matches_the_formula_and_its_autograd(case):
    name, options, weighted = case
    # off the clamp bounds, where torch releases differ (see test_clamp_bounds_pass_the_gradient)
    x, probs = _inputs(name, options, weighted, (3, 5, 34), dtype=torch.float64, edges=False)
    x.requires_grad_()
    if probs is not None:
        probs.requires_grad_()
    inputs = [t for t in (x, probs) if t is not None]
    out = FUNCTIONS[name](x, probs, **options)
    expected = _formula(name, x, probs, options)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.testing.assert_close(
        torch.autograd.grad(out, inputs, grad),
        torch.autograd.grad(expected, inputs, grad),
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == {} or c[2]], ids=_case_id)
def test_reference_backward_passes_gradcheck(case):
    name, options, weighted = case
    x, probs = _inputs(name, options, weighted, (2, 3, 6), dtype=torch.float64, seed=3)
    x = (x + 0.01).requires_grad_()  # off the clamp edges, where the derivative jumps
    inputs = (x,) if probs is None else (x, probs.requires_grad_())
    assert torch.autograd.gradcheck(lambda *t: FUNCTIONS[name](*t, **options), inputs)


@pytest.mark.parametrize("interleaved", [False, True])
def test_clamp_bounds_pass_the_gradient(interleaved):
    """At ``gate == limit`` and ``up == +-limit`` the gradient passes (subgradient 1), computed by hand."""
    gate = torch.tensor([2.0, 2.0, 2.0, -3.0, 2.5], dtype=torch.float64)
    up = torch.tensor([2.0, -2.0, 1.0, 0.5, -2.5], dtype=torch.float64)
    x = torch.stack((gate, up), -1).view(-1) if interleaved else torch.cat((gate, up))
    x.requires_grad_()
    clamped_swiglu(x, alpha=1.5, limit=2.0, interleaved=interleaved).sum().backward()
    g, u = gate.clamp(max=2.0), up.clamp(-2.0, 2.0)
    s = torch.sigmoid(1.5 * g)
    dgate = (u + 1) * (s + 1.5 * g * s * (1 - s)) * (gate <= 2.0)
    dup = g * s * (up.abs() <= 2.0)
    expected = torch.stack((dgate, dup), -1).view(-1) if interleaved else torch.cat((dgate, dup))
    assert dgate[:3].ne(0).all() and dup[:2].ne(0).all() and dgate[4] == 0 and dup[4] == 0
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_no_rows_give_empty_outputs_and_gradients(case):
    """An expert that got no tokens: zero rows forward and backward."""
    name, options, weighted = case
    x = torch.randn(0, 12, requires_grad=True)
    probs = torch.rand(0, requires_grad=True) if weighted else None
    out = FUNCTIONS[name](x, probs, **options)
    assert out.shape == (0, 6 if _gated(name) else 12)
    out.sum().backward()
    assert x.grad.shape == (0, 12) and (probs is None or probs.grad.shape == (0,))


def test_probs_may_carry_a_trailing_one_and_get_a_gradient_of_that_shape():
    x = torch.randn(4, 6)
    probs = torch.rand(4, 1, requires_grad=True)
    out = swiglu(x, probs)
    out.sum().backward()
    assert probs.grad.shape == (4, 1)
    torch.testing.assert_close(out, swiglu(x) * probs)


def test_bfloat16_output_is_one_rounding_of_the_float32_result():
    x, probs = _inputs("clamped_swiglu", {}, True, (4, 64), dtype=torch.bfloat16)
    out = clamped_swiglu(x, probs)
    assert out.dtype == torch.bfloat16
    expected = _formula("clamped_swiglu", x.double(), probs.double(), {})
    # within half a bfloat16 ulp of the exact value (plus float32 slack): rounded once, not per step
    error = (out.double() - expected).abs()
    assert (error <= expected.abs() * 2**-8 * (1 + 2**-10) + 1e-30).all()


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reference_in_float32_is_the_formulas_autograd_bit_for_bit(case):
    """The CPU path gives what autograd of the torch formula gives, bit for bit, in float32 (the
    mcore models' numbers did not move when they switched to these ops)."""
    name, options, weighted = case
    x, probs = _inputs(name, options, weighted, (5, 7, 40), seed=4, edges=False)
    leaves = [x.requires_grad_()] + ([] if probs is None else [probs.requires_grad_()])
    with use_backend("reference"):
        ours = FUNCTIONS[name](x, probs, **options)
    theirs = _formula(name, x, probs, options)
    assert torch.equal(ours, theirs)
    grad = torch.randn(ours.shape, generator=torch.Generator().manual_seed(2))
    mine, peers = torch.autograd.grad(ours, leaves, grad), torch.autograd.grad(theirs, leaves, grad)
    assert all(torch.equal(g, peer) for g, peer in zip(mine, peers, strict=True))


def test_clamped_swiglu_matches_hugging_face_gpt_oss():
    pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    gate_up = 6 * torch.randn(3, 9, 2 * 20, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    experts = SimpleNamespace(alpha=1.702, limit=7.0)
    expected = modeling.GptOssExperts._apply_gate(experts, gate_up)
    torch.testing.assert_close(clamped_swiglu(gate_up, interleaved=True), expected, rtol=1e-12, atol=1e-12)


def _run(case, backend, shape, dtype=torch.float32, device="cpu"):
    name, options, weighted = case
    x, probs = _inputs(name, options, weighted, shape, dtype=dtype, seed=shape[-1], device=device)
    x.requires_grad_()
    if probs is not None:
        probs.requires_grad_()
    with use_backend(backend):
        out = FUNCTIONS[name](x, probs, **options)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    (out * grad).sum().backward()
    tensors = [out, x.grad, None if probs is None else probs.grad]
    return [None if t is None else t.detach().float().cpu() for t in tensors]


# Odd widths and row counts (the kernels mask partial blocks), a width over one column block, one row.
SHAPES = [(5, 123, 246), (3, 7, 2), (1, 2 * 1100), (17, 10)]


def _interpreted_mismatches() -> list:
    """Run in a fresh process with ``TRITON_INTERPRET=1``: the (case, shape, tensor) triples where
    the Triton kernels and the reference disagree."""
    mismatches = []
    for case in CASES:
        for shape in SHAPES:
            triton, reference = _run(case, "triton", shape), _run(case, "reference", shape)
            for tensor, a, b in zip(("out", "dx", "dprobs"), triton, reference, strict=True):
                if (a is None) != (b is None):
                    mismatches.append([_case_id(case), shape, tensor, "missing"])
                elif a is not None:
                    # dprobs sums a row's products: a tolerance relative to the row's magnitude
                    atol = 1e-5 if tensor != "dprobs" else 1e-6 * float(b.abs().max()) * shape[-1]
                    if not torch.allclose(a, b, rtol=1e-5, atol=atol):
                        mismatches.append([_case_id(case), shape, tensor, float((a - b).abs().max())])
    return mismatches


def test_triton_kernels_match_the_reference_under_the_interpreter():
    assert interpreted_mismatches(__file__) == []


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_kernels_match_the_reference_on_a_gpu(case):
    for shape in ((5, 123, 246), (4096, 2 * 2816)):
        triton = _run(case, "triton", shape, torch.bfloat16, "cuda")
        reference = _run(case, "reference", shape, torch.bfloat16, "cuda")
        for a, b in zip(triton, reference, strict=True):
            if a is not None:
                torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * max(1.0, float(b.abs().max()) / 64))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: swiglu(torch.ones(2, 5)), ValueError, "must be even, got 5"),
        (lambda: swiglu(torch.ones(2, 0)), ValueError, "non-empty last dimension"),
        (lambda: squared_relu(torch.ones(2, 4, dtype=torch.long)), TypeError, "x must be a floating-point"),
        (lambda: geglu([1.0, 2.0]), TypeError, "x must be a tensor"),
        (
            lambda: swiglu(torch.ones(2, 4), torch.ones(3)),
            ValueError,
            r"probs must have shape \(2,\) or \(2, 1\)",
        ),
        (
            lambda: swiglu(torch.ones(2, 4), torch.ones(2, dtype=torch.long)),
            TypeError,
            "probs must be a floating",
        ),
        (lambda: swiglu(torch.ones(2, 4), clamp=-1.0), ValueError, "clamp must be >= 0"),
        (lambda: clamped_swiglu(torch.ones(2, 4), limit=float("nan")), ValueError, "limit must be a finite"),
        (lambda: quick_geglu(torch.ones(2, 4), alpha="1"), ValueError, "alpha must be a finite number"),
        (lambda: quick_gelu(torch.ones(2, 4), alpha=True), ValueError, "alpha must be a finite number"),
    ],
)
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()
