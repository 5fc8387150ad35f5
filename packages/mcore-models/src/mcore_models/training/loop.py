"""``pretrain``: the training run of one rank, from process groups to the final report.

Call it on every rank of an initialized default process group (``mcore-train`` launches the
ranks). ``pretrain`` resolves and checks the configs, makes the process groups and builds the
components of a ``Trainer`` (see ``trainer``) in this order: data, model and optimizer, the
distillation teacher, the dropout seed (once; checkpoints carry the random-number states on), the
checkpointer, the loggers; ``Trainer.train`` then resumes from a checkpoint, runs the iterations
(evaluation and saves on their intervals, metrics to TensorBoard and Weights & Biases every
``log_interval``) and the run's end (final evaluation, checkpoint, Hugging Face export, a greedy
sample and, on rank 0, ``loss.png``, ``report.json`` and the summary).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from mcore_api import internal_api
from mcore_parallel import (
    ConfigError,
    Timers,
    destroy_model_parallel,
    get_device,
    initialize_model_parallel,
    model_parallel_manual_seed,
)

from .batches import TrainData, open_train_data
from .config import TrainConfigs, TrainModelConfig
from .distillation import DistillationRun, build_projections, check_distillation
from .evaluator import HeldoutEvaluator
from .fsdp import (
    FSDPOptimizer,
    build_fsdp_train_model,
    check_fsdp_available,
    check_fsdp_layout,
)
from .hf_export import check_hybrid_export, hf_model_type
from .lr_schedule import LearningRateSchedule
from .model_setup import TrainModel, build_train_model
from .optimizer import build_optimizer
from .optimizer_protocol import TrainOptimizer
from .resume_config import (
    check_model_matches_checkpoint,
    check_vocabulary_matches_checkpoint,
    latest_checkpoint_directory,
)
from .router_replay_run import check_router_replay
from .run_context import RunContext
from .run_logging import RunLogging
from .tensorboard_writer import check_tensorboard_available
from .train_checkpoint import TrainCheckpoint
from .trainer import Trainer
from .wandb_writer import WandbWriter, check_wandb_available

_DROPOUT_SEED_OFFSET = 7919  # dropout's streams start from seed + 7919 (the weights': seed + 100 x stage)


@internal_api
def resolve_configs(configs: TrainConfigs, world_size: int) -> TrainConfigs:
    """Fill in what depends on the machine and the world: bfloat16 on a GPU, the checkpoint
    directory under the output directory, the global batch; check the batch divides.

    Raises:
        ConfigError: the global batch is not a multiple of micro-batch x data-parallel size, the
            interleaved schedule's micro-batches do not divide over the stages, a checkpoint format
            other than ``torch_dist``, an expert-parallel size that does not fit (see
            ``_check_expert_parallel`` and ``_check_expert_tensor_parallel``), a layout ``--fsdp`` cannot run, or an option context
            parallelism cannot (see ``_check_context_parallel``), ``export_hf`` for a model no Hugging
            Face family holds (see ``hf_export.hf_model_type``), a model that the checkpoint
            to resume (``checkpoint.load``) does not hold (see ``check_model_matches_checkpoint``), or
            a router replay that cannot work (see ``router_replay_run.check_router_replay``), or a
            distillation it does not do (see ``distillation.check_distillation``).
    """
    model, training = configs.model, configs.training
    if torch.cuda.is_available() and not (training.fp32 or model.fp16 or model.bf16):
        model = dataclasses.replace(model, bf16=True)
    checkpoint = configs.checkpoint
    if checkpoint.save is None:
        checkpoint = dataclasses.replace(checkpoint, save=str(Path(training.output_dir) / "checkpoints"))
    global_batch = _global_batch(configs, _data_parallel_size(model, world_size))
    _check_context_parallel(configs)
    if checkpoint.ckpt_format != "torch_dist":
        raise ConfigError(
            ["ckpt_format"],
            "mcore-train writes torch_dist checkpoints (torch.distributed.checkpoint; with --fsdp they hold "
            f"the DTensor state dicts); {checkpoint.ckpt_format!r} is not implemented",
        )
    _check_expert_parallel(configs, world_size)
    _check_expert_tensor_parallel(configs)
    if configs.training.export_hf:
        hf_model_type(model)  # a model no Hugging Face family holds is refused before training
    if training.fsdp:
        check_fsdp_layout(configs)
    resume_from = latest_checkpoint_directory(checkpoint.load) if checkpoint.load is not None else None
    if resume_from is not None:
        check_model_matches_checkpoint(model, resume_from)
    training = dataclasses.replace(training, global_batch_size=global_batch)
    resolved = dataclasses.replace(configs, model=model, checkpoint=checkpoint, training=training)
    check_router_replay(resolved, world_size)
    check_distillation(resolved)
    return resolved


def _data_parallel_size(model: TrainModelConfig, world_size: int) -> int:
    """The ranks divided by TP x PP x CP."""
    mp = model.tensor_model_parallel_size * model.pipeline_model_parallel_size * model.context_parallel_size
    if world_size % mp:
        raise ConfigError(
            [
                "tensor_model_parallel_size",
                "pipeline_model_parallel_size",
                "context_parallel_size",
                "nproc_per_node",
            ],
            f"TP x PP x CP ({mp}) must divide the number of ranks ({world_size})",
        )
    return world_size // mp


def _global_batch(configs: TrainConfigs, dp: int) -> int:
    """The global batch (default: one micro-batch per data-parallel rank), checked to divide."""
    model, training = configs.model, configs.training
    per_step = training.micro_batch_size * dp
    global_batch = training.global_batch_size or per_step
    if global_batch % per_step:
        raise ConfigError(
            ["global_batch_size", "micro_batch_size"],
            f"global_batch_size ({global_batch}) must be a multiple of micro_batch_size x data-parallel "
            f"size ({training.micro_batch_size} x {dp})",
        )
    vpp = model.virtual_pipeline_model_parallel_size
    if vpp is not None and (global_batch // per_step) % model.pipeline_model_parallel_size:
        raise ConfigError(
            ["global_batch_size", "virtual_pipeline_model_parallel_size"],
            f"the interleaved schedule needs micro-batches per step ({global_batch // per_step}) to be a "
            f"multiple of the pipeline size ({model.pipeline_model_parallel_size})",
        )
    return global_batch


def _check_expert_parallel(configs: TrainConfigs, world_size: int) -> None:
    """EP > 1 needs MoE layers and experts that divide over it; the expert grid (expert-TP x EP x
    expert-DP x PP, expert-TP defaulting to TP) must factor the ranks of a pipeline stage, as in
    Megatron-Core: TP x CP x DP = expert-TP x EP x expert-DP."""
    model, ep = configs.model, configs.model.expert_model_parallel_size
    if ep > 1 and (model.num_moe_experts is None or model.num_moe_experts % ep):
        raise ConfigError(
            ["num_moe_experts", "expert_model_parallel_size"],
            f"num_moe_experts ({model.num_moe_experts}) must be a multiple of expert_model_parallel_size ({ep})",
        )
    etp = model.expert_tensor_parallel_size or model.tensor_model_parallel_size
    stage = world_size // model.pipeline_model_parallel_size
    if stage % (etp * ep):
        raise ConfigError(
            ["expert_model_parallel_size", "expert_tensor_parallel_size", "nproc_per_node"],
            f"expert-tensor x expert parallel sizes ({etp} x {ep}) must divide the ranks of a pipeline "
            f"stage ({stage} = ranks / PP): TP x CP x DP = ETP x EP x expert-DP",
        )


def _check_expert_tensor_parallel(configs: TrainConfigs) -> None:
    """With ``expert_tensor_parallel_size`` set, the tensor-parallel ranks split each micro-batch's
    tokens among them for the experts."""
    model, training = configs.model, configs.training
    etp, tp = model.expert_tensor_parallel_size, model.tensor_model_parallel_size
    if etp is None:
        return
    tokens = configs.data.seq_length // model.context_parallel_size * training.micro_batch_size
    if tokens % tp:
        raise ConfigError(
            ["seq_length", "micro_batch_size", "tensor_model_parallel_size"],
            f"with expert_tensor_parallel_size set the {tp} tensor-parallel ranks split each micro-batch's "
            f"{tokens} tokens (per context-parallel rank) among them: make it a multiple of {tp}",
        )


def _check_context_parallel(configs: TrainConfigs) -> None:
    """CP > 1 needs sequences of a multiple of ``2 x CP`` tokens (times TP with sequence
    parallelism), whole documents' positions (no ``reset_position_ids``) and averaged gradients."""
    model, cp = configs.model, configs.model.context_parallel_size
    if cp == 1:
        return
    multiple = 2 * cp * (model.tensor_model_parallel_size if model.sequence_parallel else 1)
    if configs.data.seq_length % multiple:
        raise ConfigError(
            ["seq_length", "context_parallel_size"],
            f"seq_length ({configs.data.seq_length}) must be a multiple of {multiple} "
            "(2 x context_parallel_size, times the TP size with sequence parallelism)",
        )
    if configs.data.reset_position_ids:
        raise ConfigError(
            ["reset_position_ids", "context_parallel_size"],
            "context parallelism does not support packed documents (reset_position_ids)",
        )
    if configs.ddp.grad_reduce_op != "average":
        raise ConfigError(
            ["grad_reduce_op", "context_parallel_size"],
            "context parallelism needs grad_reduce_op 'average' (its ranks' gradients are rescaled for it)",
        )


