"""What ``mcore-serve`` checks and loads before it starts anything: the model directory (or
``mcore-train``'s default output), a free port, the checkpoint's tokenizer and limits, and that
the tensor-parallel size splits its model."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from mcore_models import InferenceCheckpoint, hf_to_transformer_config
from mcore_models.data import Tokenizer
from mcore_parallel import ConfigError

from .errors import ServeStartupError

DEFAULT_MODEL_DIR = Path("mcore-train-output") / "checkpoints"
"""Where ``mcore-train`` saves checkpoints by default, relative to the working directory."""


def resolve_model_dir(model_dir: str | None) -> Path:
    """``model_dir``, or with none ``mcore-train``'s default checkpoint directory when it exists."""
    if model_dir is not None:
        return Path(model_dir)
    if DEFAULT_MODEL_DIR.is_dir():
        return DEFAULT_MODEL_DIR
    raise ServeStartupError(
        f"no MODEL_DIR given and no ./{DEFAULT_MODEL_DIR} (mcore-train's default output) here: train a "
        "model with `uv run mcore-train` (about 3 minutes on a CPU) and run `uv run mcore-serve` again, "
        "or pass an mcore-train checkpoint or a Hugging Face model directory"
    )


def bind_http_socket(host: str, port: int) -> socket.socket:
    """The front end's socket, bound to ``host:port`` now, before the coordinator and the engines
    open connections (whose local ports could otherwise take it); ``ServeStartupError`` when it
    cannot be bound (in use, or not an address here)."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        raise ServeStartupError(
            f"cannot listen on {host}:{port}: {error.strerror or error} (port in use? choose another "
            "with --port)"
        ) from error
    return listener


@dataclass
class FrontEndModel:
    """What the HTTP front end needs of the checkpoint."""

    directory: Path
    tokenizer: Tokenizer
    max_model_len: int
    source: str


def check_tensor_parallel_size(loaded: InferenceCheckpoint, tp: int) -> None:
    """``ConfigError`` naming ``tensor_parallel_size`` when ``tp`` ranks cannot split the model of
    ``loaded`` (the rules of ``load_checkpoint_for_inference``: ``tp`` divides the attention heads
    and the KV heads, or, for a Hugging Face model, is a multiple of them; an mcore-train
    checkpoint's vocabulary rows split evenly)."""
    if tp == 1:
        return
    try:
        if loaded.source == "huggingface":
            hf_config = json.loads((loaded.directory / "config.json").read_text())
            hf_to_transformer_config(hf_config, tensor_model_parallel_size=tp)
        else:
            rows = loaded.model.padded_vocab_size
            if rows % tp:
                raise ConfigError(["vocabulary"], f"{rows} embedding rows do not split evenly")
            dataclasses.replace(
                loaded.config, tensor_model_parallel_size=tp, make_vocab_size_divisible_by=rows // tp
            )
    except ConfigError as error:
        raise ConfigError(
            ["tensor_parallel_size"], f"{tp} ranks cannot split the model of {loaded.directory}: {error}"
        ) from error


def load_front_end_model(
    model_dir: Path, dtype: str, max_model_len: int | None, tp: int = 1
) -> FrontEndModel:
    """Load ``model_dir`` once here (so a bad directory fails before any engine starts), check that
    ``tp`` ranks split it, and keep its tokenizer and length limit; ``max_model_len`` defaults to
    the model's maximum position."""
    import torch
    from mcore_models import load_checkpoint_for_inference

    print(f"mcore-serve: loading {model_dir} ...", flush=True)
    started = time.monotonic()
    loaded = load_checkpoint_for_inference(model_dir, dtype=getattr(torch, dtype))
    check_tensor_parallel_size(loaded, tp)
    limit = loaded.model.max_sequence_length or loaded.config.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ServeStartupError(
            f"--max-model-len {max_model_len} exceeds the model's maximum position {limit}"
        )
    parameters = sum(p.numel() for p in loaded.model.parameters())
    print(
        f"mcore-serve: {loaded.source} checkpoint {loaded.directory}: {parameters / 1e6:.2f} M parameters, "
        f"loaded in {time.monotonic() - started:.1f} s",
        flush=True,
    )
    return FrontEndModel(loaded.directory, loaded.tokenizer, max_model_len or limit, loaded.source)
