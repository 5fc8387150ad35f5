"""One pass of micro-batches through this rank's chunks with the pipeline schedule that fits, and
the mean loss agreed on by every rank."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from mcore_parallel import (
    DistributedDataParallel,
    ProcessGroupCollection,
    forward_backward_no_pipelining,
    forward_backward_pipelining,
    get_group_device,
)

from ..transformer.context_parallel import gather_sequence, split_batch
from ..transformer.moe import aux_loss_backward_scale
from .model_setup import TrainModel


def masked_mean_loss(per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of per-token losses where ``loss_mask`` is 1."""
    return (per_token.float() * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


def _batch_loss(per_token: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return masked_mean_loss(per_token, batch["loss_mask"])


LastStageOutput = Callable[[torch.Tensor, dict], torch.Tensor]


class _SumOverContextParallel(torch.autograd.Function):
    """Identity whose backward multiplies by the CP size: DDP averages gradients over data x context
    parallel ranks, but the CP ranks' gradients (each of its own tokens) must add up."""

    @staticmethod
    def forward(ctx, x, cp_size):
        ctx.cp_size = cp_size
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.cp_size, None


def make_forward_step(last_stage_output: LastStageOutput = _batch_loss, pass_labels: bool = True):
    """A ``forward_step_func`` for the schedules: micro-batch dicts in, ``last_stage_output(model
    output, batch)`` out of the last stage (default: the masked mean loss), hidden states elsewhere.
    The model output is the per-token loss, or with ``pass_labels=False`` the (vocab-parallel) logits.

    With context parallelism the model sees this CP rank's part of the batch (``split_batch``) and
    ``last_stage_output`` the whole sequence's output (``gather_sequence``), so a loss is that of
    CP = 1 on every rank."""

    def forward_step(
        data_iterator, chunk: torch.nn.Module, input_tensor: torch.Tensor | None
    ) -> torch.Tensor:
        batch = whole_batch = next(data_iterator)
        model = chunk.module[0] if isinstance(chunk, DistributedDataParallel) else chunk
        cp_group = model.cp_group
        if cp_group is not None:
            batch = split_batch(batch, dist.get_rank(cp_group), dist.get_world_size(cp_group))
        if input_tensor is not None:
            model.set_input_tensor(input_tensor)
        labels = batch.get("labels") if model.post_process and pass_labels else None
        output = model(batch["tokens"], position_ids=batch["position_ids"], labels=labels)
        if not model.post_process:
            return output
        if cp_group is not None:
            scaled = _SumOverContextParallel.apply(output, dist.get_world_size(cp_group))
            output = gather_sequence(scaled, cp_group)
        return last_stage_output(output, whole_batch)

    return forward_step


def run_micro_batches(
    model: TrainModel,
    micro_batches: list[dict[str, torch.Tensor]],
    groups: ProcessGroupCollection,
    forward_only: bool = False,
    dtype: torch.dtype = torch.float32,
    last_stage_output: LastStageOutput = _batch_loss,
    pass_labels: bool = True,
) -> list[torch.Tensor]:
    """Forward (and backward) over ``micro_batches``: 1F1B for pipelines, interleaved with several
    chunks. Returns the per-micro-batch losses on the last stage, ``[]`` elsewhere. ``last_stage_output``
    and ``pass_labels``: see ``make_forward_step``.

    With several chunks the whole pass runs under ``no_sync``; the optimizer's step reduces."""
    schedule_model = model.schedule_model
    common = dict(
        forward_step_func=make_forward_step(last_stage_output, pass_labels),
        num_microbatches=len(micro_batches),
        forward_only=forward_only,
    )
    no_sync = model.ddp.no_sync() if isinstance(schedule_model, list) else contextlib.nullcontext()
    # Each micro-batch loss is divided by their number before backward; so are the MoE router losses.
    with no_sync, aux_loss_backward_scale(1.0 / len(micro_batches)):
        if dist.get_world_size(groups.pp) == 1:
            return forward_backward_no_pipelining(
                data_iterator=iter(micro_batches), model=schedule_model, **common
            )
        iterators = (
            [iter(micro_batches) for _ in model.chunks] if len(model.chunks) > 1 else iter(micro_batches)
        )
        return forward_backward_pipelining(
            data_iterator=iterators, model=schedule_model, pp_group=groups.pp, dtype=dtype, **common
        )


def global_mean_loss(losses: list[torch.Tensor], groups: ProcessGroupCollection) -> float:
    """The mean of the last stages' micro-batch losses over all data-parallel ranks, on every rank.

    Collective over the world: ranks that are not a last stage contribute nothing.
    """
    values = torch.zeros(2, dtype=torch.float64, device=get_group_device(groups.dp))
    last_stage = dist.get_rank(groups.pp) == dist.get_world_size(groups.pp) - 1
    first_tp = dist.get_rank(groups.tp) == 0
    if losses and last_stage and first_tp:
        values[0] = torch.stack([loss.double() for loss in losses]).mean().to(values.device)
        values[1] = 1.0
    dist.all_reduce(values)
    return (values[0] / values[1]).item()
