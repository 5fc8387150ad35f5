"""Where the data pipeline keeps what it builds once and reuses (tokenizers, datasets, indices),
and how it writes there safely when several processes build the same thing at once."""

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


def default_cache_dir() -> Path:
    """``$MCORE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/mcore``, else ``~/.cache/mcore``."""
    if explicit := os.environ.get("MCORE_CACHE_DIR"):
        return Path(explicit)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "mcore"
    return Path.home() / ".cache" / "mcore"


@contextmanager
def atomic_output(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """A temporary file next to ``path`` that replaces ``path`` when the block succeeds and is
    deleted when it fails: readers never see a partial file, concurrent writers never clash."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(mode, dir=path.parent, prefix=f".{path.name}.", delete=False)
    try:
        with handle:
            yield handle
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
