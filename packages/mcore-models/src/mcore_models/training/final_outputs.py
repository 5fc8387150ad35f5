"""What a finished run makes of its model: the Hugging Face export, the greedy sample and the
parameter count of the whole model."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_parallel import ConfigError, get_group_device

from .fsdp import fsdp_full_model, fsdp_parameter_count
from .generation import greedy_generate
from .hf_export import export_final_model
from .model_setup import TrainModel
from .run_context import RunContext


def export_hf(context: RunContext, model: TrainModel, tokenizer) -> None:
    """The trained model as a Hugging Face checkpoint in ``export_hf`` (collective; needs PP = 1)."""
    configs, groups = context.configs, context.groups
    training = configs.training
    if len(model.chunks) != 1 or dist.get_world_size(groups.pp) != 1:
        raise ConfigError(["export_hf", "pipeline_model_parallel_size"], "Hugging Face export needs PP = 1")
    exported = fsdp_full_model(model, configs.model, groups) if training.fsdp else model.chunks[0]
    export_final_model(exported, groups, training.export_hf, tokenizer)


def greedy_sample(context: RunContext, model: TrainModel, tokenizer) -> str:
    """``sample_tokens`` greedy tokens after ``sample_prompt`` (with ``sample_repetition_penalty``), decoded
    (collective)."""
    model_config, training = context.configs.model, context.configs.training
    prompt = tokenizer.encode(training.sample_prompt)
    pad = model_config.tensor_model_parallel_size if model_config.sequence_parallel else 1
    if model_config.context_parallel_size > 1:  # 2 x CP chunks, each split by sequence parallelism
        pad *= 2 * model_config.context_parallel_size
    ids = greedy_generate(
        model,
        prompt,
        training.sample_tokens,
        context.groups,
        context.device,
        max_length=context.configs.data.seq_length,
        stop_id=tokenizer.eod_id,
        dtype=context.dtype,
        pad_multiple=pad,
        repetition_penalty=training.sample_repetition_penalty,
    )
    return tokenizer.decode(ids)


def count_parameters(model: TrainModel, groups, fsdp: bool = False) -> int:
    """Parameters of the whole model over all shards and stages (collective)."""
    if fsdp:
        return fsdp_parameter_count(model, groups.pp)
    tp = dist.get_world_size(groups.tp)
    params = list(model.container.parameters())
    local = sum(
        p.numel() * (1.0 if getattr(p, "tensor_model_parallel", False) else 1.0 / tp)
        for p in params
        if not getattr(p, "expert_parallel", False)
    )
    device = get_group_device(groups.mp)
    total = torch.tensor([local], dtype=torch.float64, device=device)
    dist.all_reduce(total, group=groups.mp)
    return round((total + _expert_parameters(params, groups, device)).item())


def _expert_parameters(params, groups, device) -> torch.Tensor:
    """Expert parameters: each slice once (a tensor replicated over expert-TP ranks on the first),
    over all stages (collective)."""
    etp_rank = dist.get_rank(groups.expert_tp) if groups.expert_tp is not None else 0
    experts = sum(
        p.numel()
        for p in params
        if getattr(p, "expert_parallel", False)
        and (getattr(p, "expert_tensor_parallel_dim", None) is not None or etp_rank == 0)
    )
    experts = torch.tensor([experts], dtype=torch.float64, device=device)
    for group in (groups.tp_ep, groups.pp):
        if group is not None:
            dist.all_reduce(experts, group=group)
    return experts
