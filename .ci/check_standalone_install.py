"""Check that a package installed alone into an environment brought only what it declares.

Run with the environment's interpreter, after installing the package:
    python check_standalone_install.py DIST FREEZE_BEFORE
FREEZE_BEFORE is ``uv pip freeze`` output taken just before the package was installed. Every
distribution that appeared since must be the package itself or in the closure of its declared
(non-extra) dependencies, and the package must import from the environment, not from a source
tree.
"""

import importlib
import sys
from importlib.metadata import PackageNotFoundError, distribution, distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def requirements_of(name: str, extras: frozenset[str] = frozenset()) -> list[Requirement]:
    """``name``'s requirements that apply here, with ``extras`` requested."""
    applicable = []
    for text in distribution(name).requires or []:
        requirement = Requirement(text)
        if requirement.marker is None or any(
            requirement.marker.evaluate({"extra": extra}) for extra in ("", *extras)
        ):
            applicable.append(requirement)
    return applicable


def dependency_closure(name: str) -> set[str]:
    """Canonical names of ``name`` and everything its requirements pull in, extras followed."""
    closure, seen, pending = set(), set(), [(name, frozenset())]
    while pending:
        current, extras = pending.pop()
        key = (canonicalize_name(current), extras)
        if key in seen:
            continue
        seen.add(key)
        closure.add(key[0])
        try:
            requirements = requirements_of(current, extras)
        except PackageNotFoundError:
            raise SystemExit(f"{name}: required {current} is not installed") from None
        pending.extend((req.name, frozenset(req.extras)) for req in requirements)
    return closure


def main() -> None:
    package, freeze_before = sys.argv[1], Path(sys.argv[2])
    before = {
        canonicalize_name(line.split("==")[0].split(" @ ")[0])
        for line in freeze_before.read_text().splitlines()
        if line and not line.startswith("#")
    }
    installed = {canonicalize_name(dist.metadata["Name"]) for dist in distributions()}
    closure = dependency_closure(package)
    brought = installed - before
    unexpected = brought - closure
    if unexpected:
        raise SystemExit(f"{package}: installing it also brought undeclared {sorted(unexpected)}")
    module = importlib.import_module(package.replace("-", "_"))
    if Path(sys.prefix).resolve() not in Path(module.__file__).resolve().parents:
        raise SystemExit(f"{package} imports from {module.__file__}, outside the environment {sys.prefix}")
    direct = sorted(canonicalize_name(req.name) for req in requirements_of(package))
    print(
        f"{package} installed alone: declares {direct or 'nothing'}; "
        f"{len(brought)} distributions installed with it, all within its dependency closure"
    )


if __name__ == "__main__":
    main()
