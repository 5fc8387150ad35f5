"""Held-out evaluation: mean loss (nats/token) and perplexity over fixed held-out batches."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from mcore_api import experimental_api
from mcore_parallel import ProcessGroupCollection

from .batches import iteration_micro_batches
from .model_setup import TrainModel
from .schedule import LastStageOutput, global_mean_loss, run_micro_batches


@experimental_api
def evaluate(
    model: TrainModel,
    dataset,
    eval_iters: int,
    global_batch_size: int,
    micro_batch_size: int,
    groups: ProcessGroupCollection,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """``{"loss", "perplexity"}`` over the first ``eval_iters`` global batches of ``dataset`` (collective).

    Always the same batches, so evaluations during a run are comparable."""
    loss = heldout_mean(
        model, dataset, eval_iters, global_batch_size, micro_batch_size, groups, device, dtype
    )
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def heldout_mean(
    model: TrainModel,
    dataset,
    eval_iters: int,
    global_batch_size: int,
    micro_batch_size: int,
    groups: ProcessGroupCollection,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    last_stage_output: LastStageOutput | None = None,
    pass_labels: bool = True,
) -> float:
    """The mean of ``last_stage_output`` (default: the loss) over the first ``eval_iters`` global
    batches of ``dataset``, in eval mode without gradients (collective)."""
    dp_rank, dp_size = dist.get_rank(groups.dp), dist.get_world_size(groups.dp)
    output = {} if last_stage_output is None else {"last_stage_output": last_stage_output}
    model.train(False)
    values = []
    with torch.no_grad():
        for index in range(1, eval_iters + 1):
            batches = iteration_micro_batches(
                dataset, index, global_batch_size, micro_batch_size, dp_rank, dp_size, device
            )
            losses = run_micro_batches(model, batches, groups, True, dtype, pass_labels=pass_labels, **output)
            values.append(global_mean_loss(losses, groups))
    model.train(True)
    return sum(values) / len(values)
