"""Transformer, MoE and Mamba/hybrid language models built on mcore-parallel and
mcore-kernels, Hugging Face checkpoint import/export, datasets, and the training loop."""

from importlib.metadata import version as _version

__version__ = _version("mcore-models")

__all__ = ["__version__"]
