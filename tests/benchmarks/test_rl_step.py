"""``benchmarks/rl_step.py --quick`` end to end: mcore-rl's ``GRPOLoop`` and TRL's ``GRPOTrainer``
on a tiny Llama. Oracle: the table has both sides and the ratio, and the JSON line's figures
follow their own definitions (the ratio is TRL's median over mcore's, the medians are of the timed
iterations after the warm-up). The script itself asserts the equal logits and token counts."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "rl_step.py"
PHASES = ("generation", "reference", "training", "refit")

pytestmark = pytest.mark.slow  # importing torch, transformers, TRL and mcore takes half a minute on 2 cores


@pytest.mark.timeout(600)
def test_quick_run_reports_both_sides_and_the_ratio():
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick"], capture_output=True, text=True, timeout=560
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("uptime at start:")
    assert any(line.startswith("mcore-rl GRPOLoop") for line in lines)
    assert any(line.startswith("TRL GRPOTrainer") for line in lines)
    assert any(line.startswith("ratio TRL / mcore-rl") for line in lines)
    result = json.loads(lines[-1])
    assert (result["prompts"], result["group_size"], result["max_tokens"], result["iterations"]) == (
        2,
        2,
        4,
        2,
    )
    assert result["logits_max_difference"] < 1e-4
    for side in ("mcore", "trl"):
        iterations = result[f"{side}_iterations_s"]
        assert len(iterations) == 1 + result["iterations"]  # the warm-up, then the timed ones
        summary = result[f"{side}_s"]
        assert summary["total"] == pytest.approx(statistics.median(it["total"] for it in iterations[1:]))
        assert summary["total"] > 0 and summary["generation"] > 0 and summary["training"] > 0
        assert all(summary[phase] >= 0 for phase in PHASES)
    assert result["trl_s"]["refit"] == 0  # TRL generates with the trained model itself
    assert result["ratio"] == pytest.approx(result["trl_s"]["total"] / result["mcore_s"]["total"])
