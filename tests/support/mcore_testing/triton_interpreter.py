"""Run a kernel test module's comparison under Triton's interpreter, in a fresh process."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def interpreted_mismatches(test_file: str) -> list:
    """``_interpreted_mismatches()`` of the test module at ``test_file``, called in a fresh Python
    with ``TRITON_INTERPRET=1`` (Triton reads it when first imported, so not in this process).
    Skips the calling test when triton is not installed (an optional accelerator)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (it is an optional accelerator)")
    path = Path(test_file)
    support = Path(__file__).parent.parent  # where mcore_testing lives, for the module's imports
    script = (
        f"import json, sys; sys.path[:0] = [{str(path.parent)!r}, {str(support)!r}]; import {path.stem}; "
        f"print(json.dumps({path.stem}._interpreted_mismatches()))"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", MCORE_KERNELS_BACKEND="auto")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])
