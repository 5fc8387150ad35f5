"""The C++ CPU kernels of ``rms_norm``, ``swiglu`` and ``apply_rotary``: outputs and gradients
against the PyTorch reference on odd shapes and every dtype they take, RMSNorm's weight gradient
independent of the thread count, and the dispatch rule that gives them float32, bfloat16 and float16
calls on the CPU, recorded by autograd or not."""

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
from mcore_kernels.dispatch import select_elementwise_backend
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


def _gradients(fn, inputs, backend):
    """The outputs of ``fn(*inputs)`` on ``backend`` and the inputs' gradients of a random
    weighting of them (every output, so a returned residual stream's gradient flows too)."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    with use_backend(backend):
        out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(7)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs] + [t.grad for t in leaves]


def _all_close(native, reference, dtype):
    for a, b in zip(native, reference, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        # a gradient sums many rounded products: a few ulps of the largest entry
        scale = b.float().abs().max().clamp(min=1.0)
        torch.testing.assert_close(a.float() / scale, b.float() / scale, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 17, 256])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_gradients_equal_the_reference(dtype, width, residual, zero_centered):
    gen = torch.Generator().manual_seed(width)
    rows = 70  # more than two of the backward's 32-row blocks, the last one short
    inputs = [
        (2 * torch.randn(rows, width, generator=gen)).to(dtype),
        (1 + 0.3 * torch.randn(width, generator=gen)).to(dtype),
    ]
    if residual:
        inputs.append(torch.randn(rows, width, generator=gen).to(dtype))

    def norm(x, weight, extra=None):
        return rms_norm(x, weight, 1e-5, residual=extra, zero_centered_gamma=zero_centered)

    _all_close(_gradients(norm, inputs, "native"), _gradients(norm, inputs, "reference"), dtype)


def test_rms_norm_weight_gradient_does_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(300, 96, generator=gen), torch.randn(96, generator=gen)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _gradients(lambda x, w: rms_norm(x, w), inputs, "native")
        torch.set_num_threads(3)
        three = _gradients(lambda x, w: rms_norm(x, w), inputs, "native")
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, three, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2, 34, 688])
def test_swiglu_gradients_equal_the_reference(dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = (4 * torch.randn(9, width, generator=gen)).to(dtype)
    x[0, 0], x[0, width // 2] = -100.0, 100.0  # exp's range end: silu and its slope are 0 there
    _all_close(_gradients(swiglu, [x], "native"), _gradients(swiglu, [x], "reference"), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("head_dim", "rotary"), [(64, 64), (80, 64), (6, 4)])
def test_apply_rotary_gradients_equal_the_reference(dtype, interleaved, head_dim, rotary):
    gen = torch.Generator().manual_seed(head_dim)
    cos, sin = rope_cos_sin(
        torch.arange(9), rope_inverse_frequencies(rotary, 10000.0), interleaved=interleaved
    )

    def rotate(x):
        return apply_rotary(x, cos[:, None, None], sin[:, None, None], interleaved=interleaved)

    x = torch.randn(9, 2, 3, head_dim, generator=gen).to(dtype)
    _all_close(_gradients(rotate, [x], "native"), _gradients(rotate, [x], "reference"), dtype)


def test_auto_takes_the_native_kernels_on_the_cpu_in_their_dtypes():
    for dtype in DTYPES:
        assert select_elementwise_backend("rms_norm", torch.ones(2, dtype=dtype)) == "native"
    assert select_elementwise_backend("rms_norm", torch.ones(2, dtype=torch.float64)) == "reference"
    x = torch.randn(4, 8, requires_grad=True)  # training: the native forward and backward
    out = swiglu(x)
    assert type(out.grad_fn).__name__ == "_ActivationFunctionBackward"
    with use_backend("reference"):
        expected = swiglu(x)
    out.sum().backward()
    native_grad, x.grad = x.grad, None
    expected.sum().backward()
    torch.testing.assert_close(native_grad, x.grad)


def test_forcing_the_native_kernel_where_it_cannot_run_says_why():
    x = torch.randn(4, 8, requires_grad=True)
    with use_backend("native"), pytest.raises(KernelBackendError, match="swiglu has no native kernel"):
        swiglu(x, torch.ones(4))  # per-token weights: the reference or Triton only
    with use_backend("native"), pytest.raises(KernelBackendError, match=r"not torch\.float64"):
        rms_norm(torch.randn(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
