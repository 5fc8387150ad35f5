"""``load_checkpoint_for_inference``: a model (whole, or split over a tensor-parallel group; CPU,
eval mode), its config and its tokenizer from an mcore-train checkpoint (saved at any layout) or a
Hugging Face model directory."""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from mcore_parallel import ConfigError, ProcessGroupCollection, checkpoint_dir, latest_iteration

from ..config.transformer_config import TransformerConfig
from ..data.tokenizer import Tokenizer
from ..models.gpt.model import GPTModel
from ..models.hybrid.layer_pattern import HybridLayerPattern
from ..models.hybrid.model import HybridModel
from ..ssm.mamba_config import MambaConfig
from .errors import CheckpointFormatError, TokenizerMissingError
from .metadata import MODEL_CONFIG_FILE, TOKENIZER_FILE, read_model_config, read_tokenizer

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# what a served model sets of the layout fields a training run saved (besides its TP size)
_SERVING_LAYOUT = dict(
    pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None,
    context_parallel_size=1,
    expert_model_parallel_size=1,
    expert_tensor_parallel_size=None,
    sequence_parallel=False,
    recompute_granularity=None,
)


@dataclass
class InferenceCheckpoint:
    """What ``load_checkpoint_for_inference`` returns.

    ``source`` is ``"mcore-train"`` or ``"huggingface"``; ``directory`` the directory the weights
    came from (for an mcore-train save directory: its latest iteration's)."""

    model: GPTModel
    config: TransformerConfig
    tokenizer: Tokenizer
    source: Literal["mcore-train", "huggingface"]
    directory: Path


