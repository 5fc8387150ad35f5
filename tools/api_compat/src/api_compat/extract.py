"""Extract a loaded package's public API from griffe's tree into an ``ApiRecord``."""

import json
from collections.abc import Callable, Iterable
from typing import Any

import griffe

from api_compat.calls import bind_arguments
from api_compat.errors import ApiCompatError
from api_compat.markers import Marker, markers_of
from api_compat.surface import ApiRecord
from api_compat.workspace import Package

#: Keys of griffe's JSON that depend on the machine, or change with every edit of a docstring.
#: (``full=False`` already leaves out the computed ``path``, ``is_*`` and file path keys.)
_NOISY_KEYS = frozenset({"docstring", "git_info", "source_link", "runtime", "analysis"})

#: Finds a loaded object by dotted path (loading the workspace package it lies in); None if unknown.
ObjectFinder = Callable[[str], griffe.Object | griffe.Alias | None]

_POSITIONAL = (griffe.ParameterKind.positional_only, griffe.ParameterKind.positional_or_keyword)


def is_private_name(name: str) -> bool:
    """``_x`` and ``__x`` are private; ``__x__`` (special names such as ``__init__``) are not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def extract_record(package: Package, module: griffe.Module, find: ObjectFinder) -> ApiRecord:
    """The public API of ``package``, given its griffe module after alias resolution.

    Public means: the names of the top-level ``__all__``, and for each listed public module the
    names of its ``__all__``, placed under a nested module named by its path relative to the
    package. Every exported name is resolved to its final target; external or unresolvable
    imports stay aliases. ``find`` looks up the field specifiers that dataclass fields call.
    """
    extractor = _Extractor(package.import_name, find)
    api = extractor.module_node(module, module.name, "")
    for dotted in sorted(package.public_modules, key=lambda name: name.count(".")):
        relative_path = dotted.removeprefix(f"{package.import_name}.")
        live = _submodule(module, relative_path)
        _insert(api, relative_path.split("."), extractor.module_node(live, live.name, relative_path))
    return extractor.finish(api)


class _Extractor:
    """Builds JSON nodes and gathers the stability markers and class bases on the way."""

    def __init__(self, import_name: str, find: ObjectFinder):
        self._import_name = import_name
        self._find = find
        self._markers: dict[str, tuple[Marker, ...]] = {}
        self._classes: list[tuple[str, griffe.Class]] = []
        self._public_class_paths: dict[str, str] = {}

    def module_node(self, module: griffe.Module, name: str, relative_path: str) -> dict[str, Any]:
        if module.exports is None:
            raise ApiCompatError(f"{module.path} has no __all__: list its public names there")
        members = {}
        for export in map(str, module.exports):
            if is_private_name(export):
                continue
            if export not in module.members:
                raise ApiCompatError(f"{module.path}.__all__ names {export!r}, which is not defined there")
            members[export] = self._node(_exported(module, export), export, _join(relative_path, export))
        return {"kind": "module", "name": name, "exports": sorted(members), "members": members}

    def finish(self, api: dict[str, Any]) -> ApiRecord:
        bases = {
            relative_path: tuple(self._public_class_paths.get(path, path) for path in _base_paths(cls))
            for relative_path, cls in self._classes
        }
        return ApiRecord(api=api, markers=self._markers, bases=bases)

    def _node(self, obj: griffe.Object | griffe.Alias, name: str, relative_path: str) -> dict[str, Any]:
        target = _final_target(obj)
        if target.is_alias:
            return {
                "kind": "alias",
                "name": name,
                "target_path": target.target_path,
                "lineno": target.alias_lineno,
                "endlineno": target.alias_endlineno,
            }
        if target.is_module:
            return self.module_node(target, name, relative_path)
        if markers := markers_of(target):
            self._markers[relative_path] = markers
        node = json.loads(target.as_json(full=False))
        node.pop("members", None)
        node = {key: value for key, value in node.items() if key not in _NOISY_KEYS}
        for parameter in node.get("parameters", ()):
            parameter.pop("docstring", None)
        if _is_dataclass_init(target):
            for parameter, encoded in zip(target.parameters, node["parameters"], strict=True):
                encoded["default"] = _to_json(self._declared_default(parameter.default))
        node["name"] = name
        if target.is_class:
            self._classes.append((relative_path, target))
            self._public_class_paths.setdefault(target.path, f"{self._import_name}.{relative_path}")
            node["members"] = {
                member_name: self._node(member, member_name, f"{relative_path}.{member_name}")
                for member_name, member in target.all_members.items()
                if not is_private_name(member_name)
            }
        return node

    def _declared_default(self, default: str | griffe.Expr | None) -> str | griffe.Expr | None:
        """The default a dataclass field declares through a field specifier, else ``default``.

        For ``x: int = config_field(3, help=...)`` that is ``3``: the call's ``default``
        argument, a call of its ``default_factory`` argument, or none (a required field).
        """
        specifier = self._field_specifier(default)
        if specifier is None:
            return default
        positional = [parameter.name for parameter in specifier.parameters if parameter.kind in _POSITIONAL]
        arguments = bind_arguments(default, positional)
        if arguments is None:
            return default
        if "default" in arguments:
            return arguments["default"]
        if "default_factory" in arguments:
            return griffe.ExprCall(arguments["default_factory"], [])
        return None

    def _field_specifier(self, default: str | griffe.Expr | None) -> griffe.Function | None:
        """The workspace function that ``default`` calls, if it is a field specifier: a function
        with a ``default`` parameter (PEP 681), like mcore_parallel's ``config_field``. (Griffe
        itself reads ``dataclasses.field``.)"""
        if not isinstance(default, griffe.ExprCall) or not isinstance(
            default.function, (griffe.ExprName, griffe.ExprAttribute)
        ):
            return None
        found = self._find(default.function.canonical_path)
        target = None if found is None else _final_target(found)
        if target is None or target.is_alias or not target.is_function or "default" not in target.parameters:
            return None
        return target


def _is_dataclass_init(obj: griffe.Object) -> bool:
    """Whether ``obj`` is the ``__init__`` of a dataclass (griffe generates it from the fields)."""
    return obj.is_function and obj.name == "__init__" and "dataclass" in getattr(obj.parent, "labels", ())


def _to_json(value: str | griffe.Expr | None) -> Any:
    """``value`` as griffe writes it in a node's JSON."""
    return json.loads(json.dumps(value, cls=griffe.JSONEncoder))


