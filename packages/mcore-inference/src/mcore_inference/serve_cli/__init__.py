"""The ``mcore-serve`` command: a checkpoint, data-parallel engine processes, the coordinator and
the OpenAI-compatible HTTP server in one process tree. Public: ``main`` (the entry point) and the
configs that generate its options."""

from mcore_inference.serve_cli.cli import main
from mcore_inference.serve_cli.config import EngineProcessConfig, ServeConfig
from mcore_inference.serve_cli.errors import ServeStartupError

__all__ = ["EngineProcessConfig", "ServeConfig", "ServeStartupError", "main"]
