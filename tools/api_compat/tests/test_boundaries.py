"""The boundary check: imports between workspace packages go through recorded public names."""

import pytest

LIB_FILES = {
    "__init__.py": '__all__ = ["public_fn", "Public"]\ndef public_fn(): ...\ndef _private_fn(): ...\nclass Public: ...',
    "sub.py": '__all__ = ["sub_fn"]\ndef sub_fn(): ...\ndef other_fn(): ...',
    "_impl.py": "def impl_fn(): ...",
}
APP_FILE = "packages/mcore-app/src/mcore_app/__init__.py"


@pytest.fixture
def lib(workspace, api_compat):
    """mcore-lib 0.1.0 (public module ``mcore_lib.sub``), baseline recorded."""
    workspace.add_package("mcore-lib", LIB_FILES, public_modules=("mcore_lib.sub",))
    assert api_compat("snapshot", "--package", "mcore-lib").code == 0
    return workspace


@pytest.fixture
def app(lib, api_compat):
    """``app(source, dependencies)``: write mcore-app and run ``boundaries`` on it."""

    def run(source: str, dependencies: tuple[str, ...] = ("mcore-lib>=0.1,<0.2",), **options):
        lib.add_package("mcore-app", {"__init__.py": source}, dependencies=dependencies, **options)
        return api_compat("boundaries", "--package", "mcore-app")

    return run


def test_clean_imports_pass(app, lib, api_compat):
    source = """
        import mcore_lib
        import mcore_lib.sub
        import mcore_lib.sub as sub_module
        from mcore_lib import Public, public_fn, sub
        from mcore_lib.sub import sub_fn
        from mcore_app import _own
        from . import _relative
        from os import path

        def use():
            mcore_lib.public_fn()
            mcore_lib.sub.sub_fn()
            mcore_lib.Public.anything_below_a_class
            sub_module.sub_fn()
            sub.sub_fn()
            Public.anything_below_a_class
            public_fn.__name__
            return mcore_lib.public_fn().attribute
    """
    result = app(source)
    assert (result.code, result.out, result.err) == (0, "", "")
    assert api_compat("boundaries").code == 0


def test_optional_dependency_counts_as_declared(app):
    result = app("from mcore_lib import public_fn", dependencies=(), optional={"lib": ["mcore-lib>=0.1"]})
    assert (result.code, result.out) == (0, "")


def test_undeclared_dependency(app):
    result = app("from mcore_lib import public_fn", dependencies=("torch>=2",))
    assert result.code == 1
    assert result.out == (
        f"mcore-app: {APP_FILE}:1: undeclared-dependency: imports mcore_lib, but mcore-lib is in neither "
        "the dependencies nor the optional-dependencies of mcore-app\n"
    )


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from mcore_lib import _private_fn", "non-public-name: mcore_lib._private_fn is not a public name"),
        (
            "from mcore_lib.sub import other_fn",
            "non-public-name: mcore_lib.sub.other_fn is not a public name",
        ),
        ("from mcore_lib._impl import impl_fn", "non-public-module: mcore_lib._impl is not a public module"),
        ("import mcore_lib._impl", "non-public-module: mcore_lib._impl is not a public module"),
        (
            "from mcore_lib.public_fn import x",
            "non-public-module: mcore_lib.public_fn is not a public module",
        ),
        (
            "import mcore_lib\nmcore_lib._private_fn()",
            "non-public-name: mcore_lib._private_fn is not a public name",
        ),
        (
            "import mcore_lib.sub as s\ns.other_fn()",
            "non-public-name: mcore_lib.sub.other_fn is not a public name",
        ),
        (
            "import mcore_lib\nmcore_lib.sub.other_fn",
            "non-public-name: mcore_lib.sub.other_fn is not a public name",
        ),
        (
            "from mcore_lib import sub\nsub.other_fn()",
            "non-public-name: mcore_lib.sub.other_fn is not a public name",
        ),
        (
            "from mcore_lib import sub as s\ns._private()",
            "non-public-name: mcore_lib.sub._private is not a public name",
        ),
    ],
)
def test_non_public_name(app, source, expected):
    result = app(source)
    assert result.code == 1
    line = source.count("\n") + 1
    assert result.out == f"mcore-app: {APP_FILE}:{line}: {expected} of mcore-lib\n"


