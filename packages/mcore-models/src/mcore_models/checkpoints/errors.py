"""The errors of reading a checkpoint directory that does not describe itself as expected."""

from __future__ import annotations


class CheckpointFormatError(ValueError):
    """A directory that is not a loadable checkpoint (neither mcore-train's nor Hugging Face's)."""


class CheckpointConfigMissingError(CheckpointFormatError):
    """An mcore-train checkpoint saved without its model config (by an older mcore-models)."""


class TokenizerMissingError(CheckpointFormatError):
    """A checkpoint directory without its ``tokenizer.json``."""


class CheckpointSchemaError(CheckpointFormatError):
    """A checkpoint file of a schema version this mcore-models does not read."""
