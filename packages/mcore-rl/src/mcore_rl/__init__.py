"""GRPO-family reinforcement-learning post-training driven by the mcore inference engine."""

from importlib.metadata import version as _version

__version__ = _version("mcore-rl")

__all__ = ["__version__"]
