"""Dynamic-batching inference engine with a paged KV cache, a ZMQ coordinator for
data-parallel engines and an OpenAI-compatible HTTP server."""

from importlib.metadata import version as _version

__version__ = _version("mcore-inference")

__all__ = ["__version__"]
