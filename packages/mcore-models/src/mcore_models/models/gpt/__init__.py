"""GPT-style decoder-only language models."""

from mcore_models.models.gpt.embedding import LanguageModelEmbedding
from mcore_models.models.gpt.model import GPTModel

__all__ = ["GPTModel", "LanguageModelEmbedding"]
