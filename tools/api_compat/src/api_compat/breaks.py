"""Breaking changes between a baseline surface and the current one, minus those its markers permit."""

from collections.abc import Iterable
from dataclasses import dataclass

import griffe
from griffe import BreakageKind
from packaging.version import Version

from api_compat.surface import Surface

#: Griffe's breakages that we keep, by the word we print. Griffe misses changed return
#: annotations and bases replaced one for one, so ``return-changed`` and
#: ``class-base-removed`` are ours.
_GRIFFE_KINDS = {
    BreakageKind.PARAMETER_REMOVED: "parameter-removed",
    BreakageKind.PARAMETER_ADDED_REQUIRED: "parameter-added-required",
    BreakageKind.PARAMETER_MOVED: "parameter-moved",
    BreakageKind.PARAMETER_CHANGED_KIND: "parameter-changed-kind",
    BreakageKind.PARAMETER_CHANGED_REQUIRED: "parameter-changed-required",
    BreakageKind.PARAMETER_CHANGED_DEFAULT: "parameter-changed-default",
    BreakageKind.OBJECT_REMOVED: "object-removed",
    BreakageKind.OBJECT_CHANGED_KIND: "object-changed-kind",
}


@dataclass(frozen=True, order=True)
class Break:
    """One incompatible change: the object's full path, a kebab-case kind, a one-line explanation."""

    path: str
    kind: str
    explanation: str


def find_breaks(old: Surface, new: Surface, version: Version) -> list[Break]:
    """Every breaking change from ``old`` (a baseline) to ``new`` (the package at ``version``), sorted.

    A break is permitted, and left out, only where ``old`` records a stability marker on the
    object or a class containing it that permits it at ``version``: a marker added in ``new``
    alone permits nothing yet.
    """
    old_objects, new_objects = old.objects(), new.objects()
    found = [
        (old.relative_path(breakage.obj.path), _explain(breakage, old_objects, old))
        for breakage in griffe.find_breaking_changes(old.root, new.root)
        if breakage.kind in _GRIFFE_KINDS
    ]
    common = sorted(old_objects.keys() & new_objects.keys())
    found += _return_changes(common, old_objects, new_objects)
    found += _removed_bases(common, old, new)
    return sorted(
        {
            Break(
                old.full_path(relative_path),
                kind,
                explanation + _marker_note(relative_path, old, new, version),
            )
            for relative_path, (kind, explanation) in found
            if not any(marker.permits_breaking(version) for marker in old.markers_on(relative_path))
        }
    )


def added_objects(old: Surface, new: Surface) -> set[str]:
    """Relative paths of current objects that the baseline does not have."""
    return new.objects().keys() - old.objects().keys()


def _marker_note(relative_path: str, old: Surface, new: Surface, version: Version) -> str:
    """Why a stability marker on the object does not permit its break, or nothing if it has none."""
    if released := old.markers_on(relative_path):
        return f" ({released[0].refusal(version)})"
    if marked := new.markers_on(relative_path):
        return f" ({marked[0].name} in the working tree only: it permits breaks once a baseline records it)"
    return ""


def _explain(
    breakage: griffe.Breakage, old_objects: dict[str, griffe.Object | griffe.Alias], old: Surface
) -> tuple[str, str]:
    kind, old_value, new_value = breakage.kind, breakage.old_value, breakage.new_value
    word = _GRIFFE_KINDS[kind]
    if kind is BreakageKind.PARAMETER_REMOVED:
        return word, f"parameter {old_value.name!r} was removed"
    if kind is BreakageKind.PARAMETER_ADDED_REQUIRED:
        return word, f"parameter {new_value.name!r} was added without a default"
    if kind is BreakageKind.PARAMETER_MOVED:
        old_function = old_objects[old.relative_path(breakage.obj.path)]
        old_index = [parameter.name for parameter in old_function.parameters].index(old_value.name)
        new_index = [parameter.name for parameter in breakage.obj.parameters].index(new_value.name)
        return word, f"positional parameter {old_value.name!r} moved from position {old_index} to {new_index}"
    if kind is BreakageKind.PARAMETER_CHANGED_KIND:
        return (
            word,
            f"parameter {old_value.name!r} changed from {old_value.kind.value} to {new_value.kind.value}",
        )
    if kind is BreakageKind.PARAMETER_CHANGED_REQUIRED:
        return word, f"parameter {old_value.name!r} became required (its default was {old_value.default})"
    if kind is BreakageKind.PARAMETER_CHANGED_DEFAULT:
        return word, f"default of {old_value.name!r} changed from {old_value.default} to {new_value.default}"
    if kind is BreakageKind.OBJECT_REMOVED:
        removed = "alias" if old_value.is_alias else old_value.kind.value
        return word, f"{removed} {old_value.name!r} was removed"
    return word, f"changed from {old_value.value} to {new_value.value}"


def _return_changes(
    common: list[str],
    old_objects: dict[str, griffe.Object | griffe.Alias],
    new_objects: dict[str, griffe.Object | griffe.Alias],
) -> Iterable[tuple[str, tuple[str, str]]]:
    """Functions whose return annotation changed or vanished (``-> None`` promises nothing)."""
    for relative_path in common:
        old_obj, new_obj = old_objects[relative_path], new_objects[relative_path]
        if old_obj.is_alias or new_obj.is_alias or not (old_obj.is_function and new_obj.is_function):
            continue
        old_returns, new_returns = old_obj.returns, new_obj.returns
        if old_returns is None or str(old_returns) == "None" or str(new_returns) == str(old_returns):
            continue
        if new_returns is None:
            yield relative_path, ("return-changed", f"return annotation {old_returns} was removed")
        else:
            yield (
                relative_path,
                ("return-changed", f"return annotation changed from {old_returns} to {new_returns}"),
            )


def _removed_bases(common: list[str], old: Surface, new: Surface) -> Iterable[tuple[str, tuple[str, str]]]:
    """Classes that lost a base, compared by canonical path (so a swapped base counts)."""
    for relative_path in common:
        if relative_path not in old.bases or relative_path not in new.bases:
            continue
        current = new.bases[relative_path]
        for base in old.bases[relative_path]:
            if base not in current:
                now = ", ".join(current) or "none"
                yield (
                    relative_path,
                    ("class-base-removed", f"base class {base} was removed (bases now: {now})"),
                )
