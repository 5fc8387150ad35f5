"""``attention_softmax``: the reference against hand-computed values, a per-row float64 oracle
(causal band, windows at their edges, fewer queries than keys, masks, sinks, empty rows), the plain
torch formula bit for bit in float32 (what the models computed before calling it) and numerical
gradients, the sink's included; the Triton kernels against the reference, forward and backward,
under Triton's interpreter on the CPU (float32) and on a GPU (``gpu``, bfloat16); argument errors."""

import math

import pytest
import torch
from mcore_kernels import attention_softmax, use_backend
from mcore_testing.triton_interpreter import interpreted_mismatches


def test_off_by_one_and_learnable_sinks_by_hand():
    # logits 0 and ln 2; sinks 0 (off-by-one: 1 + 2 + 1 = 4) and ln 3 (1 + 2 + 3 = 6)
    scores = torch.tensor([0.0, math.log(2.0)]).expand(1, 2, 1, 2)
    sink = torch.tensor([0.0, math.log(3.0)], requires_grad=True)
    probs = attention_softmax(scores, sink_logits=sink)
    expected = torch.tensor([[0.25, 0.5], [1 / 6, 2 / 6]])
    torch.testing.assert_close(probs.view(2, 2), expected, rtol=0, atol=1e-7)
    # d(sum of head-1 probabilities)/d sink = -p_sink * sum(p) = -(1/2) * (1/2)
    probs[0, 1].sum().backward()
    torch.testing.assert_close(sink.grad, torch.tensor([0.0, -0.25]), rtol=0, atol=1e-7)


def _oracle(scores, scale, causal, window, sinks, allowed):
    """Row by row in float64, from the definition."""
    n, q, k = scores.shape[-3:]
    flat = scores.double().reshape(-1, n, q, k)
    mask = None if allowed is None else allowed.expand(scores.shape).reshape(-1, n, q, k)
    out = torch.zeros_like(flat)
    for b in range(flat.shape[0]):
        for h in range(n):
            for i in range(q):
                keys = [
                    j
                    for j in range(k)
                    if (mask is None or mask[b, h, i, j])
                    and (not causal or 0 <= i + k - q - j < (window or math.inf))
                ]
                logits = [flat[b, h, i, j].item() * scale for j in keys]
                if sinks is not None:
                    logits.append(sinks[h].item())
                if not logits:
                    continue
                top = max(logits)
                denominator = sum(math.exp(v - top) for v in logits)
                for j, v in zip(keys, logits, strict=False):
                    out[b, h, i, j] = math.exp(v - top) / denominator
    return out.view(scores.shape)


# (q, k, options): windows of 1 (the diagonal only), inside, exactly k and past k; fewer queries
# than keys (a prefill chunk after cached keys); masks with rows that allow nothing
CASES = [
    (7, 7, dict(causal=True)),
    (7, 7, dict(causal=True, window_size=1)),
    (7, 7, dict(causal=True, window_size=3)),
    (7, 7, dict(causal=True, window_size=7)),
    (3, 9, dict(causal=True, window_size=20)),
    (3, 9, dict(causal=True, window_size=4, scale=0.3)),
    (5, 6, dict(scale=2.0)),
    (5, 6, dict(mask=True)),
    (5, 6, dict(mask=True, causal=True, sinks="learnable")),
    (4, 4, dict(causal=True, window_size=2, sinks="off-by-one")),
    (1, 5, dict(causal=True, window_size=2, sinks="learnable", scale=0.5)),
]


def _case_id(case):
    q, k, options = case
    return f"{q}x{k}-" + "-".join(f"{key}={value}" for key, value in options.items())


