"""GPTFIMDataset: PSM/SPM rearrangements decode back to the original text, rates, lengths."""

import numpy as np
import pytest
from mcore_models.data.fim_dataset import FIMConfig, GPTFIMDataset
from mcore_models.data.gpt_dataset import GPTDatasetConfig
from mcore_models.data.tokenizer import train_bpe_tokenizer

SEQ_LENGTH = 48
PRE, MID, SUF = 2, 3, 4  # ids of the small tokenizer's sentinels
EOD, PAD = 0, 1


@pytest.fixture
def indexed(write_indexed, small_tokenizer, ascii_stdlib_texts):
    documents = [[*small_tokenizer.encode(text[:2000]), EOD] for text in ascii_stdlib_texts]
    return write_indexed(documents, vocab_size=small_tokenizer.vocab_size)


def _dataset(indexed, tokenizer, num_samples=200, seed=5, **fim):
    config = GPTDatasetConfig(
        seq_length=SEQ_LENGTH, num_samples=num_samples, eod_id=EOD, pad_id=PAD, seed=seed
    )
    return GPTFIMDataset(indexed, config, FIMConfig(**fim), tokenizer)


def _unrearrange(tokens, tokenizer):
    """(format, prefix + middle + suffix text, number of pads) of one rearranged piece."""
    pads = int(np.sum(tokens == PAD))
    tokens = tokens[: len(tokens) - pads]
    assert tokens[0] == PRE and np.sum(tokens == SUF) == 1 and np.sum(tokens == MID) == 1
    mid_at = int(np.flatnonzero(tokens == MID)[0])
    if tokens[1] == SUF:  # SPM: <PRE> <SUF> suffix <MID> prefix middle
        suffix, prefix_and_middle = tokens[2:mid_at], tokens[mid_at + 1 :]
        return "SPM", tokenizer.decode(prefix_and_middle) + tokenizer.decode(suffix), pads
    suf_at = int(np.flatnonzero(tokens == SUF)[0])  # PSM: <PRE> prefix <SUF> suffix <MID> middle
    prefix, suffix, middle = tokens[1:suf_at], tokens[suf_at + 1 : mid_at], tokens[mid_at + 1 :]
    return "PSM", tokenizer.decode(prefix) + tokenizer.decode(middle) + tokenizer.decode(suffix), pads


@pytest.fixture(scope="module")
def byte_tokenizer(ascii_stdlib_texts):
    """No merges: one token per ASCII character, so re-encoding never changes a length."""
    return train_bpe_tokenizer(ascii_stdlib_texts[:1], vocab_size=262)


@pytest.mark.parametrize(("spm_rate", "expected_format"), [(0.0, "PSM"), (1.0, "SPM")])
def test_rearranged_samples_decode_back_to_the_original_text(
    write_indexed, byte_tokenizer, ascii_stdlib_texts, spm_rate, expected_format
):
    documents = [[*byte_tokenizer.encode(text[:500]), EOD] for text in ascii_stdlib_texts]
    indexed = write_indexed(documents, vocab_size=byte_tokenizer.vocab_size)
    dataset = _dataset(indexed, byte_tokenizer, num_samples=100, fim_rate=1.0, fim_spm_rate=spm_rate)
    formats = []
    for index in range(len(dataset)):
        original = byte_tokenizer.decode(dataset.sample_tokens(index))
        rearranged = dataset.fim_sample_tokens(index)
        if rearranged[0] != PRE:  # the middle spanned nearly everything: left as it was
            assert np.array_equal(rearranged, dataset.sample_tokens(index))
            continue
        assert len(rearranged) == SEQ_LENGTH + 1
        fim_format, text, pads = _unrearrange(rearranged, byte_tokenizer)
        formats.append(fim_format)
        # three sentinels came in, three tokens went out: from the suffix's end, then the prefix's start
        tokens = dataset.sample_tokens(index)
        n = len(tokens)
        assert pads == 0 and text in {byte_tokenizer.decode(tokens[cut : n - 3 + cut]) for cut in range(4)}
        assert text != original
    # a PSM sample with an empty prefix reads exactly like an SPM one
    assert formats.count(expected_format) > 0.9 * len(formats)


def test_with_merges_rearranged_samples_decode_to_a_piece_of_the_original(indexed, small_tokenizer):
    dataset = _dataset(indexed, small_tokenizer, num_samples=100, fim_rate=1.0)
    for index in range(len(dataset)):
        original = small_tokenizer.decode(dataset.sample_tokens(index))
        rearranged = dataset.fim_sample_tokens(index)
        assert len(rearranged) == SEQ_LENGTH + 1
        if rearranged[0] != PRE:
            continue
        _, text, _ = _unrearrange(rearranged, small_tokenizer)
        # re-encoding cut text may take more tokens, given back at the edges of the text
        assert text in original and len(text) > len(original) // 2


