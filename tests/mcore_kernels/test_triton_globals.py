"""Triton kernels read no plain Python constants from their module.

Compiled for a GPU, a ``@triton.jit`` function may read a module global only if it is a
``tl.constexpr`` (or a module or another jitted function); Triton's interpreter, which runs these
kernels on the CPU, accepts any global. This check keeps a kernel that passes the CPU suite from
failing to compile on its first GPU (as the paged-attention kernel did with ``BLOCK_N = 16``).
"""

import importlib
import pkgutil

import mcore_kernels
import pytest

triton = pytest.importorskip("triton", reason="the Triton kernels need triton installed")
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_PLAIN_CONSTANTS = (bool, int, float, str, tuple)
_PLAIN_BLOCK = 16


@triton.jit
def _reads_a_plain_global(x_ptr):
    tl.store(x_ptr, _PLAIN_BLOCK)


def _jit_functions():
    """(module name, function name, JITFunction) for every jitted function of a ``*_triton`` module."""
    for info in pkgutil.iter_modules(mcore_kernels.__path__):
        if not info.name.endswith("_triton"):
            continue
        module = importlib.import_module(f"mcore_kernels.{info.name}")
        for name, value in vars(module).items():
            while not isinstance(value, JITFunction) and hasattr(value, "fn"):
                value = value.fn  # autotuned or heuristic wrappers hold the jitted function
            if isinstance(value, JITFunction):
                yield info.name, name, value


def _plain_globals(function: JITFunction) -> list[str]:
    module_globals = function.fn.__globals__
    return [
        name
        for name in function.fn.__code__.co_names
        if isinstance(module_globals.get(name), _PLAIN_CONSTANTS)
    ]


def test_the_kernels_are_found():
    names = {(module, name) for module, name, _ in _jit_functions()}
    assert ("paged_attention_triton", "_paged_attention_kernel") in names and len(names) > 10


def test_jitted_functions_read_only_constexpr_globals():
    offenders = {
        f"{module}.{name}": plain
        for module, name, function in _jit_functions()
        if (plain := _plain_globals(function))
    }
    assert offenders == {}


def test_the_check_finds_a_plain_global():
    assert _plain_globals(_reads_a_plain_global) == ["_PLAIN_BLOCK"]
