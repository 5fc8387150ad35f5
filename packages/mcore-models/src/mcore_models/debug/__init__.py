"""Debugging aids."""

from mcore_models.debug.grad_logger import DataGradientLogger, is_linear_type

__all__ = ["DataGradientLogger", "is_linear_type"]
