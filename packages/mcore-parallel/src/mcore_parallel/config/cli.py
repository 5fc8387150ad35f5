"""Generate ``argparse`` options from config dataclasses and build the dataclasses back from them."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

from mcore_api import internal_api

from .fields import field_kind, validate_fields

ConfigT = TypeVar("ConfigT")


@internal_api
def flag_of(field: dataclasses.Field) -> str:
    """The option string of a config field: its ``flag`` metadata, or ``--field-name``."""
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def add_dataclass_arguments(
    parser: argparse.ArgumentParser, config_class: type, title: str | None = None
) -> argparse._ArgumentGroup:
    """Add one argument group to ``parser`` with an option per init field of ``config_class``.

    Options store into the field's name. ``bool`` fields become ``--x/--no-x`` switches (a flag that
    already starts with ``--no-`` is a plain switch that sets ``True``); ``Literal`` fields get
    ``choices``; ``list`` fields take one or more values; ``Optional`` fields default to ``None``.
    Fields without a default are required. Help texts come from the field metadata.

    Raises:
        TypeError: a field has no ``help`` metadata or an unsupported annotation.
    """
    description = inspect.getdoc(config_class)
    group = parser.add_argument_group(
        title or config_class.__name__, description.splitlines()[0] if description else None
    )
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        if field.init:
            _add_option(group, field, hints[field.name])
    return group


def _add_option(group: argparse._ArgumentGroup, field: dataclasses.Field, annotation: Any) -> None:
    help_text = field.metadata.get("help")
    if not help_text:
        raise TypeError(f"field {field.name!r} needs help text: declare it with config_field(..., help=...)")
    kind = field_kind(field.name, annotation)
    flag = flag_of(field)
    options: dict[str, Any] = {"dest": field.name, "help": help_text}
    if field.default is not dataclasses.MISSING:
        options["default"] = field.default
    elif field.default_factory is not dataclasses.MISSING:
        options["default"] = field.default_factory()
    else:
        options["required"] = True
    if kind.base is bool:
        if flag.startswith("--no-"):
            if options.get("default", False) is not False:
                raise TypeError(f"field {field.name!r}: a '--no-' switch must default to False")
            options["action"] = "store_true"
        else:
            options["action"] = argparse.BooleanOptionalAction
    else:
        options["type"] = kind.base
        if kind.choices is not None:
            options["choices"] = kind.choices
        if kind.is_list:
            options["nargs"] = "+"
    group.add_argument(flag, **options)


def dataclass_from_args(config_class: type[ConfigT], namespace: argparse.Namespace) -> ConfigT:
    """Build ``config_class`` from parsed arguments; its ``__post_init__`` runs, then ``validate_fields``.

    Raises:
        ConfigError: a value is outside its field's ``minimum`` or choices, or the class rejects it.
    """
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(config_class) if f.init}
    config = config_class(**values)
    validate_fields(config)
    return config


def parse_dataclasses(
    config_classes: Sequence[type],
    args: Sequence[str] | None = None,
    parser: argparse.ArgumentParser | None = None,
) -> tuple[Any, ...]:
    """Parse ``args`` (default ``sys.argv[1:]``) into one instance of each of ``config_classes``.

    Raises:
        ValueError: two classes declare a field of the same name.
        SystemExit: from ``argparse`` on unknown options or bad values.
        ConfigError: from a dataclass's validation.
    """
    seen: dict[str, str] = {}
    for config_class in config_classes:
        for f in dataclasses.fields(config_class):
            if f.name in seen:
                raise ValueError(
                    f"field {f.name!r} is declared by both {seen[f.name]} and {config_class.__name__}"
                )
            seen[f.name] = config_class.__name__
    parser = parser if parser is not None else argparse.ArgumentParser()
    for config_class in config_classes:
        add_dataclass_arguments(parser, config_class)
    namespace = parser.parse_args(args)
    return tuple(dataclass_from_args(c, namespace) for c in config_classes)