def test_fim_and_spm_rates_hold_on_many_samples(indexed, small_tokenizer):
    dataset = _dataset(indexed, small_tokenizer, num_samples=2000, fim_rate=0.3, fim_spm_rate=0.25)
    samples = [dataset.fim_sample_tokens(index) for index in range(len(dataset))]
    rearranged = [sample for sample in samples if sample[0] == PRE]
    spm = [sample for sample in rearranged if sample[1] == SUF]
    # three standard deviations of a binomial share
    assert abs(len(rearranged) / 2000 - 0.3) < 3 * np.sqrt(0.3 * 0.7 / 2000)
    assert abs(len(spm) / len(rearranged) - 0.25) < 3 * np.sqrt(0.25 * 0.75 / len(rearranged))
    untouched = [index for index, sample in enumerate(samples) if sample[0] != PRE]
    for index in untouched[:50]:
        assert np.array_equal(samples[index], dataset.sample_tokens(index))


def test_split_sample_rearranges_each_fragment(indexed, small_tokenizer):
    dataset = _dataset(
        indexed,
        small_tokenizer,
        num_samples=600,
        seed=9,
        fim_rate=0.0,
        fim_split_sample=EOD,
        fim_fragment_rate=1.0,
        fim_spm_rate=0.0,
    )
    checked = 0
    for index in range(len(dataset)):
        original = dataset.sample_tokens(index)
        if EOD not in original:
            assert np.array_equal(dataset.fim_sample_tokens(index), original)  # falls back to fim_rate = 0
            continue
        rearranged = dataset.fim_sample_tokens(index)
        assert len(rearranged) == SEQ_LENGTH + 1
        original_fragments = np.split(original, np.flatnonzero(original == EOD))
        fragments = np.split(rearranged, np.flatnonzero(rearranged == EOD))
        assert len(fragments) == len(original_fragments)  # each fragment keeps at most its length
        for original_fragment, fragment in zip(original_fragments, fragments, strict=True):
            original_fragment, fragment = (
                original_fragment[original_fragment != EOD],
                fragment[fragment != EOD],
            )
            if len(original_fragment) == 0 or fragment[0] != PRE:  # empty, or left as it was
                continue
            _, text, _ = _unrearrange(fragment, small_tokenizer)
            assert text in small_tokenizer.decode(original_fragment)
            checked += 1
    assert checked > 20


def test_fragment_rate_zero_leaves_samples_with_the_split_token_untouched(indexed, small_tokenizer):
    dataset = _dataset(indexed, small_tokenizer, fim_rate=1.0, fim_split_sample=EOD, fim_fragment_rate=0.0)
    with_split = [index for index in range(len(dataset)) if EOD in dataset.sample_tokens(index)]
    assert with_split
    for index in with_split:
        assert np.array_equal(dataset.fim_sample_tokens(index), dataset.sample_tokens(index))


def test_deterministic_by_seed_and_independent_of_read_order(indexed, small_tokenizer):
    first = _dataset(indexed, small_tokenizer, num_samples=40, fim_rate=0.5)
    forward = [first.fim_sample_tokens(index).tolist() for index in range(40)]
    again = _dataset(indexed, small_tokenizer, num_samples=40, fim_rate=0.5)
    assert [again.fim_sample_tokens(index).tolist() for index in reversed(range(40))] == forward[::-1]
    other = _dataset(indexed, small_tokenizer, num_samples=40, seed=6, fim_rate=0.5)
    assert [other.fim_sample_tokens(index).tolist() for index in range(40)] != forward


def test_training_dict_is_built_from_the_rearranged_sample(indexed, small_tokenizer):
    dataset = _dataset(indexed, small_tokenizer, num_samples=20, fim_rate=1.0)
    for index in range(len(dataset)):
        item, rearranged = dataset[index], dataset.fim_sample_tokens(index)
        assert item["tokens"].tolist() == rearranged[:-1].tolist()
        assert item["labels"].tolist() == rearranged[1:].tolist()


def test_bad_configuration_is_rejected(indexed, small_tokenizer):
    with pytest.raises(ValueError, match=r"fim_rate must be in \[0, 1\], got 1.5"):
        FIMConfig(fim_rate=1.5)
    config = GPTDatasetConfig(seq_length=SEQ_LENGTH, num_samples=4, eod_id=EOD)
    with pytest.raises(ValueError, match="pad_id is required"):
        GPTFIMDataset(indexed, config, FIMConfig(), small_tokenizer)
