"""Fused transformer kernels. Every op has a Triton kernel used on CUDA and a PyTorch
reference that runs everywhere else and is the numerical oracle for the kernel."""

from importlib.metadata import version as _version

__version__ = _version("mcore-kernels")

__all__ = ["__version__"]
