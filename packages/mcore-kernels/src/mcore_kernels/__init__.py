"""Placeholder for mcore's fused transformer kernels: this release holds no kernels, only
``__version__``. Planned: each op a Triton kernel used on CUDA and a PyTorch reference that runs
everywhere else and is the kernel's numerical oracle."""

from importlib.metadata import version as _version

__version__ = _version("mcore-kernels")

__all__ = ["__version__"]
