"""Check what importing a package does, in a fresh interpreter."""

import functools
import importlib.util
import json
import subprocess
import sys
import textwrap
from importlib.metadata import version

# Optional accelerators that no mcore package may import at import time.
OPTIONAL_ACCELERATORS = ("transformer_engine", "flash_attn", "triton")

# The mcore packages, each after those it may import: one fresh interpreter imports them in this
# order and reports after each import (a fresh interpreter costs seconds: torch's import).
MCORE_PACKAGES = (
    "mcore_api",
    "mcore_parallel",
    "mcore_kernels",
    "mcore_fsdp",
    "mcore_models",
    "mcore_inference",
    "mcore_rl",
)


def import_in_fresh_interpreter(module: str) -> dict:
    """Import ``module`` in a new Python process and report what the import did.

    Returns a dict with ``all`` (the module's ``__all__``), ``version`` (its ``__version__``),
    ``file`` (where it was imported from), ``cuda_initialized`` (whether the import initialized
    CUDA; ``None`` when it did not even load torch) and ``accelerators`` (optional accelerator
    modules the import loaded).

    The installed ``MCORE_PACKAGES`` share one interpreter (started on the first call): each is
    reported right after its import, and what it reports includes what the packages imported
    before it did (each of those is itself checked), so nothing one import does goes unseen.
    """
    if module in MCORE_PACKAGES:
        installed = tuple(name for name in MCORE_PACKAGES if importlib.util.find_spec(name) is not None)
        report = _import_in_order(installed)[module]
    else:
        report = _import_in_order((module,))[module]
    if "error" in report:
        raise AssertionError(f"importing {module} failed:\n{report['error']}")
    return report


@functools.cache
def _import_in_order(modules: tuple[str, ...]) -> dict[str, dict]:
    """Import ``modules`` one after another in a new Python process; each one's report (or the
    ``error`` of its import) after its import."""
    script = textwrap.dedent(
        f"""
        import importlib, json, sys, traceback
        reports = {{}}
        for module in {list(modules)!r}:
            try:
                imported = importlib.import_module(module)
            except BaseException:
                reports[module] = {{"error": traceback.format_exc()}}
                continue
            torch = sys.modules.get("torch")  # an import that did not load torch cannot touch CUDA
            cuda_initialized = torch.cuda.is_initialized() if torch is not None else None
            reports[module] = {{
                "all": list(imported.__all__),
                "version": imported.__version__,
                "file": imported.__file__,
                "cuda_initialized": cuda_initialized,
                "accelerators": sorted(
                    name for name in sys.modules if name.split(".")[0] in {OPTIONAL_ACCELERATORS!r}
                ),
            }}
        print(json.dumps(reports))
        """
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=180
    )
    if completed.returncode != 0:
        raise AssertionError(f"importing {', '.join(modules)} failed:\n{completed.stderr}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def assert_imports_cleanly(module: str, distribution: str) -> None:
    """Importing ``module`` initializes no CUDA, loads no optional accelerator, and exposes
    ``__all__`` and a ``__version__`` equal to the installed ``distribution``'s version."""
    report = import_in_fresh_interpreter(module)
    assert report["cuda_initialized"] in (False, None), f"importing {module} initialized CUDA"
    assert report["accelerators"] == [], f"importing {module} loaded {report['accelerators']}"
    assert report["version"] == version(distribution)
    assert "__version__" in report["all"]
