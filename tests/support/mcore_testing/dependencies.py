"""What a distribution declares it needs, and what its source imports, to compare the two."""

import ast
import sys
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement


def declared_distributions(distribution: str) -> tuple[set[str], set[str]]:
    """The distributions ``distribution`` requires: (always, only with an extra)."""
    always, optional = set(), set()
    for text in requires(distribution) or []:
        requirement = Requirement(text)
        (optional if requirement.marker is not None else always).add(requirement.name)
    return always, optional


# Distributions not named like their import package.
_DISTRIBUTION_OF_MODULE = {"zmq": "pyzmq"}


def imported_distributions(package: object) -> set[str]:
    """Top-level non-stdlib modules imported anywhere in ``package``'s source, spelled as
    distributions (named like the import package, "-" for "_", but for ``_DISTRIBUTION_OF_MODULE``)."""
    root = Path(package.__file__).parent
    modules = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module.split(".")[0])
    modules -= set(sys.stdlib_module_names) | {package.__name__}
    return {_DISTRIBUTION_OF_MODULE.get(module, module.replace("_", "-")) for module in modules}
