"""Model configuration dataclasses."""

from mcore_models.config.transformer_config import TransformerConfig

__all__ = ["TransformerConfig"]
