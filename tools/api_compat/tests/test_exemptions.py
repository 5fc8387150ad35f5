"""Stability markers recorded in the baseline permit breaks (``deprecated`` only from its
removal_version on); private names and tests are outside the API."""

import json

import pytest

#: Markers that permit any break of the object once a baseline records them, with the name
#: the checker gives them. The package is at 0.1.0, so the deprecation is due.
PERMITTING = {
    "internal_api": ("from mcore_api import internal_api", "@internal_api", "internal_api"),
    "experimental_api": ("from mcore_api import experimental_api", "@experimental_api", "experimental_api"),
    "mcore_api.experimental_api": ("import mcore_api", "@mcore_api.experimental_api", "experimental_api"),
    "private-module import": (
        "from mcore_api._stability import internal_api",
        "@internal_api",
        "internal_api",
    ),
    "deprecated, removal due": (
        "from mcore_api import deprecated",
        '@deprecated("0.0.1", "0.1.0", "mcore_x.g")',
        "deprecated",
    ),
}


def _source(marker: tuple[str, str, str] | None, body: str) -> str:
    imports, decorator, _ = marker or ("", "", "")
    return f'{imports}\n__all__ = ["f", "C"]\n{decorator}\n{body}\nclass C:\n    {decorator}\n    def m(self, a): ...'


def _broken(source: str) -> str:
    return source.replace("def f(a, b)", "def f(a)").replace("m(self, a)", "m(self)")


@pytest.fixture
def run_at(workspace, api_compat):
    """``run_at(command, source, version)``: mcore-x at ``version`` with ``__init__.py`` = source."""

    def run(command: str, source: str, version: str):
        workspace.add_package("mcore-x", {"__init__.py": source}, version=version)
        return api_compat(command, "--package", "mcore-x")

    return run


@pytest.mark.parametrize("keep_marker", [True, False], ids=["marker kept", "marker dropped"])
@pytest.mark.parametrize("marker", PERMITTING.values(), ids=PERMITTING.keys())
def test_marker_in_the_baseline_permits_breaks(compare, marker, keep_marker):
    old = _source(marker, "def f(a, b): ...")
    new = _broken(old if keep_marker else _source(None, "def f(a, b): ..."))
    result = compare(old, new)
    assert (result.code, result.out) == (0, "")


@pytest.mark.parametrize("marker", PERMITTING.values(), ids=PERMITTING.keys())
def test_marker_in_the_working_tree_only_permits_nothing(compare, marker):
    result = compare(_source(None, "def f(a, b): ..."), _broken(_source(marker, "def f(a, b): ...")))
    note = f"({marker[2]} in the working tree only: it permits breaks once a baseline records it)"
    assert result.code == 1
    assert result.out.splitlines() == [
        f"mcore-x: mcore_x.C.m: parameter-removed: parameter 'a' was removed {note}",
        f"mcore-x: mcore_x.f: parameter-removed: parameter 'b' was removed {note}",
    ]


def test_marking_is_compatible_and_permits_breaks_after_its_release(run_at, workspace):
    public = '__all__ = ["f"]\ndef f(a): ...'
    marked = public.replace("def", "from mcore_api import internal_api\n@internal_api\ndef")
    assert run_at("snapshot", public, "0.1.0").code == 0
    assert run_at("check", marked, "0.1.0").code == 0
    assert run_at("snapshot", marked, "0.2.0").code == 0
    document = json.loads(workspace.baseline("mcore-x", "0.2.0").read_text())
    assert document["markers"] == {"f": [{"name": "internal_api"}]}
    assert run_at("check", marked.replace("f(a)", "f()"), "0.3.0").out == ""
    assert run_at("snapshot", marked.replace("f(a)", "f()"), "0.3.0").code == 0
    assert run_at("check", marked.replace("f(a)", "f(b, /)"), "0.3.0").out == ""


DEPRECATED = (
    'from mcore_api import deprecated\n__all__ = ["f", "g"]\n{decorator}\ndef f(a): ...\ndef g(): ...'
)
REMOVED = '__all__ = ["g"]\ndef g(): ...'


@pytest.mark.parametrize(
    "version, expected",
    [
        ("0.2.1", "(deprecated in 0.2.0 for removal in 0.4.0; this is 0.2.1)"),
        ("0.3.0", "(deprecated in 0.2.0 for removal in 0.4.0; this is 0.3.0)"),
        ("0.4.0", None),
        ("1.0.0", None),
    ],
)
def test_deprecated_object_is_removable_from_its_removal_version_on(run_at, version, expected):
    assert run_at("snapshot", DEPRECATED.format(decorator='@deprecated("0.2.0", "0.4.0")'), "0.2.0").code == 0
    result = run_at("check", REMOVED, version)
    removed = f"mcore-x: mcore_x.f: object-removed: function 'f' was removed {expected}\n"
    assert (result.code, result.out) == ((1, removed) if expected else (0, ""))


