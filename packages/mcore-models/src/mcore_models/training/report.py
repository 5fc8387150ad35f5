"""What a run leaves behind: ``loss.png``, ``report.json`` and the summary printed at the end."""

from __future__ import annotations

import json
from pathlib import Path


def write_loss_plot(path: Path, history: dict, unigram_baseline: float | None) -> Path:
    """Training loss per iteration, held-out loss at each evaluation, and the unigram baseline."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    train = history.get("train", [])
    if train:
        axes.plot([i for i, _ in train], [loss for _, loss in train], label="training loss", linewidth=1)
    heldout = history.get("heldout", [])
    if heldout:
        axes.plot(
            [i for i, _ in heldout], [loss for _, loss in heldout], "o-", label="held-out loss", markersize=4
        )
    if unigram_baseline is not None:
        axes.axhline(
            unigram_baseline, color="grey", linestyle="--", label=f"unigram baseline ({unigram_baseline:.2f})"
        )
    axes.set_xlabel("iteration")
    axes.set_ylabel("cross entropy [nats/token]")
    axes.set_title("mcore-train")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def write_report(path: Path, report: dict) -> Path:
    """``report`` as indented JSON."""
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def summary_text(report: dict) -> str:
    """A few lines for the terminal: tokens, time, held-out loss against the baseline, where things are."""
    final = report["final_heldout"]
    baseline = report.get("unigram_baseline")
    lines = [
        f"trained {report['iterations_run']} iterations ({report['tokens_seen']:,} tokens this run) "
        f"in {report['train_seconds']:.1f} s, {report['tokens_per_second']:,.0f} tokens/s on "
        f"{report['world_size']} ranks ({report['layout']})",
        f"held-out loss {final['loss']:.3f} nats/token (perplexity {final['perplexity']:.1f})"
        + (f" vs unigram baseline {baseline:.3f}" if baseline is not None else ""),
    ]
    if report.get("checkpoint"):
        lines.append(f"checkpoint: {report['checkpoint']}")
    lines.append(f"output: {report['output_dir']} (loss.png, report.json, sample.txt)")
    return "\n".join(lines)
