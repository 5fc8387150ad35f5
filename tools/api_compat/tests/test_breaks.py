"""Each breaking change is detected, and compatible changes pass."""

import json

import pytest

BREAKING = {
    "parameter removed": (
        "def f(a, b): ...",
        "def f(a): ...",
        "mcore_x.f: parameter-removed: parameter 'b' was removed",
    ),
    "parameter added without default": (
        "def f(a): ...",
        "def f(a, b): ...",
        "mcore_x.f: parameter-added-required: parameter 'b' was added without a default",
    ),
    "parameter order changed": (
        "def f(a, b): ...",
        "def f(b, a): ...",
        "mcore_x.f: parameter-moved: positional parameter 'a' moved from position 0 to 1\n"
        "mcore_x.f: parameter-moved: positional parameter 'b' moved from position 1 to 0",
    ),
    "parameter became keyword-only": (
        "def f(a): ...",
        "def f(*, a): ...",
        "mcore_x.f: parameter-changed-kind: parameter 'a' changed from positional or keyword to keyword-only",
    ),
    "optional parameter became required": (
        "def f(a, b=1): ...",
        "def f(a, b): ...",
        "mcore_x.f: parameter-changed-required: parameter 'b' became required (its default was 1)",
    ),
    "default changed": (
        "def f(dtype=None): ...",
        "def f(dtype='bf16'): ...",
        "mcore_x.f: parameter-changed-default: default of 'dtype' changed from None to 'bf16'",
    ),
    "method parameter removed": (
        "class f:\n    def m(self, a): ...",
        "class f:\n    def m(self): ...",
        "mcore_x.f.m: parameter-removed: parameter 'a' was removed",
    ),
    "return annotation changed": (
        "def f() -> int: ...",
        "def f() -> str: ...",
        "mcore_x.f: return-changed: return annotation changed from int to str",
    ),
    "return annotation removed": (
        "def f() -> int: ...",
        "def f(): ...",
        "mcore_x.f: return-changed: return annotation int was removed",
    ),
    "object changed kind": (
        "def f(): ...",
        "class f: ...",
        "mcore_x.f: object-changed-kind: changed from function to class",
    ),
}


@pytest.mark.parametrize("old, new, expected", BREAKING.values(), ids=BREAKING.keys())
def test_breaking_change_is_reported(compare, old, new, expected):
    result = compare(f'__all__ = ["f"]\n{old}', f'__all__ = ["f"]\n{new}')
    assert result.code == 1
    assert result.out.splitlines() == [f"mcore-x: {line}" for line in expected.splitlines()]


def test_removed_object_is_reported(compare):
    result = compare('__all__ = ["f", "g"]\ndef f(): ...\ndef g(): ...', '__all__ = ["f"]\ndef f(): ...')
    assert result.code == 1
    assert result.out == "mcore-x: mcore_x.g: object-removed: function 'g' was removed\n"


@pytest.mark.parametrize(
    "new_bases, expected",
    [
        ("(A)", "base class mcore_x.B was removed (bases now: mcore_x.A)"),
        ("(A, C)", "base class mcore_x.B was removed (bases now: mcore_x.A, mcore_x.C)"),
    ],
    ids=["base dropped", "base replaced, same count"],
)
def test_removed_base_is_reported(compare, new_bases, expected):
    classes = "class A: ...\nclass B: ...\nclass C: ...\n"
    header = '__all__ = ["A", "B", "C", "D"]\n'
    result = compare(f"{header}{classes}class D(A, B): ...", f"{header}{classes}class D{new_bases}: ...")
    assert result.code == 1
    assert result.out == f"mcore-x: mcore_x.D: class-base-removed: {expected}\n"


def test_private_base_moved_between_private_modules_is_not_a_break(workspace, api_compat):
    workspace.add_package(
        "mcore-x",
        {
            "__init__.py": 'from mcore_x._a import Base\n__all__ = ["Base", "D"]\nclass D(Base): ...',
            "_a.py": "class Base: ...",
        },
    )
    assert api_compat("snapshot", "--package", "mcore-x").code == 0
    (workspace.source_path("mcore-x", "_a.py")).unlink()
    workspace.write("mcore-x", "_b.py", "class Base: ...")
    workspace.write(
        "mcore-x", "__init__.py", 'from mcore_x._b import Base\n__all__ = ["Base", "D"]\nclass D(Base): ...'
    )
    assert api_compat("check", "--package", "mcore-x").code == 0


