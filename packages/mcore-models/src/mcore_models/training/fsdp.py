"""``--fsdp``: fully sharded data parallelism from the optional ``mcore-fsdp`` package."""

from __future__ import annotations

from mcore_parallel import ConfigError


def check_fsdp_available() -> None:
    """Raise a clear error: ``mcore_fsdp`` is missing, or (this release) not wired in yet.

    Raises:
        ConfigError: naming ``fsdp`` and how to install it.
    """
    try:
        import mcore_fsdp  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            ["fsdp"], "--fsdp needs the mcore-fsdp package: pip install 'mcore-models[fsdp]'"
        ) from error
    raise ConfigError(
        ["fsdp"],
        "--fsdp is not wired to mcore-fsdp in this release yet; use data parallelism "
        "(--use-distributed-optimizer shards the optimizer state)",
    )
