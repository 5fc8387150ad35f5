"""Typed errors raised on bad input, always before any collective is issued."""


class FSDPConfigError(ValueError):
    """An argument of ``fully_shard`` (or of a method of a sharded module) is invalid."""


class CheckpointMismatchError(ValueError):
    """A state dict does not match the sharded model: missing or unexpected keys, or wrong shapes."""