def test_deprecated_object_without_removal_version_is_not_removable(run_at):
    assert run_at("snapshot", DEPRECATED.format(decorator='@deprecated("0.2.0")'), "0.2.0").code == 0
    result = run_at("check", REMOVED, "9.0.0")
    assert result.out == (
        "mcore-x: mcore_x.f: object-removed: function 'f' was removed "
        "(deprecated in 0.2.0 without a removal_version, so not removable)\n"
    )


def test_baseline_records_each_marker_with_its_arguments(run_at, workspace):
    source = """
        import mcore_api
        from mcore_api import deprecated, internal_api
        __all__ = ["f", "C"]
        @deprecated("0.2.0", removal_version="0.4.0", alternative="mcore_x.g")
        def f(): ...
        @internal_api
        class C:
            @mcore_api.experimental_api
            @deprecated(version="0.1.0")
            def m(self): ...
    """
    assert run_at("snapshot", source, "0.2.0").code == 0
    assert json.loads(workspace.baseline("mcore-x", "0.2.0").read_text())["markers"] == {
        "f": [{"name": "deprecated", "version": "0.2.0", "removal_version": "0.4.0"}],
        "C": [{"name": "internal_api"}],
        "C.m": [{"name": "experimental_api"}, {"name": "deprecated", "version": "0.1.0"}],
    }


@pytest.mark.parametrize("arguments", ["VERSION", '"0.2.0", REMOVAL', '"0.2.0", "soon"', "*VERSIONS"])
def test_unreadable_deprecation_arguments_exit_2(run_at, arguments):
    source = f'from mcore_api import deprecated\n__all__ = ["f"]\n@deprecated({arguments})\ndef f(): ...'
    result = run_at("snapshot", source, "0.2.0")
    assert result.code == 2
    assert "mcore_x.f: " in result.err
    assert "deprecated(" in result.err


def test_unmarked_sibling_of_a_marked_object_is_still_checked(compare):
    old = 'from mcore_api import experimental_api\n__all__ = ["f", "g"]\n@experimental_api\ndef f(a): ...\ndef g(a): ...'
    result = compare(old, old.replace("(a)", "()"))
    assert result.out == "mcore-x: mcore_x.g: parameter-removed: parameter 'a' was removed\n"


def test_a_decorator_of_another_package_does_not_exempt(compare):
    old = 'from other import experimental_api\n__all__ = ["f"]\n@experimental_api\ndef f(a): ...'
    result = compare(old, old.replace("f(a)", "f()"))
    assert result.code == 1


def test_members_of_a_marked_class_are_exempt(compare):
    old = """
        from mcore_api import experimental_api
        __all__ = ["C"]
        @experimental_api
        class C:
            def m(self, a): ...
            class Inner:
                def n(self, b): ...
    """
    new = """
        from mcore_api import experimental_api
        __all__ = ["C"]
        @experimental_api
        class C:
            def m(self): ...
    """
    result = compare(old, new)
    assert (result.code, result.out) == (0, "")


def test_private_names_are_exempt(compare):
    old = """
        __all__ = ["C", "_hidden"]
        def _helper(a): ...
        def _hidden(a): ...
        class C:
            def _step(self, a): ...
            def __mangled(self, a): ...
    """
    new = """
        __all__ = ["C"]
        class C:
            def _step(self): ...
    """
    result = compare(old, new)
    assert (result.code, result.out) == (0, "")


def test_special_methods_are_public(compare):
    old = '__all__ = ["C"]\nclass C:\n    def __init__(self, a): ...'
    result = compare(old, old.replace("self, a", "self"))
    assert result.out == "mcore-x: mcore_x.C.__init__: parameter-removed: parameter 'a' was removed\n"


def test_tests_folder_is_not_part_of_the_api(workspace, api_compat):
    workspace.add_package("mcore-x", {"__init__.py": '__all__ = ["f"]\ndef f(): ...'})
    tests = workspace.root / "packages" / "mcore-x" / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text("__all__ = ['test_f']\ndef test_f(tmp_path): ...\n")
    assert api_compat("snapshot", "--package", "mcore-x").code == 0
    (tests / "test_x.py").write_text("def test_g(): ...\n")
    assert api_compat("check", "--package", "mcore-x").code == 0
    assert "test_" not in workspace.baseline("mcore-x", "0.1.0").read_text()
