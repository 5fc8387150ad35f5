"""mcore-kernels' C++ CPU kernels: compiled at first use with the machine's C++ compiler against
the installed torch, cached per user, and loaded as torch ops (``torch.ops.mcore_kernels_cpu``).

The build is keyed by the source, the flags, the torch version, the compiler and the CPU's
instruction sets, so a cache shared between machines or torch versions never loads a library
built for another. ``MCORE_KERNELS_CACHE`` chooses the cache folder (default
``$XDG_CACHE_HOME/mcore-kernels``, else ``~/.cache/mcore-kernels``); ``CXX`` the compiler
(default ``c++``). Where no compiler works the native kernels are unavailable, and the dispatch
says why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

_SOURCES = (
    "paged_decode_attention.cpp",
    "rms_norm.cpp",
    "swiglu.cpp",
    "rotary.cpp",
    "argmax_rows.cpp",
    "moe_rows.cpp",
    "mamba_state_update.cpp",
)
_HEADERS = ("simd.h",)  # part of the build key: the sources include them
_OPTIMIZATION = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
_BUILD_SECONDS = 600

logger = logging.getLogger(__name__)


def _cache_folder() -> Path:
    if "MCORE_KERNELS_CACHE" in os.environ:
        return Path(os.environ["MCORE_KERNELS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mcore-kernels"


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command(compiler: str, sources: list[Path], target: Path) -> list[str]:
    torch_root = Path(torch.__file__).parent
    include = torch_root / "include"
    torch_lib = torch_root / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler, *_OPTIMIZATION, "-std=c++20", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
        *map(str, sources), "-o", str(target),
        f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu",
    ]  # fmt: skip


def _build(compiler: str) -> Path:
    folder = Path(__file__).parent / "csrc"
    sources = [folder / name for name in _SOURCES]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256()
    for part in [
        *((folder / name).read_bytes() for name in (*_SOURCES, *_HEADERS)),
        *map(str.encode, (*_OPTIMIZATION, torch.__version__)),
    ]:
        key.update(part)
    key.update(version.encode())
    key.update(_cpu_features().encode())
    target = _cache_folder() / key.hexdigest()[:24] / "libmcore_kernels_cpu.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("mcore-kernels: compiling its C++ CPU kernels once, into %s", target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            _command(compiler, sources, built), capture_output=True, text=True, timeout=_BUILD_SECONDS
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{result.stderr[-4000:]}")
        os.replace(built, target)  # atomic: a concurrent build or reader never sees half a file
    return target


@functools.cache
def native_library_error() -> str | None:
    """Why the C++ CPU kernels cannot run here, or ``None`` once they are built and loaded (asked
    once per process; the first call may compile them)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (set CXX to use another)"
    try:
        torch.ops.load_library(str(_build(compiler)))
    except Exception as error:  # a failed compile or load: the kernels are unavailable, not the package
        return f"building the C++ CPU kernels failed: {error}"
    return None