def load_checkpoint_for_inference(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    pg_collection: ProcessGroupCollection | None = None,
) -> InferenceCheckpoint:
    """Load a model for serving from ``path``: an mcore-train save directory (its latest
    checkpoint), one of its ``iter_NNNNNNN`` directories, or a Hugging Face model directory
    (``config.json``, ``*.safetensors``, ``tokenizer.json``; NemotronH, Mamba2 and Bamba directories
    give a ``HybridModel``).

    The model is on the CPU, in eval mode, with parameters in ``dtype``; its logits cover exactly
    the vocabulary (gathered over the tensor-parallel ranks). Its process groups: ``pg_collection``,
    whose tensor-parallel group splits the model over its ranks (whatever layout saved it; call
    this on every rank of that group), else a one-process world (gloo, no network), set up when no
    process group exists, holding the model whole. At TP > 1 a Hugging Face checkpoint gets the
    padded vocabulary and replicated KV heads of ``import_hf_checkpoint``; an mcore-train
    checkpoint keeps its saved vocabulary rows, which the TP size must divide. A hybrid run's
    checkpoint gives a ``HybridModel`` (its pattern and Mamba sizes are saved with it).

    Raises:
        CheckpointFormatError: ``path`` is neither kind of checkpoint.
        CheckpointConfigMissingError: an mcore-train checkpoint without its model config (an
            older mcore-models saved it; the message says how to re-save or export it).
        TokenizerMissingError: no ``tokenizer.json`` beside the weights.
        CheckpointSchemaError: a checkpoint file of an unknown schema version.
        ConfigError: the tensor-parallel size does not split the model (attention heads, KV
            heads, an mcore-train checkpoint's vocabulary rows), naming the fields; raised before
            any weight is read.
        ValueError: ``dtype`` is not a floating dtype a model runs in, or there is a process
            group of several ranks and no ``pg_collection``.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in _DTYPES]}, got {dtype}")
    directory = Path(path)
    source, directory = _locate(directory)
    load = _load_hf if source == "huggingface" else _load_mcore_train
    model, tokenizer = load(directory, dtype, pg_collection)
    model.parallel_output = False  # logits over exactly the vocabulary, padded rows cut off
    return InferenceCheckpoint(model.eval(), model.config, tokenizer, source, directory)


def _locate(path: Path) -> tuple[str, Path]:
    """Which kind of checkpoint ``path`` is, and the directory holding its weights."""
    if not path.is_dir():
        raise CheckpointFormatError(f"{path} is not a directory")
    iteration = latest_iteration(path)
    if iteration is not None:
        directory = checkpoint_dir(path, iteration)
        if not directory.is_dir():
            raise CheckpointFormatError(
                f"{path} names iteration {iteration} as latest, but {directory} is missing"
            )
        return "mcore-train", directory
    if (path / ".metadata").is_file():  # torch.distributed.checkpoint's index of an iteration directory
        return "mcore-train", path
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "huggingface", path
    raise CheckpointFormatError(
        f"{path} is neither an mcore-train checkpoint (a save directory with "
        "latest_checkpointed_iteration.txt, or one of its iter_NNNNNNN directories) nor a Hugging Face "
        "model directory (config.json and *.safetensors)"
    )


def _groups(pg_collection: ProcessGroupCollection | None) -> ProcessGroupCollection:
    if pg_collection is not None:
        return pg_collection
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise ValueError(
            "a process group of several ranks exists: pass pg_collection with the tensor-parallel group "
            "to split the model over (a group of this rank alone for a whole model)"
        )
    return ProcessGroupCollection(tp=dist.new_group([0]))


def _tp_size(pg_collection: ProcessGroupCollection | None) -> int:
    tp = None if pg_collection is None else pg_collection.tp
    return 1 if tp is None else dist.get_world_size(tp)


def _serving_config(
    fields: dict[str, Any], vocab_size: int, dtype: torch.dtype, tp: int
) -> TransformerConfig:
    """The saved config at tensor-parallel size ``tp``, in ``dtype``. The vocabulary keeps the
    padded rows of the saved layout (``make_vocab_size_divisible_by`` times its TP size), so the
    embedding and output layer have the saved global shapes; padded ids are never predicted."""
    names = {f.name for f in dataclasses.fields(TransformerConfig) if f.init}
    padding = fields["make_vocab_size_divisible_by"] * fields["tensor_model_parallel_size"]
    rows = -(-vocab_size // padding) * padding
    if rows % tp:
        raise ConfigError(
            ["tensor_model_parallel_size"],
            f"the checkpoint's embedding has {rows} rows (its vocabulary padded as saved), which "
            f"{tp} tensor-parallel ranks do not split evenly",
        )
    return TransformerConfig(
        **{name: value for name, value in fields.items() if name in names}
        | _SERVING_LAYOUT
        | dict(
            tensor_model_parallel_size=tp,
            fp16=dtype == torch.float16,
            bf16=dtype == torch.bfloat16,
            make_vocab_size_divisible_by=rows // tp,  # pads to exactly ``rows`` at this TP size
        )
    )


def _load_mcore_train(directory: Path, dtype: torch.dtype, pg_collection) -> tuple[GPTModel, Tokenizer]:
    fields, vocab_size = read_model_config(directory)
    tokenizer = read_tokenizer(directory)
    return load_mcore_train_model(directory, fields, vocab_size, tokenizer, dtype, pg_collection), tokenizer


def load_mcore_train_model(
    directory: Path,
    fields: dict[str, Any],
    vocab_size: int,
    tokenizer: Tokenizer,
    dtype: torch.dtype,
    pg_collection: ProcessGroupCollection | None,
) -> GPTModel:
    """The model of the saved config ``fields`` (see ``read_model_config``) with the weights of the
    iteration ``directory``, split over the tensor-parallel group of ``pg_collection``.

    Raises:
        ConfigError: see ``_serving_config``.
        CheckpointFormatError: the checkpoint lacks tensors of the model.
    """
    import torch.distributed.checkpoint as dcp

    from ..training.checkpointing import inference_model_state_dict

    config = _serving_config(fields, vocab_size, dtype, _tp_size(pg_collection))
    groups = _groups(pg_collection)  # after every check: no process group for a refused load
    special_tokens = dict(eos_token_ids=(tokenizer.eod_id,), pad_token_id=tokenizer.pad_id)
    model = _saved_model(fields, config, vocab_size, pg_collection=groups, **special_tokens)
    saved_keys = set(dcp.FileSystemReader(directory).read_metadata().state_dict_metadata)
    state, finish = inference_model_state_dict(model, saved_keys, groups.tp)
    missing = sorted(set(state) - saved_keys)
    if missing:
        raise CheckpointFormatError(
            f"{directory} lacks {len(missing)} tensors of the model its {MODEL_CONFIG_FILE} describes, "
            f"e.g. {missing[:3]} (routers' expert biases are in checkpoints of mcore-models after 0.1.8)"
        )
    if dist.get_world_size(groups.tp) == 1:
        _load_alone(state, directory)
    else:
        dcp.load(state, checkpoint_id=directory, process_group=groups.tp)
    finish()
    return model


def _saved_model(fields: dict[str, Any], config: TransformerConfig, vocab_size: int, **kwargs) -> GPTModel:
    """The model class the saved ``fields`` describe: a ``HybridModel`` of their layer pattern
    (its ``|`` dropped: the model is served whole) and Mamba fields, else a ``GPTModel``."""
    pattern = fields.get("hybrid_layer_pattern")
    if pattern is None:
        return GPTModel(config, vocab_size, **kwargs)
    mamba = MambaConfig(
        **{f.name: fields[f.name] for f in dataclasses.fields(MambaConfig) if f.name in fields}
    )
    symbols = HybridLayerPattern.parse(pattern).symbols
    return HybridModel(config, vocab_size, symbols, mamba, **kwargs)


def _load_alone(state: dict[str, torch.Tensor], directory: Path) -> None:
    """Fill ``state`` (whole tensors) from the checkpoint ``directory`` on this rank alone, without
    a collective: a one-rank group of any rank but 0 would fail in torch 2.6's ``dcp.load``, which
    addresses its plan's coordinator by global rank 0."""
    import torch.distributed.checkpoint as dcp

    if "no_dist" in inspect.signature(dcp.load).parameters:
        dcp.load(state, checkpoint_id=directory, no_dist=True)
    else:  # torch 2.6: dcp.load has no no_dist
        dcp.load_state_dict(state, dcp.FileSystemReader(directory), no_dist=True)