def pretrain(configs: TrainConfigs) -> dict | None:
    """Train on every rank of the default process group; returns the report on rank 0, else ``None``."""
    timers = Timers()
    rank, world = dist.get_rank(), dist.get_world_size()
    given, configs = configs, resolve_configs(configs, world)
    if configs.training.fsdp:
        check_fsdp_available()
    check_wandb_available(configs.logger)
    check_tensorboard_available(configs.logger)
    device = get_device()
    with timers.startup_phase("process groups"):
        groups = _initialize_groups(configs.model)
    try:
        run_config = dataclasses.asdict(configs)
        with WandbWriter(configs.logger, rank == 0, configs.training.output_dir, run_config) as wandb_run:
            context = RunContext(
                configs=configs,
                given=given,
                groups=groups,
                timers=timers,
                device=device,
                dtype=configs.model.params_dtype,
                rank=rank,
                world=world,
            )
            return build_trainer(context, wandb_run).train()
    finally:
        destroy_model_parallel()


def _initialize_groups(model: TrainModelConfig):
    """mcore-parallel's process groups of the model's layout."""
    return initialize_model_parallel(
        tensor_model_parallel_size=model.tensor_model_parallel_size,
        pipeline_model_parallel_size=model.pipeline_model_parallel_size,
        context_parallel_size=model.context_parallel_size,
        virtual_pipeline_model_parallel_size=model.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=model.expert_model_parallel_size,
        expert_tensor_parallel_size=model.expert_tensor_parallel_size,
        order=model.parallel_order,
    )


