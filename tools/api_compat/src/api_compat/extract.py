"""Extract a loaded package's public API from griffe's tree into an ``ApiRecord``."""

import json
from collections.abc import Iterable
from typing import Any

import griffe

from api_compat.errors import ApiCompatError
from api_compat.markers import is_marked
from api_compat.surface import ApiRecord
from api_compat.workspace import Package

#: Keys of griffe's JSON that depend on the machine, or change with every edit of a docstring.
#: (``full=False`` already leaves out the computed ``path``, ``is_*`` and file path keys.)
_NOISY_KEYS = frozenset({"docstring", "git_info", "source_link", "runtime", "analysis"})


def is_private_name(name: str) -> bool:
    """``_x`` and ``__x`` are private; ``__x__`` (special names such as ``__init__``) are not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def extract_record(package: Package, module: griffe.Module) -> ApiRecord:
    """The public API of ``package``, given its griffe module after alias resolution.

    Public means: the names of the top-level ``__all__``, and for each listed public module the
    names of its ``__all__``, placed under a nested module named by its path relative to the
    package. Every exported name is resolved to its final target; external or unresolvable
    imports stay aliases.
    """
    extractor = _Extractor(package.import_name)
    api = extractor.module_node(module, module.name, "")
    for dotted in sorted(package.public_modules, key=lambda name: name.count(".")):
        relative_path = dotted.removeprefix(f"{package.import_name}.")
        live = _submodule(module, relative_path)
        _insert(api, relative_path.split("."), extractor.module_node(live, live.name, relative_path))
    return extractor.finish(api)


class _Extractor:
    """Builds JSON nodes and gathers the exempt paths and class bases on the way."""

    def __init__(self, import_name: str):
        self._import_name = import_name
        self._exempt: set[str] = set()
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
            members[export] = self._node(module.members[export], export, _join(relative_path, export))
        return {"kind": "module", "name": name, "exports": sorted(members), "members": members}

    def finish(self, api: dict[str, Any]) -> ApiRecord:
        bases = {
            relative_path: tuple(self._public_class_paths.get(path, path) for path in _base_paths(cls))
            for relative_path, cls in self._classes
        }
        return ApiRecord(api=api, exempt=tuple(sorted(self._exempt)), bases=bases)

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
        if is_marked(target):
            self._exempt.add(relative_path)
        node = json.loads(target.as_json(full=False))
        node.pop("members", None)
        node = {key: value for key, value in node.items() if key not in _NOISY_KEYS}
        for parameter in node.get("parameters", ()):
            parameter.pop("docstring", None)
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
