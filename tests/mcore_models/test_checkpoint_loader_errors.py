"""``load_checkpoint_for_inference`` refuses what it cannot load with a typed error naming the
problem, before it sets up any process group."""

import json

import pytest
import torch
import torch.distributed as dist
from mcore_models import (
    CheckpointFormatError,
    CheckpointSchemaError,
    TokenizerMissingError,
    load_checkpoint_for_inference,
)


def _iteration_dir(tmp_path, **model_config):
    """A fake iteration directory: the checkpoint index and a ``model_config.json``."""
    directory = tmp_path / "iter_0000003"
    directory.mkdir()
    (directory / ".metadata").write_bytes(b"")
    content = {"schema_version": 1, "model": "GPTModel", "vocab_size": 8, "transformer_config": {}}
    (directory / "model_config.json").write_text(json.dumps(content | model_config))
    return directory


def test_neither_kind_of_checkpoint(tmp_path):
    with pytest.raises(CheckpointFormatError, match="is not a directory"):
        load_checkpoint_for_inference(tmp_path / "absent")
    with pytest.raises(
        CheckpointFormatError, match=r"neither an mcore-train checkpoint .* nor a Hugging Face"
    ):
        load_checkpoint_for_inference(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # no weights
    with pytest.raises(CheckpointFormatError, match="neither"):
        load_checkpoint_for_inference(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(CheckpointFormatError, match=r"iteration 7 as latest, but .*iter_0000007 is missing"):
        load_checkpoint_for_inference(tmp_path)
    assert not dist.is_initialized()


def test_unknown_schema_version(tmp_path):
    directory = _iteration_dir(tmp_path, schema_version=2)
    with pytest.raises(
        CheckpointSchemaError, match="schema_version 2, this mcore-models reads schema_version 1"
    ):
        load_checkpoint_for_inference(directory)


def test_missing_tokenizer(tmp_path):
    with pytest.raises(TokenizerMissingError, match=r"has no tokenizer\.json"):
        load_checkpoint_for_inference(_iteration_dir(tmp_path))
    assert not dist.is_initialized()


def test_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_checkpoint_for_inference(tmp_path, dtype=torch.int64)
