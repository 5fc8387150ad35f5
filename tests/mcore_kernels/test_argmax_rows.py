"""``argmax_rows``: the C++ CPU kernel gives torch's argmax (first of ties) and finiteness flags for
every dtype it takes, on widths around its 16-lane blocks, on views, and on rows no token can be
sampled from; the reference gives the same; bad input is refused."""

import pytest
import torch
from mcore_kernels import KernelBackendError, argmax_rows, use_backend
from mcore_kernels.native_build import native_library_error

needs_native = pytest.mark.skipif(
    native_library_error() is not None,
    reason=f"the native CPU kernels do not build here: {native_library_error()}",
)
BACKENDS = [pytest.param("native", marks=needs_native), "reference"]


def _logits(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(rows, width, generator=torch.Generator().manual_seed(width)) * 4
    return values.to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 7, 16, 33, 32000])
def test_indices_are_torch_argmax(backend, dtype, width):
    logits = _logits(5, width, dtype)
    with use_backend(backend):
        indices, finite = argmax_rows(logits)
    assert indices.dtype == torch.int64 and finite.dtype == torch.bool
    assert torch.equal(indices, logits.float().argmax(dim=-1))
    assert finite.all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_give_the_first_column(backend):
    logits = torch.zeros(3, 40, dtype=torch.bfloat16)
    logits[0, [5, 17, 39]] = 2.0  # ties in the scalar head, a 16-lane block and the tail
    logits[1, [31, 32]] = -1.0
    logits[1] = logits[1] - 1.0  # every entry -1 or -2: the maximum -1 first at column 0
    logits[2, 39] = 1.0
    with use_backend(backend):
        indices, _ = argmax_rows(logits)
    assert indices.tolist() == [5, 0, 39]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_without_a_token_are_flagged(backend, dtype):
    logits = _logits(5, 50, dtype)
    logits[0, 3] = float("nan")
    logits[1, 40] = float("nan")  # in the tail after the 16-lane blocks
    logits[2, 20] = float("inf")
    logits[3] = float("-inf")
    logits[4, :49] = float("-inf")  # single -inf entries are masked tokens: row 4 keeps column 49
    with use_backend(backend):
        indices, finite = argmax_rows(logits)
    assert finite.tolist() == [False, False, False, False, True]
    assert indices[4] == 49


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_view_is_read_in_place(backend):
    wide = _logits(6, 80, torch.bfloat16)
    view = wide[::2, 3:70]  # strided rows, shifted columns
    with use_backend(backend):
        indices, _ = argmax_rows(view)
    assert torch.equal(indices, view.float().argmax(dim=-1))


@pytest.mark.parametrize(
    "logits, error, message",
    [
        (torch.zeros(2, 3, dtype=torch.int64), TypeError, "floating-point"),
        ([[0.0, 1.0]], TypeError, "list"),
        (torch.zeros(4), ValueError, r"\[R, V\]"),
        (torch.zeros(2, 0), ValueError, "V > 0"),
    ],
)
def test_bad_logits_are_refused(logits, error, message):
    with pytest.raises(error, match=message):
        argmax_rows(logits)


@needs_native
def test_float64_runs_on_the_reference():
    logits = _logits(3, 20, torch.float64)
    with use_backend("auto"):
        indices, finite = argmax_rows(logits)
    assert torch.equal(indices, logits.argmax(dim=-1)) and finite.all()


@needs_native
def test_forcing_native_for_float64_or_triton_at_all_is_refused():
    with use_backend("native"), pytest.raises(KernelBackendError, match=r"not torch\.float64"):
        argmax_rows(_logits(2, 20, torch.float64))
    with use_backend("triton"), pytest.raises(KernelBackendError, match="no triton kernel"):
        argmax_rows(_logits(2, 20, torch.float32))
