"""The data pipeline: the stdlib corpus, tokenizers, indexed binary datasets, GPT/FIM/blended
datasets, and the default pipeline that builds them all once and caches them."""

from mcore_models.data.cache import default_cache_dir
from mcore_models.data.corpus import Document, stdlib_documents
from mcore_models.data.tokenizer import Tokenizer, default_tokenizer, train_bpe_tokenizer

__all__ = [
    "Document",
    "Tokenizer",
    "default_cache_dir",
    "default_tokenizer",
    "stdlib_documents",
    "train_bpe_tokenizer",
]
