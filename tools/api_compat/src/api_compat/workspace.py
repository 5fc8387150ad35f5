"""The uv workspace seen by the checker: its root, its packages and where baselines live."""

import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from api_compat.errors import ApiCompatError


@dataclass(frozen=True)
class Package:
    """One workspace package, as its ``pyproject.toml`` declares it."""

    dist: str
    version: Version
    version_text: str
    import_name: str
    src_dir: Path
    requirements: tuple[Requirement, ...]
    public_modules: tuple[str, ...]

    @property
    def package_dir(self) -> Path:
        """Folder of the import package (``src/<import>``)."""
        return self.src_dir / self.import_name

    def requirements_on(self, dist: str) -> list[Requirement]:
        """Requirements (regular and optional) that name ``dist``."""
        wanted = canonicalize_name(dist)
        return [req for req in self.requirements if canonicalize_name(req.name) == wanted]


@dataclass(frozen=True)
class Workspace:
    """The workspace root and its packages, keyed by distribution name."""

    root: Path
    packages: dict[str, Package]

    @property
    def baselines_dir(self) -> Path:
        """Where recorded baselines live."""
        return self.root / "tools" / "api_compat" / "baselines"

    def package(self, dist: str) -> Package:
        """The package named ``dist`` (any spelling that normalizes the same)."""
        for package in self.packages.values():
            if canonicalize_name(package.dist) == canonicalize_name(dist):
                return package
        known = ", ".join(sorted(self.packages))
        raise ApiCompatError(f"unknown package {dist!r}; workspace packages: {known}")

    def by_import_name(self) -> dict[str, Package]:
        """Packages keyed by their top-level import name."""
        return {package.import_name: package for package in self.packages.values()}


def find_root(start: Path) -> Path:
    """The nearest folder at or above ``start`` whose ``pyproject.toml`` has ``[tool.uv.workspace]``."""
    for folder in (start, *start.parents):
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file() and "workspace" in _read_toml(pyproject).get("tool", {}).get("uv", {}):
            return folder
    raise ApiCompatError(f"no pyproject.toml with [tool.uv.workspace] at or above {start}")


def load_workspace(root: Path) -> Workspace:
    """Read every ``<root>/packages/*/pyproject.toml``."""
    packages = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        package = _read_package(pyproject)
        packages[package.dist] = package
    if not packages:
        raise ApiCompatError(f"no packages found under {root / 'packages'}")
    return Workspace(root=root, packages=packages)


def _read_package(pyproject: Path) -> Package:
    data = _read_toml(pyproject)
    project = data.get("project", {})
    dist, version_text = project.get("name"), project.get("version")
    if not dist or not version_text:
        raise ApiCompatError(f"{pyproject}: [project] needs a static name and version")
    try:
        version = Version(version_text)
        requirements = tuple(
            Requirement(text)
            for text in [
                *project.get("dependencies", []),
                *(item for extra in project.get("optional-dependencies", {}).values() for item in extra),
            ]
        )
    except (InvalidVersion, InvalidRequirement) as error:
        raise ApiCompatError(f"{pyproject}: {error}") from error
    import_name = dist.replace("-", "_")
    public_modules = tuple(data.get("tool", {}).get("api-compat", {}).get("public-modules", []))
    for module in public_modules:
        if not module.startswith(f"{import_name}."):
            raise ApiCompatError(f"{pyproject}: public module {module!r} is not a submodule of {import_name}")
    return Package(
        dist=dist,
        version=version,
        version_text=version_text,
        import_name=import_name,
        src_dir=pyproject.parent / "src",
        requirements=requirements,
        public_modules=public_modules,
    )


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ApiCompatError(f"cannot read {path}: {error}") from error
