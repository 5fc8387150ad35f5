"""``migrate`` re-derives baselines of an older format from the git commit that recorded them."""

import json
import subprocess
from pathlib import Path

import pytest
from api_compat import baselines

RELEASED = '__all__ = ["f"]\ndef f(a): ...'


def _git(root: Path, *args: str) -> str:
    command = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args]
    return subprocess.run(command, cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def _commit(root: Path, message: str) -> str:
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", message)
    return _git(root, "rev-parse", "HEAD")


def _downgrade_to_format_1(path: Path) -> None:
    """Rewrite a baseline as format 1 wrote it: no ``format``, marked paths under ``exempt``."""
    document = json.loads(path.read_text())
    del document["format"]
    document["exempt"] = sorted(document.pop("markers"))
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")


@pytest.fixture
def released(workspace, api_compat):
    """A git repository where mcore-x 0.1.0 was released with a format-1 baseline, then moved on
    to 0.2.0 (a new function ``g``); returns the release commit."""
    _git(workspace.root, "init", "-q")
    workspace.add_package("mcore-x", {"__init__.py": RELEASED})
    assert api_compat("snapshot", "--package", "mcore-x").code == 0
    _downgrade_to_format_1(workspace.baseline("mcore-x", "0.1.0"))
    release = _commit(workspace.root, "mcore-x 0.1.0")
    workspace.add_package(
        "mcore-x", {"__init__.py": '__all__ = ["f", "g"]\ndef f(a): ...\ndef g(): ...'}, version="0.2.0"
    )
    _commit(workspace.root, "mcore-x 0.2.0")
    return release


def test_format_1_baseline_is_refused_until_migrated(released, workspace, api_compat):
    result = api_compat("check", "--package", "mcore-x")
    assert result.code == 2
    assert "has format 1, this checker reads format 2: run 'api-compat migrate'" in result.err

    result = api_compat("migrate")
    assert (result.code, result.out) == (
        0,
        f"mcore-x: re-derived tools/api_compat/baselines/mcore-x/0.1.0.json from commit {released}\n",
    )
    document = json.loads(workspace.baseline("mcore-x", "0.1.0").read_text())
    assert (document["format"], document["migrated_from"], document["version"]) == (2, released, "0.1.0")
    assert sorted(document["api"]["members"]) == ["f"]  # the released sources, not the working tree's
    result = api_compat("check", "--package", "mcore-x")
    assert (result.code, result.out) == (0, "")
    assert api_compat("migrate").out == ""


def test_migration_reads_the_sources_a_migrated_baseline_came_from(
    released, workspace, api_compat, monkeypatch
):
    assert api_compat("migrate").code == 0
    _commit(workspace.root, "baselines migrated")  # at 0.2.0: no source of 0.1.0's baseline
    monkeypatch.setattr(baselines, "FORMAT", 3)
    result = api_compat("migrate")
    assert (result.code, result.err) == (0, "")
    assert json.loads(workspace.baseline("mcore-x", "0.1.0").read_text())["migrated_from"] == released


def test_uncommitted_baseline_is_not_migrated(released, workspace, api_compat):
    path = workspace.baseline("mcore-x", "0.1.0")
    path.write_text(path.read_text().replace('"version": "0.1.0"', '"version": "0.1.0" '))
    result = api_compat("migrate")
    assert result.code == 2
    assert "tools/api_compat/baselines/mcore-x/0.1.0.json is not committed as it is" in result.err


def test_baseline_committed_beside_another_version_is_not_migrated(released, workspace, api_compat):
    workspace.baseline("mcore-x", "0.1.0").rename(workspace.baseline("mcore-x", "0.1.5"))
    commit = _commit(workspace.root, "a baseline named after a version the package never had")
    result = api_compat("migrate")
    assert result.code == 2
    assert f"mcore-x is at version 0.2.0 in commit {commit}, not 0.1.5" in result.err
