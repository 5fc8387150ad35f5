"""The files that make an mcore-train checkpoint self-describing, beside its tensors.

Each iteration directory holds (written by rank 0 into the checkpoint's staging directory, so they
appear with the tensors or not at all):

- ``model_config.json``: ``{"schema_version", "model": "GPTModel" or "HybridModel", "vocab_size",
  "transformer_config": {field: value}}``, every field of the model config as the run used it
  (its parallel sizes included: a loader replaces them with its own; a hybrid model's
  ``hybrid_layer_pattern`` and Mamba fields too);
- ``tokenizer.json`` (``Tokenizer.save``) and ``tokenizer_config.json``: ``{"schema_version",
  "eod_token", "pad_token"}``, the names of the tokenizer's end-of-document and pad tokens;
- ``train_config.json``: ``{"schema_version", "configs": {section: {field: value}}}``, the
  ``TrainConfigs`` of the run as given to ``pretrain``, the defaults of a resume.

A reader refuses other schema versions (``CheckpointSchemaError``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..config.transformer_config import TransformerConfig
from ..data.cache import atomic_output
from ..data.tokenizer import Tokenizer
from .errors import CheckpointConfigMissingError, CheckpointSchemaError, TokenizerMissingError

SCHEMA_VERSION = 1
MODEL_CONFIG_FILE = "model_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TRAIN_CONFIG_FILE = "train_config.json"
_MODEL_CLASSES = ("GPTModel", "HybridModel")


def _write_json(path: Path, content: dict[str, Any]) -> None:
    with atomic_output(path, "w") as handle:
        json.dump({"schema_version": SCHEMA_VERSION} | content, handle, indent=2)
        handle.write("\n")


def write_checkpoint_metadata(
    directory: Path, model_config: TransformerConfig, vocab_size: int, tokenizer: Tokenizer, train_configs
) -> None:
    """Write the model config, the tokenizer and ``train_configs`` (a ``TrainConfigs``) into ``directory``."""
    _write_json(
        directory / MODEL_CONFIG_FILE,
        {
            "model": "GPTModel"
            if getattr(model_config, "hybrid_layer_pattern", None) is None
            else "HybridModel",
            "vocab_size": vocab_size,
            "transformer_config": dataclasses.asdict(model_config),
        },
    )
    tokenizer.save(directory / TOKENIZER_FILE)
    names = {
        "eod_token": tokenizer.backend.id_to_token(tokenizer.eod_id),
        "pad_token": tokenizer.backend.id_to_token(tokenizer.pad_id),
    }
    _write_json(directory / TOKENIZER_CONFIG_FILE, names)
    _write_json(directory / TRAIN_CONFIG_FILE, {"configs": dataclasses.asdict(train_configs)})


def read_versioned_json(path: Path) -> dict[str, Any]:
    """The content of a checkpoint JSON file, its schema version checked and removed.

    Raises:
        CheckpointSchemaError: a schema version other than ``SCHEMA_VERSION``, or none.
    """
    content = json.loads(path.read_text())
    version = content.pop("schema_version", None)
    if version != SCHEMA_VERSION:
        raise CheckpointSchemaError(
            f"{path}: schema_version {version!r}, this mcore-models reads schema_version {SCHEMA_VERSION} "
            "(a newer mcore-models wrote it: upgrade mcore-models)"
        )
    return content


def has_model_config(directory: Path) -> bool:
    """Whether the iteration directory ``directory`` describes its model."""
    return (directory / MODEL_CONFIG_FILE).is_file()


def read_model_config(directory: Path) -> tuple[dict[str, Any], int]:
    """The saved model config fields (``TransformerConfig``'s; a hybrid model's pattern and Mamba
    fields too) and the vocabulary size of the iteration ``directory``
    (or of ``directory`` itself where it is a ``model_config.json`` file).

    Raises:
        CheckpointConfigMissingError: no ``model_config.json`` (a checkpoint of an older mcore-models).
        CheckpointSchemaError: see ``read_versioned_json``.
    """
    directory = Path(directory)
    path = directory if directory.is_file() else directory / MODEL_CONFIG_FILE
    if not path.is_file():
        raise CheckpointConfigMissingError(
            f"{directory} is an mcore-train checkpoint without {MODEL_CONFIG_FILE} (saved by an mcore-models "
            "older than self-describing checkpoints). Re-save it: resume it once with mcore-train and the "
            "original flags (--load DIR), and the next checkpoint describes itself; or export it with "
            "mcore-train --export-hf HF_DIR and load HF_DIR"
        )
    content = read_versioned_json(path)
    if content.get("model") not in _MODEL_CLASSES:
        raise CheckpointSchemaError(
            f"{path}: model {content.get('model')!r}, expected one of {_MODEL_CLASSES}"
        )
    return content["transformer_config"], content["vocab_size"]


def read_tokenizer(directory: Path) -> Tokenizer:
    """The tokenizer saved in ``directory`` (``tokenizer.json``, token names from ``tokenizer_config.json``).

    Raises:
        TokenizerMissingError: no ``tokenizer.json``.
    """
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        raise TokenizerMissingError(
            f"{directory} has no {TOKENIZER_FILE}: copy the tokenizer the model was trained with there"
        )
    config_path = directory / TOKENIZER_CONFIG_FILE
    names = read_versioned_json(config_path) if config_path.is_file() else {}
    return Tokenizer.from_file(path, eod_token=names.get("eod_token"), pad_token=names.get("pad_token"))


def read_train_configs(directory: Path) -> dict[str, dict[str, Any]] | None:
    """The saved ``TrainConfigs`` of the iteration ``directory`` by section and field, or ``None``
    when it has none (a checkpoint of an older mcore-models)."""
    path = directory / TRAIN_CONFIG_FILE
    return read_versioned_json(path)["configs"] if path.is_file() else None
