"""``rms_norm`` and ``layer_norm``: the reference against hand-written float64 formulas, torch's own
norms and numerical gradients; the Triton kernels against the reference's formulas, forward and backward,
under Triton's interpreter on the CPU (float32) and on a GPU (``gpu``); argument errors."""

import pytest
import torch
from mcore_kernels import layer_norm, rms_norm, use_backend
from mcore_kernels.norm import _NormFunction
from mcore_testing.triton_interpreter import interpreted_mismatches

# Odd widths (the kernels pad to a power of two and mask), and a width of one.
WIDTHS = [1, 7, 33, 64]


def _naive(x, weight, bias, residual, eps, zero_centered, rms):
    """The formulas in float64, one row at a time."""
    h = x if residual is None else x + residual
    gamma = weight.double() + (1.0 if zero_centered else 0.0)
    rows = []
    for row in h.double().reshape(-1, h.shape[-1]):
        centered = row if rms else row - row.mean()
        out = centered / torch.sqrt((centered**2).mean() + eps) * gamma
        rows.append(out if bias is None else out + bias.double())
    return torch.stack(rows).view(h.shape), h


def _inputs(width, *, dtype=torch.float32, residual=False, bias=False, seed=0, rows=(3, 5)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, width, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(width, generator=gen)).to(dtype)
    return (
        x,
        weight,
        0.2 * torch.randn(width, generator=gen).to(dtype) if bias else None,
        torch.randn(*rows, width, generator=gen).to(dtype) if residual else None,
    )


def _call(x, weight, bias, residual, eps, zero_centered, rms):
    if rms:
        return rms_norm(x, weight, eps, residual=residual, zero_centered_gamma=zero_centered)
    return layer_norm(x, weight, bias, eps, residual=residual, zero_centered_gamma=zero_centered)


CASES = [
    dict(rms=True, bias=False, residual=False, zero_centered=False),
    dict(rms=True, bias=False, residual=True, zero_centered=True),
    dict(rms=False, bias=True, residual=False, zero_centered=False),
    dict(rms=False, bias=True, residual=True, zero_centered=True),
    dict(rms=False, bias=False, residual=True, zero_centered=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(k for k, v in c.items() if v) or "plain")
@pytest.mark.parametrize("width", WIDTHS)
def test_reference_matches_the_formulas(case, width):
    x, weight, bias, residual = _inputs(width, residual=case["residual"], bias=case["bias"])
    out = _call(x, weight, bias, residual, 1e-5, case["zero_centered"], case["rms"])
    expected, h = _naive(x, weight, bias, residual, 1e-5, case["zero_centered"], case["rms"])
    if residual is not None:
        out, out_h = out
        torch.testing.assert_close(out_h, h, rtol=0, atol=0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [1, 33])
def test_reference_equals_torch_norms(width):
    x, weight, bias, _ = _inputs(width, bias=True)
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-6), torch.nn.functional.rms_norm(x, (width,), weight, 1e-6)
    )
    torch.testing.assert_close(
        layer_norm(x, weight, bias, 1e-5), torch.nn.functional.layer_norm(x, (width,), weight, bias, 1e-5)
    )


def test_bfloat16_output_is_one_rounding_of_the_float32_result():
    x, weight, _, residual = _inputs(48, dtype=torch.bfloat16, residual=True)
    out, h = rms_norm(x, weight, 1e-6, residual=residual)
    assert out.dtype == h.dtype == torch.bfloat16
    assert torch.equal(h, x + residual)
    expected, _ = _naive(x, weight, None, residual, 1e-6, False, True)
    assert torch.equal(out, expected.float().to(torch.bfloat16))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(k for k, v in c.items() if v) or "plain")
def test_reference_backward_passes_gradcheck(case):
    x, weight, bias, residual = (
        None if t is None else t.double().requires_grad_()
        for t in _inputs(6, residual=case["residual"], bias=case["bias"])
    )

    def function(x, weight, bias, residual):
        out = _call(x, weight, bias, residual, 1e-5, case["zero_centered"], case["rms"])
        if residual is None:
            return out
        out, h = out
        return out + 0.5 * h.sin()  # both outputs feed the loss

    inputs = tuple(t for t in (x, weight, bias, residual))
    assert torch.autograd.gradcheck(function, inputs)