def build_trainer(context: RunContext, wandb_run: WandbWriter) -> Trainer:
    """The ``Trainer`` of ``context``'s configs: data, model and optimizer, the distillation
    teacher (with ``teacher_load``), the dropout seed, checkpointer, loggers (collective)."""
    configs, timers, groups = context.configs, context.timers, context.groups
    data = _open_data(context)
    with timers.startup_phase("model"):
        model, optimizer = _build_model_and_optimizer(context, data.tokenizer.vocab_size)
    if configs.training.export_hf:
        check_hybrid_export(model.chunks[0])
    distillation = None
    if configs.distillation.teacher_load is not None:
        with timers.startup_phase("teacher"):
            distillation = DistillationRun(
                configs, model, data.tokenizer, groups, context.device, context.dtype
            )
    # dropout's streams, seeded once and carried on by checkpoints (a resumed run continues them)
    model_parallel_manual_seed(configs.training.seed + _DROPOUT_SEED_OFFSET, dist.get_rank(groups.tp))
    checkpoint = TrainCheckpoint(context, model, optimizer, data.tokenizer)
    if context.is_writer:
        context.output_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(
        context,
        model=model,
        optimizer=optimizer,
        data=data,
        schedule=LearningRateSchedule(configs.optimizer.lr, configs.scheduler, configs.training.train_iters),
        checkpoint=checkpoint,
        logging=RunLogging(context, model, wandb_run),
        evaluator=HeldoutEvaluator(context, model, data.heldout),
        distillation=distillation,
    )


def _open_data(context: RunContext) -> TrainData:
    """The training and held-out data (rank 0 builds or opens the cached data first)."""
    training = context.configs.training
    with context.timers.startup_phase("data"):
        samples = (
            training.train_iters * training.global_batch_size,
            training.eval_iters * training.global_batch_size,
        )
        if context.rank != 0:
            dist.barrier()
        data = open_train_data(context.configs.data, training.seed, *samples, progress=context.shows_progress)
        if context.rank == 0:
            dist.barrier()
    return data


def _build_model_and_optimizer(context: RunContext, vocab_size: int) -> tuple[TrainModel, TrainOptimizer]:
    """This rank's model and its optimizer: sharded with ``--fsdp``, else DDP with the local or
    distributed optimizer."""
    configs, groups, training = context.configs, context.groups, context.configs.training
    if configs.checkpoint.load is not None:
        resume_from = latest_checkpoint_directory(configs.checkpoint.load)
        if resume_from is not None:
            check_vocabulary_matches_checkpoint(vocab_size, resume_from)
    if training.fsdp:
        model = build_fsdp_train_model(
            configs.model,
            vocab_size,
            groups,
            training.fsdp_strategy,
            training.seed,
            offload_optimizer=configs.optimizer.optimizer_cpu_offload,
        )
        return model, FSDPOptimizer(model.ddp, configs.optimizer, model.names)
    model = build_train_model(
        configs.model, vocab_size, groups, configs.ddp, training.seed, build_projections(configs)
    )
    return model, build_optimizer(model.ddp, configs.optimizer, groups)
