"""mcore's fused transformer ops: each a Triton kernel used on CUDA and a PyTorch reference that runs
everywhere else and is the kernel's numerical oracle (``dispatch`` picks one). Today: RMSNorm and
LayerNorm with an optional fused residual add. Importing this package never imports Triton."""

from importlib.metadata import version as _version

from mcore_kernels.dispatch import KernelBackendError, select_backend, use_backend
from mcore_kernels.norm import layer_norm, rms_norm

__version__ = _version("mcore-kernels")

__all__ = [
    "KernelBackendError",
    "__version__",
    "layer_norm",
    "rms_norm",
    "select_backend",
    "use_backend",
]
