"""Resuming from a self-describing checkpoint: its run's configs are the defaults of ``--load DIR``
(flags given on the command line win), and a model it cannot hold is refused.

What a resume may change of the model config: the parallel layout and precision
(``ModelParallelConfig``'s fields: checkpoints load at any layout), dropout, recomputation, the layer
implementation, how context-parallel ranks and token dispatchers communicate, the router's loss
coefficients, the initialisation (the weights come from the checkpoint) and where a hybrid layer
pattern's ``|`` splits the pipeline stages. Every other field (``TransformerConfig``'s, the hybrid
pattern and the Mamba sizes) shapes the weights or the function they compute, and must match.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mcore_parallel import ConfigError, ModelParallelConfig, checkpoint_dir, latest_iteration

from ..checkpoints.metadata import has_model_config, read_model_config, read_train_configs
from ..config.transformer_config import TransformerConfig
from ..models.hybrid.layer_pattern import STAGE_SEPARATOR

RESUME_MAY_CHANGE = frozenset(
    {f.name for f in dataclasses.fields(ModelParallelConfig)}
    | {
        "attention_dropout",
        "hidden_dropout",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "transformer_impl",
        "cp_comm_type",
        "moe_token_dispatcher_type",
        "moe_aux_loss_coeff",
        "moe_z_loss_coeff",
        "moe_input_jitter_eps",
        "moe_router_bias_update_rate",
        "init_method_std",
        "use_scaled_init_for_output",
        "mamba_dt_min",
        "mamba_dt_max",
        "mamba_dt_init_floor",
        "mamba_a_init_min",
        "mamba_a_init_max",
        "mamba_conv_init",
    }
)
"""Model config fields a resume may set differently from the checkpoint's."""


def latest_checkpoint_directory(load_dir: str | Path) -> Path | None:
    """The iteration directory ``--load load_dir`` resumes from, or ``None`` when nothing is saved there."""
    iteration = latest_iteration(load_dir)
    return None if iteration is None else checkpoint_dir(load_dir, iteration)


def explicit_fields(parser: argparse.ArgumentParser, argv: Sequence[str] | None, names: set[str]) -> set[str]:
    """The fields of ``names`` that ``argv`` sets explicitly (argparse fills a default only into an
    attribute the namespace lacks, so a marker left in place means the flag was not given)."""
    marker = object()
    namespace = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(names, marker)))
    return {name for name in names if getattr(namespace, name) is not marker}


def apply_saved_defaults(
    namespace: argparse.Namespace, saved: dict[str, dict[str, Any]], explicit: set[str]
) -> None:
    """Set every field of ``namespace`` not in ``explicit`` to its value in the ``saved`` configs.

    ``load`` stays as given; ``save`` follows an explicit ``--output-dir`` (re-derived from it)
    unless it is given itself."""
    for fields in saved.values():
        for name, value in fields.items():
            if name not in explicit and name != "load" and hasattr(namespace, name):
                setattr(namespace, name, value)
    if "output_dir" in explicit and "save" not in explicit:
        namespace.save = None


def check_model_matches_checkpoint(model: TransformerConfig, directory: Path) -> None:
    """Refuse resuming ``directory`` (an iteration directory) with a model it cannot hold; a
    checkpoint without a model config is not checked.

    Raises:
        ConfigError: naming every field that differs from the checkpoint's, with both values.
    """
    if not has_model_config(directory):
        return
    saved, _ = read_model_config(directory)
    differing = sorted(
        name
        for name, value in saved.items()
        if name not in RESUME_MAY_CHANGE
        and hasattr(model, name)
        and _differs(name, getattr(model, name), value)
    )
    if differing:
        details = ", ".join(
            f"{name}={getattr(model, name)!r} (checkpoint: {saved[name]!r})" for name in differing
        )
        raise ConfigError(
            differing,
            f"the checkpoint in {directory} holds a different model: {details}; leave these flags out to "
            "resume with the checkpoint's values, or start a new run without --load",
        )


def _differs(name: str, value: Any, saved: Any) -> bool:
    """Whether a model field differs from its saved value; a hybrid layer pattern's ``|`` (where
    the pipeline stages split, a layout) is not compared."""
    if name == "hybrid_layer_pattern" and value is not None and saved is not None:
        return value.replace(STAGE_SEPARATOR, "") != saved.replace(STAGE_SEPARATOR, "")
    return value != saved


def check_vocabulary_matches_checkpoint(vocab_size: int, directory: Path) -> None:
    """Refuse resuming ``directory`` with a tokenizer of another vocabulary size than the one it
    was trained with; a checkpoint without a model config is not checked.

    Raises:
        ConfigError: naming ``tokenizer_file`` and ``vocab_size``, with both sizes.
    """
    if not has_model_config(directory):
        return
    _, saved = read_model_config(directory)
    if vocab_size != saved:
        raise ConfigError(
            ["tokenizer_file", "vocab_size"],
            f"the tokenizer has {vocab_size} ids, the checkpoint in {directory} was trained with {saved}: "
            "resume with the tokenizer of its run (saved there as tokenizer.json)",
        )


def saved_train_configs(load_dir: str | Path) -> tuple[Path, dict[str, dict[str, Any]]] | None:
    """The iteration directory ``--load load_dir`` resumes from and its saved run configs, or
    ``None`` when there is no checkpoint or it does not carry them."""
    directory = latest_checkpoint_directory(load_dir)
    if directory is None:
        return None
    saved = read_train_configs(directory)
    return None if saved is None else (directory, saved)