def test_removed_public_module_is_reported(workspace, api_compat):
    workspace.add_package(
        "mcore-x",
        {"__init__.py": '__all__ = ["f"]\ndef f(): ...', "sub.py": '__all__ = ["g"]\ndef g(): ...'},
        public_modules=("mcore_x.sub",),
    )
    assert api_compat("snapshot", "--package", "mcore-x").code == 0
    workspace.source_path("mcore-x", "sub.py").unlink()
    workspace.write_pyproject("mcore-x", "0.1.0")
    result = api_compat("check", "--package", "mcore-x")
    assert result.code == 1
    assert result.out == "mcore-x: mcore_x.sub: object-removed: module 'sub' was removed\n"


def test_change_inside_public_module_is_reported(workspace, api_compat):
    workspace.add_package(
        "mcore-x",
        {"__init__.py": "__all__ = []", "sub.py": '__all__ = ["g"]\ndef g(a): ...'},
        public_modules=("mcore_x.sub",),
    )
    assert api_compat("snapshot", "--package", "mcore-x").code == 0
    workspace.write("mcore-x", "sub.py", '__all__ = ["g"]\ndef g(): ...')
    result = api_compat("check", "--package", "mcore-x")
    assert result.out == "mcore-x: mcore_x.sub.g: parameter-removed: parameter 'a' was removed\n"


def test_reexported_object_is_checked_under_its_public_name(workspace, api_compat):
    workspace.add_package(
        "mcore-x",
        {"__init__.py": 'from mcore_x._impl import f\n__all__ = ["f"]', "_impl.py": "def f(a): ..."},
    )
    assert api_compat("snapshot", "--package", "mcore-x").code == 0
    workspace.write("mcore-x", "_impl.py", "def f(): ...")
    assert api_compat("check", "--package", "mcore-x").out == (
        "mcore-x: mcore_x.f: parameter-removed: parameter 'a' was removed\n"
    )


def test_inherited_method_is_part_of_the_class(workspace, api_compat):
    workspace.add_package(
        "mcore-x",
        {
            "__init__.py": 'from mcore_x._base import _Base\n__all__ = ["C"]\nclass C(_Base): ...',
            "_base.py": "class _Base:\n    def m(self, a): ...",
        },
    )
    assert api_compat("snapshot", "--package", "mcore-x").code == 0
    workspace.write("mcore-x", "_base.py", "class _Base:\n    def m(self): ...")
    assert api_compat("check", "--package", "mcore-x").out == (
        "mcore-x: mcore_x.C.m: parameter-removed: parameter 'a' was removed\n"
    )


COMPATIBLE = {
    "optional parameter added": ("def f(a): ...", "def f(a, b=None, *, c=2): ..."),
    "function added": ("def f(a): ...", "def f(a): ...\ndef g(): ...\n__all__.append('g')"),
    "body changed": ("def f(a):\n    return a", "def f(a):\n    '''Doc.'''\n    return a * 2"),
    "return annotation added": ("def f(a): ...", "def f(a) -> int: ..."),
    "-> None gained a value": ("def f(a) -> None: ...", "def f(a) -> int: ..."),
    "base added": ("class B: ...\nclass f(B): ...", "class B: ...\nclass A: ...\nclass f(B, A): ..."),
    "default spelled the same": ("def f(a=(1, 2)): ...", "def f(a=(1, 2)):\n    pass"),
}


@pytest.mark.parametrize("old, new", COMPATIBLE.values(), ids=COMPATIBLE.keys())
def test_compatible_change_passes(compare, old, new):
    result = compare(f'__all__ = ["f"]\n{old}', f'__all__ = ["f"]\n{new}')
    assert (result.code, result.out) == (0, "")


CONFIG = """
import dataclasses
__all__ = ["Config"]
def config_field(default=dataclasses.MISSING, *, help, default_factory=dataclasses.MISSING):
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"help": help})
@dataclasses.dataclass
class Config:
    x: int = FIELD
"""

