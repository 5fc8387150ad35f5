"""The working tree's public API, loaded with one griffe loader shared by all workspace packages."""

import griffe

from api_compat.errors import ApiCompatError
from api_compat.extract import extract_record
from api_compat.surface import ApiRecord, Surface
from api_compat.workspace import Package, Workspace


class CurrentApi:
    """Loads workspace packages on demand and caches their records and surfaces."""

    def __init__(self, workspace: Workspace):
        # Static analysis only: with inspection allowed, griffe would import (or inspect whatever
        # is in sys.modules, torch included) to resolve external names, making the result slow
        # and dependent on the process.
        self._loader = griffe.GriffeLoader(
            search_paths=[package.src_dir for package in workspace.packages.values()], allow_inspection=False
        )
        self._workspace = workspace
        self._records: dict[str, ApiRecord] = {}
        self._surfaces: dict[str, Surface] = {}

    def record(self, package: Package) -> ApiRecord:
        """The package's current public API as plain data.

        The workspace packages it requires are loaded with it, whatever was loaded before, so
        that members inherited from their classes and field specifiers imported from them are
        always found.
        """
        if package.dist not in self._records:
            for needed in self._with_dependencies(package):
                self._load(needed.import_name)
            with griffe.logger.disable():
                self._loader.resolve_aliases(implicit=False, external=True)
            module = self._loader.modules_collection[package.import_name]
            self._records[package.dist] = extract_record(package, module, self._find)
        return self._records[package.dist]

    def surface(self, package: Package) -> Surface:
        """The package's current public API, decoded exactly as a baseline would be."""
        if package.dist not in self._surfaces:
            self._surfaces[package.dist] = Surface.from_record(self.record(package))
        return self._surfaces[package.dist]

    def _with_dependencies(self, package: Package) -> list[Package]:
        """``package`` and the workspace packages it requires, directly or not (extras included),
        each after those it requires: griffe builds a dataclass's ``__init__`` when it loads the
        class, from the fields of the base classes loaded by then."""
        ordered: list[Package] = []
        seen: set[str] = set()

        def visit(current: Package) -> None:
            seen.add(current.dist)
            for sibling in self._workspace.packages.values():
                if sibling.dist not in seen and current.requirements_on(sibling.dist):
                    visit(sibling)
            ordered.append(current)

        visit(package)
        return ordered

    def _load(self, import_name: str) -> None:
        if import_name in self._loader.modules_collection:
            return
        try:
            with griffe.logger.disable():  # failures are reported by us, in one line
                self._loader.load(import_name)
        except (griffe.GriffeError, ImportError, OSError, SyntaxError, ValueError) as error:
            raise ApiCompatError(f"griffe could not load {import_name}: {error}") from error

    def _find(self, path: str) -> griffe.Object | griffe.Alias | None:
        """The loaded object at a dotted path; None if there is none."""
        try:
            return self._loader.modules_collection[path]
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
