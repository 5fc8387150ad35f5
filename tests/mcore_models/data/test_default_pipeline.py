"""The default pipeline: built once into the cache, reopened afterwards, baseline recorded."""

import math

import numpy as np
import pytest
from mcore_models.data import corpus, default_pipeline
from mcore_models.data.default_pipeline import build_default_pipeline
from mcore_models.data.unigram_baseline import unigram_cross_entropy


@pytest.fixture
def small_stdlib(tmp_path, monkeypatch, ascii_stdlib_texts):
    root = tmp_path / "stdlib"
    for i, text in enumerate(ascii_stdlib_texts):
        (root / f"pkg{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"pkg{i % 3}" / f"mod{i}.py").write_text(text)
    monkeypatch.setattr(corpus, "stdlib_root", lambda: root)
    return root


def test_pipeline_is_built_once_and_reopened(small_stdlib, tmp_path, monkeypatch):
    pipeline = build_default_pipeline(
        vocab_size=300, heldout_fraction=0.2, cache_dir=tmp_path / "cache", progress=False
    )
    summary = pipeline.summary
    assert summary["train"]["documents"] + summary["heldout"]["documents"] == 30
    assert summary["heldout"]["documents"] > 0
    assert pipeline.train.num_documents == summary["train"]["documents"]
    assert summary["heldout"]["tokens"] == pipeline.heldout.num_tokens
    heldout_texts = [d.text for d in corpus.stdlib_documents("heldout", heldout_fraction=0.2)]
    assert [
        pipeline.tokenizer.decode(pipeline.heldout[i][:-1]) for i in range(len(pipeline.heldout))
    ] == heldout_texts
    expected = unigram_cross_entropy(pipeline.train.tokens, pipeline.heldout.tokens, 300)
    assert pipeline.unigram_baseline == pytest.approx(expected)
    assert 0 < pipeline.unigram_baseline < math.log(300)

    def refuse(*args, **kwargs):
        raise AssertionError("the cached pipeline should have been reopened")

    monkeypatch.setattr(default_pipeline, "write_indexed_dataset", refuse)
    again = build_default_pipeline(
        vocab_size=300, heldout_fraction=0.2, cache_dir=tmp_path / "cache", progress=False
    )
    assert again.directory == pipeline.directory and again.unigram_baseline == pipeline.unigram_baseline
    assert np.array_equal(again.train.tokens, pipeline.train.tokens)
    assert list((tmp_path / "cache" / "pipelines").iterdir()) == [pipeline.directory]  # no staging left


@pytest.mark.slow
def test_default_pipeline_on_the_real_stdlib(tmp_path):
    pipeline = build_default_pipeline(cache_dir=tmp_path, workers=2, progress=False)
    assert pipeline.tokenizer.vocab_size == 4096
    assert pipeline.summary["train"]["documents"] > 300 and pipeline.summary["train"]["tokens"] > 1_000_000
    assert 4.0 < pipeline.unigram_baseline < math.log(4096)