# Hugging Face model types of hybrid (Mamba) models -> their importer in models.hybrid.
_HYBRID_IMPORTS = {"nemotron_h": "import_nemotron_h", "mamba2": "import_mamba2", "bamba": "import_bamba"}


def _load_hf(directory: Path, dtype: torch.dtype, pg_collection) -> tuple[GPTModel, Tokenizer]:
    import tokenizers

    from ..hf.checkpoint import import_hf_checkpoint
    from ..hf.io import read_hf_config
    from ..models import hybrid as hybrid_models

    if not (directory / TOKENIZER_FILE).is_file():
        raise TokenizerMissingError(
            f"{directory} has no {TOKENIZER_FILE}: save the model's tokenizer there "
            "(transformers: tokenizer.save_pretrained(directory))"
        )
    precision = dict(fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16)
    hybrid = _HYBRID_IMPORTS.get(read_hf_config(directory).get("model_type"))
    if hybrid is None:
        model = import_hf_checkpoint(directory, pg_collection=_groups(pg_collection), **precision)
    else:
        importer = getattr(hybrid_models, hybrid)
        model = importer(directory, pg_collection=_groups(pg_collection), **precision).to(dtype)
    backend = tokenizers.Tokenizer.from_file(str(directory / TOKENIZER_FILE))
    # the tokenizer's end-of-document and pad tokens are the model's (when it names them)
    eos = backend.id_to_token(model.eos_token_ids[0]) if model.eos_token_ids else None
    pad = backend.id_to_token(model.pad_token_id) if model.pad_token_id is not None else None
    return model, Tokenizer(backend, eod_token=eos, pad_token=pad)
