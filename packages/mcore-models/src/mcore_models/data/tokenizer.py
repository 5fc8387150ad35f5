"""Tokenizers: a byte-level BPE trained locally on the default corpus, or any HF ``tokenizer.json``.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` and adds what training needs to know: the
end-of-document and pad ids and the fill-in-the-middle sentinels. ``default_tokenizer`` trains a
BPE on the training split of the standard-library corpus the first time and loads it from the
cache afterwards, keyed by Python version, vocabulary size and a fingerprint of the corpus.
"""

import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from mcore_models.data.cache import atomic_output, default_cache_dir
from mcore_models.data.corpus import corpus_fingerprint, stdlib_documents

EOD_TOKEN = "<|endoftext|>"
"""End of document (id 0 in a tokenizer trained here)."""
PAD_TOKEN = "<pad>"
"""Padding, masked out of the loss (id 1)."""
FIM_PREFIX_TOKEN = "<fim_prefix>"
"""Fill-in-the-middle: starts the prefix (id 2)."""
FIM_MIDDLE_TOKEN = "<fim_middle>"
"""Fill-in-the-middle: starts the middle, the part to generate (id 3)."""
FIM_SUFFIX_TOKEN = "<fim_suffix>"
"""Fill-in-the-middle: starts the suffix (id 4)."""
FIM_PAD_TOKEN = "<fim_pad>"
"""Fill-in-the-middle: the FIM pad token of the usual FIM vocabularies; reserved, unused here (id 5)."""
#: The special tokens of a tokenizer trained here, in id order (0..5).
SPECIAL_TOKENS = (EOD_TOKEN, PAD_TOKEN, FIM_PREFIX_TOKEN, FIM_MIDDLE_TOKEN, FIM_SUFFIX_TOKEN, FIM_PAD_TOKEN)
#: Names tried, in order, for the end-of-document token of a loaded ``tokenizer.json``.
EOD_CANDIDATES = (EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")
#: Names tried, in order, for its pad token; without one the pad id falls back to the EOD id.
PAD_CANDIDATES = (PAD_TOKEN, "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")
_BYTE_ALPHABET_SIZE = 256


class Tokenizer:
    """Encode/decode text and name the special ids: ``eod_id``, ``pad_id``, the FIM sentinels.

    ``eod_token`` and ``pad_token`` name those tokens; left ``None``, the first of
    ``EOD_CANDIDATES`` / ``PAD_CANDIDATES`` present in the vocabulary is used. A tokenizer with
    no pad token pads with its EOD id (``GPTDataset`` warns about that collision). FIM sentinel
    ids are ``None`` when the vocabulary lacks them.
    """

    def __init__(
        self, backend: tokenizers.Tokenizer, eod_token: str | None = None, pad_token: str | None = None
    ):
        self.backend = backend
        self.eod_id = self._special_id(eod_token, EOD_CANDIDATES, "eod_token")
        if pad_token is None and not any(self.token_to_id(name) is not None for name in PAD_CANDIDATES):
            self.pad_id = self.eod_id
        else:
            self.pad_id = self._special_id(pad_token, PAD_CANDIDATES, "pad_token")
        self.fim_prefix_id = self.token_to_id(FIM_PREFIX_TOKEN)
        self.fim_middle_id = self.token_to_id(FIM_MIDDLE_TOKEN)
        self.fim_suffix_id = self.token_to_id(FIM_SUFFIX_TOKEN)
        self.fim_pad_id = self.token_to_id(FIM_PAD_TOKEN)

    @classmethod
    def from_file(cls, path: str | os.PathLike, eod_token: str | None = None, pad_token: str | None = None):
        """Load a Hugging Face ``tokenizer.json``."""
        return cls(tokenizers.Tokenizer.from_file(str(path)), eod_token=eod_token, pad_token=pad_token)

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as a ``tokenizer.json`` (atomically)."""
        with atomic_output(path, "w") as handle:
            handle.write(self.backend.to_str())

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Text and id of every token the backend marks special."""
        return {
            token.content: token_id
            for token_id, token in self.backend.get_added_tokens_decoder().items()
            if token.special
        }

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token``, or ``None`` if it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added (special-token text is recognised)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text, in parallel inside the backend."""
        return [encoding.ids for encoding in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens written out."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def _special_id(self, name: str | None, candidates: Sequence[str], field: str) -> int:
        for candidate in (name,) if name is not None else candidates:
            token_id = self.token_to_id(candidate)
            if token_id is not None:
                return token_id
        tried = repr(name) if name is not None else f"any of {list(candidates)}"
        raise ValueError(f"{field}: the vocabulary has no token {tried}")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE with ``SPECIAL_TOKENS`` (ids 0..5) on ``texts``.

    The vocabulary holds the special tokens, the 256 byte symbols and merges up to ``vocab_size``
    (fewer if the texts run out of pairs seen ``min_frequency`` times).
    """
    smallest = len(SPECIAL_TOKENS) + _BYTE_ALPHABET_SIZE
    if vocab_size < smallest:
        raise ValueError(f"vocab_size must be at least {smallest} (specials + bytes), got {vocab_size}")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(backend, eod_token=EOD_TOKEN, pad_token=PAD_TOKEN)


def default_tokenizer(
    vocab_size: int = 4096,
    cache_dir: str | os.PathLike | None = None,
    heldout_fraction: float = 0.05,
    include_tests: bool = False,
) -> Tokenizer:
    """The BPE trained on the training split of the stdlib corpus, from the cache or trained now.

    Cached as ``<cache_dir>/tokenizers/py<X.Y.Z>-v<vocab_size>-<fingerprint>.json``;
    ``cache_dir`` defaults to ``default_cache_dir()``.
    """
    corpus = dict(split="train", heldout_fraction=heldout_fraction, include_tests=include_tests)
    fingerprint = corpus_fingerprint(stdlib_documents(**corpus))
    python = ".".join(map(str, sys.version_info[:3]))
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache_dir / "tokenizers" / f"py{python}-v{vocab_size}-{fingerprint}.json"
    if path.exists():
        return Tokenizer.from_file(path, eod_token=EOD_TOKEN, pad_token=PAD_TOKEN)
    tokenizer = train_bpe_tokenizer((document.text for document in stdlib_documents(**corpus)), vocab_size)
    tokenizer.save(path)
    return tokenizer
