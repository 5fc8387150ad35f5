"""mcore's fused transformer ops: each a Triton kernel used on CUDA and a PyTorch reference that runs
everywhere else and is the kernel's numerical oracle (``dispatch`` picks one). Today: RMSNorm and
LayerNorm with an optional fused residual add; decode attention over a paged KV cache, with a
C++ CPU kernel built at first use. Importing this package never imports Triton nor compiles."""

from importlib.metadata import version as _version

from mcore_kernels.dispatch import KernelBackendError, select_backend, use_backend
from mcore_kernels.norm import layer_norm, rms_norm
from mcore_kernels.paged_attention import paged_decode_attention

__version__ = _version("mcore-kernels")

__all__ = [
    "KernelBackendError",
    "__version__",
    "layer_norm",
    "paged_decode_attention",
    "rms_norm",
    "select_backend",
    "use_backend",
]
