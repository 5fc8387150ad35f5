"""Objects marked with mcore_api's stability markers, private names and tests are exempt."""

import pytest

MARKERS = {
    "internal_api": ("from mcore_api import internal_api", "@internal_api"),
    "experimental_api": ("from mcore_api import experimental_api", "@experimental_api"),
    "deprecated": ("from mcore_api import deprecated", '@deprecated("0.2.0", "0.4.0", "mcore_x.g")'),
    "mcore_api.experimental_api": ("import mcore_api", "@mcore_api.experimental_api"),
    "private-module import": ("from mcore_api._stability import internal_api", "@internal_api"),
}


def _source(marker: tuple[str, str] | None, body: str) -> str:
    imports, decorator = marker or ("", "")
    return f'{imports}\n__all__ = ["f", "C"]\n{decorator}\n{body}\nclass C:\n    {decorator}\n    def m(self, a): ...'


@pytest.mark.parametrize("marker", MARKERS.values(), ids=MARKERS.keys())
def test_marked_in_current_tree_only(compare, marker):
    result = compare(
        _source(None, "def f(a, b): ..."), _source(marker, "def f(a): ...").replace("m(self, a)", "m(self)")
    )
    assert (result.code, result.out) == (0, "")


@pytest.mark.parametrize("marker", MARKERS.values(), ids=MARKERS.keys())
def test_marked_in_baseline_only(compare, marker):
    result = compare(
        _source(marker, "def f(a, b): ..."), _source(None, "def f(a): ...").replace("m(self, a)", "m(self)")
    )
    assert (result.code, result.out) == (0, "")


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
