"""The cache folder and atomic writes into it."""

from pathlib import Path

import pytest
from mcore_models.data.cache import atomic_output, default_cache_dir


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("MCORE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "mcore"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "mcore"
    monkeypatch.setenv("MCORE_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == Path(tmp_path / "explicit")


def test_atomic_output_replaces_on_success_and_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "sub" / "file.txt"
    with atomic_output(target, "w") as handle:
        handle.write("new")
    assert target.read_text() == "new"
    with pytest.raises(RuntimeError), atomic_output(target, "w") as handle:
        handle.write("partial")
        raise RuntimeError("interrupted")
    assert target.read_text() == "new"
    assert [path.name for path in target.parent.iterdir()] == ["file.txt"]
