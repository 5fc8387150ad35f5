"""Acceptance tests on a copy of the real workspace (its packages and root pyproject.toml)."""

import re
import shutil
from pathlib import Path

import pytest
from api_compat.cli import main

REPO_ROOT = Path(__file__).resolve().parents[3]
FSDP_INIT = Path("packages/mcore-fsdp/src/mcore_fsdp/__init__.py")
FSDP_PYPROJECT = Path("packages/mcore-fsdp/pyproject.toml")


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of the real workspace, without baselines."""
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(
        REPO_ROOT / "packages", tmp_path / "packages", ignore=shutil.ignore_patterns("__pycache__")
    )
    return tmp_path


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_fsdp_signature_may_change_once_a_release_marks_it_experimental(copy, capsys):
    init, pyproject = copy / FSDP_INIT, copy / FSDP_PYPROJECT
    original = init.read_text()
    shard_model = (
        "\n\ndef shard_model(module, mesh, reshard_after_forward=True): ...\n\n__all__ += ['shard_model']\n"
    )
    marked = (
        "from mcore_api import experimental_api\n"
        + original
        + shard_model.replace("def", "@experimental_api\ndef")
    )
    changed = marked.replace("module, mesh,", "module,")
    _append(init, shard_model)
    assert main(["snapshot", "--root", str(copy), "--package", "mcore-fsdp"]) == 0

    init.write_text(changed)
    capsys.readouterr()
    assert main(["check", "--root", str(copy), "--package", "mcore-fsdp"]) == 1
    out = capsys.readouterr().out
    assert "mcore_fsdp.shard_model: parameter-removed: parameter 'mesh' was removed" in out
    assert "experimental_api in the working tree only" in out

    init.write_text(marked)
    pyproject.write_text(re.sub(r'(?m)^version = ".*"$', 'version = "99.0.0"', pyproject.read_text()))
    assert main(["snapshot", "--root", str(copy), "--package", "mcore-fsdp"]) == 0
    init.write_text(changed)
    assert main(["check", "--root", str(copy), "--package", "mcore-fsdp"]) == 0


def test_rewording_the_help_of_a_config_field_is_compatible(copy, capsys):
    config = copy / "packages/mcore-parallel/src/mcore_parallel/config/optimizer.py"
    original = config.read_text()
    assert 'help="Learning rate.")' in original
    assert main(["snapshot", "--root", str(copy), "--package", "mcore-parallel"]) == 0
    config.write_text(original.replace('help="Learning rate.")', 'help="Peak learning rate.")'))
    assert main(["check", "--root", str(copy), "--package", "mcore-parallel"]) == 0
    config.write_text(
        original.replace(
            'config_field(1e-4, minimum=0.0, help="Learning rate.")',
            'config_field(1e-3, minimum=0.0, help="Learning rate.")',
        )
    )
    capsys.readouterr()
    assert main(["check", "--root", str(copy), "--package", "mcore-parallel"]) == 1
    assert "default of 'lr' changed from 0.0001 to 0.001" in capsys.readouterr().out


def test_fsdp_importing_undeclared_and_non_public_names_violates_boundaries(copy, capsys):
    assert main(["snapshot", "--root", str(copy), "--package", "mcore-api"]) == 0
    init = copy / FSDP_INIT
    first = init.read_text().count("\n") + 1
    _append(init, "from mcore_parallel import __version__\nfrom mcore_api._stability import mark\n")
    capsys.readouterr()
    assert main(["boundaries", "--root", str(copy), "--package", "mcore-fsdp"]) == 1
    prefix = f"mcore-fsdp: {FSDP_INIT.as_posix()}:"
    injected = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith((f"{prefix}{first}:", f"{prefix}{first + 1}:"))
    ]
    assert sorted(injected) == [
        f"{prefix}{first}: undeclared-dependency: imports mcore_parallel, but mcore-parallel is in neither "
        "the dependencies nor the optional-dependencies of mcore-fsdp",
        f"{prefix}{first + 1}: non-public-module: mcore_api._stability is not a public module of mcore-api",
        f"{prefix}{first + 1}: undeclared-dependency: imports mcore_api, but mcore-api is in neither "
        "the dependencies nor the optional-dependencies of mcore-fsdp",
    ]
