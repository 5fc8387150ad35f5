"""The engine's attention on mcore-kernels' Triton kernels (the CUDA path: ``paged_kv_append``,
``paged_attention`` per prefill chunk, ``paged_decode_attention`` for the decode rows) against
the naive per-query oracle: under Triton's interpreter on the CPU (float32, every step layout,
the padded decode of CUDA graphs included) and on a GPU (``gpu``, the automatic choice)."""

import pytest
import torch
from mcore_inference.model_runner import DecodeBuffers, ModelRunner
from mcore_kernels import use_backend
from mcore_testing.paged_steps import (
    DIM,
    GROUPS,
    SCALE,
    STEP_SPANS,
    attend_one_layer,
    attention_oracle,
    paged_context,
    step_chunks,
)
from mcore_testing.triton_interpreter import interpreted_mismatches

OPTIONS = [(None, False, 1), (3, True, 2), (8, False, 4)]  # (window, sinks, heads per key head)


def _eager_error(layout, window, with_sinks, per_group, *, device="cpu", dtype=torch.float32):
    context = paged_context(dtype, device)
    chunks = step_chunks(context, STEP_SPANS[layout])
    heads = GROUPS * per_group
    tokens = sum(c.length for c in chunks)
    query = torch.randn(tokens, heads, DIM, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    sinks = torch.linspace(-1.0, 2.0, heads, device=device) if with_sinks else None
    ModelRunner(None, context).prepare_step(chunks)
    out = attend_one_layer(context, query, window, sinks)
    expected = attention_oracle(context, chunks, query, SCALE, window, sinks)
    return float((out.float().cpu() - expected).abs().max())


def _padded_decode_error(window, with_sinks, per_group):
    context = paged_context()
    chunks = step_chunks(context, STEP_SPANS["decode"])
    heads = GROUPS * per_group
    query = torch.randn(8, heads, DIM, generator=torch.Generator().manual_seed(5))  # 3 padded rows
    sinks = torch.linspace(-1.0, 2.0, heads) if with_sinks else None
    ModelRunner(None, context).prepare_padded_decode(chunks, DecodeBuffers(8, 16, context.device), 8, 16)
    out = attend_one_layer(context, query, window, sinks)
    expected = attention_oracle(context, chunks, query[:5], SCALE, window, sinks)
    return float((out[:5] - expected).abs().max())


def _interpreted_mismatches() -> list:
    """Run in a fresh process with ``TRITON_INTERPRET=1``: the steps whose output on the Triton
    kernels differs from the oracle."""
    mismatches = []
    with use_backend("triton"):
        for layout in sorted(STEP_SPANS):
            for options in OPTIONS:
                if _eager_error(layout, *options) > 1e-5:
                    mismatches.append([layout, *options])
        for options in OPTIONS:
            if _padded_decode_error(*options) > 1e-5:
                mismatches.append(["padded-decode", *options])
    return mismatches


def test_step_on_the_triton_kernels_matches_the_oracle_under_the_interpreter():
    assert interpreted_mismatches(__file__) == []


@pytest.mark.gpu
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("layout", sorted(STEP_SPANS))
def test_step_on_a_gpu_matches_the_oracle(layout, options):
    assert _eager_error(layout, *options, device="cuda", dtype=torch.bfloat16) < 2e-2
