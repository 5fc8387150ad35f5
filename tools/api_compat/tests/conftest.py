"""Throwaway uv workspaces for the checker's tests, and a way to run ``api-compat`` on them in-process.

No mcore_api package is needed: a stability marker is recognized from the import statement
that brings the decorator in (``from mcore_api import experimental_api``).
"""

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from api_compat.cli import main


@dataclass(frozen=True)
class Result:
    """Exit status and captured output of one ``api-compat`` run."""

    code: int
    out: str
    err: str


class FakeWorkspace:
    """A workspace root with ``packages/<dist>/`` folders written on demand."""

    def __init__(self, root: Path):
        self.root = root
        (root / "pyproject.toml").write_text('[tool.uv.workspace]\nmembers = ["packages/*"]\n')

    def add_package(
        self,
        dist: str,
        files: dict[str, str],
        *,
        version: str = "0.1.0",
        dependencies: tuple[str, ...] = (),
        optional: dict[str, list[str]] | None = None,
        public_modules: tuple[str, ...] = (),
    ) -> None:
        """Write ``packages/<dist>/pyproject.toml`` and ``src/<import>/<file>`` for each of ``files``."""
        self.write_pyproject(dist, version, dependencies, optional or {}, public_modules)
        for name, source in files.items():
            self.write(dist, name, source)

    def write_pyproject(
        self,
        dist: str,
        version: str,
        dependencies: tuple[str, ...] = (),
        optional: dict[str, list[str]] | None = None,
        public_modules: tuple[str, ...] = (),
    ) -> None:
        """(Re)write a package's ``pyproject.toml``."""
        lines = [
            "[project]",
            f'name = "{dist}"',
            f'version = "{version}"',
            f"dependencies = {json.dumps(list(dependencies))}",
        ]
        if optional:
            lines += [
                "[project.optional-dependencies]",
                *(f"{extra} = {json.dumps(reqs)}" for extra, reqs in optional.items()),
            ]
        if public_modules:
            lines += ["[tool.api-compat]", f"public-modules = {json.dumps(list(public_modules))}"]
        folder = self.root / "packages" / dist
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "pyproject.toml").write_text("\n".join(lines) + "\n")

    def write(self, dist: str, name: str, source: str) -> Path:
        """Write ``src/<import>/<name>`` of ``dist`` (source is dedented)."""
        path = self.source_path(dist, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip())
        return path

    def source_path(self, dist: str, name: str) -> Path:
        """Path of ``src/<import>/<name>`` of ``dist``."""
        return self.root / "packages" / dist / "src" / dist.replace("-", "_") / name

    def baseline(self, dist: str, version: str) -> Path:
        """Where the baseline of ``dist`` at ``version`` is recorded."""
        return self.root / "tools" / "api_compat" / "baselines" / dist / f"{version}.json"


@pytest.fixture
def workspace(tmp_path: Path) -> FakeWorkspace:
    """An empty throwaway workspace."""
    return FakeWorkspace(tmp_path)


@pytest.fixture
def api_compat(workspace: FakeWorkspace, capsys: pytest.CaptureFixture[str]):
    """``api_compat("check", "--package", "mcore-x")``: run the CLI in-process on ``workspace``."""

    def run(*argv: str) -> Result:
        capsys.readouterr()
        code = main(["--root", str(workspace.root), *argv])
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


@pytest.fixture
def compare(workspace: FakeWorkspace, api_compat):
    """``compare(old, new)``: snapshot mcore-x with ``__init__.py`` = old, then check it with new."""

    def run(old: str, new: str) -> Result:
        workspace.add_package("mcore-x", {"__init__.py": old})
        assert api_compat("snapshot", "--package", "mcore-x").code == 0
        workspace.write("mcore-x", "__init__.py", new)
        return api_compat("check", "--package", "mcore-x")

    return run
