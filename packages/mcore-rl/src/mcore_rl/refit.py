"""Weight refit: the trainer's current weights copied into a live inference engine's model, in
place, whatever the tensor-parallel sizes of the two (gathered to full tensors over the trainer's
group, then cut to the engine's shards)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_inference import DynamicInferenceEngine
from mcore_models import gather_full_tensor, shard_full_tensor, state_tensors


@experimental_api
class RefitError(RuntimeError):
    """Base of the errors ``refit`` raises before copying anything (the engine keeps its weights)."""


@experimental_api
class EngineBusyError(RefitError):
    """The engine has unfinished requests (queued, running, or kept by ``suspend``): refit would
    mix two policies in one rollout. Finish or abort them first."""


@experimental_api
class RefitMismatchError(RefitError, ValueError):
    """The trainer's and the engine's models differ in a tensor's name or full (unsharded) shape;
    the message names the tensor."""


def _tp_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The model's tensor-parallel group when it has more than one rank, else ``None``."""
    group = getattr(model, "tp_group", None)
    return group if group is not None and dist.get_world_size(group) > 1 else None


def _full_shape(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The unsharded shape of this rank's ``tensor`` (split over ``group`` if tagged so)."""
    shape = list(tensor.shape)
    if group is not None and getattr(tensor, "tensor_model_parallel", False):
        shape[tensor.partition_dim] *= dist.get_world_size(group)
    return tuple(shape)


def _padded_vocab(model: torch.nn.Module) -> int | None:
    return getattr(model, "padded_vocab_size", None)


def _vocab_rows(trainer: torch.nn.Module, engine_model: torch.nn.Module, source, target) -> bool:
    """Whether full shapes ``source`` (trainer) and ``target`` (engine) differ only in rows of
    vocabulary padding: dim 0 is each model's padded vocabulary, of one real vocabulary."""
    return (
        source[1:] == target[1:]
        and _padded_vocab(trainer) == source[0]
        and _padded_vocab(engine_model) == target[0]
        and getattr(trainer, "vocab_size", None) == getattr(engine_model, "vocab_size", None)
    )


def _plan(
    trainer: torch.nn.Module,
    source: Mapping[str, torch.Tensor],
    group: dist.ProcessGroup | None,
    engine_model: torch.nn.Module,
) -> dict[str, torch.Tensor]:
    """The engine's tensor for each of the trainer's (``source``, split over ``group``), by name;
    ``RefitMismatchError`` naming the first tensor one model lacks or whose full shape differs."""
    target = state_tensors(engine_model)
    missing, unexpected = sorted(set(source) - set(target)), sorted(set(target) - set(source))
    if missing or unexpected:
        raise RefitMismatchError(
            f"the models' tensors differ: only the trainer has {missing[:5]}, only the engine has "
            f"{unexpected[:5]} ({len(missing)} and {len(unexpected)} in all)"
        )
    engine_group = _tp_group(engine_model)
    for name in source:
        full, engine_full = _full_shape(source[name], group), _full_shape(target[name], engine_group)
        if full != engine_full and not _vocab_rows(trainer, engine_model, full, engine_full):
            raise RefitMismatchError(
                f"{name}: the trainer's full shape {list(full)} differs from the engine's {list(engine_full)}"
            )
    return target


def _check(
    trainer: torch.nn.Module,
    source: Mapping[str, torch.Tensor],
    group: dist.ProcessGroup | None,
    engine: DynamicInferenceEngine | None,
) -> dict[str, torch.Tensor] | None:
    """The copy plan (``None`` without an engine); raises what refuses the refit."""
    if engine is None:
        return None
    if not isinstance(engine, DynamicInferenceEngine):
        raise TypeError(f"engine: must be a DynamicInferenceEngine or None, got {type(engine).__name__}")
    if engine.has_unfinished_requests():
        raise EngineBusyError("the engine has unfinished requests: finish or abort them before refit")
    return _plan(trainer, source, group, engine.model)


def _agree(error: Exception | None, group: dist.ProcessGroup | None) -> None:
    """Raise ``error``, or the first error of another rank of ``group``, on every rank of it, so
    that no rank enters the gathers that another left (collective over ``group``)."""
    errors = [error]
    if group is not None:
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e is not None), None)
    if first is error and error is not None:
        raise error
    if first is not None:
        raise type(first)(f"refused on another rank of the trainer's tensor-parallel group: {first}")


