"""Backend selection: the default per device, the environment and ``use_backend`` overrides, and
errors for unknown names and for forcing Triton where it cannot run."""

import pytest
import torch
from mcore_kernels import (
    KernelBackendError,
    apply_rotary,
    clamped_swiglu,
    rms_norm,
    select_backend,
    squared_relu,
    use_backend,
)
from mcore_kernels import dispatch as dispatch_module


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv("MCORE_KERNELS_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_cpu_tensors_take_the_reference_by_default():
    assert select_backend("op", torch.ones(1)) == "reference"


def test_the_environment_and_the_context_manager_choose(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "reference")
    assert select_backend("op", torch.ones(1)) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch_module, "triton_importable", lambda: True)
    with use_backend("triton"):  # the context manager wins over the environment
        assert select_backend("op", torch.ones(1)) == "triton"
        with use_backend("reference"):
            assert select_backend("op", torch.ones(1)) == "reference"
        assert select_backend("op", torch.ones(1)) == "triton"  # restored on exit
    assert select_backend("op", torch.ones(1)) == "reference"


@pytest.mark.parametrize("name", ["Triton", "cuda", "", "ref"])
def test_unknown_backend_names_are_refused(monkeypatch, name):
    with pytest.raises(KernelBackendError, match="use_backend\\(name\\) must be one of"):
        with use_backend(name):
            pass
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", name)
    with pytest.raises(KernelBackendError, match="MCORE_KERNELS_BACKEND must be one of"):
        rms_norm(torch.ones(2), torch.ones(2))


def test_forcing_triton_on_a_cpu_tensor_without_the_interpreter_is_an_error(monkeypatch):
    monkeypatch.setattr(dispatch_module, "triton_importable", lambda: True)
    with (
        use_backend("triton"),
        pytest.raises(KernelBackendError, match=r"rms_norm: .* \(TRITON_INTERPRET=1\)"),
    ):
        rms_norm(torch.ones(2), torch.ones(2))


def test_forcing_triton_without_triton_is_an_error(monkeypatch):
    monkeypatch.setattr(dispatch_module, "triton_importable", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with use_backend("triton"), pytest.raises(KernelBackendError, match="triton is not installed"):
        rms_norm(torch.ones(2), torch.ones(2))


@pytest.mark.parametrize(
    ("op", "call"),
    [
        ("apply_rotary", lambda: apply_rotary(torch.ones(2, 4), torch.ones(2, 4), torch.zeros(2, 4))),
        ("clamped_swiglu", lambda: clamped_swiglu(torch.ones(2, 4))),
        ("squared_relu", lambda: squared_relu(torch.ones(2, 4), torch.ones(2))),
    ],
)
def test_every_op_refuses_a_forced_triton_it_cannot_run(monkeypatch, op, call):
    monkeypatch.setattr(dispatch_module, "triton_importable", lambda: True)
    with use_backend("triton"), pytest.raises(KernelBackendError, match=rf"{op}: .* \(TRITON_INTERPRET=1\)"):
        call()
    with use_backend("reference"):
        call()
