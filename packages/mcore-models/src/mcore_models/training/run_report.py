"""The report of a finished run (``report.json``'s dict) and where it goes: ``loss.png``,
``sample.txt``, ``report.json``, the Weights & Biases summary and the printed summary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import TrainConfigs
from .report import summary_text, write_loss_plot, write_report
from .run_context import RunContext
from .wandb_writer import WandbWriter


@dataclass(kw_only=True)
class RunOutcome:
    """What a run did: where it started, how long it trained, its final held-out result, its last
    checkpoint, the whole model's parameter count, the sample and the recorded history."""

    start: int
    train_seconds: float
    final: dict[str, float]
    parameters: int
    last_saved: Path | None
    sample: str | None
    history: dict
    straggler_reports: list[dict]
    unigram_baseline: float | None
    kd_report: dict | None = None


def layout_text(configs: TrainConfigs, dp_size: int) -> str:
    """``TP=.. PP=.. [VPP=..] [CP=..] [EP=..] [ETP=..] DP=.. [SP] [distributed-optimizer] [FSDP(..)]``."""
    model, training = configs.model, configs.training
    parts = [f"TP={model.tensor_model_parallel_size}", f"PP={model.pipeline_model_parallel_size}"]
    if model.virtual_pipeline_model_parallel_size:
        parts.append(f"VPP={model.virtual_pipeline_model_parallel_size}")
    if model.context_parallel_size > 1:
        parts.append(f"CP={model.context_parallel_size}")
    if model.expert_model_parallel_size > 1:
        parts.append(f"EP={model.expert_model_parallel_size}")
    if model.expert_tensor_parallel_size is not None:
        parts.append(f"ETP={model.expert_tensor_parallel_size}")
    parts.append(f"DP={dp_size}")
    text = " ".join(parts) + (" SP" if model.sequence_parallel else "")
    text += " distributed-optimizer" if configs.ddp.use_distributed_optimizer else ""
    return text + (f" FSDP({training.fsdp_strategy})" if training.fsdp else "")


def run_report(context: RunContext, outcome: RunOutcome) -> dict:
    """``report.json``'s dict (``kd`` only with distillation)."""
    configs, training, timers = context.configs, context.configs.training, context.timers
    iterations_run = training.train_iters - outcome.start
    tokens = iterations_run * context.tokens_per_iteration
    history = outcome.history
    report = {
        "iterations": training.train_iters,
        "iterations_run": iterations_run,
        "resumed_from": outcome.start or None,
        "world_size": context.world,
        "layout": layout_text(configs, context.dp_size),
        "device": str(context.device),
        "dtype": str(context.dtype).removeprefix("torch."),
        "parameters": outcome.parameters,
        "global_batch_size": training.global_batch_size,
        "seq_length": configs.data.seq_length,
        "tokens_seen": tokens,
        "train_seconds": outcome.train_seconds,
        "tokens_per_second": tokens / max(outcome.train_seconds, 1e-9),
        "final_train_loss": history["train"][-1][1] if history["train"] else None,
        "final_heldout": outcome.final,
        "unigram_baseline": outcome.unigram_baseline,
        "checkpoint": str(outcome.last_saved) if outcome.last_saved else None,
        "hf_export": training.export_hf,
        "sample_prompt": training.sample_prompt,
        "sample": outcome.sample,
        "startup_seconds": timers.startup_phases(),
        "mean_seconds": {name: timers(name).average() for name in timers.names() if timers(name).count},
        "output_dir": str(context.output_dir.resolve()),
        "history": history,
        "straggler_reports": outcome.straggler_reports,
    }
    if outcome.kd_report is not None:
        report["kd"] = outcome.kd_report
    return report


def publish_report(context: RunContext, report: dict, wandb_run: WandbWriter) -> None:
    """Write ``loss.png``, ``sample.txt`` (with a sample) and ``report.json``, send the W&B summary
    and print the summary (rank 0)."""
    output_dir, sample = context.output_dir, report["sample"]
    write_loss_plot(output_dir / "loss.png", report["history"], report["unigram_baseline"])
    if sample is not None:
        (output_dir / "sample.txt").write_text(sample + "\n")
    write_report(output_dir / "report.json", report)
    final = report["final_heldout"]
    wandb_run.summary(
        {
            "final/heldout_loss": final["loss"],
            "final/heldout_perplexity": final["perplexity"],
            "final/train_loss": report["final_train_loss"],
            "final/tokens_per_second": report["tokens_per_second"],
            "final/train_seconds": report["train_seconds"],
            "final/tokens_seen": report["tokens_seen"],
            "parameters": report["parameters"],
            "unigram_baseline": report["unigram_baseline"],
        }
    )
    print(summary_text(report))
    if sample is not None:
        print(f"\ngreedy sample from {report['sample_prompt']!r}:\n{'-' * 60}\n{sample}\n{'-' * 60}")
