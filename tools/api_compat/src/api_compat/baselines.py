"""Recorded baselines: ``<baselines>/<dist>/<version>.json``, one file per package and version.

A baseline's ``format`` says which rules of extraction wrote it. Format 1 (no ``format`` key)
recorded marked paths without the markers' arguments, a dataclass field's default as the whole
``config_field(...)`` call, and an export that shadows its same-named submodule as the module.
Format 2 records markers with their arguments, the field's default, and the exported object.
An older format cannot be read; ``api-compat migrate`` re-derives it from its recorded sources.
"""

import json
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from api_compat.errors import ApiCompatError
from api_compat.markers import Marker
from api_compat.surface import ApiRecord, Surface
from api_compat.workspace import Package

#: The format that ``write`` produces and ``surface`` reads.
FORMAT = 2


class Baselines:
    """Reads and writes baseline files; decoded surfaces are cached per package and version."""

    def __init__(self, directory: Path):
        self._directory = directory
        self._surfaces: dict[tuple[str, Version], Surface] = {}

    def versions(self, dist: str) -> list[Version]:
        """Recorded versions of ``dist``, lowest first."""
        return sorted(self._files(dist))

    def path(self, dist: str, version: Version) -> Path:
        """The file of the recorded baseline of ``dist`` at ``version``."""
        return self._files(dist)[version]

    def document(self, dist: str, version: Version) -> dict[str, Any]:
        """The baseline file's JSON document, of any format."""
        path = self.path(dist, version)
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ApiCompatError(f"cannot read baseline {path}: {error}") from error

    def outdated(self, dist: str) -> list[Version]:
        """Recorded versions of ``dist`` whose baseline is in an older format than ``FORMAT``."""
        return [version for version in self.versions(dist) if _format(self.document(dist, version)) < FORMAT]

    def surface(self, dist: str, version: Version) -> Surface:
        """The recorded public API of ``dist`` at ``version``."""
        key = (dist, version)
        if key not in self._surfaces:
            path, data = self.path(dist, version), self.document(dist, version)
            if _format(data) != FORMAT:
                raise ApiCompatError(
                    f"baseline {path} has format {_format(data)}, this checker reads format {FORMAT}: "
                    "run 'api-compat migrate'"
                )
            try:
                record = ApiRecord(
                    api=data["api"],
                    markers={
                        name: tuple(Marker(**marker) for marker in markers)
                        for name, markers in data["markers"].items()
                    },
                    bases={name: tuple(bases) for name, bases in data["bases"].items()},
                )
            except (ValueError, TypeError, KeyError, AttributeError) as error:
                raise ApiCompatError(f"cannot read baseline {path}: {error!r}") from error
            self._surfaces[key] = Surface.from_record(record)
        return self._surfaces[key]

    def write(self, package: Package, record: ApiRecord, migrated_from: str | None = None) -> Path:
        """Record ``record`` as the baseline of the package's current version; return the file.

        ``migrated_from`` names the commit whose sources a migrated baseline was re-derived from.
        """
        path = self._files(package.dist).get(package.version) or (
            self._directory / package.dist / f"{package.version_text}.json"
        )
        document = {
            "format": FORMAT,
            "package": package.dist,
            "version": package.version_text,
            "markers": {
                name: [marker.to_json() for marker in markers] for name, markers in record.markers.items()
            },
            "bases": {name: list(bases) for name, bases in record.bases.items()},
            "api": record.api,
        }
        if migrated_from is not None:
            document["migrated_from"] = migrated_from
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        self._surfaces.pop((package.dist, package.version), None)
        return path

    def _files(self, dist: str) -> dict[Version, Path]:
        files = {}
        for path in sorted((self._directory / dist).glob("*.json")):
            try:
                files[Version(path.stem)] = path
            except InvalidVersion as error:
                raise ApiCompatError(f"baseline {path} is not named <version>.json") from error
        return files


def _format(document: dict[str, Any]) -> int:
    return document.get("format", 1)
