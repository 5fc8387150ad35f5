"""What an RL run leaves behind: ``reward.png``, ``report.json`` and the summary it prints."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .grpo_loop import PHASES


def write_reward_plot(path: Path, history: list[dict[str, Any]], baseline: dict[str, float] | None) -> Path:
    """Train reward per iteration and held-out reward at each evaluation (iteration 0: before RL)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    axes.plot(
        [r["iteration"] for r in history],
        [r["train_reward"] for r in history],
        label="train reward",
        linewidth=1,
    )
    heldout = [(0, baseline["reward"])] if baseline is not None else []
    heldout += [(r["iteration"], r["heldout_reward"]) for r in history if "heldout_reward" in r]
    if heldout:
        axes.plot(*zip(*heldout, strict=True), "o-", label="held-out reward", markersize=4)
    axes.set_xlabel("iteration")
    axes.set_ylabel("mean reward")
    axes.set_title("mcore-rl: GRPO")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def run_report(
    history: list[dict[str, Any]], before: dict[str, float], after: dict[str, float], extra: dict[str, Any]
) -> dict[str, Any]:
    """``report.json``'s dict: held-out results before and after, seconds per phase, history."""
    timings = {phase: sum(r[f"time_{phase}"] for r in history) for phase in PHASES}
    return {
        "heldout_before": before,
        "heldout_after": after,
        "reward_gain": after["reward"] - before["reward"],
        "accuracy_gain": after["accuracy"] - before["accuracy"],
        "iterations": len(history),
        "failed_rollouts": sum(r["failed_rollouts"] for r in history),
        "timings": timings,
        **extra,
        "history": [{k: _json_number(v) for k, v in r.items()} for r in history],
    }


def _json_number(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_report(path: Path, report: dict[str, Any]) -> Path:
    """``report`` as indented JSON."""
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def summary_text(report: dict[str, Any]) -> str:
    """A few lines for the terminal: held-out reward and accuracy before and after, where time went."""
    before, after, timings = report["heldout_before"], report["heldout_after"], report["timings"]
    total = sum(timings.values()) or 1.0
    split = ", ".join(f"{p} {s:.1f} s ({100 * s / total:.0f}%)" for p, s in timings.items())
    return "\n".join(
        [
            f"held-out reward {before['reward']:.3f} -> {after['reward']:.3f}, "
            f"accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
            f"after {report['iterations']} GRPO iterations",
            f"time: {split}",
            f"failed rollouts: {report['failed_rollouts']}",
        ]
    )
