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
        self._import_names = set(workspace.by_import_name())
        self._records: dict[str, ApiRecord] = {}
        self._surfaces: dict[str, Surface] = {}

    def record(self, package: Package) -> ApiRecord:
        """The package's current public API as plain data."""
        if package.dist not in self._records:
            try:
                with griffe.logger.disable():  # failures are reported by us, in one line
                    module = self._loader.load(package.import_name)
                    self._loader.resolve_aliases(implicit=False, external=True)
            except (griffe.GriffeError, ImportError, OSError, SyntaxError, ValueError) as error:
                raise ApiCompatError(f"griffe could not load {package.import_name}: {error}") from error
            self._records[package.dist] = extract_record(package, module, self._find)
        return self._records[package.dist]

    def surface(self, package: Package) -> Surface:
        """The package's current public API, decoded exactly as a baseline would be."""
        if package.dist not in self._surfaces:
            self._surfaces[package.dist] = Surface.from_record(self.record(package))
        return self._surfaces[package.dist]

    def _find(self, path: str) -> griffe.Object | griffe.Alias | None:
        """The object at a dotted path in a workspace package (loaded on first use); None if unknown."""
        top = path.split(".", 1)[0]
        if top not in self._import_names:
            return None
        try:
            with griffe.logger.disable():
                if top not in self._loader.modules_collection:
                    self._loader.load(top)
                return self._loader.modules_collection[path]
        except (KeyError, griffe.GriffeError, ImportError, OSError, SyntaxError, ValueError):
            return None
