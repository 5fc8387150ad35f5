"""Fully sharded data parallelism for any ``torch.nn.Module``. Depends only on torch and
mcore-api, so it installs alone into any trainer."""

from importlib.metadata import version as _version

__version__ = _version("mcore-fsdp")

__all__ = ["__version__"]
