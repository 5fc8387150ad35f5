"""Print the lowest torch a built wheel declares, read from the wheel's own metadata.

    python torch_floor.py WHEEL

prints the version its ``Requires-Dist: torch...`` allows at least (``2.6`` for ``torch>=2.6``),
or nothing when the wheel does not depend on torch. A torch requirement without a lower bound,
or with only an exclusive one (``>``), has no version to test and is an error.
"""

import sys
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement
from packaging.version import Version


def requires_dist(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = (name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    return Parser().parsestr(text, headersonly=True).get_all("Requires-Dist") or []


def lower_bound(requirement: Requirement) -> Version:
    bounds = []
    for spec in requirement.specifier:
        if spec.operator in (">=", "~=") or (spec.operator == "==" and not spec.version.endswith(".*")):
            bounds.append(Version(spec.version))
        elif spec.operator == "==":
            bounds.append(Version(spec.version.removesuffix(".*")))
    if not bounds:
        raise SystemExit(f"{requirement}: no inclusive lower bound, so no lowest torch to test")
    return max(bounds)


def main() -> None:
    (wheel,) = sys.argv[1:]
    torch = [
        requirement
        for requirement in map(Requirement, requires_dist(wheel))
        if requirement.name == "torch"
        and (requirement.marker is None or requirement.marker.evaluate({"extra": ""}))
    ]
    if torch:
        print(max(lower_bound(requirement) for requirement in torch))


if __name__ == "__main__":
    main()