FIELD_CHANGES = {
    "help reworded": ('config_field(3, help="Old.")', 'config_field(3, help="New words.")', None),
    "default spelled as keyword": ('config_field(3, help="a")', 'config_field(default=3, help="a")', None),
    "required field gets a default": ('config_field(help="a")', 'config_field(3, help="a")', None),
    "default changed": (
        'config_field(3, help="a")',
        'config_field(4, help="a")',
        "parameter-changed-default: default of 'x' changed from 3 to 4",
    ),
    "default factory changed": (
        'config_field(default_factory=list, help="a")',
        'config_field(default_factory=tuple, help="a")',
        "parameter-changed-default: default of 'x' changed from list() to tuple()",
    ),
    "default dropped": (
        'config_field(3, help="a")',
        'config_field(help="a")',
        "parameter-changed-required: parameter 'x' became required (its default was 3)",
    ),
}


@pytest.mark.parametrize("old, new, expected", FIELD_CHANGES.values(), ids=FIELD_CHANGES.keys())
def test_field_specifier_defaults_are_compared_by_value(compare, old, new, expected):
    result = compare(CONFIG.replace("FIELD", old), CONFIG.replace("FIELD", new))
    assert result.out == (f"mcore-x: mcore_x.Config.__init__: {expected}\n" if expected else "")


def test_field_specifier_of_a_sibling_package(workspace, api_compat):
    specifier, config = CONFIG.split("@dataclasses.dataclass")
    workspace.add_package("mcore-lib", {"__init__.py": specifier.replace('["Config"]', '["config_field"]')})
    header = (
        'import dataclasses\nfrom mcore_lib import config_field\n__all__ = ["Config"]\n@dataclasses.dataclass'
    )
    workspace.add_package(
        "mcore-x",
        {"__init__.py": header + config.replace("FIELD", 'config_field(3, help="a")')},
        dependencies=("mcore-lib>=0.1",),
    )
    assert api_compat("snapshot", "--package", "mcore-x").code == 0
    workspace.write("mcore-x", "__init__.py", header + config.replace("FIELD", 'config_field(3, help="b")'))
    assert api_compat("check", "--package", "mcore-x").code == 0
    workspace.write("mcore-x", "__init__.py", header + config.replace("FIELD", 'config_field(5, help="b")'))
    assert api_compat("check", "--package", "mcore-x").out == (
        "mcore-x: mcore_x.Config.__init__: parameter-changed-default: default of 'x' changed from 3 to 5\n"
    )


@pytest.mark.parametrize(
    "new_init, new_sub, expected",
    [
        (
            'from mcore_x import shard\n__all__ = ["shard"]',
            '__all__ = ["shard"]\ndef shard(module, mesh): ...',
            "object-changed-kind: changed from function to module",
        ),
        (
            'from mcore_x.shard import shard\n__all__ = ["shard"]',
            '__all__ = ["shard"]\ndef shard(module): ...',
            "parameter-removed: parameter 'mesh' was removed",
        ),
    ],
    ids=["export became the module", "signature changed"],
)
def test_export_shadowing_its_submodule_is_the_imported_function(
    workspace, api_compat, new_init, new_sub, expected
):
    workspace.add_package(
        "mcore-x",
        {
            "__init__.py": 'from mcore_x.shard import shard\n__all__ = ["shard"]',
            "shard.py": '__all__ = ["shard"]\ndef shard(module, mesh): ...',
        },
    )
    assert api_compat("snapshot", "--package", "mcore-x").code == 0
    workspace.write("mcore-x", "__init__.py", new_init)
    workspace.write("mcore-x", "shard.py", new_sub)
    assert api_compat("check", "--package", "mcore-x").out == f"mcore-x: mcore_x.shard: {expected}\n"


def test_what_a_class_inherits_from_a_required_sibling_is_recorded(workspace, api_compat):
    base = "import dataclasses\n@dataclasses.dataclass\nclass Base:\n    a: int = 1\n    def m(self, x): ..."
    workspace.add_package("mcore-lib", {"__init__.py": f'__all__ = ["Base"]\n{base}'})
    config = "import dataclasses\nfrom mcore_lib import Base\n@dataclasses.dataclass\nclass Config(Base):\n    b: int = 2"
    workspace.add_package(
        "mcore-x", {"__init__.py": f'__all__ = ["Config"]\n{config}'}, dependencies=("mcore-lib>=0.1",)
    )
    assert api_compat("snapshot", "--package", "mcore-x").code == 0
    recorded = json.loads(workspace.baseline("mcore-x", "0.1.0").read_text())["api"]["members"]["Config"]
    assert [parameter["name"] for parameter in recorded["members"]["__init__"]["parameters"]] == [
        "self",
        "a",
        "b",
    ]
    assert recorded["members"]["m"]["kind"] == "function"
