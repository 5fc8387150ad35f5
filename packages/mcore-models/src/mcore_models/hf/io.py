"""Reading and writing Hugging Face checkpoint directories: ``config.json`` plus safetensors files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_NAME = "model.safetensors"
GENERATION_CONFIG_NAME = "generation_config.json"
# transformers writes the floats JSON lacks as {"__float__": "Infinity"} (and reads them back).
_FLOAT_TAG = "__float__"
_TAGGED_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _untag_float(obj: dict[str, Any]) -> Any:
    if obj.keys() == {_FLOAT_TAG} and obj[_FLOAT_TAG] in _TAGGED_FLOATS:
        return _TAGGED_FLOATS[obj[_FLOAT_TAG]]
    return obj


def _tag_floats(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return {_FLOAT_TAG: "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        return {key: _tag_floats(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [_tag_floats(value) for value in obj]
    return obj


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(), object_hook=_untag_float)


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint directory (with transformers' tagged floats,
    ``{"__float__": "Infinity"}``, as floats)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}")
    return _read_json(path)


def read_hf_generation_config(directory: str | Path) -> dict[str, Any]:
    """The parsed ``generation_config.json`` of a checkpoint directory (``{}`` when it has none)."""
    path = Path(directory) / GENERATION_CONFIG_NAME
    return _read_json(path) if path.is_file() else {}


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
    made contiguous and unshared; infinite and NaN floats tagged as transformers writes them)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in weights.items()}
    save_file(tensors, directory / WEIGHTS_NAME, metadata={"format": "pt"})
    for name, contents in (("config.json", config), (GENERATION_CONFIG_NAME, generation_config)):
        (directory / name).write_text(json.dumps(_tag_floats(contents), indent=2, sort_keys=True) + "\n")
