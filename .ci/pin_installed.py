"""Print constraints that keep what an environment has and lock everything else.

    python pin_installed.py LOCKED INSTALLED

LOCKED is ``uv export`` output (the workspace's lock as requirements), INSTALLED is ``uv pip freeze``
output of an environment that already holds a torch other than the locked one, with whatever that
torch brought (its own CUDA libraries, Triton, sympy, ...). Prints INSTALLED's pins, then LOCKED's
lines for every other distribution, so the test dependencies and the package installed next come
at their locked versions while torch and its dependencies stay as they are.
"""

import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def requirement_lines(path: str) -> list[str]:
    return [
        line
        for line in Path(path).read_text().splitlines()
        if line.strip() and not line.startswith((" ", "#", "-"))
    ]


def main() -> None:
    locked, installed = sys.argv[1:]
    pins = requirement_lines(installed)
    kept = {canonicalize_name(Requirement(line).name) for line in pins}
    print("\n".join(pins))
    for line in requirement_lines(locked):
        if canonicalize_name(Requirement(line).name) not in kept:
            print(line)


if __name__ == "__main__":
    main()
