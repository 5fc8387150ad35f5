"""``moe_permute`` / ``moe_unpermute``: the reference against a per-token float64 oracle (dropped
assignments, padding rows, with and without probabilities); the Triton kernels against the
reference, forward and backward, under Triton's interpreter on the CPU (float32: 123 tokens, 7 and
64 experts, k = 1, 2, 4, hidden sizes across one and several column blocks) and on a GPU (``gpu``,
bfloat16); the native CPU kernels against the reference on every case (float32, bfloat16 and
float16); argument errors, and rows out of range or named twice on every CPU backend."""

import pytest
import torch
from mcore_kernels import moe_permute, moe_unpermute, use_backend
from mcore_kernels.native_build import native_library_error
from mcore_testing.triton_interpreter import interpreted_mismatches


def _row_map(tokens, experts, topk, *, alignment=4, seed=0):
    """``(row_map [T, k], num_rows)``: assignments grouped by expert in token order, each group
    padded to ``alignment`` rows, every fifth assignment dropped."""
    generator = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(experts, generator=generator)[:topk] for _ in range(tokens)])
    row_map = torch.full((tokens, topk), -1, dtype=torch.int64)
    row = 0
    for expert in range(experts):
        for t in range(tokens):
            for j in range(topk):
                if indices[t, j] == expert and (t * topk + j) % 5 != 4:
                    row_map[t, j] = row
                    row += 1
        row = (row + alignment - 1) // alignment * alignment
    return row_map, row


def test_reference_matches_a_per_token_oracle():
    row_map, num_rows = _row_map(11, 5, 2)
    hidden = torch.randn(11, 3, dtype=torch.float64)
    rows = torch.randn(num_rows, 3, dtype=torch.float64)
    probs = torch.rand(11, 2, dtype=torch.float64)
    permuted = torch.zeros(num_rows, 3, dtype=torch.float64)
    expected = torch.zeros(11, 3, dtype=torch.float64)
    for t in range(11):
        for j in range(2):
            if row_map[t, j] >= 0:
                permuted[row_map[t, j]] = hidden[t]
                expected[t] += probs[t, j] * rows[row_map[t, j]]
    assert torch.equal(moe_permute(hidden, row_map, num_rows), permuted)
    torch.testing.assert_close(moe_unpermute(rows, row_map, probs), expected, rtol=0, atol=1e-12)
    unweighted = moe_unpermute(rows, row_map)
    torch.testing.assert_close(
        unweighted, moe_unpermute(rows, row_map, torch.ones(11, 2, dtype=torch.float64))
    )


CASES = [(123, experts, topk, hidden) for experts in (7, 64) for topk in (1, 2, 4) for hidden in (40, 1100)]
# Under the interpreter (seconds a case): each experts x top-k pair once, the width alternating
# between one block and two (1100 > the 1024-column block)
INTERPRETED_CASES = [
    (123, experts, topk, (40, 1100)[(e + k) % 2])
    for e, experts in enumerate((7, 64))
    for k, topk in enumerate((1, 2, 4))
]
OUTPUTS = ("permuted", "combined", "dhidden", "drows", "dprobs")


def _case_id(case):
    return "{}x{}-k{}-h{}".format(*case)


def _run(case, backend, *, dtype=torch.float32, device="cpu"):
    """Permute, unpermute with probabilities, and the gradients of a weighted sum of both outputs:
    ``(permuted, combined, dhidden, drows, dprobs)``."""
    tokens, experts, topk, width = case
    row_map, num_rows = _row_map(tokens, experts, topk, seed=experts + topk)
    generator = torch.Generator().manual_seed(width)
    hidden = torch.randn(tokens, width, generator=generator).to(device, dtype).requires_grad_(True)
    rows = torch.randn(num_rows, width, generator=generator).to(device, dtype).requires_grad_(True)
    probs = torch.rand(tokens, topk, generator=generator).to(device, dtype).requires_grad_(True)
    w_permuted = torch.randn(num_rows, width, generator=generator).to(device, dtype)
    w_combined = torch.randn(tokens, width, generator=generator).to(device, dtype)
    row_map = row_map.to(device)
    with use_backend(backend):
        permuted = moe_permute(hidden, row_map, num_rows)
        combined = moe_unpermute(rows, row_map, probs)
    ((permuted * w_permuted).sum() + (combined * w_combined).sum()).backward()
    return permuted.detach(), combined.detach(), hidden.grad, rows.grad, probs.grad


