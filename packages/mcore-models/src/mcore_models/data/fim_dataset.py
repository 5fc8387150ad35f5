"""``GPTFIMDataset``: GPT samples rearranged for fill-in-the-middle training.

A sample (or fragment of one) chosen for FIM is decoded to text, cut at two random character
positions into prefix, middle and suffix, and each part re-encoded. It then reads, with
``<PRE>``, ``<SUF>``, ``<MID>`` the tokenizer's FIM sentinels:

- PSM: ``<PRE> prefix <SUF> suffix <MID> middle``
- SPM: ``<PRE> <SUF> suffix <MID> prefix middle`` (the SPM variant that keeps ``<PRE>`` first)

so the model learns to write the middle given both sides. Options (``FIMConfig``):

- ``fim_rate``: probability that a sample is rearranged;
- ``fim_spm_rate``: share of rearranged pieces in SPM rather than PSM;
- ``fim_split_sample``: a token id (usually EOD); a sample that contains it is split there into
  fragments, each rearranged independently with probability ``fim_fragment_rate``, and rejoined
  with the split token (a sample without it falls back to ``fim_rate``).

Length is preserved. A rearranged piece grows by its three sentinels, and by what re-encoding
the cut text costs (characters that used to merge across a cut); it gives the excess back from
the end of its suffix, then from the start of its prefix: only context at the edges of the text
is lost, never the middle. A piece whose prefix and suffix together are too short for that
(the middle spans nearly all of it) is left as it was. A sample that shrank is padded at the
end with ``pad_id``, which the loss mask leaves out. Every sample keeps ``seq_length + 1``
tokens. The random choices of sample ``i`` come from a generator seeded with ``(seed, i)``, so
they do not depend on the order in which samples are read.

Cuts fall on characters, as in the FIM paper, so a middle may start inside what used to be one
token, but never inside the text of a special token (an EOD inside the sample stays one token).
A multi-byte character split by the sample's own boundaries decodes to U+FFFD.
"""

import re
from dataclasses import dataclass

import numpy as np
import torch

from mcore_models.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from mcore_models.data.indexed_dataset import IndexedDataset
from mcore_models.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class FIMConfig:
    """Fill-in-the-middle options; see the module docstring."""

    fim_rate: float = 0.5
    fim_spm_rate: float = 0.5
    fim_split_sample: int | None = None
    fim_fragment_rate: float = 0.5

    def __post_init__(self):
        for field in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
            if not 0.0 <= getattr(self, field) <= 1.0:
                raise ValueError(f"{field} must be in [0, 1], got {getattr(self, field)}")


class GPTFIMDataset(GPTDataset):
    """``GPTDataset`` whose samples are rearranged for fill-in-the-middle by ``fim_config``.

    ``tokenizer`` decodes and re-encodes samples and provides the FIM sentinel ids;
    ``config.pad_id`` pads samples that shrank and is required.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        config: GPTDatasetConfig,
        fim_config: FIMConfig,
        tokenizer: Tokenizer,
    ):
        missing = [
            name
            for name in ("fim_prefix_id", "fim_middle_id", "fim_suffix_id")
            if getattr(tokenizer, name) is None
        ]
        if missing:
            raise ValueError(f"tokenizer has no FIM sentinel for {', '.join(missing)}")
        if config.pad_id is None:
            raise ValueError("config.pad_id is required: GPTFIMDataset pads samples that shrink")
        self.fim_config = fim_config
        self.tokenizer = tokenizer
        self._special_text = re.compile("|".join(map(re.escape, tokenizer.special_tokens)) or r"(?!)")
        super().__init__(indexed_dataset, config)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self._sample_dict(self.fim_sample_tokens(index))

    def fim_sample_tokens(self, index: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of sample ``index`` after the FIM transformation."""
        sample = self.sample_tokens(index)
        rng = np.random.default_rng([self.config.seed, index % len(self)])
        split = self.fim_config.fim_split_sample
        if split is None or not np.any(sample == split):
            rearranged = self._maybe_rearrange(sample, rng, self.fim_config.fim_rate)
        else:
            fragments = np.split(sample, np.flatnonzero(sample == split))
            pieces = [self._maybe_rearrange(fragments[0], rng, self.fim_config.fim_fragment_rate)]
            for fragment in fragments[1:]:  # each starts with the split token
                pieces += [
                    fragment[:1],
                    self._maybe_rearrange(fragment[1:], rng, self.fim_config.fim_fragment_rate),
                ]
            rearranged = np.concatenate(pieces)
        padding = np.full(len(sample) - len(rearranged), self.config.pad_id, dtype=np.int64)
        return np.concatenate([rearranged, padding])

    def _maybe_rearrange(self, tokens: np.ndarray, rng: np.random.Generator, rate: float) -> np.ndarray:
        """With probability ``rate``, ``tokens`` in PSM or SPM order and at most as long;
        otherwise, or when that length cannot be kept, ``tokens`` unchanged. Empty pieces are
        never rearranged."""
        if rng.random() >= rate or len(tokens) == 0:
            return tokens
        text = self.tokenizer.decode(tokens)
        start, end = sorted(rng.choice(self._cut_positions(text), size=2))
        prefix, middle, suffix = (
            np.asarray(self.tokenizer.encode(part), dtype=np.int64)
            for part in (text[:start], text[start:end], text[end:])
        )
        excess = max(0, len(prefix) + len(middle) + len(suffix) + 3 - len(tokens))
        from_suffix = min(excess, len(suffix))
        from_prefix = excess - from_suffix
        if from_prefix > len(prefix):
            return tokens
        prefix, suffix = prefix[from_prefix:], suffix[: len(suffix) - from_suffix]
        pre, mid, suf = (
            self.tokenizer.fim_prefix_id,
            self.tokenizer.fim_middle_id,
            self.tokenizer.fim_suffix_id,
        )
        if rng.random() < self.fim_config.fim_spm_rate:
            return np.concatenate([[pre, suf], suffix, [mid], prefix, middle]).astype(np.int64)
        return np.concatenate([[pre], prefix, [suf], suffix, [mid], middle]).astype(np.int64)

    def _cut_positions(self, text: str) -> np.ndarray:
        """Character positions ``0 .. len(text)`` that are not inside a special token's text."""
        inside = np.zeros(len(text) + 1, dtype=bool)
        for match in self._special_text.finditer(text):
            inside[match.start() + 1 : match.end()] = True
        return np.flatnonzero(~inside)

    def _other_special_ids(self) -> dict[str, int | None]:
        return {
            **super()._other_special_ids(),
            "fim_prefix_id": self.tokenizer.fim_prefix_id,
            "fim_middle_id": self.tokenizer.fim_middle_id,
            "fim_suffix_id": self.tokenizer.fim_suffix_id,
        }