def _inputs(q, k, options, *, heads=3, lead=(2,), dtype=torch.float32, device="cpu", seed=0):
    """``(scores, keyword arguments)`` of one case; masks are random with empty rows."""
    generator = torch.Generator().manual_seed(seed)
    scores = 3 * torch.randn(*lead, heads, q, k, generator=generator)
    kwargs = {name: options[name] for name in ("scale", "causal", "window_size") if name in options}
    if options.get("mask"):
        allowed = torch.rand(*lead, 1, q, k, generator=generator) < 0.6
        allowed[..., 0, 1, :] = False
        kwargs["allowed"] = allowed.to(device)
    sinks = options.get("sinks")
    if sinks is not None:
        values = torch.zeros(heads) if sinks == "off-by-one" else torch.randn(heads, generator=generator)
        kwargs["sink_logits"] = values.to(device)
    return scores.to(device, dtype), kwargs


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reference_matches_the_definition(case):
    q, k, options = case
    scores, kwargs = _inputs(q, k, options, dtype=torch.float64)
    probs = attention_softmax(scores, **kwargs)
    expected = _oracle(
        scores,
        kwargs.get("scale", 1.0),
        kwargs.get("causal", False),
        kwargs.get("window_size"),
        kwargs.get("sink_logits"),
        kwargs.get("allowed"),
    )
    torch.testing.assert_close(probs, expected, rtol=1e-12, atol=1e-12)


def _plain(scores, scale, allowed, sink):
    """The softmax the mcore models computed before calling this op."""
    s = (scores * scale).masked_fill(~allowed, float("-inf"))
    if sink is None:
        return torch.softmax(s, dim=-1)
    b, n, q, _ = s.shape
    return torch.softmax(torch.cat((s, sink.view(1, n, 1, 1).expand(b, n, q, 1)), dim=-1), dim=-1)[..., :-1]


@pytest.mark.parametrize("sinks", [None, "learnable"])
def test_reference_in_float32_is_the_plain_formula_bit_for_bit(sinks):
    scores, kwargs = _inputs(9, 9, {"sinks": sinks}, lead=(2,), seed=3)
    allowed = torch.ones(9, 9, dtype=torch.bool).tril()[None, None] & (torch.rand(2, 1, 9, 9) < 0.8)
    allowed |= torch.eye(9, dtype=torch.bool)  # every row keeps its diagonal
    sink = kwargs.get("sink_logits")
    leaves = [scores.requires_grad_()] + ([] if sink is None else [sink.requires_grad_()])
    ours = attention_softmax(scores, scale=0.125, allowed=allowed, sink_logits=sink)
    theirs = _plain(scores, 0.125, allowed, sink)
    assert torch.equal(ours, theirs)
    grad = torch.randn(ours.shape)
    mine, peers = torch.autograd.grad(ours, leaves, grad), torch.autograd.grad(theirs, leaves, grad)
    assert all(torch.equal(g, peer) for g, peer in zip(mine, peers, strict=True))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reference_gradients_pass_gradcheck(case):
    q, k, options = case
    scores, kwargs = _inputs(q, k, options, dtype=torch.float64, lead=(1,), heads=2)
    scores.requires_grad_()
    sink = kwargs.pop("sink_logits", None)
    if sink is None:
        assert torch.autograd.gradcheck(lambda s: attention_softmax(s, **kwargs), (scores,))
        return
    sink = sink.double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda s, z: attention_softmax(s, sink_logits=z, **kwargs), (scores, sink)
    )


def test_rows_with_nothing_to_attend_to_are_zeros_with_zero_gradients():
    scores = torch.randn(1, 2, 3, 4, requires_grad=True)
    allowed = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    allowed[..., 1, :] = False
    probs = attention_softmax(scores, allowed=allowed)
    assert torch.equal(probs[:, :, 1], torch.zeros(1, 2, 4))
    torch.testing.assert_close(probs.sum(-1)[:, :, [0, 2]], torch.ones(1, 2, 2))
    probs.backward(torch.randn(probs.shape))
    assert torch.isfinite(scores.grad).all() and torch.equal(scores.grad[:, :, 1], torch.zeros(1, 2, 4))


