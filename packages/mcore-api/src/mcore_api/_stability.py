"""``internal_api`` and ``experimental_api``: label an object without wrapping it."""

from typing import TypeVar

_T = TypeVar("_T")

#: Attribute set on every marked object; its value is ``"internal"``, ``"experimental"`` or
#: ``"deprecated"``.
STABILITY_ATTRIBUTE = "__mcore_api_stability__"


def mark(obj: object, stability: str) -> None:
    """Record ``stability`` on ``obj`` (the function behind a static/class method)."""
    target = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    if not callable(target):
        raise TypeError(
            f"API-stability markers apply to functions, methods and classes, not {type(obj).__name__}"
        )
    setattr(target, STABILITY_ATTRIBUTE, stability)


def internal_api(obj: _T) -> _T:
    """Mark ``obj`` as internal: usable inside mcore, no compatibility promise to users.

    The object is returned unchanged (same identity, signature and docstring).
    """
    mark(obj, "internal")
    return obj


def experimental_api(obj: _T) -> _T:
    """Mark ``obj`` as experimental: public, but its signature may change in any release.

    The object is returned unchanged (same identity, signature and docstring).
    """
    mark(obj, "experimental")
    return obj
