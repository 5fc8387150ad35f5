"""Recorded baselines: ``<baselines>/<dist>/<version>.json``, one file per package and version."""

import json
from pathlib import Path

from packaging.version import InvalidVersion, Version

from api_compat.errors import ApiCompatError
from api_compat.surface import ApiRecord, Surface
from api_compat.workspace import Package


class Baselines:
    """Reads and writes baseline files; decoded surfaces are cached per package and version."""

    def __init__(self, directory: Path):
        self._directory = directory
        self._surfaces: dict[tuple[str, Version], Surface] = {}

    def versions(self, dist: str) -> list[Version]:
        """Recorded versions of ``dist``, lowest first."""
        return sorted(self._files(dist))

    def surface(self, dist: str, version: Version) -> Surface:
        """The recorded public API of ``dist`` at ``version``."""
        key = (dist, version)
        if key not in self._surfaces:
            path = self._files(dist)[version]
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                record = ApiRecord(
                    api=data["api"],
                    exempt=tuple(data["exempt"]),
                    bases={name: tuple(bases) for name, bases in data["bases"].items()},
                )
            except (OSError, ValueError, KeyError, AttributeError) as error:
                raise ApiCompatError(f"cannot read baseline {path}: {error}") from error
            self._surfaces[key] = Surface.from_record(record)
        return self._surfaces[key]

    def write(self, package: Package, record: ApiRecord) -> Path:
        """Record ``record`` as the baseline of the package's current version; return the file."""
        path = self._files(package.dist).get(package.version) or (
            self._directory / package.dist / f"{package.version_text}.json"
        )
        document = {
            "package": package.dist,
            "version": package.version_text,
            "exempt": list(record.exempt),
            "bases": {name: list(bases) for name, bases in record.bases.items()},
            "api": record.api,
        }
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
