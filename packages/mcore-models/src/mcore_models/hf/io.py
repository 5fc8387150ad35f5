"""Reading and writing Hugging Face checkpoint directories: ``config.json`` plus safetensors files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_NAME = "model.safetensors"
GENERATION_CONFIG_NAME = "generation_config.json"


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}")
    return json.loads(path.read_text())


def read_hf_generation_config(directory: str | Path) -> dict[str, Any]:
    """The parsed ``generation_config.json`` of a checkpoint directory (``{}`` when it has none)."""
    path = Path(directory) / GENERATION_CONFIG_NAME
    return json.loads(path.read_text()) if path.is_file() else {}


def read_hf_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory`` (sharded checkpoints included)."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    return weights


def write_hf_checkpoint(
    directory: str | Path,
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    generation_config: dict[str, Any],
) -> None:
    """Write ``config.json``, ``generation_config.json`` and one ``model.safetensors`` (tensors
    made contiguous and unshared)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in weights.items()}
    save_file(tensors, directory / WEIGHTS_NAME, metadata={"format": "pt"})
    for name, contents in (("config.json", config), (GENERATION_CONFIG_NAME, generation_config)):
        (directory / name).write_text(json.dumps(contents, indent=2, sort_keys=True) + "\n")