def _run(case, backend, *, shape=None, dtype=torch.float32, device="cpu"):
    q, k, options = case
    heads, lead = (3, (2,)) if shape is None else (shape[0], ())
    scores, kwargs = _inputs(q, k, options, heads=heads, lead=lead, dtype=dtype, device=device, seed=q * k)
    scores.requires_grad_()
    sink = kwargs.get("sink_logits")
    if sink is not None:
        sink.requires_grad_()
    with use_backend(backend):
        probs = attention_softmax(scores, **kwargs)
    grad = torch.randn(probs.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    (probs.float() * grad.float()).sum().backward()
    tensors = [probs, scores.grad, None if sink is None else sink.grad]
    return [None if t is None else t.detach().float().cpu() for t in tensors]


# The odd shape: 5 heads of 123 x 123 scores (a partial block), under options that together
# hold every feature: causal with a window, scale, a mask with learnable sinks, off-by-one sinks.
# (Seconds per case under the interpreter: the small shapes run every case.)
ODD = (5, 123, 123)
ODD_OPTIONS = [
    dict(causal=True, window_size=3),
    dict(scale=2.0),
    dict(mask=True, causal=True, sinks="learnable"),
    dict(causal=True, window_size=2, sinks="off-by-one"),
]


def _interpreted_mismatches() -> list:
    """Run in a fresh process with ``TRITON_INTERPRET=1``: the (case, shape, block, tensor) tuples
    where the Triton kernels and the reference disagree."""
    from mcore_kernels import softmax_triton

    odd = [(ODD[1], ODD[2], options) for options in ODD_OPTIONS]
    # rows in one block; then the small cases in blocks of 4 columns (the last one partial), as
    # rows longer than MAX_BLOCK are read
    runs = [(softmax_triton.MAX_BLOCK, case, None) for case in CASES]
    runs += [(softmax_triton.MAX_BLOCK, case, ODD) for case in odd] + [(4, case, None) for case in CASES]
    mismatches = []
    for max_block, case, shape in runs:
        softmax_triton.MAX_BLOCK = max_block
        triton, reference = _run(case, "triton", shape=shape), _run(case, "reference", shape=shape)
        for name, a, b in zip(("probs", "dscores", "dsink"), triton, reference, strict=True):
            if (a is None) != (b is None) or (a is not None and not torch.allclose(a, b, 1e-5, 1e-5)):
                mismatches.append([_case_id(case), shape, max_block, name])
    return mismatches


def test_triton_kernels_match_the_reference_under_the_interpreter():
    assert interpreted_mismatches(__file__) == []


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_kernels_match_the_reference_on_a_gpu(case):
    for size, shape in ((case, None), ((ODD[1], ODD[2], case[2]), ODD)):
        triton = _run(size, "triton", shape=shape, dtype=torch.bfloat16, device="cuda")
        reference = _run(size, "reference", shape=shape, dtype=torch.bfloat16, device="cuda")
        for a, b in zip(triton, reference, strict=True):
            if a is not None:
                torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (dict(scores=torch.ones(2, 3, dtype=torch.int64)), TypeError, "scores must be a floating-point"),
        (dict(scores=torch.ones(3)), ValueError, r"scores must be \[..., q, k\]"),
        (dict(scale=0.0), ValueError, "scale must be a finite number > 0"),
        (dict(scale=float("nan")), ValueError, "scale must be a finite number > 0"),
        (dict(causal=True, window_size=0), ValueError, "window_size must be a positive int"),
        (dict(window_size=2), ValueError, "window_size needs causal=True"),
        (dict(sink_logits=torch.zeros(3)), ValueError, r"sink_logits must have shape \(n,\)"),
        (dict(sink_logits=torch.zeros(2, dtype=torch.int64)), TypeError, "sink_logits must be a floating"),
        (dict(allowed=torch.ones(4, 5)), TypeError, "allowed must be a bool tensor"),
        (dict(allowed=torch.ones(3, 5, dtype=torch.bool)), ValueError, "allowed .* must broadcast"),
    ],
)
def test_bad_arguments_are_named(arguments, error, match):
    call = dict(scores=torch.randn(1, 2, 4, 5)) | arguments
    with pytest.raises(error, match=match):
        attention_softmax(call.pop("scores"), **call)
