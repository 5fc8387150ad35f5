"""Package-boundary check: a package uses a sibling only through names that are public in the
sibling and present in the sibling's baseline at the lowest version the package's requirement allows."""

from dataclasses import dataclass

from packaging.requirements import Requirement
from packaging.version import Version

from api_compat.baselines import Baselines
from api_compat.current import CurrentApi
from api_compat.errors import ApiCompatError
from api_compat.imports import SiblingUse, UseKind, find_sibling_uses
from api_compat.workspace import Package, Workspace


@dataclass(frozen=True, order=True)
class Violation:
    """One boundary violation, located by file (relative to the root) and line."""

    file: str
    line: int
    kind: str
    explanation: str


@dataclass(frozen=True)
class _Edge:
    """What an importing package declares about one sibling, and the baseline that follows."""

    sibling: Package
    requirements: tuple[Requirement, ...]
    baseline: Version | None

    def describe(self) -> str:
        return " or ".join(f"'{requirement}'" for requirement in self.requirements)


class BoundaryChecker:
    """Checks the sources of workspace packages against their siblings' public APIs and baselines."""

    def __init__(self, workspace: Workspace, current: CurrentApi, baselines: Baselines):
        self._workspace = workspace
        self._current = current
        self._baselines = baselines
        self._by_import_name = workspace.by_import_name()

    def check(self, package: Package) -> list[Violation]:
        """Every violation in the ``.py`` files under the package's source folder, sorted."""
        siblings = set(self._by_import_name) - {package.import_name}
        edges = {name: self._edge(package, self._by_import_name[name]) for name in siblings}
        violations: set[Violation] = set()
        for path in sorted(package.package_dir.rglob("*.py")):
            try:
                uses = find_sibling_uses(path.read_text(encoding="utf-8"), str(path), siblings)
            except (OSError, SyntaxError, ValueError) as error:
                raise ApiCompatError(f"cannot parse {path}: {error}") from error
            file = path.relative_to(self._workspace.root).as_posix()
            for use in uses:
                edge = edges[use.top]
                for kind, explanation in self._check_use(package, edge, use):
                    violations.add(Violation(file, use.line, kind, explanation))
        return sorted(violations)

    def _edge(self, package: Package, sibling: Package) -> _Edge:
        requirements = tuple(package.requirements_on(sibling.dist))
        allowed = [
            version
            for version in self._baselines.versions(sibling.dist)
            if any(requirement.specifier.contains(version, prereleases=True) for requirement in requirements)
        ]
        return _Edge(sibling, requirements, min(allowed, default=None))

    def _check_use(self, package: Package, edge: _Edge, use: SiblingUse) -> list[tuple[str, str]]:
        sibling = edge.sibling
        found = []
        if use.kind is not UseKind.ATTRIBUTE:
            if not edge.requirements:
                found.append(
                    (
                        "undeclared-dependency",
                        f"imports {sibling.import_name}, but {sibling.dist} is in neither the dependencies "
                        f"nor the optional-dependencies of {package.dist}",
                    )
                )
            elif edge.baseline is None:
                recorded = ", ".join(map(str, self._baselines.versions(sibling.dist))) or "none"
                found.append(
                    (
                        "no-matching-baseline",
                        f"no recorded baseline of {sibling.dist} satisfies {edge.describe()} (recorded: {recorded})",
                    )
                )
        if use.kind is UseKind.STAR:
            found.append(("star-import", f"'from {use.module} import *': import the names you use instead"))
        else:
            found += self._check_names(edge, use)
        return found

    def _check_names(self, edge: _Edge, use: SiblingUse) -> list[tuple[str, str]]:
        sibling = edge.sibling
        module_parts = tuple(use.module.split(".")[1:])
        parts = (sibling.import_name, *module_parts, *use.names)
        missing = self._current.surface(sibling).first_missing(module_parts, use.names)
        if missing is not None:
            dotted = ".".join(parts[: missing + 2])
            what = "module" if missing < len(module_parts) else "name"
            return [(f"non-public-{what}", f"{dotted} is not a public {what} of {sibling.dist}")]
        if edge.baseline is None:
            return []
        missing = self._baselines.surface(sibling.dist, edge.baseline).first_missing(module_parts, use.names)
        if missing is None:
            return []
        dotted = ".".join(parts[: missing + 2])
        return [
            (
                "missing-from-baseline",
                f"{dotted} is public in the working tree but not in the baseline {edge.baseline} of "
                f"{sibling.dist}, the lowest version {edge.describe()} allows: bump {sibling.dist}, "
                f"snapshot it, raise the lower bound",
            )
        ]
