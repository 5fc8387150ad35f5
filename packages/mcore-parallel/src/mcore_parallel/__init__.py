"""Parallelism for PyTorch training: process groups, tensor and pipeline parallelism,
DDP and the distributed optimizer, distributed checkpointing, config dataclasses and the CLI
generated from them. Runs on CPU with gloo and on CUDA with NCCL."""

from importlib.metadata import version as _version

__version__ = _version("mcore-parallel")

__all__ = ["__version__"]
