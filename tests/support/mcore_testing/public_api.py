"""Checks of a package's public surface: stability markers, docstrings, README coverage."""

import importlib
import inspect
import re
from pathlib import Path

# The attribute mcore_api's markers set; read by name so this module needs no mcore package.
STABILITY_ATTRIBUTE = "__mcore_api_stability__"

REPOSITORY = Path(__file__).resolve().parents[3]


def public_objects(module_name: str) -> dict[str, object]:
    """The objects named by ``module_name.__all__``, by name."""
    module = importlib.import_module(module_name)
    return {name: getattr(module, name) for name in module.__all__}


def stability_markers(module_name: str) -> dict[str, str]:
    """``{name: "internal" | "experimental" | "deprecated"}`` for the marked names of ``__all__``
    (a class's own marker: one inherited from a marked base class does not mark it, as for
    ``tools/api_compat``, which reads the decorators)."""
    return {
        name: vars(obj)[STABILITY_ATTRIBUTE]
        for name, obj in public_objects(module_name).items()
        if (inspect.isclass(obj) or inspect.isroutine(obj)) and STABILITY_ATTRIBUTE in vars(obj)
    }


def undocumented(module_name: str) -> list[str]:
    """Public classes and functions without a docstring of their own (dataclasses' generated
    ``Name(field=...)`` does not count). Constants cannot carry one at run time and are skipped."""
    missing = []
    for name, obj in public_objects(module_name).items():
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        doc = obj.__doc__ or ""
        if not doc.strip() or doc.startswith(f"{obj.__name__}("):
            missing.append(name)
    return missing


def missing_from_readme(module_names: list[str], distribution: str) -> list[str]:
    """Names of the modules' ``__all__`` that ``packages/<distribution>/README.md`` never mentions
    as code (`` `name` ``, `` `name(...)` ``, `` `name.attribute` ``)."""
    text = (REPOSITORY / "packages" / distribution / "README.md").read_text()
    return [
        f"{module_name}.{name}"
        for module_name in module_names
        for name in public_objects(module_name)
        if not re.search(r"`" + re.escape(name) + r"[`(\[.]", text)
    ]