def _interpreted_mismatches() -> list:
    """Run in a fresh process with ``TRITON_INTERPRET=1``: the (case, tensor) pairs where the Triton
    kernels and the reference disagree."""
    mismatches = []
    for case in INTERPRETED_CASES:
        for name, a, b in zip(OUTPUTS, _run(case, "triton"), _run(case, "reference"), strict=True):
            if not torch.allclose(a, b, 1e-5, 1e-5):
                mismatches.append([_case_id(case), name])
    return mismatches


def test_triton_kernels_match_the_reference_under_the_interpreter():
    assert interpreted_mismatches(__file__) == []


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_kernels_match_the_reference_on_a_gpu(case):
    """In bfloat16 each output of the kernels is as close to the float32 reference as PyTorch's
    own bfloat16 result is: ``dprobs`` sums ``width`` products, so both round at its magnitude."""
    exact = _run(case, "reference", dtype=torch.float32, device="cuda")
    triton = _run(case, "triton", dtype=torch.bfloat16, device="cuda")
    reference = _run(case, "reference", dtype=torch.bfloat16, device="cuda")
    for name, t, r, e in zip(OUTPUTS, triton, reference, exact, strict=True):
        _low_precision_error_bound(name, t, r, e)


needs_native = pytest.mark.skipif(
    native_library_error() is not None,
    reason=f"the native CPU kernels do not build here: {native_library_error()}",
)


def _low_precision_error_bound(name, kernel, reference, exact):
    """The kernel's error against float32 may be up to twice PyTorch's own in the same dtype."""
    kernel_error = (kernel.float() - exact).abs().max().item()
    reference_error = (reference.float() - exact).abs().max().item()
    assert kernel_error <= 2 * reference_error + 1e-2, (name, kernel_error, reference_error)


@needs_native
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_native_kernels_match_the_reference(case):
    """Equal up to float32 summation order; ``dprobs`` sums ``width`` products (up to ~40 here)."""
    for name, native, reference in zip(OUTPUTS, _run(case, "native"), _run(case, "reference"), strict=True):
        atol = 1e-4 if name == "dprobs" else 1e-5
        assert torch.allclose(native, reference, rtol=1e-5, atol=atol), (
            name,
            (native - reference).abs().max(),
        )


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES[::5], ids=_case_id)
def test_native_kernels_in_low_precision(case, dtype):
    """Permuting copies exactly; the sums round once from float32, at most as far as PyTorch's own."""
    exact = _run(case, "reference")
    native = _run(case, "native", dtype=dtype)
    reference = _run(case, "reference", dtype=dtype)
    assert torch.equal(native[0], reference[0])
    for name, n, r, e in zip(OUTPUTS[1:], native[1:], reference[1:], exact[1:], strict=True):
        _low_precision_error_bound(name, n, r, e)


BACKENDS_HERE = ["reference", pytest.param("native", marks=needs_native)]


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: moe_permute(torch.ones(2, 3), torch.tensor([[0, 1], [1, 2]]), 4), "names row 1 twice"),
        (lambda: moe_permute(torch.ones(2, 3), torch.tensor([[0, 1], [-1, 4]]), 4), "names row 4 of 4"),
        (lambda: moe_unpermute(torch.ones(3, 3), torch.tensor([[0, 1], [2, 3]])), "names row 3 of 3"),
    ],
    ids=["permute-twice", "permute-past-the-end", "unpermute-past-the-end"],
)
def test_rows_out_of_range_or_repeated_are_refused_on_the_cpu(backend, call, match):
    with use_backend(backend), pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: moe_permute(torch.ones(3, 2, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int64), 3),
            TypeError,
            "hidden must be a floating-point",
        ),
        (
            lambda: moe_permute(torch.ones(3, 2), torch.zeros(3, 1), 3),
            ValueError,
            r"row_map must be an int64 \[T=3, k\]",
        ),
        (
            lambda: moe_permute(torch.ones(3, 2), torch.zeros(2, 1, dtype=torch.int64), 3),
            ValueError,
            r"row_map must be an int64 \[T=3, k\]",
        ),
        (
            lambda: moe_permute(torch.ones(3, 2), torch.zeros(3, 1, dtype=torch.int64), -1),
            ValueError,
            "num_rows must be a non-negative int",
        ),
        (
            lambda: moe_unpermute(torch.ones(3), torch.zeros(3, 1, dtype=torch.int64)),
            TypeError,
            "rows must be a floating-point",
        ),
        (
            lambda: moe_unpermute(torch.ones(3, 2), torch.zeros(3, dtype=torch.int64)),
            ValueError,
            r"row_map must be an int64 \[T, k\]",
        ),
        (
            lambda: moe_unpermute(torch.ones(3, 2), torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 2)),
            ValueError,
            "probs must be a floating-point tensor of row_map's shape",
        ),
    ],
)
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()
