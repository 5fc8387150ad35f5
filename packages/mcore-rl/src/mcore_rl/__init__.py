"""Placeholder for GRPO-family reinforcement-learning post-training on the mcore inference
engine: this release holds no code, only ``__version__``."""

from importlib.metadata import version as _version

__version__ = _version("mcore-rl")

__all__ = ["__version__"]