def test_star_import(app):
    result = app("from mcore_lib import *")
    assert result.code == 1
    assert "star-import: 'from mcore_lib import *'" in result.out


def test_name_absent_from_the_lowest_allowed_baseline(app, lib, api_compat):
    lib.write(
        "mcore-lib",
        "__init__.py",
        LIB_FILES["__init__.py"].replace('"Public"]', '"Public", "new_fn"]') + "\ndef new_fn(): ...",
    )
    lib.write_pyproject("mcore-lib", "0.2.0", public_modules=("mcore_lib.sub",))
    assert api_compat("snapshot", "--package", "mcore-lib").code == 0

    result = app("from mcore_lib import new_fn", dependencies=("mcore-lib>=0.1,<0.3",))
    assert result.code == 1
    assert result.out == (
        f"mcore-app: {APP_FILE}:1: missing-from-baseline: mcore_lib.new_fn is public in the working tree but not "
        "in the baseline 0.1.0 of mcore-lib, the lowest version 'mcore-lib<0.3,>=0.1' allows: bump mcore-lib, "
        "snapshot it, raise the lower bound\n"
    )
    assert app("from mcore_lib import new_fn", dependencies=("mcore-lib>=0.2,<0.3",)).code == 0


def test_name_public_in_the_working_tree_only(app, lib):
    lib.write(
        "mcore-lib",
        "__init__.py",
        LIB_FILES["__init__.py"].replace('"Public"]', '"Public", "new_fn"]') + "\ndef new_fn(): ...",
    )
    result = app("from mcore_lib import new_fn")
    assert result.code == 1
    assert "missing-from-baseline: mcore_lib.new_fn is public in the working tree" in result.out


@pytest.mark.parametrize(
    "source",
    [
        "from mcore_lib import sub\nsub.new_fn()",
        "from mcore_lib import sub as s\ns.new_fn()",
        "from mcore_lib.sub import inner\ninner.new_fn()",
    ],
)
def test_attribute_of_a_from_imported_module_absent_from_the_baseline(app, lib, api_compat, source):
    lib.source_path("mcore-lib", "sub.py").unlink()
    lib.write("mcore-lib", "sub/__init__.py", LIB_FILES["sub.py"])
    lib.write("mcore-lib", "sub/inner.py", '__all__ = ["inner_fn"]\ndef inner_fn(): ...')
    lib.write_pyproject("mcore-lib", "0.1.0", public_modules=("mcore_lib.sub", "mcore_lib.sub.inner"))
    assert api_compat("snapshot", "--package", "mcore-lib").code == 0
    lib.write(
        "mcore-lib", "sub/__init__.py", '__all__ = ["sub_fn", "new_fn"]\ndef sub_fn(): ...\ndef new_fn(): ...'
    )
    lib.write(
        "mcore-lib",
        "sub/inner.py",
        '__all__ = ["inner_fn", "new_fn"]\ndef inner_fn(): ...\ndef new_fn(): ...',
    )

    result = app(source)
    assert result.code == 1
    module = "mcore_lib.sub.inner" if "inner" in source else "mcore_lib.sub"
    assert result.out.startswith(
        f"mcore-app: {APP_FILE}:2: missing-from-baseline: {module}.new_fn is public in the working tree but not "
        "in the baseline 0.1.0 of mcore-lib"
    )


def test_specifier_matching_no_recorded_baseline(app):
    result = app("from mcore_lib import public_fn", dependencies=("mcore-lib>=0.5",))
    assert result.code == 1
    assert result.out == (
        f"mcore-app: {APP_FILE}:1: no-matching-baseline: no recorded baseline of mcore-lib satisfies "
        "'mcore-lib>=0.5' (recorded: 0.1.0)\n"
    )


def test_violations_in_submodules_and_functions_are_located(app, lib, api_compat):
    app("")
    lib.write("mcore-app", "deep/mod.py", "def f():\n    from mcore_lib import _private_fn\n")
    result = api_compat("boundaries", "--package", "mcore-app")
    assert result.out.startswith("mcore-app: packages/mcore-app/src/mcore_app/deep/mod.py:2: non-public-name")


def test_unparsable_file_exits_2(app, lib, api_compat):
    app("")
    lib.write("mcore-app", "broken.py", "def f(:\n")
    result = api_compat("boundaries", "--package", "mcore-app")
    assert result.code == 2
    assert "cannot parse" in result.err
