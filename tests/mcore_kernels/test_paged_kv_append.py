"""``paged_kv_append``: the reference and, under Triton's interpreter (and on a GPU, ``gpu``), the
Triton kernel against slot-by-slot copies into a paged cache (block sizes 1 and 16, padding rows
with a negative slot, a cast to the cache's dtype); errors for bad arguments."""

import pytest
import torch
from mcore_kernels import paged_kv_append, use_backend
from mcore_testing.triton_interpreter import interpreted_mismatches

CASES = [  # (num_blocks, block_size, groups, dim, slots)
    (3, 16, 2, 40, [0, 17, 47, 5, 16]),
    (7, 1, 4, 80, [6, 0, 3]),
    (2, 16, 1, 64, [-1, 31, -1, 2]),  # padding rows write nothing
]


def _run(case, backend, *, cache_dtype=torch.float32, device="cpu"):
    num_blocks, block_size, groups, dim, slots = case
    generator = torch.Generator().manual_seed(len(slots))
    caches = [torch.randn(num_blocks, block_size, groups, dim, generator=generator) for _ in range(2)]
    caches = [cache.to(device, cache_dtype) for cache in caches]
    new = [torch.randn(len(slots), groups, dim, generator=generator).to(device) for _ in range(2)]
    expected = [cache.clone().view(-1, groups, dim) for cache in caches]
    for row, slot in enumerate(slots):
        if slot >= 0:
            expected[0][slot], expected[1][slot] = new[0][row], new[1][row]
    with use_backend(backend):
        paged_kv_append(*caches, *new, torch.tensor(slots, device=device))
    return [cache.view(-1, groups, dim) for cache in caches], expected


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_reference_writes_each_row_at_its_slot(case, cache_dtype):
    written, expected = _run(case, "reference", cache_dtype=cache_dtype)
    for a, b in zip(written, expected, strict=True):
        assert torch.equal(a, b)


def _interpreted_mismatches() -> list:
    """Run in a fresh process with ``TRITON_INTERPRET=1``: the cases the Triton kernel gets wrong."""
    wrong = []
    for case in CASES:
        written, expected = _run(case, "triton")
        if not all(torch.equal(a, b) for a, b in zip(written, expected, strict=True)):
            wrong.append(case)
    return wrong


def test_triton_kernel_writes_each_row_at_its_slot_under_the_interpreter():
    assert interpreted_mismatches(__file__) == []


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_writes_each_row_at_its_slot_on_a_gpu(case):
    written, expected = _run(case, "triton", cache_dtype=torch.bfloat16, device="cuda")
    for a, b in zip(written, expected, strict=True):
        assert torch.equal(a, b)


def _valid():
    caches = [torch.zeros(2, 4, 2, 8) for _ in range(2)]
    return (*caches, torch.ones(3, 2, 8), torch.ones(3, 2, 8), torch.tensor([0, 5, 7]))


BAD = {
    "key not a tensor": (lambda a: (*a[:2], 1.0, *a[3:]), TypeError, "key must be a tensor"),
    "integer cache": (lambda a: (a[0].long(), *a[1:]), TypeError, "key_cache must be floating point"),
    "value shape": (lambda a: (*a[:3], a[3][:, :1], a[4]), ValueError, "key and value must be"),
    "head dim": (
        lambda a: (*a[:2], a[2][..., :4], a[3][..., :4], a[4]),
        ValueError,
        "key_cache and value_cache",
    ),
    "strided cache": (
        lambda a: (a[0].transpose(0, 1), a[1].transpose(0, 1), *a[2:]),
        ValueError,
        "contiguous",
    ),
    "float slots": (lambda a: (*a[:4], a[4].float()), ValueError, "slot_mapping must be"),
    "slot past the cache": (lambda a: (*a[:4], torch.tensor([0, 5, 16])), ValueError, "names slot 16"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_raise_errors_naming_them(case):
    change, error, message = BAD[case]
    with use_backend("reference"), pytest.raises(error, match=message):
        paged_kv_append(*change(_valid()))
