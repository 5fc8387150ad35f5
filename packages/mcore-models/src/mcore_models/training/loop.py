"""``pretrain``: the training run of one rank, from process groups to the final report.

Call it on every rank of an initialized default process group (``mcore-train`` launches the
ranks). The order of things: process groups, data, model and optimizer, the dropout seed (once;
checkpoints carry the random-number states on), checkpoint load, the iterations (evaluation and
saves on their intervals, metrics to TensorBoard and Weights & Biases every ``log_interval``),
then final evaluation, checkpoint, Hugging Face export, a greedy sample and, on rank 0,
``loss.png``, ``report.json`` and the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from pathlib import Path

import torch
import torch.distributed as dist
from mcore_api import internal_api
from mcore_parallel import (
    ConfigError,
    DistributedCheckpointer,
    StragglerDetector,
    Timers,
    destroy_model_parallel,
    get_device,
    get_group_device,
    initialize_model_parallel,
    latest_iteration,
    model_parallel_manual_seed,
    reduce_sequence_parallel_grads,
)

from ..checkpoints.metadata import write_checkpoint_metadata
from ..debug.grad_logger import DataGradientLogger
from ..transformer.moe import reset_global_loads, router_loss_metrics, update_expert_biases
from .batches import iteration_micro_batches, open_train_data
from .checkpointing import load_training_checkpoint, save_training_checkpoint
from .config import TrainConfigs
from .distillation import DistillationRun, build_projections, check_distillation
from .evaluation import evaluate
from .fsdp import (
    FSDPOptimizer,
    build_fsdp_train_model,
    check_fsdp_available,
    check_fsdp_layout,
    fsdp_full_model,
    fsdp_parameter_count,
)
from .generation import greedy_generate
from .hf_export import export_final_model, hf_model_type
from .lr_schedule import learning_rate
from .metrics_log import MetricsLog
from .model_setup import build_train_model
from .optimizer import build_optimizer
from .progress import TrainingProgress
from .report import summary_text, write_loss_plot, write_report
from .resume_config import (
    check_model_matches_checkpoint,
    check_vocabulary_matches_checkpoint,
    latest_checkpoint_directory,
)
from .router_replay_run import RouterReplayRun, check_router_replay
from .schedule import global_mean_loss, run_micro_batches
from .tensorboard_writer import TensorBoardWriter, check_tensorboard_available
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
    dp = world_size // mp
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
    model_config, training = configs.model, configs.training
    if training.fsdp:
        check_fsdp_available()
    check_wandb_available(configs.logger)
    check_tensorboard_available(configs.logger)
    device = get_device()
    dtype = model_config.params_dtype
    with timers.startup_phase("process groups"):
        groups = initialize_model_parallel(
            tensor_model_parallel_size=model_config.tensor_model_parallel_size,
            pipeline_model_parallel_size=model_config.pipeline_model_parallel_size,
            context_parallel_size=model_config.context_parallel_size,
            virtual_pipeline_model_parallel_size=model_config.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=model_config.expert_model_parallel_size,
            expert_tensor_parallel_size=model_config.expert_tensor_parallel_size,
            order=model_config.parallel_order,
        )
    try:
        run_config = dataclasses.asdict(configs)
        with WandbWriter(configs.logger, rank == 0, training.output_dir, run_config) as wandb_run:
            return _train(configs, given, groups, timers, device, dtype, rank, world, wandb_run)
    finally:
        destroy_model_parallel()


def _train(configs, given, groups, timers, device, dtype, rank, world, wandb_run) -> dict | None:
    model_config, training, data_config = configs.model, configs.training, configs.data
    dp_rank, dp_size = dist.get_rank(groups.dp), dist.get_world_size(groups.dp)
    tp_rank = dist.get_rank(groups.tp)
    global_batch, micro = training.global_batch_size, training.micro_batch_size
    is_writer = rank == 0
    progress_output = training.progress and is_writer

    with timers.startup_phase("data"):
        samples = training.train_iters * global_batch, training.eval_iters * global_batch
        if rank != 0:
            dist.barrier()  # rank 0 builds (or opens) the cached data first
        data = open_train_data(data_config, training.seed, *samples, progress=progress_output)
        if rank == 0:
            dist.barrier()
    with timers.startup_phase("model"):
        vocab_size = data.tokenizer.vocab_size
        if configs.checkpoint.load is not None:
            resume_from = latest_checkpoint_directory(configs.checkpoint.load)
            if resume_from is not None:
                check_vocabulary_matches_checkpoint(vocab_size, resume_from)
        if training.fsdp:
            model = build_fsdp_train_model(
                model_config,
                vocab_size,
                groups,
                training.fsdp_strategy,
                training.seed,
                offload_optimizer=configs.optimizer.optimizer_cpu_offload,
            )
            optimizer = FSDPOptimizer(model.ddp, configs.optimizer, model.expert_names)
        else:
            model = build_train_model(
                model_config, vocab_size, groups, configs.ddp, training.seed, build_projections(configs)
            )
            optimizer = build_optimizer(model.ddp, configs.optimizer, groups)
    distill = None
    if configs.distillation.teacher_load is not None:
        with timers.startup_phase("teacher"):
            distill = DistillationRun(configs, model, data.tokenizer, groups, device, dtype)
    # dropout's streams, seeded once and carried on by checkpoints (a resumed run continues them)
    model_parallel_manual_seed(training.seed + _DROPOUT_SEED_OFFSET, tp_rank)
    checkpointer = DistributedCheckpointer(configs.checkpoint)
    # beside each checkpoint's tensors: what rebuilds the model and resumes the run (``given``: the
    # configs as passed to ``pretrain``, before machine-dependent values were filled in)
    write_files = functools.partial(
        write_checkpoint_metadata,
        model_config=model_config,
        vocab_size=vocab_size,
        tokenizer=data.tokenizer,
        train_configs=given,
    )
    start, history = 0, {"train": [], "heldout": [], "lr": []}
    load_dir = configs.checkpoint.load
    if load_dir is not None and latest_iteration(load_dir) is not None:
        with timers.startup_phase("checkpoint load"):
            start, saved = load_training_checkpoint(checkpointer, model, optimizer, groups.tp, groups)
            history.update(saved)
    elif load_dir is not None and is_writer:
        print(f"no checkpoint in {load_dir}; starting from scratch")

    output_dir = Path(training.output_dir)
    if is_writer:
        output_dir.mkdir(parents=True, exist_ok=True)
    tensorboard = TensorBoardWriter(configs.logger, is_writer)
    tokens_per_iteration = global_batch * data_config.seq_length
    log = MetricsLog(configs.logger, tensorboard, wandb_run, timers, tokens_per_iteration, device)
    straggler = StragglerDetector.from_config(configs.straggler) if configs.straggler.enabled else None
    grad_logger = (
        DataGradientLogger(model.container, output_dir / "grads", every=training.save_grads_interval)
        if training.save_grads_interval
        else None
    )
    progress = TrainingProgress(training.train_iters, start, tokens_per_iteration, progress_output)
    if is_writer and start:
        progress.write(f"resumed from {load_dir} at iteration {start}")
    model.train(True)
    kl_before = distill.heldout_kl(data.heldout) if distill is not None else None
    router_replay = (
        RouterReplayRun(configs, model.container, rank, start + 1)
        if training.moe_router_replay != "off"
        else None
    )
    last_saved, straggler_reports = None, []
    began = time.perf_counter()
    for iteration in range(start + 1, training.train_iters + 1):
        timers("iteration").start()
        lr = learning_rate(iteration, configs.optimizer.lr, configs.scheduler, training.train_iters)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with log.timed("batch"):
            batches = iteration_micro_batches(
                data.train, iteration, global_batch, micro, dp_rank, dp_size, device
            )
        optimizer.zero_grad()
        step_timer = straggler.step() if straggler is not None else contextlib.nullcontext()
        with step_timer:
            if grad_logger is not None:
                grad_logger.begin(iteration)
            with log.timed("forward-backward"):
                if router_replay is not None:
                    router_replay.begin(iteration)
                with distill.loss.capture() if distill is not None else contextlib.nullcontext():
                    kd_arguments = distill.schedule_arguments() if distill is not None else {}
                    losses = run_micro_batches(model, batches, groups, dtype=dtype, **kd_arguments)
                if router_replay is not None:
                    router_replay.end(iteration)
            with log.timed("sequence-parallel-grads"):
                reduce_sequence_parallel_grads(model.container, groups.tp)  # their main_grads
            if grad_logger is not None:
                _log_grads(grad_logger, model)
            with log.timed("optimizer"):
                grad_norm = optimizer.step()
                update_expert_biases(model.container, groups.dp_cp)  # CP ranks route other tokens
                reset_global_loads(model.container)
        loss = global_mean_loss(losses, groups)
        seconds = timers("iteration").stop()
        history["train"].append([iteration, loss])
        history["lr"].append([iteration, lr])
        progress.update(iteration, loss, seconds, lr)
        extra = router_loss_metrics(model.container) | (distill.metrics(iteration) if distill else {})
        log.iteration(iteration, loss, lr, grad_norm, seconds, extra)
        if straggler is not None:
            report = straggler.maybe_report()
            if report is not None:
                straggler_reports.append({"iteration": iteration, **dataclasses.asdict(report)})
                progress.write(f"straggler report at iteration {iteration}: {report}")
        if (
            training.eval_interval
            and iteration % training.eval_interval == 0
            and iteration < training.train_iters
        ):
            with log.timed("evaluation"):
                result = evaluate(
                    model, data.heldout, training.eval_iters, global_batch, micro, groups, device, dtype
                )
            history["heldout"].append([iteration, result["loss"]])
            progress.write(
                f"iteration {iteration}: held-out loss {result['loss']:.3f} (ppl {result['perplexity']:.1f})"
            )
            log.heldout(iteration, result)
        interval = configs.checkpoint.save_interval
        if interval and iteration % interval == 0 and iteration < training.train_iters:
            with log.timed("save"):
                last_saved = save_training_checkpoint(
                    checkpointer, model, optimizer, groups.tp, iteration, history, groups, write_files
                )
                if router_replay is not None:
                    router_replay.save(configs, world, iteration)  # a resume records on from here
    progress.close()
    train_seconds = time.perf_counter() - began
    if router_replay is not None:
        router_replay.save(configs, world, training.train_iters)
    iterations_run = training.train_iters - start

    with log.timed("evaluation"):
        final = evaluate(model, data.heldout, training.eval_iters, global_batch, micro, groups, device, dtype)
    if not history["heldout"] or history["heldout"][-1][0] != training.train_iters:
        history["heldout"].append([training.train_iters, final["loss"]])
    log.heldout(training.train_iters, final)
    kd_report = distill.report(kl_before, distill.heldout_kl(data.heldout)) if distill is not None else None
    if iterations_run > 0 or last_saved is None:
        with log.timed("save"):
            last_saved = save_training_checkpoint(
                checkpointer, model, optimizer, groups.tp, training.train_iters, history, groups, write_files
            )
    with log.timed("save"):
        checkpointer.wait()  # an asynchronous save is complete and marked latest from here on
    if training.export_hf:
        exported = fsdp_full_model(model, model_config, groups) if training.fsdp else model.chunks[0]
        _export_hf(exported, model, groups, training.export_hf, data.tokenizer)
    sample = None
    if training.sample_tokens:
        prompt = data.tokenizer.encode(training.sample_prompt)
        pad = model_config.tensor_model_parallel_size if model_config.sequence_parallel else 1
        if model_config.context_parallel_size > 1:  # 2 x CP chunks, each split by sequence parallelism
            pad *= 2 * model_config.context_parallel_size
        ids = greedy_generate(
            model,
            prompt,
            training.sample_tokens,
            groups,
            device,
            max_length=data_config.seq_length,
            stop_id=data.tokenizer.eod_id,
            dtype=dtype,
            pad_multiple=pad,
            repetition_penalty=training.sample_repetition_penalty,
        )
        sample = data.tokenizer.decode(ids)
    parameters = _count_parameters(model, groups, training.fsdp)
    tensorboard.close()
    if grad_logger is not None:
        grad_logger.remove()
    if not is_writer:
        return None
    report = {
        "iterations": training.train_iters,
        "iterations_run": iterations_run,
        "resumed_from": start or None,
        "world_size": world,
        "layout": (
            f"TP={model_config.tensor_model_parallel_size} PP={model_config.pipeline_model_parallel_size}"
            + (
                f" VPP={model_config.virtual_pipeline_model_parallel_size}"
                if model_config.virtual_pipeline_model_parallel_size
                else ""
            )
            + (f" CP={model_config.context_parallel_size}" if model_config.context_parallel_size > 1 else "")
            + (
                f" EP={model_config.expert_model_parallel_size}"
                if model_config.expert_model_parallel_size > 1
                else ""
            )
            + (
                f" ETP={model_config.expert_tensor_parallel_size}"
                if model_config.expert_tensor_parallel_size is not None
                else ""
            )
            + f" DP={dp_size}"
            + (" SP" if model_config.sequence_parallel else "")
            + (" distributed-optimizer" if configs.ddp.use_distributed_optimizer else "")
            + (f" FSDP({training.fsdp_strategy})" if training.fsdp else "")
        ),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": parameters,
        "global_batch_size": global_batch,
        "seq_length": data_config.seq_length,
        "tokens_seen": iterations_run * tokens_per_iteration,
        "train_seconds": train_seconds,
        "tokens_per_second": iterations_run * tokens_per_iteration / max(train_seconds, 1e-9),
        "final_train_loss": history["train"][-1][1] if history["train"] else None,
        "final_heldout": final,
        "unigram_baseline": data.unigram_baseline,
        "checkpoint": str(last_saved) if last_saved else None,
        "hf_export": training.export_hf,
        "sample_prompt": training.sample_prompt,
        "sample": sample,
        "startup_seconds": timers.startup_phases(),
        "mean_seconds": {name: timers(name).average() for name in timers.names() if timers(name).count},
        "output_dir": str(output_dir.resolve()),
        "history": history,
        "straggler_reports": straggler_reports,
    }
    if kd_report is not None:
        report["kd"] = kd_report
    write_loss_plot(output_dir / "loss.png", history, data.unigram_baseline)
    if sample is not None:
        (output_dir / "sample.txt").write_text(sample + "\n")
    write_report(output_dir / "report.json", report)
    wandb_run.summary(
        {
            "final/heldout_loss": final["loss"],
            "final/heldout_perplexity": final["perplexity"],
            "final/train_loss": report["final_train_loss"],
            "final/tokens_per_second": report["tokens_per_second"],
            "final/train_seconds": train_seconds,
            "final/tokens_seen": report["tokens_seen"],
            "parameters": parameters,
            "unigram_baseline": data.unigram_baseline,
        }
    )
    print(summary_text(report))
    if sample is not None:
        print(f"\ngreedy sample from {training.sample_prompt!r}:\n{'-' * 60}\n{sample}\n{'-' * 60}")
    return report


def _count_parameters(model, groups, fsdp: bool = False) -> int:
    """Parameters of the whole model over all shards and stages (collective)."""
    if fsdp:
        return fsdp_parameter_count(model)
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
    # experts: each slice once (a tensor replicated over expert-TP ranks on the first), over all stages
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
    return round((total + experts).item())


def _log_grads(logger: DataGradientLogger, model) -> None:
    """Hand DDP's accumulated gradients to the logger as ``.grad`` for its weight-gradient record."""
    params = list(model.container.parameters())
    for p in params:
        p.grad = p.main_grad
    logger.end()
    for p in params:
        p.grad = None


def _export_hf(exported, model, groups, directory: str, tokenizer) -> None:
    """``exported`` (this rank's unsharded ``GPTModel``) as a Hugging Face checkpoint (see ``hf_export``)."""
    if len(model.chunks) != 1 or dist.get_world_size(groups.pp) != 1:
        raise ConfigError(["export_hf", "pipeline_model_parallel_size"], "Hugging Face export needs PP = 1")
    export_final_model(exported, groups, directory, tokenizer)
