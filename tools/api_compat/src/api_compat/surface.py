"""A package's public API: as plain JSON data (``ApiRecord``) and as a comparable griffe tree (``Surface``)."""

import json
from dataclasses import dataclass
from typing import Any

import griffe

from api_compat.markers import Marker


@dataclass(frozen=True)
class ApiRecord:
    """The public API in plain, machine-independent JSON data, as a baseline file stores it.

    ``api`` is a scrubbed griffe tree rooted at a synthetic module named after the package.
    ``markers`` and ``bases`` carry what that tree loses once decoded: the stability markers of
    each marked object, with their arguments, and the canonical paths of each class's bases.
    Both are keyed by paths relative to the root (``"Linear.forward"``).
    """

    api: dict[str, Any]
    markers: dict[str, tuple[Marker, ...]]
    bases: dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class Surface:
    """The public API as a griffe tree that ``griffe.find_breaking_changes`` can compare."""

    root: griffe.Module
    markers: dict[str, tuple[Marker, ...]]
    bases: dict[str, tuple[str, ...]]

    @classmethod
    def from_record(cls, record: ApiRecord) -> "Surface":
        """Decode a record (baselines and the working tree go through the same decoding).

        The root gets a modules collection of its own, so that aliases to objects outside the
        surface fail to resolve cleanly (griffe then skips them) instead of raising.
        """
        root = json.loads(json.dumps(record.api), object_hook=griffe.json_decoder)
        griffe.ModulesCollection().set_member(root.name, root)
        return cls(root=root, markers=dict(record.markers), bases=dict(record.bases))

    def relative_path(self, path: str) -> str:
        """``"mcore_x.Linear.forward"`` → ``"Linear.forward"``."""
        return path.removeprefix(f"{self.root.name}.")

    def full_path(self, relative_path: str) -> str:
        """``"Linear.forward"`` → ``"mcore_x.Linear.forward"``."""
        return f"{self.root.name}.{relative_path}"

    def markers_on(self, relative_path: str) -> list[Marker]:
        """The stability markers of the object and of the classes that contain it."""
        parts = relative_path.split(".")
        return [
            marker
            for end in range(1, len(parts) + 1)
            for marker in self.markers.get(".".join(parts[:end]), ())
        ]

    def objects(self) -> dict[str, griffe.Object | griffe.Alias]:
        """Every object of the surface, keyed by relative path (modules and classes are walked)."""
        found: dict[str, griffe.Object | griffe.Alias] = {}
        pending: list[tuple[str, griffe.Object | griffe.Alias]] = [("", self.root)]
        while pending:
            prefix, obj = pending.pop()
            for name, member in obj.members.items():
                relative_path = f"{prefix}{name}"
                found[relative_path] = member
                if not member.is_alias and (member.is_module or member.is_class):
                    pending.append((f"{relative_path}.", member))
        return found

    def first_missing(self, module_parts: tuple[str, ...], names: tuple[str, ...]) -> int | None:
        """Index of the first part of ``module_parts + names`` that this surface lacks, or None.

        Each of ``module_parts`` must be a module of the surface; ``names`` are looked up while
        the path still points at a module (attributes of a class or function are not tracked).
        """
        node: griffe.Object | griffe.Alias = self.root
        for index, part in enumerate((*module_parts, *names)):
            if node.is_alias or not node.is_module:
                return None
            member = node.members.get(part)
            must_be_module = index < len(module_parts)
            if member is None or (must_be_module and (member.is_alias or not member.is_module)):
                return index
            node = member
        return None
