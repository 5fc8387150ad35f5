"""``mamba_state_update``: both backends against a per-element float64 oracle of the recurrence
(odd state sizes around the kernel's vector widths, grouped heads, with and without ``D``, every
input dtype), slots not named left untouched, float64 on the reference, autograd through the
reference, and bad input refused alike by both backends."""

import math

import pytest
import torch
from mcore_kernels import KernelBackendError, mamba_state_update, use_backend
from mcore_kernels.native_build import native_library_error

needs_native = pytest.mark.skipif(
    native_library_error() is not None,
    reason=f"the native CPU kernels do not build here: {native_library_error()}",
)
BACKENDS = [pytest.param("native", marks=needs_native), "reference"]


def _inputs(slots_total=6, b=3, h=4, p=5, n=7, g=2, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(slots_total, h, p, n, generator=gen)
    slots = torch.randperm(slots_total, generator=gen)[:b]
    x = torch.randn(b, h, p, generator=gen).to(dtype)
    dt = torch.rand(b, h, generator=gen) + 0.1
    A = -torch.rand(h, generator=gen) - 0.1
    B, C = (torch.randn(b, g, n, generator=gen).to(dtype) for _ in range(2))
    D = torch.randn(h, generator=gen)
    return states, slots, x, dt, A, B, C, D


def _oracle(states, slots, x, dt, A, B, C, D):
    """Element by element in float64: (y, the states afterwards)."""
    states = states.double().clone()
    b, h, p = x.shape
    n, per_group = states.shape[-1], h // B.shape[1]
    y = torch.zeros(b, h, p, dtype=torch.float64)
    for r in range(b):
        for k in range(h):
            q, step = k // per_group, float(dt[r, k])
            decay = math.exp(step * float(A[k]))
            for i in range(p):
                total = 0.0
                for j in range(n):
                    value = decay * float(states[slots[r], k, i, j]) + step * float(x[r, k, i]) * float(
                        B[r, q, j]
                    )
                    states[slots[r], k, i, j] = value
                    total += value * float(C[r, q, j])
                y[r, k, i] = total + (float(D[k]) * float(x[r, k, i]) if D is not None else 0.0)
    return y, states


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("p", "n", "skip"), [(5, 7, True), (16, 33, False), (3, 64, True)])
def test_matches_the_oracle(backend, dtype, p, n, skip):
    states, slots, x, dt, A, B, C, D = _inputs(p=p, n=n, dtype=dtype)
    D = D if skip else None
    expected_y, expected_states = _oracle(states, slots, x, dt, A, B, C, D)
    with use_backend(backend):
        y = mamba_state_update(states, slots, x, dt, A, B, C, D)
    assert y.dtype == dtype and states.dtype == torch.float32
    rounding = 1e-5 if dtype == torch.float32 else 1e-2  # y is rounded once into x's dtype
    torch.testing.assert_close(y.double(), expected_y, rtol=rounding, atol=rounding)
    torch.testing.assert_close(states.double(), expected_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slots_not_named_are_untouched(backend):
    states, slots, *rest = _inputs(slots_total=8, b=2)
    before = states.clone()
    with use_backend(backend):
        mamba_state_update(states, slots, *rest)
    others = [s for s in range(8) if s not in slots.tolist()]
    assert torch.equal(states[others], before[others])
    assert not torch.equal(states[slots], before[slots])


def test_float64_runs_on_the_reference_in_float64():
    states, slots, x, dt, A, B, C, D = (t.double() if t.is_floating_point() else t for t in _inputs())
    expected_y, expected_states = _oracle(states, slots, x, dt, A, B, C, D)
    y = mamba_state_update(states, slots, x, dt, A, B, C, D)
    torch.testing.assert_close(y, expected_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(states, expected_states, rtol=1e-12, atol=1e-12)
    with use_backend("native"), pytest.raises(KernelBackendError, match="float32, bfloat16 or float16"):
        mamba_state_update(states, slots, x, dt, A, B, C, D)


def test_gradients_flow_through_the_reference():
    states, slots, x, dt, A, B, C, D = _inputs()
    x.requires_grad_()
    y = mamba_state_update(states, slots, x, dt, A, B, C, D)
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert grad.shape == x.shape and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            {"slots": torch.tensor([0, 6, 1])},
            ValueError,
            "slot 6 is not one of the 6|not one of the 6 state slots",
        ),
        ({"slots": torch.tensor([2, 2, 1])}, ValueError, "named twice"),
        ({"slots": torch.tensor([0, 1, 2], dtype=torch.int32)}, TypeError, "slots must be an int64"),
        ({"x": torch.zeros(3, 4, 6)}, ValueError, r"x has shape \(3, 4, 6\), expected \(3, 4, 5\)"),
        ({"B": torch.zeros(3, 3, 7)}, ValueError, "3 groups must divide the 4 heads"),
        ({"C": torch.zeros(3, 2, 6)}, ValueError, r"C has shape \(3, 2, 6\)"),
        ({"D": torch.zeros(3)}, ValueError, r"D has shape \(3,\), expected \(4,\)"),
        ({"dt": torch.zeros(3, 4, dtype=torch.int64)}, TypeError, "dt must be a floating-point"),
    ],
)
def test_bad_input_is_refused_before_any_state_changes(backend, change, error, match):
    names = ("states", "slots", "x", "dt", "A", "B", "C", "D")
    arguments = dict(zip(names, _inputs(), strict=True)) | change
    before = arguments["states"].clone()
    with use_backend(backend), pytest.raises(error, match=match):
        mamba_state_update(**arguments)
    assert torch.equal(arguments["states"], before)
