"""``deprecated``: warn once per call site that an object is going away."""

import functools
import inspect
import re
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from mcore_api._stability import mark

_T = TypeVar("_T")

_VERSION_PATTERN = re.compile(r"^\d+(\.\d+)*([a-z0-9.+-]*)$")


@dataclass(frozen=True)
class DeprecationInfo:
    """What ``deprecated`` records on the object as ``__mcore_api_deprecated__``."""

    version: str
    removal_version: str | None
    alternative: str | None

    def message(self, qualified_name: str) -> str:
        removal = (
            f"it will be removed in version {self.removal_version}"
            if self.removal_version
            else "it may be removed in a future version"
        )
        text = f"{qualified_name} is deprecated since version {self.version}; {removal}"
        if self.alternative:
            text += f"; use {self.alternative} instead"
        return text + "."


def _release_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.match(r"^[\d.]*\d", version).group(0).split("."))


def _check_version(field: str, value: object) -> None:
    if not isinstance(value, str) or not _VERSION_PATTERN.match(value):
        raise ValueError(f"deprecated(): {field} must be a version string like '0.2.0', got {value!r}")


class _CallSiteWarner:
    """Emits a warning the first time each call site reaches a deprecated object."""

    def __init__(self, message: str):
        self._message = message
        self._seen: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    def warn(self, caller_depth: int) -> None:
        frame = sys._getframe(caller_depth + 1)
        site = (frame.f_code.co_filename, frame.f_lineno)
        with self._lock:
            if site in self._seen:
                return
            self._seen.add(site)
        warnings.warn(self._message, DeprecationWarning, stacklevel=caller_depth + 2)


def _wrap_function(func: Callable[..., Any], warner: _CallSiteWarner) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            warner.warn(caller_depth=1)
            return await func(*args, **kwargs)

        return async_wrapper

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        warner.warn(caller_depth=1)
        return func(*args, **kwargs)

    return wrapper


def _wrap_class(cls: type, warner: _CallSiteWarner) -> type:
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        signature = None
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        warner.warn(caller_depth=1)
        original_init(self, *args, **kwargs)

    cls.__init__ = __init__
    if signature is not None:
        cls.__signature__ = signature
    return cls


def deprecated(
    version: str, removal_version: str | None = None, alternative: str | None = None
) -> Callable[[_T], _T]:
    """Mark a function, method or class as deprecated since ``version``.

    Each call site that calls the function or instantiates the class gets one
    ``DeprecationWarning`` naming ``version``, ``removal_version`` and ``alternative``.
    Signature, docstring and name of the decorated object stay those of the original.

    Args:
        version: the release that deprecates the object, e.g. ``"0.2.0"``.
        removal_version: the release that may remove it; must be later than ``version``.
        alternative: what to use instead, e.g. ``"mcore_fsdp.fully_shard"``.
    """
    if callable(version):
        raise TypeError("deprecated() needs a version: write @deprecated('0.2.0'), not @deprecated")
    _check_version("version", version)
    if removal_version is not None:
        _check_version("removal_version", removal_version)
        if _release_tuple(removal_version) <= _release_tuple(version):
            raise ValueError(
                f"deprecated(): removal_version {removal_version!r} must be later than version {version!r}"
            )
    if alternative is not None and not isinstance(alternative, str):
        raise TypeError(f"deprecated(): alternative must be a string, got {type(alternative).__name__}")
    info = DeprecationInfo(version, removal_version, alternative)

    def decorate(obj: _T) -> _T:
        if isinstance(obj, (staticmethod, classmethod)):
            return type(obj)(decorate(obj.__func__))
        if not callable(obj):
            raise TypeError(
                f"deprecated() applies to functions, methods and classes, not {type(obj).__name__}"
            )
        warner = _CallSiteWarner(info.message(f"{obj.__module__}.{obj.__qualname__}"))
        wrapped = _wrap_class(obj, warner) if isinstance(obj, type) else _wrap_function(obj, warner)
        mark(wrapped, "deprecated")
        wrapped.__mcore_api_deprecated__ = info
        return wrapped

    return decorate
