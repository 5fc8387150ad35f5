"""The data pipeline: the stdlib corpus, tokenizers, indexed binary datasets, GPT/FIM/blended
datasets, ``mcore-preprocess``, and the default pipeline that builds them once and caches them.

Importing this module loads numpy, tokenizers and torch; ``import mcore_models`` does not import it.
"""

from mcore_models.data.blended_dataset import BlendedDataset, blend_order, blended_dataset_sizes
from mcore_models.data.cache import default_cache_dir
from mcore_models.data.corpus import Document, corpus_fingerprint, stdlib_documents
from mcore_models.data.default_pipeline import DefaultPipeline, build_default_pipeline
from mcore_models.data.fim_dataset import FIMConfig, GPTFIMDataset
from mcore_models.data.gpt_dataset import AmbiguousPadTokenWarning, GPTDataset, GPTDatasetConfig
from mcore_models.data.gpt_indices import GPTIndices, build_gpt_indices
from mcore_models.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetFormatError,
    IndexedDatasetWriter,
    merge_indexed_datasets,
    token_dtype,
)
from mcore_models.data.preprocess import read_documents, write_indexed_dataset
from mcore_models.data.tokenizer import (
    EOD_TOKEN,
    FIM_MIDDLE_TOKEN,
    FIM_PAD_TOKEN,
    FIM_PREFIX_TOKEN,
    FIM_SUFFIX_TOKEN,
    PAD_TOKEN,
    Tokenizer,
    default_tokenizer,
    train_bpe_tokenizer,
)
from mcore_models.data.unigram_baseline import unigram_cross_entropy

__all__ = [
    "EOD_TOKEN",
    "FIM_MIDDLE_TOKEN",
    "FIM_PAD_TOKEN",
    "FIM_PREFIX_TOKEN",
    "FIM_SUFFIX_TOKEN",
    "PAD_TOKEN",
    "AmbiguousPadTokenWarning",
    "BlendedDataset",
    "DefaultPipeline",
    "Document",
    "FIMConfig",
    "GPTDataset",
    "GPTDatasetConfig",
    "GPTFIMDataset",
    "GPTIndices",
    "IndexedDataset",
    "IndexedDatasetFormatError",
    "IndexedDatasetWriter",
    "Tokenizer",
    "blend_order",
    "blended_dataset_sizes",
    "build_default_pipeline",
    "build_gpt_indices",
    "corpus_fingerprint",
    "default_cache_dir",
    "default_tokenizer",
    "merge_indexed_datasets",
    "read_documents",
    "stdlib_documents",
    "token_dtype",
    "train_bpe_tokenizer",
    "unigram_cross_entropy",
    "write_indexed_dataset",
]
