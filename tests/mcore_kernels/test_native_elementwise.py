"""The forward-only C++ CPU kernels of ``rms_norm``, ``swiglu`` and ``apply_rotary`` (inference):
against the PyTorch reference on odd shapes and every dtype they take, and the dispatch rule that
gives them only calls autograd does not record, in float32, bfloat16 or float16."""

import pytest
import torch
from mcore_kernels import (
    KernelBackendError,
    apply_rotary,
    rms_norm,
    rope_cos_sin,
    rope_inverse_frequencies,
    swiglu,
    use_backend,
)
from mcore_kernels.dispatch import select_forward_backend
from mcore_kernels.native_build import native_library_error

pytestmark = pytest.mark.skipif(
    native_library_error() is not None,
    reason=f"the native CPU kernels do not build here: {native_library_error()}",
)

# One rounding of a float32 result either way: equal up to float32 noise, a bf16/fp16 ulp at most.
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
    torch.float16: dict(rtol=2**-10, atol=1e-5),
}
DTYPES = list(TOLERANCE)


def _both(fn):
    """``fn()`` on the native kernel and on the reference, with no autograd recording."""
    with torch.no_grad():
        with use_backend("native"):
            native = fn()
        with use_backend("reference"):
            reference = fn()
    return native, reference


def _close(native, reference, dtype):
    assert native.dtype == reference.dtype == dtype and native.shape == reference.shape
    torch.testing.assert_close(native.float(), reference.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 15, 17, 123, 512])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_equals_the_reference(dtype, width, residual, zero_centered):
    gen = torch.Generator().manual_seed(width)
    x = (3 * torch.randn(5, 3, width, generator=gen)).to(dtype)
    weight = torch.randn(width, generator=gen).to(dtype)
    extra = torch.randn(5, 3, width, generator=gen).to(dtype) if residual else None
    native, reference = _both(
        lambda: rms_norm(x, weight, 1e-5, residual=extra, zero_centered_gamma=zero_centered)
    )
    if residual:
        assert torch.equal(native[1], reference[1])  # the residual stream: x + residual in x's dtype
        native, reference = native[0], reference[0]
    _close(native, reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2, 30, 34, 246, 3072])
def test_swiglu_equals_the_reference(dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = (4 * torch.randn(7, width, generator=gen)).to(dtype)
    x[0, 0], x[0, 1] = -100.0, 100.0  # exp's range ends: silu is 0 and the identity there
    native, reference = _both(lambda: swiglu(x))
    _close(native, reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("head_dim", "rotary"), [(64, 64), (80, 64), (40, 40), (6, 4)])
def test_apply_rotary_equals_the_reference(dtype, interleaved, head_dim, rotary):
    gen = torch.Generator().manual_seed(head_dim)
    inv_freq = rope_inverse_frequencies(rotary, 10000.0)
    cos, sin = rope_cos_sin(torch.arange(9), inv_freq, interleaved=interleaved)
    x = torch.randn(9, 2, 3, head_dim, generator=gen).to(dtype)  # [s, b, heads, d]
    tables = cos[:, None, None], sin[:, None, None]
    native, reference = _both(lambda: apply_rotary(x, *tables, interleaved=interleaved))
    _close(native, reference, dtype)


def test_auto_takes_the_native_kernel_only_where_autograd_records_nothing():
    x = torch.randn(4, 8)
    weight = torch.ones(8, requires_grad=True)
    assert select_forward_backend("rms_norm", x, x, weight) == "reference"  # weight needs a gradient
    with torch.no_grad():
        assert select_forward_backend("rms_norm", x, x, weight) == "native"
    assert select_forward_backend("rms_norm", x, x, weight.detach()) == "native"
    assert select_forward_backend("rms_norm", x.double(), x.double()) == "reference"
    out = rms_norm(x, weight)  # and the gradient is there
    out.sum().backward()
    assert weight.grad is not None


def test_forcing_the_native_kernel_where_it_cannot_run_says_why():
    x = torch.randn(4, 8, requires_grad=True)
    with (
        use_backend("native"),
        pytest.raises(KernelBackendError, match="has no backward, and autograd records this call"),
    ):
        swiglu(x)
    with use_backend("native"), pytest.raises(KernelBackendError, match=r"not torch\.float64"):
        rms_norm(torch.randn(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