def _exported(module: griffe.Module, name: str) -> griffe.Object | griffe.Alias:
    """What ``module.name`` is at run time.

    ``from pkg.sub import sub`` in ``pkg/__init__.py`` binds ``sub`` to the imported object,
    which shadows the submodule that griffe keeps under that name.
    """
    member = module.members[name]
    imported = module.imports.get(name)
    if member.is_alias or not member.is_module or imported in (None, member.path):
        return member
    return griffe.Alias(name, imported, parent=module)


def _final_target(obj: griffe.Object | griffe.Alias) -> griffe.Object | griffe.Alias:
    """Follow aliases as far as they resolve."""
    while obj.is_alias:
        try:
            obj = obj.target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return obj
    return obj


def _base_paths(cls: griffe.Class) -> Iterable[str]:
    return (base.canonical_path if isinstance(base, griffe.Expr) else str(base) for base in cls.bases)


def _submodule(module: griffe.Module, relative_path: str) -> griffe.Module:
    current: griffe.Object | griffe.Alias = module
    for part in relative_path.split("."):
        current = current.members.get(part)
        if current is None or current.is_alias or not current.is_module:
            raise ApiCompatError(
                f"public module {module.name}.{relative_path} listed in [tool.api-compat] does not exist"
            )
    return current


def _insert(api: dict[str, Any], parts: list[str], node: dict[str, Any]) -> None:
    """Place ``node`` at ``parts`` below ``api``, creating empty parent modules as needed."""
    parent = api
    for part in parts[:-1]:
        parent = parent["members"].setdefault(
            part, {"kind": "module", "name": part, "exports": [], "members": {}}
        )
    parent["members"][parts[-1]] = node


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
