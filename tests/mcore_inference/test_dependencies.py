"""mcore-inference declares exactly the distributions its code imports: nothing it does not use
(a coordinator or server stack before one exists), nothing it uses undeclared."""

import ast
import re
import sys
from importlib.metadata import requires
from pathlib import Path

import mcore_inference


def _imported_top_level_modules() -> set[str]:
    modules = set()
    for path in Path(mcore_inference.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - {"mcore_inference"}


def test_declared_dependencies_are_the_imported_ones():
    # Every distribution involved is named like its import package, "-" for "_".
    declared = {re.match(r"[\w.-]+", line)[0] for line in requires("mcore-inference") if ";" not in line}
    imported = {module.replace("_", "-") for module in _imported_top_level_modules()}
    assert declared == imported == {"torch", "mcore-api", "mcore-parallel", "mcore-models"}
