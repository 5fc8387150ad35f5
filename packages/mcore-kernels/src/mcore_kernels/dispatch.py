"""Which implementation an op runs: a Triton kernel, a native C++ CPU kernel, or its PyTorch
reference.

Each op names the kernels it has (``kernels=``). By default (``"auto"``) a CUDA tensor takes the
op's Triton kernel when Triton is importable, a CPU tensor the op's native kernel when it builds
here (``native_build``), and every other case the reference. ``MCORE_KERNELS_BACKEND`` (``auto``,
``triton``, ``native`` or ``reference``) or ``use_backend(...)`` (a context manager, which wins
over the environment) force one of them. Forcing a kernel where it cannot run (an op without it,
Triton missing, a CPU tensor without Triton's interpreter, ``TRITON_INTERPRET=1``, a native
kernel off the CPU or without a working compiler) raises ``KernelBackendError`` instead of
quietly running the reference.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
from collections.abc import Iterator

import torch

from .native_build import native_library_error

BACKENDS = ("auto", "triton", "native", "reference")
ENVIRONMENT_VARIABLE = "MCORE_KERNELS_BACKEND"

_override = threading.local()


class KernelBackendError(RuntimeError):
    """The backend asked for cannot run this op here, or its name is unknown."""


def _checked(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise KernelBackendError(f"{source} must be one of {BACKENDS}, got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the ops called inside the block (in this thread) on backend ``name``."""
    previous = getattr(_override, "name", None)
    _override.name = _checked(name, "use_backend(name)")
    try:
        yield
    finally:
        _override.name = previous


def requested_backend() -> str:
    """The backend asked for: ``use_backend``'s, else ``MCORE_KERNELS_BACKEND``'s, else ``"auto"``."""
    name = getattr(_override, "name", None)
    if name is not None:
        return name
    return _checked(os.environ.get(ENVIRONMENT_VARIABLE, "auto"), ENVIRONMENT_VARIABLE)


@functools.cache
def triton_importable() -> bool:
    """Whether the optional ``triton`` package imports here (asked once, on the first Triton
    dispatch: importing the package does not import Triton)."""
    try:
        importlib.import_module("triton")
    except Exception:  # not installed, or installed without what it imports (e.g. setuptools)
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def select_backend(op: str, tensor: torch.Tensor, *, kernels: tuple[str, ...] = ("triton",)) -> str:
    """The backend ``op``, which has the kernels ``kernels`` besides its reference, runs on
    ``tensor``'s device: ``"triton"``, ``"native"`` or ``"reference"`` (see the module doc)."""
    name = requested_backend()
    if name == "reference":
        return name
    if name == "auto":
        if tensor.device.type == "cuda" and "triton" in kernels and triton_importable():
            return "triton"
        if tensor.device.type == "cpu" and "native" in kernels and native_library_error() is None:
            return "native"
        return "reference"
    if name not in kernels:
        raise KernelBackendError(f"{op}: the {name} backend was forced but {op} has no {name} kernel")
    if name == "native":
        return _native(op, tensor)
    if not triton_importable():
        raise KernelBackendError(
            f"{op}: the Triton backend was forced but triton is not installed (or does not import)"
        )
    if tensor.device.type != "cuda" and not _interpreting():
        raise KernelBackendError(
            f"{op}: the Triton backend was forced for a {tensor.device.type} tensor; Triton runs on "
            "CUDA, or on the CPU only under its interpreter (TRITON_INTERPRET=1)"
        )
    return name


NATIVE_ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def select_elementwise_backend(
    op: str, tensor: torch.Tensor, kernels: tuple[str, ...] = ("triton", "native")
) -> str:
    """``select_backend`` for an op with a native C++ CPU kernel that takes float32, bfloat16 and
    float16 and, by default, a Triton kernel (``rms_norm``, ``swiglu``, ``apply_rotary``,
    ``moe_permute``, ``moe_unpermute``, forward and backward; ``argmax_rows`` has
    ``kernels=("native",)``). ``auto`` runs other dtypes
    (float64) on the reference; forcing ``native`` for them raises ``KernelBackendError``."""
    if tensor.dtype in NATIVE_ELEMENTWISE_DTYPES:
        return select_backend(op, tensor, kernels=kernels)
    if requested_backend() == "native":
        raise KernelBackendError(
            f"{op}: the native backend was forced but its kernel takes float32, bfloat16 or float16, "
            f"not {tensor.dtype}"
        )
    return select_backend(op, tensor, kernels=tuple(k for k in kernels if k != "native"))


def autograd_records(*inputs: torch.Tensor | None) -> bool:
    """Whether autograd records a call on ``inputs``: grad mode is on and one of them requires grad
    (an op may then skip its autograd function and call a kernel directly)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


def _native(op: str, tensor: torch.Tensor) -> str:
    if tensor.device.type != "cpu":
        raise KernelBackendError(
            f"{op}: the native backend was forced for a {tensor.device.type} tensor; it runs on the CPU"
        )
    error = native_library_error()
    if error is not None:
        raise KernelBackendError(f"{op}: the native backend was forced but cannot run here: {error}")
    return "native"
