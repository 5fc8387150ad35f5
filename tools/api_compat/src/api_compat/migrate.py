"""Re-derive baselines of an older format from the package sources they were recorded from.

The sources come from git: the commit named by the baseline's ``migrated_from`` if it has one,
else the last commit that wrote the file (``snapshot`` records a baseline together with the
sources it describes). The package must have the baseline's version at that commit.
"""

import io
import subprocess
import tarfile
import tempfile
from pathlib import Path

from packaging.version import Version

from api_compat.baselines import Baselines
from api_compat.current import CurrentApi
from api_compat.errors import ApiCompatError
from api_compat.surface import ApiRecord
from api_compat.workspace import Package, Workspace, load_workspace


def migrate(workspace: Workspace, baselines: Baselines, package: Package) -> list[tuple[Path, str]]:
    """Rewrite each outdated baseline of ``package``; return each file with its source commit."""
    migrated = []
    for version in baselines.outdated(package.dist):
        path = baselines.path(package.dist, version)
        commit = baselines.document(package.dist, version).get("migrated_from") or _last_commit(
            workspace.root, path
        )
        released, record = _record_at(workspace.root, commit, package.dist, version)
        baselines.write(released, record, migrated_from=commit)
        migrated.append((path, commit))
    return migrated


def _last_commit(root: Path, path: Path) -> str:
    """The last commit that wrote ``path``, which must be unchanged since."""
    relative = path.relative_to(root).as_posix()
    if _git(root, "status", "--porcelain", "--", relative):
        raise ApiCompatError(f"{relative} is not committed as it is: commit it before migrating")
    commit = _git(root, "log", "-1", "--format=%H", "--", relative).decode().strip()
    if not commit:
        raise ApiCompatError(f"{relative} was never committed: git cannot tell what it was recorded from")
    return commit


def _record_at(root: Path, commit: str, dist: str, version: Version) -> tuple[Package, ApiRecord]:
    """The package ``dist`` in ``commit``, which must have it at ``version``, and its public API there."""
    archive = _git(root, "archive", "--format=tar", "--prefix=packages/", f"{commit}:./packages")
    with tempfile.TemporaryDirectory() as folder:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder, filter="data")
        released_workspace = load_workspace(Path(folder))
        released = released_workspace.package(dist)
        if released.version != version:
            raise ApiCompatError(f"{dist} is at version {released.version} in commit {commit}, not {version}")
        return released, CurrentApi(released_workspace).record(released)


def _git(root: Path, *args: str) -> bytes:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        raise ApiCompatError(f"git {' '.join(args)} failed: {detail.decode().strip() or error}") from error
