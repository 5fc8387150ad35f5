"""``apply_rotary`` and ``rope_cos_sin``: the reference against rotation as complex multiplication,
the formula's autograd and numerical gradients; the Triton kernel
against the reference, forward and backward, under Triton's interpreter on the CPU (float32) and on
a GPU (``gpu``); argument errors."""

import pytest
import torch
from mcore_kernels import apply_rotary, rope_cos_sin, rope_inverse_frequencies, use_backend
from mcore_testing.triton_interpreter import interpreted_mismatches


def _angles(positions, rotary, base=10000.0):
    """``[*positions.shape, rotary / 2]`` float64: pair ``j`` turns ``base ** (-2j / rotary)`` per position."""
    inv_freq = base ** (-torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    return positions.double().unsqueeze(-1) * inv_freq


def _complex_rotation(x, angles, interleaved):
    """Rotate each pair, as the complex number ``a + ib``, by ``exp(i angle)``; the rest of ``x`` as is."""
    rotary = 2 * angles.shape[-1]
    head, rest = x[..., :rotary].double(), x[..., rotary:].double()
    if interleaved:
        a, b = head[..., 0::2], head[..., 1::2]
    else:
        a, b = head.chunk(2, dim=-1)
    z = torch.complex(a, b) * torch.polar(torch.ones_like(angles), angles)
    if interleaved:
        rotated = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((rotated, rest), dim=-1)


# (head dim, rotary dims): full, partial (GLM-style half, and Phi-style 0.4), a single pair
DIMS = [(64, 64), (80, 80), (40, 40), (64, 32), (80, 32), (40, 2)]


def _tables(positions, rotary, interleaved, dtype=torch.float32):
    inv_freq = rope_inverse_frequencies(rotary, 10000.0)
    return tuple(t.to(dtype) for t in rope_cos_sin(positions, inv_freq, interleaved=interleaved))


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize(("dim", "rotary"), DIMS)
def test_reference_is_complex_rotation(dim, rotary, interleaved):
    gen = torch.Generator().manual_seed(dim + rotary)
    x = torch.randn(7, 2, 3, dim, generator=gen, dtype=torch.float64)  # [s, b, heads, d]
    positions = torch.arange(7).unsqueeze(1) * 3 + torch.arange(2)  # [s, b], a different position per sample
    cos, sin = _tables(positions, rotary, interleaved, torch.float64)
    out = apply_rotary(x, cos.unsqueeze(2), sin.unsqueeze(2), interleaved=interleaved)
    expected = _complex_rotation(x, _angles(positions, rotary).unsqueeze(2), interleaved)
    # the tables' angles are float32 products, the oracle's float64: positions < 20 keep them close
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _formula(x, cos, sin, interleaved):
    """``(a cos - b sin, b cos + a sin)`` per pair, written with torch ops (differentiable in ``x``)."""
    rotary = cos.shape[-1]
    head, rest = x[..., :rotary], x[..., rotary:]
    a, b = (head[..., 0::2], head[..., 1::2]) if interleaved else head.chunk(2, dim=-1)
    c, s = (
        (cos[..., 0::2], sin[..., 0::2])
        if interleaved
        else (cos[..., : rotary // 2], sin[..., : rotary // 2])
    )
    first, second = a * c - b * s, b * c + a * s
    rotated = torch.stack((first, second), -1).flatten(-2) if interleaved else torch.cat((first, second), -1)
    return torch.cat((rotated, rest), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize(("dim", "rotary"), [(64, 64), (80, 32)])
def test_reference_backward_is_the_formulas_autograd(dim, rotary, interleaved):
    x = torch.randn(5, 4, dim, dtype=torch.float64, requires_grad=True)  # [s, heads, d]
    cos, sin = (t.unsqueeze(1) for t in _tables(torch.arange(5) + 100, rotary, interleaved, torch.float64))
    out = apply_rotary(x, cos, sin, interleaved=interleaved)
    expected = _formula(x, cos, sin, interleaved)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn(out.shape, dtype=torch.float64)
    torch.testing.assert_close(
        torch.autograd.grad(out, x, grad)[0],
        torch.autograd.grad(expected, x, grad)[0],
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_reference_backward_passes_gradcheck(interleaved):
    x = torch.randn(3, 2, 10, dtype=torch.float64, requires_grad=True)
    # tables whose halves differ (the general map, not only rotations): the backward is its transpose
    cos, sin = torch.randn(3, 1, 6, dtype=torch.float64), torch.randn(3, 1, 6, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: apply_rotary(x, cos, sin, interleaved=interleaved), (x,))


def test_cos_sin_layouts_and_scaling():
    inv_freq = torch.tensor([1.0, 0.5, 0.25])
    cos, sin = rope_cos_sin(torch.tensor([2]), inv_freq, scaling=1.5)
    angles = torch.tensor([2.0, 1.0, 0.5])
    torch.testing.assert_close(cos[0], 1.5 * torch.cat((angles, angles)).cos())
    cos, sin = rope_cos_sin(torch.tensor([2]), inv_freq, interleaved=True)
    torch.testing.assert_close(sin[0], angles.repeat_interleave(2).sin())
    torch.testing.assert_close(rope_inverse_frequencies(6, 64.0), 64.0 ** -(torch.arange(3) / 3.0))


# How tables broadcast over x: (x shape, tables shape); rotary dims = tables' last dim.
LAYOUTS = [
    ((5, 3, 4, 64), (5, 3, 1, 64)),  # [s, b, heads, d], one table row per token
    ((5, 3, 4, 80), (5, 1, 1, 32)),  # one per position, shared by the batch; partial rotary
    ((2, 123, 3, 40), (123, 1, 40)),  # [b, s, heads, d] with [s, 1, r] tables
    ((6, 5, 40), (6, 5, 16)),  # a table row per row of x (no broadcast)
    ((4, 1, 80), (4, 1, 80)),  # one head
    ((3, 130), (3, 128)),  # rows of x only, a single pass-through pair
]


def _run(layout, interleaved, backend, dtype=torch.float32, device="cpu"):
    shape, table_shape = layout
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
    positions = torch.randint(0, 4096, table_shape[:-1], generator=gen)
    cos, sin = (t.to(device) for t in _tables(positions, table_shape[-1], interleaved))
    with use_backend(backend):
        out = apply_rotary(x, cos, sin, interleaved=interleaved)
    (out * torch.randn(out.shape, generator=gen).to(device, dtype)).sum().backward()
    return out.detach().float().cpu(), x.grad.float().cpu()


def _interpreted_mismatches() -> list:
    """Run in a fresh process with ``TRITON_INTERPRET=1``: the (layout, layout kind, tensor) triples
    where the Triton kernel and the reference disagree."""
    mismatches = []
    for layout in LAYOUTS:
        for interleaved in (False, True):
            triton, reference = _run(layout, interleaved, "triton"), _run(layout, interleaved, "reference")
            for name, a, b in zip(("out", "dx"), triton, reference, strict=True):
                if not torch.allclose(a, b, rtol=1e-5, atol=1e-5):
                    mismatches.append([layout, interleaved, name, float((a - b).abs().max())])
    return mismatches


def test_triton_kernel_matches_the_reference_under_the_interpreter():
    assert interpreted_mismatches(__file__) == []


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_triton_kernel_matches_the_reference_on_a_gpu(interleaved):
    for layout in [*LAYOUTS, ((4096, 2, 32, 128), (4096, 2, 1, 128))]:
        triton = _run(layout, interleaved, "triton", torch.bfloat16, "cuda")
        reference = _run(layout, interleaved, "reference", torch.bfloat16, "cuda")
        for a, b in zip(triton, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def test_empty_input_is_returned_as_is():
    x = torch.randn(0, 2, 8)
    assert apply_rotary(x, torch.ones(1, 8), torch.ones(1, 8)).shape == (0, 2, 8)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: apply_rotary(torch.ones(2, 8), torch.ones(2, 6), torch.ones(2, 4)), ValueError, "one shape"),
        (
            lambda: apply_rotary(torch.ones(2, 8), torch.ones(2, 5), torch.ones(2, 5)),
            ValueError,
            "even and in",
        ),
        (
            lambda: apply_rotary(torch.ones(2, 8), torch.ones(2, 10), torch.ones(2, 10)),
            ValueError,
            r"\[2, 8\]",
        ),
        (
            lambda: apply_rotary(torch.ones(2, 8), torch.ones(3, 8), torch.ones(3, 8)),
            ValueError,
            "must broadcast",
        ),
        (
            lambda: apply_rotary(torch.ones(2, 8, dtype=torch.long), torch.ones(8), torch.ones(8)),
            TypeError,
            "x must",
        ),
        (lambda: apply_rotary(torch.ones(2, 8), [1.0], torch.ones(8)), TypeError, "cos must be a tensor"),
        (lambda: rope_inverse_frequencies(7, 10000.0), ValueError, "dim must be an even int"),
        (lambda: rope_inverse_frequencies(8, 1.0), ValueError, "base must be a number > 1"),
    ],
)
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()
