"""Declaring a config field once: default, help, flag and allowed range in one place."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any, Literal, Union, get_args, get_origin


class ConfigError(ValueError):
    """A config value, or a combination of values, is invalid; ``fields`` names the fields involved."""

    def __init__(self, fields: Sequence[str], message: str):
        self.fields = tuple(fields)
        super().__init__(f"{', '.join(self.fields)}: {message}")


def config_field(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flag: str | None = None,
    minimum: int | float | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that also describes its command-line option.

    Args:
        help: the option's help text.
        flag: the option string; defaults to ``--`` plus the field name with ``-`` for ``_``.
        minimum: smallest allowed value (inclusive), checked by ``validate_fields``; ``None`` values
            of optional fields are exempt.
    """
    metadata = {"help": help, "flag": flag, "minimum": minimum}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class FieldKind:
    """What a field's annotation means for parsing: base type, optional, list, allowed choices."""

    base: type
    optional: bool
    is_list: bool
    choices: tuple[Any, ...] | None


def field_kind(name: str, annotation: Any) -> FieldKind:
    """Classify ``annotation``: ``T``, ``T | None``, ``list[T]``, ``Literal[...]`` and their mixes,
    with ``T`` one of ``bool``, ``int``, ``float``, ``str``.

    Raises:
        TypeError: any other annotation, naming the field.
    """
    optional = False
    if get_origin(annotation) in (Union, _UnionType) and type(None) in get_args(annotation):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) != 1:
            raise TypeError(f"field {name!r}: unsupported union annotation {annotation!r}")
        optional, annotation = True, members[0]
    is_list = get_origin(annotation) is list
    if is_list:
        (annotation,) = get_args(annotation)
    choices = None
    if get_origin(annotation) is Literal:
        choices = get_args(annotation)
        kinds = {type(c) for c in choices}
        if len(kinds) != 1:
            raise TypeError(f"field {name!r}: Literal choices must share one type, got {choices!r}")
        annotation = kinds.pop()
    if annotation not in (bool, int, float, str):
        raise TypeError(
            f"field {name!r}: unsupported annotation; use bool, int, float, str, Literal, list or Optional"
        )
    if annotation is bool and (optional or is_list):
        raise TypeError(f"field {name!r}: bool fields cannot be optional or lists")
    return FieldKind(annotation, optional, is_list, choices)


def validate_fields(config: Any) -> None:
    """Check every field of a config dataclass against its ``Literal`` choices and ``minimum``.

    Raises:
        ConfigError: naming the field, its value and the allowed values or range.
    """
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None:
            continue
        kind = field_kind(f.name, hints[f.name])
        values = value if kind.is_list else [value]
        for item in values:
            if kind.choices is not None and item not in kind.choices:
                raise ConfigError([f.name], f"must be one of {list(kind.choices)}, got {item!r}")
            minimum = f.metadata.get("minimum")
            if minimum is not None and item < minimum:
                raise ConfigError([f.name], f"must be >= {minimum}, got {item!r}")


_UnionType = type(int | None)
