"""mcore-preprocess: reading jsonl/text, tokenizing in worker processes, the command line."""

import json
from importlib.metadata import entry_points

import numpy as np
import pytest
from mcore_models.data.indexed_dataset import IndexedDataset
from mcore_models.data.preprocess import main, read_documents, write_indexed_dataset

TEXTS = ["def f():\n    return 1\n", "", "import os\n", "class A:\n    pass\n" * 20, "x = 'é'\n"]


def _write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n\n")
    return path


def test_read_documents_from_jsonl_and_text(tmp_path):
    jsonl = _write_jsonl(tmp_path / "a.jsonl", [{"text": "one", "id": 1}, {"text": "two"}])
    other_key = _write_jsonl(tmp_path / "b.jsonl", [{"content": "three"}])
    text = tmp_path / "c.txt"
    text.write_text("first line\n\nsecond line\n")
    assert list(read_documents([jsonl, text])) == ["one", "two", "first line\n\nsecond line\n"]
    assert list(read_documents([text], text_unit="line")) == ["first line", "second line"]
    assert list(read_documents([other_key], json_key="content")) == ["three"]
    with pytest.raises(ValueError, match=r"b\.jsonl:1: no string field 'text' \(set --json-key\)"):
        list(read_documents([other_key]))


def test_documents_are_encoded_in_order_with_eod(tmp_path, small_tokenizer):
    dataset = write_indexed_dataset(TEXTS, tmp_path / "one", small_tokenizer, progress=False)
    assert dataset.num_documents == len(TEXTS) and dataset.dtype == np.uint16
    for text, sequence in zip(TEXTS, (dataset[i] for i in range(len(dataset))), strict=True):
        assert sequence[-1] == small_tokenizer.eod_id
        assert small_tokenizer.decode(sequence[:-1]) == text
    without_eod = write_indexed_dataset(
        TEXTS, tmp_path / "bare", small_tokenizer, append_eod=False, progress=False
    )
    assert without_eod.num_tokens == dataset.num_tokens - len(TEXTS)


def test_worker_processes_give_the_same_dataset(tmp_path, small_tokenizer):
    texts = TEXTS * 10
    serial = write_indexed_dataset(texts, tmp_path / "serial", small_tokenizer, progress=False)
    parallel = write_indexed_dataset(texts, tmp_path / "parallel", small_tokenizer, workers=2, progress=False)
    assert np.array_equal(serial.tokens, parallel.tokens)
    assert np.array_equal(serial.sequence_lengths, parallel.sequence_lengths)


def test_command_line_with_a_tokenizer_json(tmp_path, small_tokenizer, capsys):
    small_tokenizer.save(tmp_path / "tokenizer.json")
    jsonl = _write_jsonl(tmp_path / "in.jsonl", [{"body": text} for text in TEXTS])
    main(
        [
            *("--input", str(jsonl), "--output-prefix", str(tmp_path / "out" / "data")),
            *("--tokenizer", str(tmp_path / "tokenizer.json"), "--json-key", "body", "--workers", "2"),
        ]
    )
    dataset = IndexedDataset(tmp_path / "out" / "data")
    assert [small_tokenizer.decode(dataset[i][:-1]) for i in range(len(dataset))] == TEXTS
    assert f"wrote {len(TEXTS)} documents, {dataset.num_tokens} tokens (uint16)" in capsys.readouterr().out


def test_console_script_is_declared():
    (script,) = entry_points(group="console_scripts", name="mcore-preprocess")
    assert script.value == "mcore_models.data.preprocess:main"
