"""Run a kernel test module's comparison under Triton's interpreter, in a fresh process.

The interpreter runs take minutes together, almost all of it on one core. ``defer_interpreted``
moves the tests that call ``interpreted_mismatches`` to the end of the session and starts their
runs at once, one after another, in a background process at the lowest CPU priority: they use the
core the other tests leave idle, and a test finds its result waiting (or waits for it).
"""

import atexit
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

INTERPRETED_SUFFIX = "under_the_interpreter"
"""Tests whose name ends so call ``interpreted_mismatches`` (the suite's naming rule)."""

_SUPPORT = Path(__file__).parent.parent  # where mcore_testing lives, for the modules' imports
_prefetch: dict = {}  # the runner's "pid", its "results" folder, "files" (path: result index)


def interpreted_mismatches(test_file: str) -> list:
    """``_interpreted_mismatches()`` of the test module at ``test_file``, called in a fresh Python
    with ``TRITON_INTERPRET=1`` (Triton reads it when first imported, so not in this process).
    Skips the calling test when triton is not installed (an optional accelerator)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (it is an optional accelerator)")
    path = Path(test_file).resolve()
    done = _prefetched(path) or _run(path)
    assert done["returncode"] == 0, done["stderr"][-3000:]
    return json.loads(done["stdout"].splitlines()[-1])


def defer_interpreted(items: list) -> None:
    """Move the interpreter tests among ``items`` to the end and start their runs in the background."""
    deferred = [item for item in items if item.name.split("[")[0].endswith(INTERPRETED_SUFFIX)]
    if not deferred or importlib.util.find_spec("triton") is None:
        return
    items[:] = [item for item in items if item not in deferred] + deferred
    files = list(dict.fromkeys(str(Path(item.path).resolve()) for item in deferred))
    results = tempfile.mkdtemp(prefix="mcore-triton-interpreter-")
    launcher = subprocess.Popen(
        [sys.executable, __file__, results, *files],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(_SUPPORT), os.environ.get("PYTHONPATH", "")])),
        preexec_fn=lambda: os.nice(19),
        stdout=subprocess.DEVNULL,
    )
    launcher.wait()  # it forks the runner off and exits: the runner is no child of this process
    pid = int((Path(results) / "pid").read_text())
    _prefetch.update(pid=pid, results=Path(results), files={file: i for i, file in enumerate(files)})
    atexit.register(_stop_prefetch)


def _prefetched(path: Path) -> dict | None:
    """The background run's outcome for ``path`` once written (``None``: not prefetched, or the
    background process ended without writing it)."""
    index = _prefetch.get("files", {}).get(str(path))
    if index is None:
        return None
    result = _prefetch["results"] / f"{index}.json"
    while not result.exists():
        if not _alive(_prefetch["pid"]) and not result.exists():
            return None
        time.sleep(0.2)
    return json.loads(result.read_text())


def _run(path: Path) -> dict:
    """Run ``path``'s ``_interpreted_mismatches`` now, in a fresh interpreter process."""
    script = (
        f"import json, sys; sys.path[:0] = [{str(path.parent)!r}, {str(_SUPPORT)!r}]; import {path.stem}; "
        f"print(json.dumps({path.stem}._interpreted_mismatches()))"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", MCORE_KERNELS_BACKEND="auto")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_prefetch() -> None:
    """Kill the runner and its interpreter run (its own session) and drop the results."""
    try:
        os.killpg(_prefetch["pid"], signal.SIGKILL)
    except ProcessLookupError:
        pass
    shutil.rmtree(_prefetch["results"], ignore_errors=True)


def _run_all(results: Path, files: list[str]) -> None:
    """The background process: each file's run in turn, its outcome written when complete."""
    for index, file in enumerate(files):
        partial = results / f"{index}.partial"
        partial.write_text(json.dumps(_run(Path(file))))
        partial.rename(results / f"{index}.json")


def _detach() -> None:
    """Fork the runner off: the launcher writes its pid and exits, the runner leads a new session
    (so no test that waits for its own children finds it, and one signal stops it all)."""
    runner = os.fork()
    if runner:
        (Path(sys.argv[1]) / "pid").write_text(str(runner))
        os._exit(0)
    os.setsid()


if __name__ == "__main__":
    _detach()
    _run_all(Path(sys.argv[1]), sys.argv[2:])
