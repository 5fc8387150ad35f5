"""mcore_api's stability markers: found among an object's decorators, recorded with their arguments."""

import ast
from dataclasses import asdict, dataclass
from typing import Any

import griffe
from packaging.version import Version

from api_compat.calls import bind_arguments
from api_compat.errors import ApiCompatError

MARKER_NAMES = frozenset({"internal_api", "experimental_api", "deprecated"})

#: The positional parameters of ``mcore_api.deprecated``, in order.
_DEPRECATED_PARAMETERS = ("version", "removal_version", "alternative")


@dataclass(frozen=True)
class Marker:
    """One stability marker on an object; ``deprecated`` also carries its two version arguments."""

    name: str
    version: str | None = None
    removal_version: str | None = None

    def __post_init__(self) -> None:
        if self.name not in MARKER_NAMES:
            raise ValueError(f"unknown stability marker {self.name!r}")
        for version in (self.version, self.removal_version):
            if version is not None:
                Version(version)  # raises InvalidVersion (a ValueError) or TypeError

    def permits_breaking(self, package_version: Version) -> bool:
        """Whether this marker, released on an object, lets the package at ``package_version`` break it.

        ``internal_api`` and ``experimental_api`` always do; ``deprecated`` from its
        ``removal_version`` on, and never without one.
        """
        if self.name != "deprecated":
            return True
        return self.removal_version is not None and package_version >= Version(self.removal_version)

    def refusal(self, package_version: Version) -> str:
        """Why a released ``deprecated`` marker does not permit breaking the object yet."""
        if self.removal_version is None:
            return f"deprecated in {self.version} without a removal_version, so not removable"
        return (
            f"deprecated in {self.version} for removal in {self.removal_version}; this is {package_version}"
        )

    def to_json(self) -> dict[str, str]:
        """The marker as a baseline stores it (arguments that were not given are left out)."""
        return {key: value for key, value in asdict(self).items() if value is not None}


def markers_of(obj: griffe.Object) -> tuple[Marker, ...]:
    """The stability markers among a live function's or class's decorators, outermost first."""
    return tuple(
        _marker(obj, decorator)
        for decorator in getattr(obj, "decorators", ())
        if _is_marker_path(decorator.callable_path)
    )


def _is_marker_path(callable_path: str) -> bool:
    """Whether a decorator's resolved callable path is one of mcore_api's stability markers."""
    return callable_path.startswith("mcore_api.") and callable_path.rsplit(".", 1)[-1] in MARKER_NAMES


def _marker(obj: griffe.Object, decorator: griffe.Decorator) -> Marker:
    name = decorator.callable_path.rsplit(".", 1)[-1]
    if name != "deprecated" or not isinstance(decorator.value, griffe.ExprCall):
        return Marker(name)
    arguments = bind_arguments(decorator.value, _DEPRECATED_PARAMETERS)
    if arguments is None:
        raise ApiCompatError(f"{obj.path}: cannot read the arguments of @{decorator.value}")
    try:
        return Marker(name, _literal(arguments.get("version")), _literal(arguments.get("removal_version")))
    except (ValueError, SyntaxError, TypeError) as error:
        raise ApiCompatError(
            f"{obj.path}: deprecated() needs string literals for version and removal_version ({error})"
        ) from error


def _literal(argument: str | griffe.Expr | None) -> Any:
    """The value of a literal argument (griffe keeps its source text); None for a missing one."""
    return None if argument is None else ast.literal_eval(str(argument))
