"""``ModuleSpec`` and ``build_module``: which class builds each part of a layer, chosen by a spec."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModuleSpec:
    """A recipe for a module: the class (or factory) to call, extra keyword ``params``, and
    ``submodules`` (usually a dataclass of further specs) passed as ``submodules=``."""

    module: type | Callable[..., Any]
    params: dict[str, Any] = field(default_factory=dict)
    submodules: Any = None


def build_module(
    spec_or_module: ModuleSpec | type | Callable[..., Any] | None, *args: Any, **kwargs: Any
) -> Any:
    """Instantiate ``spec_or_module`` with ``args`` and ``kwargs``.

    A ``ModuleSpec`` adds its ``params`` (call-site ``kwargs`` win) and, when set, its
    ``submodules``; a bare class or factory is simply called. ``None`` builds nothing.
    """
    if spec_or_module is None:
        return None
    if not isinstance(spec_or_module, ModuleSpec):
        return spec_or_module(*args, **kwargs)
    options = {**spec_or_module.params, **kwargs}
    if spec_or_module.submodules is not None:
        options["submodules"] = spec_or_module.submodules
    return spec_or_module.module(*args, **options)
