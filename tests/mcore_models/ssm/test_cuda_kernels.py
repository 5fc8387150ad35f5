"""``mamba_ssm``'s scan kernel and ``causal_conv1d``'s kernel as optional accelerators of
``ssd_chunked_scan`` and ``causal_conv1d``: never taken for CPU or float64 tensors (even when the
package imports) nor for conv widths it lacks; the calls they get map our arguments onto their
documented APIs and layouts (checked with stand-ins that run our PyTorch functions); on a GPU with
the packages installed (``gpu``), their results equal the PyTorch ones."""

import importlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from mcore_models.ssm import cuda_kernels, ssd_chunked_scan, ssd_naive_recurrence, ssd_scan


def test_cpu_and_float64_tensors_never_take_the_kernel(monkeypatch, ssd_inputs):
    module = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    module.mamba_chunk_scan_combined = lambda *args, **kwargs: pytest.fail("the CUDA kernel was called")
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.ssd_combined", module)
    cuda_kernels._load.cache_clear()
    try:
        inputs = ssd_inputs(dtype=torch.float32)
        assert cuda_kernels.chunk_scan_kernel(*inputs.values()) is None
        ssd_chunked_scan(*(inputs[k] for k in "x dt A B C".split()), chunk_size=4, D=inputs["D"])
    finally:
        cuda_kernels._load.cache_clear()


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


def _conv_inputs(seqlen=9, channels=6, width=4):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, seqlen, channels, generator=gen)
    weight, bias = torch.randn(channels, width, generator=gen), torch.randn(channels, generator=gen)
    return x, weight, bias, torch.randn(2, channels, width - 1, generator=gen)


@pytest.mark.parametrize("final_state", [False, True])
def test_the_conv_kernel_gets_our_arguments_as_its_api_names_them(monkeypatch, final_state):
    x, weight, bias, initial = _conv_inputs()
    calls = []

    def stand_in(x, weight, bias=None, initial_states=None, return_final_states=False, activation=None):
        """causal_conv1d_fn's documented semantics: x [b, channels, s], channel-last with states."""
        assert x.stride(1) == 1 and (initial_states is None or initial_states.stride(1) == 1)
        calls.append(activation)
        width = weight.shape[1]
        history = x.new_zeros(*x.shape[:2], width - 1) if initial_states is None else initial_states
        padded = torch.cat([history, x], dim=-1)
        y = F.conv1d(padded, weight.unsqueeze(1), bias, groups=x.shape[1])
        y = F.silu(y) if activation == "silu" else y
        return (y, padded[..., -(width - 1) :]) if return_final_states else y

    conv_module = importlib.import_module("mcore_models.ssm.causal_conv1d")  # the module, not the function
    expected = conv_module.causal_conv1d(
        x, weight, bias, initial_state=initial, return_final_state=final_state
    )
    monkeypatch.setattr(conv_module, "conv_kernel", lambda width, *tensors: stand_in)
    got = conv_module.causal_conv1d(x, weight, bias, initial_state=initial, return_final_state=final_state)
    assert calls == ["silu"]
    for ours, theirs in zip(
        got if final_state else [got], expected if final_state else [expected], strict=True
    ):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_conv_widths_and_devices_the_kernel_does_not_take():
    x, weight, bias, initial = _conv_inputs()
    assert cuda_kernels.conv_kernel(4, x, weight, bias, initial) is None  # CPU tensors
    assert cuda_kernels.conv_kernel(5) is None and cuda_kernels.conv_kernel(1) is None


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen", [2, 9])
def test_the_conv_kernel_equals_the_pytorch_path_on_a_gpu(seqlen):
    pytest.importorskip(
        "causal_conv1d", reason="causal_conv1d (the optional CUDA accelerator) is not installed"
    )
    from mcore_models.ssm import causal_conv1d

    x, weight, bias, initial = _conv_inputs(seqlen=seqlen)
    y, state = causal_conv1d(
        *(t.cuda() for t in (x, weight, bias)), initial_state=initial.cuda(), return_final_state=True
    )
    expected_y, expected_state = causal_conv1d(
        x, weight, bias, initial_state=initial, return_final_state=True
    )
    torch.testing.assert_close(y.cpu(), expected_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.cpu(), expected_state, rtol=1e-4, atol=1e-4)