def _grads(case, width, backend, dtype=torch.float32, device="cpu", rows=(3, 5)):
    x, weight, bias, residual = (
        None if t is None else t.to(device).requires_grad_()
        for t in _inputs(
            width, dtype=dtype, residual=case["residual"], bias=case["bias"], seed=width, rows=rows
        )
    )
    if backend == "formulas":  # the reference's own formulas, also where layer_norm takes torch's
        out = _NormFunction.apply(
            x, weight, bias, residual, 1e-5, case["zero_centered"], case["rms"], "reference"
        )
    else:
        with use_backend(backend):
            out = _call(x, weight, bias, residual, 1e-5, case["zero_centered"], case["rms"])
    h = None
    if residual is not None:
        out, h = out
    gen = torch.Generator().manual_seed(1)
    loss = (out.float() * torch.randn(out.shape, generator=gen).to(device)).sum()
    if h is not None:
        loss = loss + (h.float() * torch.randn(h.shape, generator=gen).to(device)).sum()
    loss.backward()
    tensors = [out, h, x.grad, weight.grad, None if bias is None else bias.grad]
    tensors.append(None if residual is None else residual.grad)
    return [None if t is None else t.detach().float().cpu() for t in tensors]


def _interpreted_mismatches() -> list:
    """Run in a fresh process with ``TRITON_INTERPRET=1`` (read when Triton is first imported):
    the (case, width, tensor) triples where the Triton kernels and the reference disagree."""
    mismatches = []
    # 15 rows (one per backward program), and 300 (several per program, the last program short)
    shapes = [(width, (3, 5)) for width in WIDTHS] + [(33, (3, 100))]
    for case in CASES:
        for width, rows in shapes:
            triton, reference = (
                _grads(case, width, "triton", rows=rows),
                _grads(case, width, "formulas", rows=rows),
            )
            names = ("out", "h", "dx", "dweight", "dbias", "dresidual")
            for name, a, b in zip(names, triton, reference, strict=True):
                if (a is None) != (b is None) or (a is not None and not torch.allclose(a, b, 1e-5, 1e-5)):
                    mismatches.append([case, width, rows, name])
    return mismatches


def test_triton_kernels_match_the_reference_under_the_interpreter():
    assert interpreted_mismatches(__file__) == []


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(k for k, v in c.items() if v) or "plain")
def test_triton_kernels_match_the_reference_on_a_gpu(case):
    for width in (7, 4096):
        triton = _grads(case, width, "triton", torch.bfloat16, "cuda")
        reference = _grads(case, width, "reference", torch.bfloat16, "cuda")
        for a, b in zip(triton, reference, strict=True):
            if a is not None:
                torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (dict(weight=torch.ones(5)), ValueError, r"weight must have shape \(4,\)"),
        (dict(bias=torch.ones(3)), ValueError, r"bias must have shape \(4,\)"),
        (dict(residual=torch.ones(2, 5)), ValueError, "residual must match x"),
        (dict(residual=torch.ones(2, 4, dtype=torch.float64)), ValueError, "residual must match x"),
        (dict(eps=0.0), ValueError, "eps must be a positive number"),
        (dict(eps="1e-5"), ValueError, "eps must be a positive number"),
        (dict(x=torch.ones(2, 4, dtype=torch.long)), TypeError, "x must be a floating-point tensor"),
        (dict(x=torch.ones(2, 0)), ValueError, "non-empty last dimension"),
        (dict(weight=[1.0] * 4), TypeError, "weight must be a tensor"),
    ],
)
def test_bad_arguments_are_named(arguments, error, match):
    call = dict(x=torch.ones(2, 4), weight=torch.ones(4), bias=None, residual=None, eps=1e-5) | arguments
    with pytest.raises(error, match=match):
        layer_norm(call["x"], call["weight"], call["bias"], call["eps"], residual=call["residual"])
