"""Check what importing a package does, in a fresh interpreter."""

import json
import subprocess
import sys
import textwrap
from importlib.metadata import version

# Optional accelerators that no mcore package may import at import time.
OPTIONAL_ACCELERATORS = ("transformer_engine", "flash_attn", "triton")


def import_in_fresh_interpreter(module: str) -> dict:
    """Import ``module`` in a new Python process and report what the import did.

    Returns a dict with ``all`` (the module's ``__all__``), ``version`` (its ``__version__``),
    ``file`` (where it was imported from), ``cuda_initialized`` (whether the import initialized
    CUDA; ``None`` when it did not even load torch) and ``accelerators`` (optional accelerator
    modules the import loaded).
    """
    script = textwrap.dedent(
        f"""
        import json, sys
        import {module} as imported
        torch = sys.modules.get("torch")  # an import that did not load torch cannot touch CUDA
        cuda_initialized = torch.cuda.is_initialized() if torch is not None else None
        print(json.dumps({{
            "all": list(imported.__all__),
            "version": imported.__version__,
            "file": imported.__file__,
            "cuda_initialized": cuda_initialized,
            "accelerators": sorted(
                name for name in sys.modules if name.split(".")[0] in {OPTIONAL_ACCELERATORS!r}
            ),
        }}))
        """
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120
    )
    if completed.returncode != 0:
        raise AssertionError(f"importing {module} failed:\n{completed.stderr}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def assert_imports_cleanly(module: str, distribution: str) -> None:
    """Importing ``module`` initializes no CUDA, loads no optional accelerator, and exposes
    ``__all__`` and a ``__version__`` equal to the installed ``distribution``'s version."""
    report = import_in_fresh_interpreter(module)
    assert report["cuda_initialized"] in (False, None), f"importing {module} initialized CUDA"
    assert report["accelerators"] == [], f"importing {module} loaded {report['accelerators']}"
    assert report["version"] == version(distribution)
    assert "__version__" in report["all"]
