"""``mamba_ssm``'s scan kernel as an optional accelerator of ``ssd_chunked_scan``: never taken for
CPU or float64 tensors (even when the package imports); the call it gets maps our arguments onto
its documented API (checked with a stand-in that runs our scan); on a GPU with ``mamba_ssm``
installed (``gpu``), its results equal the per-step recurrence."""

import sys
import types

import pytest
import torch
from mcore_models.ssm import cuda_kernels, ssd_chunked_scan, ssd_naive_recurrence, ssd_scan


def test_cpu_and_float64_tensors_never_take_the_kernel(monkeypatch, ssd_inputs):
    module = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    module.mamba_chunk_scan_combined = lambda *args, **kwargs: pytest.fail("the CUDA kernel was called")
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.ssd_combined", module)
    cuda_kernels._mamba_chunk_scan.cache_clear()
    try:
        inputs = ssd_inputs(dtype=torch.float32)
        assert cuda_kernels.chunk_scan_kernel(*inputs.values()) is None
        ssd_chunked_scan(*(inputs[k] for k in "x dt A B C".split()), chunk_size=4, D=inputs["D"])
    finally:
        cuda_kernels._mamba_chunk_scan.cache_clear()


@pytest.mark.parametrize("final_state", [False, True])
def test_the_kernel_gets_our_arguments_as_its_api_names_them(monkeypatch, ssd_inputs, final_state):
    inputs = ssd_inputs(seqlen=9, dtype=torch.float32)
    calls = []

    def stand_in(x, dt, A, B, C, chunk_size, D=None, initial_states=None, return_final_states=False):
        calls.append(chunk_size)
        return ssd_naive_recurrence(
            x, dt, A, B, C, D=D, initial_state=initial_states, return_final_state=return_final_states
        )

    monkeypatch.setattr(ssd_scan, "chunk_scan_kernel", lambda *tensors: stand_in)
    positional = [inputs[k] for k in "x dt A B C".split()]
    optional = {"D": inputs["D"], "initial_state": inputs["initial_state"]}
    got = ssd_chunked_scan(*positional, chunk_size=4, **optional, return_final_state=final_state)
    monkeypatch.undo()
    expected = ssd_chunked_scan(*positional, chunk_size=4, **optional, return_final_state=final_state)
    assert calls == [4]
    for ours, theirs in zip(
        got if final_state else [got], expected if final_state else [expected], strict=True
    ):
        assert ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_the_kernel_equals_the_recurrence_on_a_gpu(ssd_inputs):
    pytest.importorskip("mamba_ssm", reason="mamba_ssm (the optional CUDA accelerator) is not installed")
    inputs = {
        k: v.float() for k, v in ssd_inputs(batch=2, seqlen=70, nheads=4, headdim=16, dstate=16).items()
    }
    positional = [inputs[k] for k in "x dt A B C".split()]
    optional = {"D": inputs["D"], "initial_state": inputs["initial_state"]}
    y, state = ssd_chunked_scan(
        *(t.cuda() for t in positional),
        chunk_size=32,
        **{k: v.cuda() for k, v in optional.items()},
        return_final_state=True,
    )
    expected_y, expected_state = ssd_naive_recurrence(*positional, **optional, return_final_state=True)
    torch.testing.assert_close(y.cpu(), expected_y, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(state.cpu(), expected_state, rtol=1e-3, atol=1e-3)
