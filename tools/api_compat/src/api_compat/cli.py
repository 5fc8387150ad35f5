"""The ``api-compat`` command line: ``check``, ``snapshot``, ``boundaries`` and ``migrate``.

Exit status: 0 clean, 1 breaking changes or boundary violations (or a refused snapshot),
2 error (unknown package, missing baseline, unloadable package...). Errors take precedence.
"""

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from api_compat.baselines import Baselines
from api_compat.boundaries import BoundaryChecker
from api_compat.breaks import Break, added_objects, find_breaks
from api_compat.current import CurrentApi
from api_compat.errors import ApiCompatError
from api_compat.migrate import migrate
from api_compat.workspace import Package, Workspace, find_root, load_workspace

CLEAN, FOUND, ERROR = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_request:
        return ERROR if exit_request.code not in (0, None) else CLEAN
    try:
        root = args.root.resolve() if getattr(args, "root", None) else find_root(Path.cwd())
        workspace = load_workspace(root)
        return args.run(workspace, args)
    except ApiCompatError as error:
        print(f"api-compat: error: {error}", file=sys.stderr)
        return ERROR


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--root",
        type=Path,
        default=argparse.SUPPRESS,
        help="workspace root (default: nearest folder up from here whose pyproject.toml has [tool.uv.workspace])",
    )
    parser = argparse.ArgumentParser(
        prog="api-compat", parents=[common], description="API compatibility and package-boundary checker."
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    check = commands.add_parser(
        "check", parents=[common], help="compare each package's public API with its latest baseline"
    )
    check.add_argument("--package", action="append", default=[], metavar="DIST", help="only this package")
    check.set_defaults(run=_check)
    snapshot = commands.add_parser(
        "snapshot", parents=[common], help="record the baseline of a package's current version"
    )
    snapshot.add_argument("--package", required=True, metavar="DIST")
    snapshot.set_defaults(run=_snapshot)
    boundaries = commands.add_parser(
        "boundaries",
        parents=[common],
        help="check imports between packages against public APIs and baselines",
    )
    boundaries.add_argument(
        "--package", action="append", default=[], metavar="DIST", help="only this package"
    )
    boundaries.set_defaults(run=_boundaries)
    migration = commands.add_parser(
        "migrate",
        parents=[common],
        help="re-derive baselines of an older format from the git commits that recorded them",
    )
    migration.add_argument("--package", action="append", default=[], metavar="DIST", help="only this package")
    migration.set_defaults(run=_migrate)
    return parser


def _check(workspace: Workspace, args: argparse.Namespace) -> int:
    current, baselines = CurrentApi(workspace), Baselines(workspace.baselines_dir)

    def check_one(package: Package) -> int:
        versions = baselines.versions(package.dist)
        if not versions:
            raise ApiCompatError(f"no baseline recorded; run 'api-compat snapshot --package {package.dist}'")
        latest = versions[-1]
        if package.version < latest:
            raise ApiCompatError(f"version {package.version} is lower than the latest baseline {latest}")
        old, new = baselines.surface(package.dist, latest), current.surface(package)
        breaks = find_breaks(old, new, package.version)
        _print_breaks(package, breaks)
        if added := added_objects(old, new):
            advice = "run snapshot" if package.version > latest else "bump the version and run snapshot"
            print(
                f"{package.dist}: {len(added)} public objects not in baseline {latest}: {advice}",
                file=sys.stderr,
            )
        return FOUND if breaks else CLEAN

    return _each(workspace, args.package, check_one)


def _snapshot(workspace: Workspace, args: argparse.Namespace) -> int:
    current, baselines = CurrentApi(workspace), Baselines(workspace.baselines_dir)
    package = workspace.package(args.package)
    record = current.record(package)
    earlier = [version for version in baselines.versions(package.dist) if version <= package.version]
    if earlier:
        breaks = find_breaks(
            baselines.surface(package.dist, earlier[-1]), current.surface(package), package.version
        )
        if breaks:
            _print_breaks(package, breaks)
            print(
                f"{package.dist}: refusing to snapshot {package.version}: {len(breaks)} breaking changes against "
                f"baseline {earlier[-1]}; deprecate (mcore_api.deprecated) instead of breaking",
                file=sys.stderr,
            )
            return FOUND
    path = baselines.write(package, record)
    print(f"{package.dist}: recorded {path.relative_to(workspace.root).as_posix()}")
    return CLEAN


def _boundaries(workspace: Workspace, args: argparse.Namespace) -> int:
    checker = BoundaryChecker(workspace, CurrentApi(workspace), Baselines(workspace.baselines_dir))

    def check_one(package: Package) -> int:
        violations = checker.check(package)
        for violation in violations:
            print(
                f"{package.dist}: {violation.file}:{violation.line}: {violation.kind}: {violation.explanation}"
            )
        return FOUND if violations else CLEAN

    return _each(workspace, args.package, check_one)


def _migrate(workspace: Workspace, args: argparse.Namespace) -> int:
    baselines = Baselines(workspace.baselines_dir)

    def migrate_one(package: Package) -> int:
        for path, commit in migrate(workspace, baselines, package):
            print(
                f"{package.dist}: re-derived {path.relative_to(workspace.root).as_posix()} from commit {commit}"
            )
        return CLEAN

    return _each(workspace, args.package, migrate_one)


def _each(workspace: Workspace, names: list[str], run: Callable[[Package], int]) -> int:
    """Run ``run`` on the named packages (default all); an error in one does not stop the others."""
    packages = [workspace.package(name) for name in names] or list(workspace.packages.values())
    status = CLEAN
    for package in packages:
        try:
            status = max(status, run(package))
        except ApiCompatError as error:
            print(f"{package.dist}: error: {error}", file=sys.stderr)
            status = ERROR
    return status


def _print_breaks(package: Package, breaks: list[Break]) -> None:
    for found in breaks:
        print(f"{package.dist}: {found.path}: {found.kind}: {found.explanation}")
