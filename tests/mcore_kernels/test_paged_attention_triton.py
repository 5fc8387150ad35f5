"""The Triton paged-attention kernel (``paged_attention`` and ``paged_decode_attention`` on the
Triton backend) against the PyTorch reference: under Triton's interpreter on the CPU (float32) and
on a GPU (``gpu``, bfloat16); decode rows and prefill chunks with odd lengths, windows at their
edges, sinks, grouped-query ratios 1, 2 and 4, block sizes 1 and 16, head dims 40, 64 and 80."""

import pytest
import torch
from mcore_kernels import KernelBackendError, paged_attention, paged_decode_attention, use_backend
from mcore_testing.paged_cache import paged_sequences
from mcore_testing.triton_interpreter import interpreted_mismatches

CASES = [  # (heads, groups, dim, block_size, [(seq_len, query_len)], window, sinks)
    (4, 4, 64, 16, [(7, 7), (40, 9), (17, 1), (1, 1)], None, False),
    (8, 4, 40, 1, [(5, 5), (19, 3)], None, True),
    (8, 2, 80, 16, [(33, 33), (50, 18)], 16, True),
    (4, 1, 64, 1, [(9, 4), (4, 4)], 1, False),
    (6, 3, 40, 16, [(31, 31), (32, 1), (33, 2)], 32, True),  # a window at the sequence's edge
    (8, 2, 64, 16, [(80, 70)], 17, False),  # several query tiles
]


def _case_id(case) -> str:
    heads, groups, dim, block_size, sequences, window, sinks = case
    return f"n{heads}g{groups}d{dim}bs{block_size}w{window}{'-sinks' if sinks else ''}-{len(sequences)}seqs"


def _run(case, backend, *, dtype=torch.float32, device="cpu"):
    heads, groups, dim, block_size, sequences, window, sinks = case
    args = paged_sequences(
        heads=heads,
        groups=groups,
        dim=dim,
        block_size=block_size,
        sequences=sequences,
        dtype=dtype,
        device=device,
    )
    sink_logits = torch.linspace(-1.0, 2.0, heads, device=device) if sinks else None
    options = dict(scale=dim**-0.5, window_size=window, sink_logits=sink_logits)
    with use_backend(backend):
        chunks = paged_attention(*args, **options)
        query, key_blocks, value_blocks, table, _, seq_lens = args
        decode = paged_decode_attention(
            query[: len(seq_lens)], key_blocks, value_blocks, table, seq_lens - 1, **options
        )
    return chunks.float().cpu(), decode.float().cpu()


def _interpreted_mismatches() -> list:
    """Run in a fresh process with ``TRITON_INTERPRET=1``: the (case, op, error) triples where the
    Triton kernel and the reference disagree."""
    mismatches = []
    for case in CASES:
        triton, reference = _run(case, "triton"), _run(case, "reference")
        for name, a, b in zip(("chunks", "decode"), triton, reference, strict=True):
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-5):
                mismatches.append([_case_id(case), name, float((a - b).abs().max())])
    return mismatches


def test_triton_kernel_matches_the_reference_under_the_interpreter():
    assert interpreted_mismatches(__file__) == []


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_kernel_matches_the_reference_on_a_gpu(case):
    triton = _run(case, "triton", dtype=torch.bfloat16, device="cuda")
    reference = _run(case, "reference", dtype=torch.bfloat16, device="cuda")
    for a, b in zip(triton, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_forcing_triton_on_a_cpu_tensor_outside_the_interpreter_is_refused():
    args = paged_sequences(heads=2, groups=1, dim=16, block_size=4, sequences=[(3, 3)])
    with use_backend("triton"), pytest.raises(KernelBackendError, match="the Triton backend was forced"):
        paged_attention(*args, scale=1.0)
