"""Where the data pipeline keeps what it builds once and reuses: tokenizers, datasets, indices."""

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$MCORE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/mcore``, else ``~/.cache/mcore``."""
    if explicit := os.environ.get("MCORE_CACHE_DIR"):
        return Path(explicit)
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "mcore"
    return Path.home() / ".cache" / "mcore"
