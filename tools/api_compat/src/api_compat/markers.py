"""Recognize mcore_api's stability markers among an object's decorators."""

import griffe

MARKER_NAMES = frozenset({"internal_api", "experimental_api", "deprecated"})


def is_marker_path(callable_path: str) -> bool:
    """Whether a decorator's resolved callable path is one of mcore_api's stability markers."""
    return callable_path.startswith("mcore_api.") and callable_path.rsplit(".", 1)[-1] in MARKER_NAMES


def is_marked(obj: griffe.Object) -> bool:
    """Whether a live (not decoded) function or class carries a stability marker."""
    return any(is_marker_path(decorator.callable_path) for decorator in getattr(obj, "decorators", ()))