def _engine_tensor(full: torch.Tensor, target: torch.Tensor, engine_model: torch.nn.Module) -> torch.Tensor:
    """This engine rank's shard of ``full`` (the trainer's whole tensor) for ``target``."""
    group = _tp_group(engine_model)
    shape = _full_shape(target, group)
    if full.shape != shape:  # vocabulary padding: the real rows, zeros after them
        rows = engine_model.vocab_size
        padded = full.new_zeros(shape)
        padded[:rows] = full[:rows]
        full = padded
    if group is None:
        return full
    return shard_full_tensor(target, full, dist.get_rank(group), dist.get_world_size(group))


def _copy(
    sources: Mapping[str, torch.Tensor],
    group: dist.ProcessGroup | None,
    targets: dict[str, torch.Tensor] | None,
    engine_model: torch.nn.Module | None,
) -> None:
    """Gather each trainer tensor over ``group`` (one at a time) and copy it into the engine's in
    ``targets``."""
    with torch.no_grad():
        for name, source in sources.items():
            full = source.detach() if group is None else gather_full_tensor(source, group)
            if targets is not None:
                targets[name].copy_(_engine_tensor(full, targets[name], engine_model))


@experimental_api
def refit(
    trainer_model: torch.nn.Module,
    engine: DynamicInferenceEngine | None,
    *,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> int | None:
    """Copy ``trainer_model``'s weights into ``engine.model`` in place; return the engine's new
    ``weight_version`` (``None`` where ``engine`` is ``None``), to tag the rollouts it generates.

    Collective over the trainer's tensor-parallel group (``trainer_model.tp_group``): call it on
    every rank of that group, with ``engine=None`` on ranks that host no engine. Each tensor is
    gathered whole over that group, then each engine takes its shard at its own tensor-parallel
    rank and size (``engine.model.tp_group``), cast to the engine's dtype (e.g. bfloat16); rows of
    vocabulary padding (which differ with the TP size) are zero. The engine's parameters are
    written in place (no new allocation; CUDA graphs and CPU weight packing see the new values),
    and its prefix cache is dropped (see ``DynamicInferenceEngine.update_weights``). Pass the bare
    model, not a DDP wrapper. Pipeline stages and expert-parallel shards are not gathered: against
    a whole engine model they show up as differing names or shapes.

    ``tensors``: the trainer's whole (unsplit) tensors by state-dict name, copied instead of
    ``trainer_model``'s own, e.g. the gathered weights of a model sharded by mcore-fsdp
    (``full_state_dict()``); ``trainer_model`` then only tells the vocabulary sizes, nothing is
    gathered, and the call is not collective.

    Raises, on every rank of the group and before anything is copied:
        EngineBusyError: an engine has unfinished requests (refit refuses rather than pauses:
            a rollout never mixes two policies). Works while the engine is suspended.
        RefitMismatchError: a tensor one model lacks, or of another full shape, named.
        TypeError: ``engine`` is not a ``DynamicInferenceEngine`` or ``None``.
    """
    group = _tp_group(trainer_model) if tensors is None else None
    sources = state_tensors(trainer_model) if tensors is None else dict(tensors)
    targets, error = None, None
    try:
        targets = _check(trainer_model, sources, group, engine)
    except (RefitError, TypeError) as caught:
        error = caught
    _agree(error, group)
    if engine is None:
        _copy(sources, group, None, None)
        return None
    return engine.update_weights(lambda model: _copy(sources, group, targets, model))
