"""Optional dependencies of ``mcore-train``, imported only when a setting asks for them."""

from __future__ import annotations

import importlib
from types import ModuleType

from mcore_parallel import ConfigError


def import_extra(module: str, field: str, feature: str, package: str, extra: str) -> ModuleType:
    """``module``, imported; ``feature`` (what ``field`` turned on) needs it.

    Raises:
        ConfigError: naming ``field``, the missing ``package`` and the extra that installs it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(
            [field], f"{feature} needs the {package} package: pip install 'mcore-models[{extra}]'"
        ) from error
