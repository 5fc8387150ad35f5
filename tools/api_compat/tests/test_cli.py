"""Exit statuses, snapshot rules, the stderr note and the installed command."""

import json
import subprocess
import sys

import pytest

SIMPLE = '__all__ = ["f"]\ndef f(a): ...'


@pytest.fixture
def recorded(workspace, api_compat):
    """mcore-x 0.1.0 with ``f(a)``, its baseline recorded."""
    workspace.add_package("mcore-x", {"__init__.py": SIMPLE})
    assert api_compat("snapshot", "--package", "mcore-x").code == 0
    return workspace


def test_clean_check_exits_0(recorded, api_compat):
    assert api_compat("check") == api_compat("check", "--package", "mcore-x")
    assert api_compat("check").code == 0


def test_breaking_change_exits_1(recorded, api_compat):
    recorded.write("mcore-x", "__init__.py", SIMPLE.replace("f(a)", "f()"))
    assert api_compat("check").code == 1


def test_root_option_is_accepted_after_the_command(recorded, api_compat):
    from api_compat.cli import main

    assert main(["check", "--root", str(recorded.root), "--package", "mcore-x"]) == 0


def test_root_is_found_from_the_current_directory(recorded, monkeypatch):
    from api_compat.cli import main

    monkeypatch.chdir(recorded.source_path("mcore-x", "."))
    assert main(["check"]) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["check", "--package", "mcore-nope"], "unknown package 'mcore-nope'"),
        (["snapshot", "--package", "mcore-nope"], "unknown package 'mcore-nope'"),
        (["boundaries", "--package", "mcore-nope"], "unknown package 'mcore-nope'"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2(recorded, api_compat, argv, message):
    result = api_compat(*argv)
    assert result.code == 2
    assert message in result.err


def test_missing_baseline_exits_2(workspace, api_compat):
    workspace.add_package("mcore-x", {"__init__.py": SIMPLE})
    result = api_compat("check")
    assert result.code == 2
    assert "mcore-x: error: no baseline recorded; run 'api-compat snapshot --package mcore-x'" in result.err


def test_load_failure_exits_2(recorded, api_compat):
    recorded.write("mcore-x", "__init__.py", "def f(:\n")
    result = api_compat("check")
    assert result.code == 2
    assert "griffe could not load mcore_x" in result.err


def test_missing_all_exits_2(recorded, api_compat):
    recorded.write("mcore-x", "__init__.py", "def f(a): ...")
    result = api_compat("check")
    assert result.code == 2
    assert "mcore_x has no __all__" in result.err


def test_version_lower_than_latest_baseline_exits_2(recorded, api_compat):
    recorded.write_pyproject("mcore-x", "0.0.9")
    result = api_compat("check")
    assert result.code == 2
    assert "version 0.0.9 is lower than the latest baseline 0.1.0" in result.err


def test_error_takes_precedence_over_breaks(recorded, api_compat):
    recorded.write("mcore-x", "__init__.py", SIMPLE.replace("f(a)", "f()"))
    recorded.add_package("mcore-y", {"__init__.py": SIMPLE})
    result = api_compat("check")
    assert result.code == 2
    assert "mcore_x.f: parameter-removed" in result.out
    assert "mcore-y: error: no baseline recorded" in result.err


def test_new_public_objects_are_noted_on_stderr(recorded, api_compat):
    recorded.write(
        "mcore-x", "__init__.py", '__all__ = ["f", "g", "C"]\ndef f(a): ...\ndef g(): ...\nclass C: ...'
    )
    result = api_compat("check")
    assert (result.code, result.out) == (0, "")
    assert (
        result.err == "mcore-x: 2 public objects not in baseline 0.1.0: bump the version and run snapshot\n"
    )


def test_snapshot_refuses_a_breaking_resnapshot(recorded, api_compat):
    before = recorded.baseline("mcore-x", "0.1.0").read_text()
    recorded.write("mcore-x", "__init__.py", SIMPLE.replace("f(a)", "f()"))
    recorded.write_pyproject("mcore-x", "0.2.0")
    result = api_compat("snapshot", "--package", "mcore-x")
    assert result.code == 1
    assert result.out == "mcore-x: mcore_x.f: parameter-removed: parameter 'a' was removed\n"
    assert "refusing to snapshot 0.2.0" in result.err
    assert not recorded.baseline("mcore-x", "0.2.0").exists()
    assert recorded.baseline("mcore-x", "0.1.0").read_text() == before


def test_snapshot_refuses_a_break_marked_in_the_working_tree_only(recorded, api_compat):
    recorded.write(
        "mcore-x",
        "__init__.py",
        'from mcore_api import internal_api\n__all__ = ["f"]\n@internal_api\ndef f(): ...',
    )
    recorded.write_pyproject("mcore-x", "0.2.0")
    result = api_compat("snapshot", "--package", "mcore-x")
    assert result.code == 1
    assert result.out == (
        "mcore-x: mcore_x.f: parameter-removed: parameter 'a' was removed "
        "(internal_api in the working tree only: it permits breaks once a baseline records it)\n"
    )
    assert not recorded.baseline("mcore-x", "0.2.0").exists()


def test_snapshot_of_a_compatible_new_version(recorded, api_compat):
    recorded.write("mcore-x", "__init__.py", '__all__ = ["f", "g"]\ndef f(a, b=0): ...\ndef g(): ...')
    recorded.write_pyproject("mcore-x", "0.2.0")
    result = api_compat("snapshot", "--package", "mcore-x")
    assert (result.code, result.out) == (
        0,
        "mcore-x: recorded tools/api_compat/baselines/mcore-x/0.2.0.json\n",
    )
    assert api_compat("check").code == 0


def test_baseline_file_is_portable_and_reviewable(workspace, api_compat, tmp_path):
    workspace.add_package(
        "mcore-x",
        {
            "__init__.py": '"""Doc."""\nfrom mcore_x._impl import C\nfrom collections import OrderedDict\n'
            '__all__ = ["C", "OrderedDict"]',
            "_impl.py": 'class C:\n    """Doc of C."""\n    def m(self, a: int = 1) -> int:\n        """Doc of m."""',
        },
    )
    assert api_compat("snapshot", "--package", "mcore-x").code == 0
    text = workspace.baseline("mcore-x", "0.1.0").read_text()
    assert str(tmp_path) not in text
    assert "Doc" not in text
    document = json.loads(text)
    assert text == json.dumps(document, indent=2, sort_keys=True) + "\n"
    assert (document["format"], document["package"], document["version"]) == (2, "mcore-x", "0.1.0")
    assert document["markers"] == {}
    assert document["bases"] == {"C": []}
    # Static analysis only: a module already imported in this process is not inspected.
    assert document["api"]["members"]["OrderedDict"]["target_path"] == "collections.OrderedDict"


def test_installed_command_runs(recorded):
    recorded.write("mcore-x", "__init__.py", SIMPLE.replace("f(a)", "f()"))
    completed = subprocess.run(
        [sys.executable, "-m", "api_compat", "--root", str(recorded.root), "check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 1
    assert completed.stdout == "mcore-x: mcore_x.f: parameter-removed: parameter 'a' was removed\n"
